"""A CPU forward for Llama-shaped decoders, in bf16 or fp32, that runs each layer in about a dozen calls.

transformers' modules run one decoder layer as about 83 torch ops and a stack of Python frames: RMSNorm alone
is 27 ops, then the rotary embedding, the MLP's activation, the residual adds, the cache writes, decorators and
a causal mask that our attention never reads. At a decode step's few rows those cost more than their
arithmetic: about a quarter of a lone SmolLM2 step. This forward keeps the model's own modules for what they do
well (the embedding, the rotary module's cos and sin, the linears, and the LM head), calls q, k and v as one
linear and gate and up as another at a decode step's few rows (`JointLinear`), and runs the rest as
`rqbatcher.kernels.native`'s layer ops: one call per norm with the residual add folded in, one for the rotary embedding
of queries and keys, and in bf16 one for SiLU(gate) * up (fp32 keeps torch's SiLU, whose exp the kernels cannot
match bit for bit). Those round wherever the modules' torch ops do, so the logits are the bits of transformers'
forward (tests/test_fused_decoder.py checks every step of an engine, in both dtypes). With int8 weights
(`rqbatcher.workers.model.int8_linear`) the linears are the `Int8Linear` modules' weights on the native kernel,
called bound to them (`Int8Linear.eager`), q/k/v and gate/up one int8 call each (`Int8JointLinear`): the same bits
as the modules one by one.

It serves the families whose decoder layer is Llama's (`FAMILIES`) with a SiLU MLP, in bf16 or fp32 on a CPU
where the kernels of that dtype load (`rqbatcher.kernels.native.build_for`); any other model keeps transformers'
forward. A compiled forward (`EngineConfig.compile`) keeps its own graph.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rqbatcher.kernels import native
from rqbatcher.kernels.attention import AttentionMetadata, attend
from rqbatcher.workers.model.int8_linear import joint_linear

log = logging.getLogger(__name__)

# model_type -> the sliding window one layer's attention module passes to the attention function, as that
# family's module reads it. Every family here has Llama's decoder layer, RMSNorm and rotary embedding.
FAMILIES: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "llama": lambda attention: None,
    "mistral": lambda attention: attention.config.sliding_window,
    "qwen2": lambda attention: attention.sliding_window,
}
SILU_NAMES = ("silu", "swish")
DTYPES = (torch.bfloat16, torch.float32)  # those of rqbatcher.kernels.native's layer ops


def _silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(gate) * up  # the MLP's own ops, for fp32's bits


@dataclass(frozen=True)
class _Layer:
    """One decoder layer's parts, read once from its modules."""

    index: int
    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    eps: float
    # the linears' calls (`_eager`)
    qkv_proj: Callable[[torch.Tensor], list[torch.Tensor]]
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    gate_up_proj: Callable[[torch.Tensor], list[torch.Tensor]]
    down_proj: Callable[[torch.Tensor], torch.Tensor]
    heads: int
    kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None


class FusedDecoder:
    """Logits of a step's kept rows (or their final hidden states) from token ids and positions, for
    `rqbatcher.workers.model.runner.ModelRunner`."""

    def __init__(self, model: torch.nn.Module) -> None:
        config = model.config.get_text_config()
        decoder = model.model
        sliding_window = FAMILIES[config.model_type]
        self.embed_tokens = decoder.embed_tokens
        self.rotary_emb = decoder.rotary_emb
        self.final_norm = decoder.norm.weight
        self.final_eps = decoder.norm.variance_epsilon
        self.lm_head = model.lm_head
        self.silu_mul = native.silu_mul if model.dtype == torch.bfloat16 else _silu_mul
        self.layers = [_layer(layer, config, sliding_window) for layer in decoder.layers[: config.num_hidden_layers]]

    @classmethod
    def of(cls, model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> FusedDecoder | None:
        """The fused forward of `model`, or None where it does not serve (see `why_not`)."""
        reason = why_not(model, device, dtype)
        if reason is not None:
            log.info("transformers' forward runs the layers: %s", reason)
            return None
        return cls(model)

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, last_rows: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """`input_ids` and `position_ids [T]`; returns the logits `[len(last_rows), vocab]`."""
        return self.lm_head(self.final_hidden(input_ids, position_ids, last_rows, metadata))

    def final_hidden(self, input_ids: torch.Tensor, position_ids: torch.Tensor, rows: torch.Tensor,
                     metadata: AttentionMetadata) -> torch.Tensor:
        """The final norm's output at `rows` `[len(rows), hidden]`: what the LM head reads, and what embeddings
        pool."""
        tokens = input_ids.shape[0]
        hidden = self.embed_tokens(input_ids)  # [T, hidden], a fresh tensor: the residual adds write into it
        cos, sin = (part[0] for part in self.rotary_emb(hidden, position_ids[None]))
        delta = None  # what the previous layer's MLP adds to the residual
        for layer in self.layers:
            x = (native.rms_norm(hidden, layer.input_norm, layer.eps) if delta is None
                 else native.add_rms_norm(hidden, delta, layer.input_norm, layer.eps))
            query, key, value = layer.qkv_proj(x)
            query = query.view(tokens, layer.heads, layer.head_dim)
            key = key.view(tokens, layer.kv_heads, layer.head_dim)
            value = value.view(tokens, layer.kv_heads, layer.head_dim)
            native.rotary_(query, key, cos, sin)
            attended = attend(query, key, value, metadata, layer.index, layer.scaling, layer.sliding_window)
            x = native.add_rms_norm(hidden, layer.o_proj(attended.reshape(tokens, -1)), layer.post_attention_norm,
                                    layer.eps)
            delta = layer.down_proj(self.silu_mul(*layer.gate_up_proj(x)))
        return native.add_rms_norm(hidden[rows], delta[rows], self.final_norm, self.final_eps)


def _layer(layer: torch.nn.Module, config, sliding_window: Callable[[torch.nn.Module], int | None]) -> _Layer:
    attention, mlp = layer.self_attn, layer.mlp
    return _Layer(
        index=attention.layer_idx, input_norm=layer.input_layernorm.weight,
        post_attention_norm=layer.post_attention_layernorm.weight, eps=layer.input_layernorm.variance_epsilon,
        qkv_proj=_eager(joint_linear([attention.q_proj, attention.k_proj, attention.v_proj])),
        o_proj=_eager(attention.o_proj), gate_up_proj=_eager(joint_linear([mlp.gate_proj, mlp.up_proj])),
        down_proj=_eager(mlp.down_proj),
        heads=config.num_attention_heads, kv_heads=config.num_key_value_heads, head_dim=attention.head_dim,
        scaling=attention.scaling, sliding_window=sliding_window(attention))


def _eager(linear: Callable) -> Callable:
    """The call the layer loop makes to a linear (or a joint one): its `eager` call where it has one (its kernel
    bound to its weights: `Int8Linear.eager`, `PackedLinear.eager`, `FewRowsLinear.eager`...), else a module's bound
    forward (nn.Module's __call__ cost 2% of a lone step on an AMD EPYC Zen 1, for hooks that nothing sets on them),
    else the joint linear itself."""
    eager = getattr(linear, "eager", None)
    if eager is not None:
        return eager()
    return linear.forward if isinstance(linear, torch.nn.Module) else linear


def why_not(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused forward cannot run `model` on `device` in `dtype`, or None when it can."""
    config = model.config.get_text_config()
    if device.type != "cpu" or dtype not in DTYPES:
        name = str(dtype).removeprefix("torch.")
        return f"the fused layers run in bfloat16 or float32 on a CPU, not {name} on {device.type}"
    if config.model_type not in FAMILIES:
        return f"the fused layers know {', '.join(FAMILIES)}, not {config.model_type}"
    if getattr(config, "hidden_act", None) not in SILU_NAMES:
        return f"the fused layers' MLP is SiLU-gated, not {getattr(config, 'hidden_act', None)}"
    norms = [layer.input_layernorm for layer in model.model.layers] + [
        layer.post_attention_layernorm for layer in model.model.layers]
    if len({norm.variance_epsilon for norm in norms}) != 1:
        return "the layers' norms differ in epsilon"
    return native.unavailable_reason(native.build_for(dtype))
