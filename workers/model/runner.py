"""Runs one forward per engine step over a ragged batch, with the paged KV cache.

The runner only executes: it gets `{sequence: n_tokens}` from the scheduler, packs every
sequence's new tokens into one row with explicit positions and cache slots, and returns the
logits of the sequences that sample this step. For embedding inputs (`Sequence.embed`) it keeps instead the final
norm's hidden states of every row they computed (`embedding_rows`), on whichever forward runs: the fused layers
return them beside the logits, transformers' forward gives them through a hook on its decoder, and a step carrying
embedding rows runs eagerly, never on a compiled graph. For a sequence that takes its prompt's logprobs
(`Sequence.prompt_logprobs`) the LM head also reads every row of its chunk that predicts a prompt token, after the
sampling rows (`prompt_logits`); no other step projects more than its sampling rows.

Attention runs on the torch backend (decode groups and prefill spans planned here), on the cpu one (the
same, with all decodes in one group for `rqbatcher.kernels.native`'s kernel, and in bf16 prompt chunks on its prefill
kernel), or the Triton one (flat arrays, `rqbatcher.kernels.triton_attention`), as
`EngineConfig.attention_backend` resolves.

How fast a step goes: on a CPU in bf16 every linear layer runs on a weight packed once at load
(`workers.model.packed_linear`), and a decode step's few rows, in bf16 or fp32, on `kernels.native`'s kernels where
they run; the layers of a Llama-shaped model run fused (`workers.model.fused_decoder`) where those kernels load; with
`EngineConfig.compile`, steps of up to `max_num_seqs` tokens run a compiled forward
(`rqbatcher.workers.model.compiled_forward`), padded to a few token-count buckets. With `EngineConfig.quantization`
int8, the decoder's linears and the LM head run on int8 weights instead (`workers.model.int8_linear`), neither
packed nor routed.

With `EngineConfig.batch_invariant` (the default), a bf16 step on `kernels.native` gives each row the same bits
whatever else it holds: every linear on `tile_linear`, and decodes and prompt chunks in one attention arithmetic
(docs/batch-invariance.md).
"""

from __future__ import annotations

import itertools
import logging

import torch

from rqbatcher.config import ATTENTION_CPU, ATTENTION_TRITON, QUANTIZATION_INT8, EngineConfig
from rqbatcher.kernels import native
from rqbatcher.kernels.attention import (
    AttentionMetadata,
    DecodeGroup,
    PrefillSpan,
    decode_runs,
    length_bias,
    shared_prefix_runs,
    step_metadata,
)
from rqbatcher.kernels.triton_attention import FlatAttentionMetadata
from rqbatcher.workers.model.attention_backend import resolve_attention_backend
from rqbatcher.workers.model.compiled_forward import CompiledForward
from rqbatcher.workers.model.fused_decoder import FusedDecoder
from rqbatcher.workers.model.int8_linear import native_int8, quantize_linears
from rqbatcher.workers.model.loading import LoadedModel
from rqbatcher.workers.model.packed_linear import can_pack, fp32_rows_native, pack_linears, route_fp32_linears
from rqbatcher.workers.model.precision import DTYPES
from rqbatcher.workers.scheduler import StepPlan
from rqbatcher.workers.scheduler.sequence import Sequence

log = logging.getLogger(__name__)

DECODE_PAD_RATIO = 2  # decodes share a padded attention call while their contexts are within this ratio
PAD_TOKEN_ID = 0  # fills a compiled step's padding rows; their keys are never written and their logits dropped


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def kv_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model, read from its config."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def num_kv_blocks(model: torch.nn.Module, config: EngineConfig) -> int:
    """KV blocks that fit `config.kv_cache_bytes` (or `config.num_blocks` when given)."""
    layers, kv_heads, head_dim = kv_shape(model)
    bytes_per_block = 2 * layers * config.block_size * kv_heads * head_dim * DTYPES[config.dtype].itemsize
    return config.num_blocks or max(1, config.kv_cache_bytes // bytes_per_block)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        if config.dtype not in DTYPES:
            raise ValueError(f"the runner needs a concrete dtype, not {config.dtype!r} (build_engine resolves 'auto')")
        self.device = resolve_device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.model = loaded.model.to(device=self.device, dtype=self.dtype)
        if config.quantization == QUANTIZATION_INT8:  # before the packing and routing below, which then skip them
            log.info("%d linears on int8 weights, on %s", quantize_linears(self.model),
                     "the native int8 kernel" if native_int8(self.device) else "torch's reference arithmetic")
        layers, kv_heads, head_dim = kv_shape(self.model)
        heads = self.model.config.get_text_config().num_attention_heads
        self.heads_per_kv_head = heads // kv_heads
        backend = resolve_attention_backend(config.attention_backend, self.device,
                                            native.why_not(self.device, self.dtype, heads, kv_heads, head_dim))
        self.flat_attention = backend == ATTENTION_TRITON
        self.native_decode = backend == ATTENTION_CPU
        # the prefill kernels are bf16's; their head_dims are the decode kernel's
        self.native_prefill = self.native_decode and self.dtype == torch.bfloat16
        # bf16 steps whose rows do not depend on each other: the linears on one kernel at every row count (decodes and
        # prompt chunks share one attention arithmetic always: `native.paged_decode`)
        self.batch_invariant = False
        if can_pack(self.device, self.dtype):
            few_rows_native = native.load() is not None
            self.batch_invariant = config.batch_invariant and few_rows_native
            packed = pack_linears(self.model, few_rows_native, self.batch_invariant)
            if self.batch_invariant:
                log.info("%d linears on the bf16 CPU kernels at every row count (batch invariant)", packed)
            else:
                log.info("packed %d linear weights for oneDNN%s", packed,
                         "; decode rows on the bf16 CPU kernels" if few_rows_native else "")
        elif fp32_rows_native(self.device, self.dtype):
            log.info("%d fp32 linears take decode rows on the fp32 CPU kernel", route_fp32_linears(self.model))
        self.fused = FusedDecoder.of(self.model, self.device, self.dtype)
        self.num_blocks = num_kv_blocks(self.model, config)
        slots = self.num_blocks * config.block_size
        self.kv_caches = [
            (torch.zeros(slots, kv_heads, head_dim, dtype=self.dtype, device=self.device),
             torch.zeros(slots, kv_heads, head_dim, dtype=self.dtype, device=self.device))
            for _ in range(layers)
        ]
        self.decoder = self.model.get_decoder()  # the layers and final norm, under the LM head
        # the final hidden states of the embedding inputs' rows of the last `execute`, by sequence
        self.embedding_rows: dict[Sequence, torch.Tensor] = {}
        # the prompt positions' logits of the last `execute`, of the sequences that take their prompt's logprobs: by
        # sequence, (the index of the first prompt token they predict, logits [rows, vocab])
        self.prompt_logits: dict[Sequence, tuple[int, torch.Tensor]] = {}
        self.compiled: CompiledForward | None = None
        if config.compile:
            self.compiled = CompiledForward(self.model, min(config.max_num_seqs, config.max_num_batched_tokens))
            self.compiled.compile_buckets(self._run_idle_step)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _plan_decodes(self, decodes: list[Sequence]) -> tuple[list[Sequence], list[DecodeGroup]]:
        """Order the decodes into attention groups, built once per step. Decodes that start from the same
        cached blocks (prefix caching) are grouped to read those blocks once, as long as their own keys
        are no more than the shared ones (each decode's query also meets the others' own keys, masked);
        the others are grouped by context length alone. On the cpu backend all decodes form one group: its
        kernel reads each decode's blocks alone, in this order, so decodes that start from the same blocks
        come one after the other and the second finds their prefix in the CPU's cache."""
        if self.native_decode:
            decodes = sorted(decodes, key=lambda seq: seq.block_table[0])
            return decodes, [self._group(decodes, 0)] if decodes else []
        by_first_block: dict[int, list[Sequence]] = {}
        for seq in decodes:
            by_first_block.setdefault(seq.block_table[0], []).append(seq)
        order: list[Sequence] = []
        groups: list[DecodeGroup] = []
        alone: list[Sequence] = []
        for members in by_first_block.values():
            if len(members) == 1:
                alone.extend(members)
                continue
            shared = sum(1 for _ in itertools.takewhile(lambda blocks: len(set(blocks)) == 1,
                                                        zip(*(s.block_table for s in members))))
            for part in self._by_context(members):
                per_group = max(1, shared // (max(len(s.block_table) for s in part) - shared))
                for chunk in (part[i : i + per_group] for i in range(0, len(part), per_group)):
                    if len(chunk) == 1:
                        alone.extend(chunk)
                        continue
                    groups.append(self._shared_group(chunk, shared, len(order)))
                    order.extend(chunk)
        for part in self._by_context(alone):
            groups.append(self._group(part, len(order)))
            order.extend(part)
        return order, groups

    @staticmethod
    def _by_context(decodes: list[Sequence]) -> list[list[Sequence]]:
        """Sort by context length, and split where a context exceeds DECODE_PAD_RATIO times the part's shortest."""
        parts: list[list[Sequence]] = []
        for seq in sorted(decodes, key=lambda s: s.num_computed_tokens):
            if not parts or seq.num_computed_tokens + 1 > DECODE_PAD_RATIO * (parts[-1][0].num_computed_tokens + 1):
                parts.append([])
            parts[-1].append(seq)
        return parts

    def _group(self, decodes: list[Sequence], start: int) -> DecodeGroup:
        """Decodes at rows `start...`, each over its own blocks, padded to the longest (the cpu backend's
        kernel reads each decode's blocks alone: no padding is read, so no mask is built)."""
        width = max(len(s.block_table) for s in decodes)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decodes])
        lens = torch.tensor([s.num_computed_tokens + 1 for s in decodes])
        if self.native_decode:
            return DecodeGroup(start, start + len(decodes), tables, lens, bias=None, native=True)
        bias = length_bias(lens, width * self.block_size, self.dtype)
        runs = decode_runs([s.block_table for s in decodes], lens.tolist(), self.block_size, self.device)
        return DecodeGroup(start, start + len(decodes), tables.to(self.device), lens.to(self.device),
                           bias.to(self.device), runs=runs)

    def _shared_group(self, decodes: list[Sequence], shared: int, start: int) -> DecodeGroup:
        """Decodes at rows `start...` that all start from the same `shared` blocks: one row of blocks (those
        once, then each decode's own, padded to one width) and a bias, one row per query head, that shows
        each decode its keys."""
        own = [s.block_table[shared:] for s in decodes]
        width = max(len(blocks) for blocks in own)
        row = decodes[0].block_table[:shared] + [b for blocks in own for b in blocks + [0] * (width - len(blocks))]
        lens = torch.tensor([s.num_computed_tokens + 1 for s in decodes])
        own_keys, own_lens = width * self.block_size, lens - shared * self.block_size
        key = torch.arange(len(decodes) * own_keys)
        sees = (key[None, :] // own_keys == torch.arange(len(decodes))[:, None]) & (key % own_keys < own_lens[:, None])
        bias = torch.zeros(len(decodes), len(row) * self.block_size, dtype=self.dtype)
        bias[:, shared * self.block_size :].masked_fill_(~sees, float("-inf"))
        bias = bias.repeat_interleave(self.heads_per_kv_head, dim=0)
        return DecodeGroup(start, start + len(decodes), torch.tensor([row], device=self.device), lens.to(self.device),
                           bias.to(self.device), shared_blocks=shared,
                           prefix_runs=shared_prefix_runs(row[:shared], self.block_size, self.device))

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> tuple[torch.Tensor, list[Sequence]]:
        """One forward for everything scheduled. Returns logits `[K, vocab]` (float32) of the
        K sequences whose prompt is now fully computed, in the order returned; the embedding inputs' hidden states
        are left in `embedding_rows`."""
        self.embedding_rows, self.prompt_logits = {}, {}
        decodes = [s for s, n in plan.num_tokens.items() if n == 1]
        decodes, decode_groups = (decodes, []) if self.flat_attention else self._plan_decodes(decodes)
        prefills = [(s, n) for s, n in plan.num_tokens.items() if n > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        spans: list[PrefillSpan] = []
        sampling: list[Sequence] = []
        last_rows: list[int] = []
        rows: list[tuple[list[int], int, int]] = []  # (block table, first position, new tokens), for flat attention
        embedding_spans: list[tuple[Sequence, int, int]] = []  # (embedding input, its first row, its rows)
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # (sequence, first row, rows, first token predicted)
        for seq, n in [(s, 1) for s in decodes] + prefills:
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slot_mapping.extend(self._slots(seq, start, end))
            rows.append((seq.block_table, start, n))
            if n > 1 and not self.flat_attention:
                spans.append(PrefillSpan.of(row, n, start, seq.block_table, self.block_size, self.device,
                                            self.native_prefill))
            if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:  # rows predicting prompt tokens
                prompt_spans.append((seq, row, min(end, seq.num_prompt_tokens - 1) - start, start + 1))
            if seq.embed:
                embedding_spans.append((seq, row, n))
            elif plan.samples(seq):
                sampling.append(seq)
                last_rows.append(row + n - 1)

        if self.flat_attention:
            metadata = FlatAttentionMetadata.build(self.kv_caches, self.block_size, rows, slot_mapping, self.device)
        else:
            metadata = AttentionMetadata(
                kv_caches=self.kv_caches,
                num_tokens=len(input_ids),
                slot_mapping=torch.tensor(slot_mapping, device=self.device),
                num_decodes=len(decodes),
                block_size=self.block_size,
                decode_groups=decode_groups,
                prefills=spans,
            )
        prompt_rows = [r for _, row, n, _ in prompt_spans for r in range(row, row + n)]
        if not sampling and not embedding_spans and not prompt_rows:
            last_rows = [len(input_ids) - 1]  # the LM head needs at least one row; its logits are unused
        last_rows += prompt_rows  # after the sampling rows: their logits come first, as without
        if embedding_spans:
            pooled_rows = [r for _, row, n in embedding_spans for r in range(row, row + n)]
            logits, hidden = self._forward_keeping(input_ids, positions, last_rows, pooled_rows, metadata)
            offsets = itertools.accumulate((n for _, _, n in embedding_spans), initial=0)
            self.embedding_rows = {seq: hidden[at : at + n] for (seq, _, n), at in zip(embedding_spans, offsets)}
        else:
            logits = self._forward(input_ids, positions, last_rows, metadata)
        at = len(last_rows) - len(prompt_rows)
        for seq, _, n, first in prompt_spans:
            self.prompt_logits[seq], at = (first, logits[at : at + n]), at + n
        return logits[: len(sampling)].float(), sampling

    def _forward_keeping(self, input_ids: list[int], positions: list[int], last_rows: list[int],
                         pooled_rows: list[int], metadata: AttentionMetadata | FlatAttentionMetadata
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits of `last_rows` (none: the LM head runs on the fused layers not at all, on transformers' forward
        on one row) and the final hidden states of `pooled_rows`, eagerly: on the fused layers where they serve the
        model (the LM head reads the same rows as without embeddings), else transformers' forward with a hook on its
        decoder."""
        if self.fused is not None:
            hidden = self.fused.final_hidden(torch.tensor(input_ids, device=self.device),
                                             torch.tensor(positions, device=self.device),
                                             torch.tensor(last_rows + pooled_rows, device=self.device), metadata)
            return self.fused.lm_head(hidden[: len(last_rows)]), hidden[len(last_rows) :]
        captured: list[torch.Tensor] = []
        hook = self.decoder.register_forward_hook(lambda module, args, output: captured.append(output[0]))
        try:
            with step_metadata(metadata):
                out = self.model(input_ids=torch.tensor([input_ids], device=self.device),
                                 position_ids=torch.tensor([positions], device=self.device), use_cache=False,
                                 logits_to_keep=torch.tensor(last_rows or [0], device=self.device))
        finally:
            hook.remove()
        return out.logits[0], captured[0][0, pooled_rows]

    def _forward(self, input_ids: list[int], positions: list[int], last_rows: list[int],
                 metadata: AttentionMetadata | FlatAttentionMetadata) -> torch.Tensor:
        """Logits of `last_rows` (and maybe of padding rows after them). A step that fits a compiled
        bucket is padded to it and runs the compiled forward; any other runs eagerly, on the fused layers where
        they serve the model."""
        model = self.model
        bucket = self.compiled.bucket(len(input_ids)) if self.compiled else None
        if bucket is None and self.fused is not None:
            return self.fused(torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device),
                              torch.tensor(last_rows, device=self.device), metadata)
        if bucket is not None:
            model = self.compiled
            input_ids = input_ids + [PAD_TOKEN_ID] * (bucket - len(input_ids))
            positions = positions + [0] * (bucket - len(positions))
            last_rows = last_rows + [0] * (bucket - len(last_rows))
        with step_metadata(metadata):
            out = model(
                input_ids=torch.tensor([input_ids], device=self.device),
                position_ids=torch.tensor([positions], device=self.device),
                use_cache=False,
                logits_to_keep=torch.tensor(last_rows, device=self.device),
            )
        return out.logits[0]

    @torch.inference_mode()
    def _run_idle_step(self, num_tokens: int) -> None:
        """A step of `num_tokens` padding rows and no real token: it touches no cache, and compiles a bucket."""
        idle = FlatAttentionMetadata if self.flat_attention else AttentionMetadata
        self._forward([PAD_TOKEN_ID] * num_tokens, [0] * num_tokens, [0],
                      idle.idle(self.kv_caches, self.block_size, self.device))
