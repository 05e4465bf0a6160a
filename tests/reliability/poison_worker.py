"""`batcher worker` with a poisoned model: the forward raises when its input holds POISON_IDS in a row.

Run it like the CLI: `python -m tests.reliability.poison_worker worker --redis-url ... --model ...`.
Nothing in batcher changes: the hook only sits on the loaded model's input embedding, the way a
broken kernel or a corrupt weight would make one request's forward raise. Validation still lets the
poisoned prompt through, since every id is inside the vocabulary.
"""

from __future__ import annotations

import torch

import rqbatcher.workers.model.loading

POISON_IDS = (381, 382, 383, 381, 382, 383)  # the test prompts use ids 3..380, so nothing else trips it
_load_model = rqbatcher.workers.model.loading.load_model


def poisoned(input_ids: torch.Tensor) -> bool:
    row = input_ids.reshape(-1).tolist()
    n = len(POISON_IDS)
    return any(tuple(row[i:i + n]) == POISON_IDS for i in range(len(row) - n + 1))


def _raise_on_poison(module, args):
    if poisoned(args[0]):
        raise RuntimeError(f"poisoned input: the forward cannot run token ids {list(POISON_IDS)}")


def load_model(*args, **kwargs):
    loaded = _load_model(*args, **kwargs)
    loaded.model.get_input_embeddings().register_forward_pre_hook(_raise_on_poison)
    return loaded


rqbatcher.workers.model.loading.load_model = load_model  # build_engine imports it at call time

if __name__ == "__main__":
    from rqbatcher.cli import main

    main()
