"""What a model's embeddings are, read from its folder: whether it is an embedding model, how a sequence's hidden
states pool into one vector, and which shorter lengths (Matryoshka) the vectors may be cut to.

- An embedding model: a config whose architectures are all bare decoders (`Qwen2Model`, `LlamaModel`: no LM head),
  or a sentence-transformers folder (modules.json with a Pooling module).
- Pooling: the sentence-transformers Pooling module's config where present (last token, mean or first token), last
  token for the families whose embedding models pool that way (Qwen3-Embedding), mean otherwise.
- Matryoshka: `is_matryoshka: true` in config.json allows any length up to the hidden size,
  `matryoshka_dimensions: [...]` those lengths; the model's own size is always allowed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from transformers.utils import cached_file

POOL_LAST, POOL_MEAN, POOL_FIRST = "last", "mean", "first"
MODULES_FILE = "modules.json"
POOLING_MODULE_TYPE = "sentence_transformers.models.Pooling"
POOLING_CONFIG_FILE = "config.json"
SENTENCE_TRANSFORMERS_MODES = {  # a Pooling config's flag -> our pooling, in the order they are looked at
    "pooling_mode_lasttoken": POOL_LAST,
    "pooling_mode_mean_tokens": POOL_MEAN,
    "pooling_mode_cls_token": POOL_FIRST,
}
LAST_TOKEN_FAMILIES = ("qwen3",)  # model types whose embedding models pool the last token (Qwen3-Embedding)
ANY_DIMENSIONS = "any"
LM_HEAD_SUFFIXES = ("LMHeadModel",)  # architectures named "...Model" that do have an LM head (GPT2LMHeadModel)


@dataclass(frozen=True)
class EmbeddingFacts:
    """How one model embeds. `matryoshka`: "" (only its own size), "any", or a comma-separated list of lengths."""

    is_embedding_model: bool
    pooling: str
    size: int
    matryoshka: str = ""

    def dimensions_problem(self, dimensions: int | None) -> str | None:
        """Why `dimensions` cannot be given for this model, or None when it can."""
        if dimensions is None or dimensions == self.size:
            return None
        allowed = ("any length up to " + str(self.size) if self.matryoshka == ANY_DIMENSIONS
                   else self.matryoshka or "only its own size, " + str(self.size))
        if dimensions > self.size or (self.matryoshka != ANY_DIMENSIONS
                                      and str(dimensions) not in self.matryoshka.split(",")):
            return f"dimensions={dimensions} is not available: this model's embeddings can have {allowed}"
        return None


def _read_json(source: str, name: str) -> object | None:
    """A JSON file of the model's folder (or hub repository), None where it has none."""
    try:
        path = cached_file(source, name, _raise_exceptions_for_missing_entries=False,
                           _raise_exceptions_for_connection_errors=False)
    except OSError:
        return None
    if path is None:
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _sentence_transformers_pooling(source: str) -> str | None:
    """The pooling a sentence-transformers folder's Pooling module names, None without one."""
    modules = _read_json(source, MODULES_FILE)
    module = next((m for m in modules or () if isinstance(m, dict) and m.get("type") == POOLING_MODULE_TYPE), None)
    if module is None:
        return None
    folder = module.get("path", "").strip("/")
    config = _read_json(source, f"{folder}/{POOLING_CONFIG_FILE}" if folder else POOLING_CONFIG_FILE) or {}
    return next((pool for flag, pool in SENTENCE_TRANSFORMERS_MODES.items() if config.get(flag)), POOL_MEAN)


def _matryoshka(config) -> str:
    if getattr(config, "is_matryoshka", False):
        return ANY_DIMENSIONS
    return ",".join(str(int(d)) for d in getattr(config, "matryoshka_dimensions", None) or ())


def embedding_facts(source: str, config) -> EmbeddingFacts:
    """How the model at `source` (a folder or a hub id) with transformers config `config` embeds."""
    text_config = config.get_text_config()
    st_pooling = _sentence_transformers_pooling(source)
    architectures = getattr(config, "architectures", None) or []
    bare = bool(architectures) and all(a.endswith("Model") and not a.endswith(LM_HEAD_SUFFIXES)
                                       for a in architectures)
    pooling = st_pooling or (POOL_LAST if text_config.model_type in LAST_TOKEN_FAMILIES else POOL_MEAN)
    return EmbeddingFacts(is_embedding_model=bare or st_pooling is not None, pooling=pooling,
                          size=text_config.hidden_size, matryoshka=_matryoshka(text_config) or _matryoshka(config))
