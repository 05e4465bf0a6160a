"""Embedding requests in the engine: each input is a prefill-only sequence (`Sequence.embed`), scheduled like a
prompt, and its final hidden states pool into one vector.

Pooling follows the model (`rqbatcher.workers.model.pooling`): the mean of every token's hidden state, summed across the
chunks of a chunked prefill; the last token's; or the first token's. A chunk that starts at position 0 starts the
pool again, so a sequence preempted and recomputed pools once. Every vector is L2-normalised (OpenAI's embeddings
are unit length; sentence-transformers' Normalize module does the same), and a request's `dimensions` cuts it to
that length and normalises it again (Matryoshka). Vectors travel as OpenAI's base64: little-endian float32 bytes.

The request ends when its last input ends, with every vector in input order, its inputs' tokens as prompt tokens
and no completion; an input that fails fails the request.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np
import torch

from rqbatcher.config import TASK_EMBED, TASK_GENERATE
from rqbatcher.schema import GenerationRequest
from rqbatcher.service_class import class_of, urgency_of
from rqbatcher.workers.engine.api import RequestError, RequestOutput
from rqbatcher.workers.model.loading import LoadedModel, ModelLoadError
from rqbatcher.workers.model.pooling import POOL_FIRST, POOL_LAST, POOL_MEAN, EmbeddingFacts
from rqbatcher.workers.scheduler.sequence import Sequence

INPUT_SEPARATOR = "#input"  # an input's sequence id: <request id>#input<i>
WIRE_DTYPE = np.dtype("<f4")  # OpenAI's base64 embeddings: little-endian float32
CANCELLED = "cancelled"  # the one early end that leaves a request stopped rather than failed


def serving_tasks(asked: tuple[str, ...], facts: EmbeddingFacts, model_name: str) -> tuple[str, ...]:
    """What a worker serves: the tasks asked for, or by default its model's nature (an embedding model embeds, a
    causal LM generates). An embedding model has no LM head, so it cannot generate."""
    tasks = tuple(dict.fromkeys(asked)) or ((TASK_EMBED,) if facts.is_embedding_model else (TASK_GENERATE,))
    if TASK_GENERATE in tasks and facts.is_embedding_model:
        raise ModelLoadError(f"model {model_name!r} is an embedding model (it has no LM head): it cannot generate; "
                           f"serve it with --task {TASK_EMBED}")
    return tasks


def encode(vector: torch.Tensor) -> str:
    """A vector as OpenAI's `encoding_format: base64` sends it."""
    return base64.b64encode(vector.numpy().astype(WIRE_DTYPE).tobytes()).decode("ascii")


def finish_vector(pooled: torch.Tensor, dimensions: int | None) -> torch.Tensor:
    """Unit length, then cut to `dimensions` and unit length again."""
    vector = torch.nn.functional.normalize(pooled.double(), dim=0)
    if dimensions is not None and dimensions < vector.shape[0]:
        vector = torch.nn.functional.normalize(vector[:dimensions], dim=0)
    return vector.float()


@dataclass
class _Pool:
    """One input's pooling so far: the sum (mean), or the row kept (last, first), and the rows it covers."""

    value: torch.Tensor | None = None
    rows: int = 0


@dataclass
class _EmbeddingRequest:
    request_id: str
    sequences: list[Sequence]
    dimensions: int | None
    arrival_time: float
    vectors: dict[int, str] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(seq.num_prompt_tokens for seq in self.sequences)


class Embeddings:
    """The embedding requests in an engine: their inputs' sequences, pools and finished vectors. An input may have
    up to `max_model_len` tokens, and no more than the KV cache's `cache_tokens`."""

    def __init__(self, loaded: LoadedModel, max_model_len: int, cache_tokens: int) -> None:
        self.loaded, self.facts = loaded, loaded.embedding
        self.max_model_len, self.cache_tokens = max_model_len, cache_tokens
        self._requests: dict[str, _EmbeddingRequest] = {}
        self._owner: dict[str, tuple[_EmbeddingRequest, int]] = {}  # sequence id -> (its request, input index)
        self._pools: dict[str, _Pool] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, request: GenerationRequest, arrival: float) -> list[Sequence]:
        """The sequences of a new embedding request, one per input, for the scheduler; RequestError, keeping
        nothing, where it cannot be served."""
        if (problem := self.facts.dimensions_problem(request.dimensions)) is not None:
            raise RequestError(problem)
        sequences = []
        for i, item in enumerate(request.embed):
            ids = list(item) if isinstance(item, list) else list(self.loaded.tokenizer(item)["input_ids"])
            self._check_input(i, ids)
            sequences.append(Sequence(f"{request_id}{INPUT_SEPARATOR}{i}", ids, request.sampling, arrival_time=arrival,
                                      service_class=class_of(request), urgency=urgency_of(request),
                                      tenant=request.tenant, embed=True))
        self._register(request_id, sequences, request.dimensions, arrival)
        return sequences

    def _check_input(self, index: int, ids: list[int]) -> None:
        if not ids:
            raise RequestError(f"input {index} has no tokens")
        if len(ids) > self.max_model_len:
            raise RequestError(f"input {index} has {len(ids)} tokens; this model's context is {self.max_model_len} "
                               "(max_model_len)")
        if len(ids) > self.cache_tokens:
            raise RequestError(f"input {index} has {len(ids)} tokens; the whole KV cache holds {self.cache_tokens}")
        bad = next((t for t in ids if t >= self.loaded.vocab_size), None)
        if bad is not None:
            raise RequestError(f"input {index}: token id {bad} is outside the vocabulary "
                               f"(size {self.loaded.vocab_size})")

    def _register(self, request_id: str, sequences: list[Sequence], dimensions: int | None, arrival: float) -> None:
        request = self._requests[request_id] = _EmbeddingRequest(request_id, sequences, dimensions, arrival)
        for i, seq in enumerate(sequences):
            self._owner[seq.request_id] = (request, i)
            self._pools[seq.request_id] = _Pool()

    def pool(self, seq: Sequence, rows: torch.Tensor) -> None:
        """Add the final hidden states of the rows `seq` computed this step (its chunk starts at
        `seq.num_computed_tokens`, not yet advanced)."""
        pool = self._pools.get(seq.request_id)
        if pool is None:  # its request has ended (a sibling input failed)
            return
        rows = rows.float().cpu()
        if seq.num_computed_tokens == 0:
            pool.value, pool.rows = None, 0
        if self.facts.pooling == POOL_MEAN:
            total = rows.double().sum(dim=0)
            pool.value = total if pool.value is None else pool.value + total
        elif self.facts.pooling == POOL_LAST:
            pool.value = rows[-1]
        elif self.facts.pooling == POOL_FIRST and seq.num_computed_tokens == 0:
            pool.value = rows[0]
        pool.rows += rows.shape[0]

    def finish(self, seq: Sequence) -> RequestOutput | None:
        """`seq`'s vector, now that its tokens are all computed; the request's output once it is its last (None
        too for an input whose request has already ended)."""
        if seq.request_id not in self._owner:
            return None
        request, index = self._owner.pop(seq.request_id)
        pool = self._pools.pop(seq.request_id)
        pooled = pool.value / pool.rows if self.facts.pooling == POOL_MEAN else pool.value
        request.vectors[index] = encode(finish_vector(pooled, request.dimensions))
        if len(request.vectors) < len(request.sequences):
            return None
        del self._requests[request.request_id]
        return self._output(request, "stop", embeddings=[request.vectors[i] for i in range(len(request.sequences))])

    def end(self, request_id: str, reason: str | None = None, error: str | None = None
            ) -> tuple[RequestOutput, list[Sequence]]:
        """End a request early (a cancel, a failed input): its output, and its sequences still to finish. Any end
        but a cancel (a timeout) fails it: half its vectors are no answer."""
        if error is None and reason != CANCELLED:
            error = f"it ended ({reason}) before its embeddings were done"
        request = self._requests.pop(request_id)
        live = [seq for seq in request.sequences if seq.request_id in self._owner]
        for seq in live:
            del self._owner[seq.request_id], self._pools[seq.request_id]
        return self._output(request, reason, error=error), live

    def request_of(self, seq: Sequence) -> str:
        return self._owner[seq.request_id][0].request_id

    @staticmethod
    def _output(request: _EmbeddingRequest, reason: str | None, error: str | None = None,
                embeddings: list[str] | None = None) -> RequestOutput:
        times = [seq.last_token_time for seq in request.sequences if seq.last_token_time is not None]
        return RequestOutput(request_id=request.request_id, new_token_ids=[], delta_text="", text="", token_ids=[],
                             num_prompt_tokens=request.num_tokens, finish_reason=None if error else reason,
                             error=error, embeddings=embeddings, arrival_time=request.arrival_time,
                             first_token_time=max(times, default=None), last_token_time=max(times, default=None))
