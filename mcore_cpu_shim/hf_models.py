"""Tiny Hugging Face models written locally with ``transformers`` (random weights, no hub).

The one builder behind ``mcore-cpu-shim demo``, the Megatron-Bridge tests and the conversion
benchmark: ``write(family, folder)`` saves a model (``config.json`` and safetensors shards) that
Megatron-Bridge converts like the real thing, small enough for a test on two CPU cores.

Families: ``llama`` (dense, plain RoPE) and ``gpt-oss`` (YaRN, learnable softmax offsets,
sliding-window layers, 4 experts with 2 per token). ``overrides`` change any config field
(e.g. a larger ``hidden_size`` for the benchmark).
"""

from __future__ import annotations

import os

FAMILIES = ("llama", "gpt-oss")

# Shared by every family: small, but every dimension a real model has (GQA, two layers so
# that per-layer mappings and GPT-OSS's alternating window layers are both exercised).
_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def config(family: str, **overrides):
    """The ``transformers`` config of a tiny model of ``family``."""
    import transformers

    if family == "llama":
        fields = dict(_COMMON, intermediate_size=128, rms_norm_eps=1e-5)
        cls = transformers.LlamaConfig
    elif family == "gpt-oss":
        fields = dict(
            _COMMON,
            intermediate_size=64,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=32,
            # YaRN's factor 32 over 4096 original positions, as the released models say
            max_position_embeddings=131072,
        )
        cls = transformers.GptOssConfig
    else:
        raise ValueError(f"unknown model family {family!r}; choose one of {', '.join(FAMILIES)}")
    fields.update(overrides)
    return cls(**fields)


def write(family: str, folder, dtype: str = "bfloat16", seed: int = 0, **overrides) -> str:
    """Write a tiny randomly initialised ``family`` model to ``folder``; returns the folder."""
    import torch
    import transformers

    cfg = config(family, **overrides)
    cfg.dtype = dtype
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.dtype.is_floating_point:
                # Every tensor random, not only what the init touches (biases, norms, sinks),
                # so that a mapping that drops or swaps a tensor shows in an exact comparison.
                tensor.copy_(torch.randn_like(tensor) * 0.05)
    model = model.to(getattr(torch, dtype))
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer(cfg.vocab_size).save_pretrained(folder)
    return str(folder)


def tokenizer(vocab_size: int):
    """A word-level tokenizer with ``vocab_size`` entries (a real checkpoint folder has one, and
    converters load it)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(vocab_size - 3)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def tensors(folder) -> dict:
    """Every tensor of the safetensors files in ``folder``, by name."""
    from safetensors.torch import load_file

    found = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            found.update(load_file(os.path.join(folder, name)))
    return found
