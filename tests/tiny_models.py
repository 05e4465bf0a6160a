"""Tiny transformers models and a locally trained tokenizer, saved with `save_pretrained`.

Nothing is downloaded: the tokenizer is trained here with `tokenizers`, and the weights are
random (seeded) from a config.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModel,
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

VOCAB_SIZE = 384
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# A template with tool support, in the Hermes/Qwen2.5 manner: the tools listed in the system turn, an assistant's
# calls written in <tool_call> tags, and each result as a user turn in <tool_response> tags
TOOLS_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n{% endif %}"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools></s>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and tools and loop.first %}"
    "{% elif m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n</tool_response></s>"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|assistant|>{{ m['content'] }}"
    "{% for c in m['tool_calls'] %}<tool_call>\n{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": "
    "{{ c['function']['arguments'] | tojson }}}\n</tool_call>{% endfor %}</s>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
LONG_CONTEXT = 4096  # positions of the tool models: a tool list and its fallback prompt take hundreds of tokens
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Continuous batching decides the batch again at every step.",
    "A long document prefilled in one piece stalls every running decode.",
    "Summarise this document in three sentences, please.",
    "Redis streams carry tokens to the consumers while they are generated.",
    "Ünïcödé characters like café, naïve, 東京 and emoji 🙂 must survive detokenization.",
] * 20

COMMON = dict(vocab_size=VOCAB_SIZE, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
FAMILIES = {
    "llama": lambda: LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, **COMMON),
    "qwen2": lambda: Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=1, **COMMON),
    "mistral": lambda: MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=24, **COMMON),
    "gpt2": lambda: GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=512, vocab_size=VOCAB_SIZE,
                               bos_token_id=1, eos_token_id=2),
}
# Built on demand only (not a `family` of every engine test): the GPU check's tiny Qwen3 (q/k norms, head_dim).
MORE_FAMILIES = {
    "qwen3": lambda: Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, **COMMON),
}


def build_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   chat_template=CHAT_TEMPLATE)


def build_tool_model(path: Path, template: str = TOOLS_CHAT_TEMPLATE) -> Path:
    """A tiny Llama with a long context and `template` (the tool-aware one, or the plain CHAT_TEMPLATE)."""
    build_tiny_model("llama", path, max_position_embeddings=LONG_CONTEXT)
    tokenizer = build_tokenizer()
    tokenizer.chat_template = template
    tokenizer.save_pretrained(path)
    return path


def build_tiny_model(family: str, path: Path, **config_overrides) -> Path:
    """Write a tiny random model of `family` and the tokenizer to `path`; return `path`."""
    torch.manual_seed(0)
    config = {**FAMILIES, **MORE_FAMILIES}[family]()
    for name, value in config_overrides.items():
        setattr(config, name, value)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # a wider logit spread makes greedy ties (and flaky comparisons) unlikely
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else None
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path


POOLING_MODES = {"lasttoken": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens",
                 "cls": "pooling_mode_cls_token"}


def build_embedding_model(path: Path, pooling: str = "mean", matryoshka: bool | list[int] = False,
                          family: str = "qwen2") -> Path:
    """A tiny embedding model: `family`'s decoder saved without its LM head (architectures: Qwen2Model...), the
    tokenizer, and sentence-transformers' modules.json with a Pooling module (`pooling`: lasttoken, mean or cls) and
    Normalize. `matryoshka`: True writes `is_matryoshka`, a list writes `matryoshka_dimensions`."""
    torch.manual_seed(0)
    config = {**FAMILIES, **MORE_FAMILIES}[family]()
    if matryoshka is True:
        config.is_matryoshka = True
    elif matryoshka:
        config.matryoshka_dimensions = list(matryoshka)
    AutoModel.from_config(config).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
               {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir(exist_ok=True)
    modes = {mode: mode == POOLING_MODES[pooling] for mode in POOLING_MODES.values()}
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": config.hidden_size,
                                                                **modes}))
    return path


def build_tiny_gguf(path: Path, quantization: str = "F32") -> Path:
    """The tiny Llama (`build_tiny_model`) written as a GGUF file at `path` the way llama.cpp's converter writes one:
    its tensors under GGUF names, q and k in llama.cpp's rotary order, weights of two dims in `quantization` (a
    `gguf.GGMLQuantizationType` name: F32, Q8_0...) and the rest in F32, the tokenizer as a byte-level BPE."""
    import gguf  # the worker extra's

    folder = build_tiny_model("llama", path.with_suffix(".hf"))
    model = AutoModelForCausalLM.from_pretrained(folder)
    config, tokenizer = model.config, PreTrainedTokenizerFast.from_pretrained(folder)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types([gguf.TokenType.CONTROL if token in tokenizer.all_special_tokens else gguf.TokenType.NORMAL
                            for token, _ in vocab])
    writer.add_token_merges([" ".join(merge) for merge in json.loads(tokenizer.backend_tokenizer.to_str())["model"]
                             ["merges"]])
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    qtype = gguf.GGMLQuantizationType[quantization]
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            data = data.reshape(heads, 2, data.shape[0] // heads // 2, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
        stored = qtype if data.ndim == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight",)), gguf.quants.quantize(data, stored),
                          raw_dtype=stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
