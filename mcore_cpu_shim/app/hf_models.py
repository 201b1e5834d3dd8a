"""Tiny Hugging Face models written locally with ``transformers`` (random weights, no hub).

The one builder behind ``mcore-cpu-shim demo``, the Megatron-Bridge tests and the conversion
benchmark: ``write(family, folder)`` saves a model (``config.json`` and safetensors shards) that
Megatron-Bridge converts like the real thing, small enough for a test on two CPU cores.

Families (what each exercises on the megatron side):
  llama        dense, plain RoPE, GQA
  qwen2        as llama, with biases on the q/k/v projections
  qwen3        as llama, with q/k layer norms
  qwen3-moe    qwen3 attention, 4 experts with 2 per token (no shared expert)
  gpt-oss      YaRN, learnable softmax offsets, sliding-window layers, 4 experts top-2
  deepseek-v3  MLA with YaRN, a dense first layer, then 4 routed experts (sigmoid scores with an
               expert bias, grouped top-2) and a shared expert
  mixtral      llama attention, 4 experts top-2 (softmax scores) in every layer; no Megatron-Bridge
               converts it (neither 0.3.1 nor main has a Mixtral bridge): the tests convert it
               with megatron-core directly (tests/test_family_mixtral.py)
``overrides`` change any config field (e.g. a larger ``hidden_size`` for the benchmark).
"""

from __future__ import annotations

import os

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3-moe", "gpt-oss", "deepseek-v3", "mixtral")
# The families no Megatron-Bridge has a bridge for; the others it converts (``demo --model``).
WITHOUT_BRIDGE = ("mixtral",)
BRIDGE_FAMILIES = tuple(family for family in FAMILIES if family not in WITHOUT_BRIDGE)
# The config fields of the routed experts' count and FFN size, by MoE family (the others are
# dense: ``intermediate_size`` is their FFN).
EXPERT_FIELDS = {
    "qwen3-moe": ("num_experts", "moe_intermediate_size"),
    "gpt-oss": ("num_local_experts", "intermediate_size"),
    "deepseek-v3": ("n_routed_experts", "moe_intermediate_size"),
    "mixtral": ("num_local_experts", "intermediate_size"),
}

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
    elif family in ("qwen2", "qwen3"):
        fields = dict(_COMMON, intermediate_size=128, rms_norm_eps=1e-6)
        cls = transformers.Qwen2Config if family == "qwen2" else transformers.Qwen3Config
    elif family == "qwen3-moe":
        fields = dict(_COMMON, intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                      num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6)
        cls = transformers.Qwen3MoeConfig
    elif family == "deepseek-v3":
        fields = dict(
            _COMMON,
            num_key_value_heads=4,  # MLA: one latent for every head
            intermediate_size=128,  # the dense first layer
            moe_intermediate_size=64,
            first_k_dense_replace=1,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            routed_scaling_factor=2.5,
            # in the released config.json, not among DeepseekV3Config's own fields; converters
            # read them (Bridge: scoring_func -> moe_router_score_function)
            scoring_func="sigmoid",
            topk_method="noaux_tc",
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
            # YaRN as the released model's config has it (factor 40 over 4096 positions)
            max_position_embeddings=163840,
            rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096,
                              beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),
        )
        fields.pop("head_dim")
        cls = transformers.DeepseekV3Config
    elif family == "mixtral":
        fields = dict(_COMMON, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                      rms_norm_eps=1e-5, sliding_window=None)
        cls = transformers.MixtralConfig
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


def write(family: str, folder, dtype: str = "bfloat16", seed: int = 0, shard_size=None, **overrides) -> str:
    """Write a tiny randomly initialised ``family`` model to ``folder``; returns the folder.
    ``shard_size``: ``save_pretrained``'s ``max_shard_size`` (e.g. ``"10MB"``: several shards
    and a ``model.safetensors.index.json``)."""
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
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            # float32 in the released DeepSeek-V3 checkpoint (and in Megatron's router)
            buffer.data = buffer.data.float()
    os.makedirs(folder, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True, **({"max_shard_size": shard_size} if shard_size else {}))
    tokenizer(cfg.vocab_size).save_pretrained(folder)
    return str(folder)


def write_mxfp4(folder, reference, seed: int = 0, **overrides) -> str:
    """A tiny GPT-OSS in the layout its published checkpoints have: the expert weights in MXFP4
    (``*_blocks``, ``*_scales``; ``app/quantized.py``), the rest bfloat16, and
    ``quantization_config.quant_method = "mxfp4"`` in config.json. ``reference``: where to write
    the same model unquantized (the expert weights as the blocks decode, exactly), the
    reference of every comparison. Returns ``folder``."""
    import torch

    from .quantized import E2M1

    write("gpt-oss", reference, seed=seed, **overrides)
    table = torch.tensor(E2M1[:8])  # the magnitudes
    originals, quantized = tensors(reference), {}
    for name, value in originals.items():
        if ".mlp.experts." not in name or name.endswith("_bias"):
            quantized[name] = value
            continue
        rows = value.transpose(-1, -2).float()  # [experts, out, in]: blocks along the input
        groups = rows.reshape(*rows.shape[:-1], -1, 32)
        # The scale: the smallest power of two that brings the block's largest value to <= 6.
        peak = groups.abs().amax(-1, keepdim=True).clamp(min=2.0**-100)
        exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
        scaled = groups / torch.pow(2.0, exponent)
        magnitude = (scaled.abs().unsqueeze(-1) - table).abs().argmin(-1)
        codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
        quantized[f"{name}_blocks"] = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()
        quantized[f"{name}_scales"] = (exponent.squeeze(-1) + 127).to(torch.uint8).contiguous()
        decoded = torch.tensor(E2M1)[codes.long()] * torch.pow(2.0, exponent)
        originals[name] = decoded.reshape(rows.shape).transpose(-1, -2).to(value.dtype).contiguous()
    return _save_quantized(folder, reference, originals, quantized, {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"]})


def write_fp8(folder, reference, block=(128, 128), seed: int = 0, **overrides) -> str:
    """A tiny DeepSeek-V3 in the layout of the published FP8 checkpoints (DeepSeek-V3/R1,
    Kimi-K2): every linear weight of the layers float8 e4m3 with a float32 ``*_scale_inv`` per
    ``block`` (rows x columns; the edge blocks partial where a size is no multiple), the
    embeddings, norms, router and output layer bfloat16, and ``quantization_config`` with
    ``quant_method: fp8`` and ``weight_block_size``. ``reference``: where to write the same
    model dequantized (weight x scale_inv per block, to bfloat16): the reference of every
    comparison. Returns ``folder``."""
    import torch

    write("deepseek-v3", reference, seed=seed, **overrides)
    originals, quantized = tensors(reference), {}
    rows, columns = block
    for name, value in originals.items():
        # every linear weight of the layers but the router's (norms are one-dimensional)
        linear = name.startswith("model.layers.") and value.dim() == 2 and not name.endswith(".mlp.gate.weight")
        if not linear:
            quantized[name] = value
            continue
        w = value.float()
        padded = torch.nn.functional.pad(w, (0, -w.shape[1] % columns, 0, -w.shape[0] % rows))
        blocks = padded.reshape(padded.shape[0] // rows, rows, padded.shape[1] // columns, columns)
        scale_inv = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)  # e4m3's largest value
        expanded = scale_inv.repeat_interleave(rows, 0)[: w.shape[0]].repeat_interleave(columns, 1)[:, : w.shape[1]]
        stored = (w / expanded).to(torch.float8_e4m3fn)
        quantized[name], quantized[f"{name}_scale_inv"] = stored, scale_inv.float().contiguous()
        originals[name] = (stored.float() * expanded).to(value.dtype)
    return _save_quantized(folder, reference, originals, quantized, {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)})


def _save_quantized(folder, reference, decoded, stored, quantization):
    """Write ``decoded`` as the reference's only safetensors file, and ``folder``: the
    reference's other files, ``stored`` and ``quantization`` in its config.json."""
    import json

    from safetensors.torch import save_file

    for file in [n for n in os.listdir(reference) if n.endswith(".safetensors")]:
        os.remove(os.path.join(reference, file))
    save_file(decoded, os.path.join(reference, "model.safetensors"), metadata={"format": "pt"})
    os.makedirs(folder, exist_ok=True)
    for file in os.listdir(reference):
        if not file.endswith(".safetensors"):
            with open(os.path.join(reference, file), "rb") as source, open(os.path.join(folder, file), "wb") as copy:
                copy.write(source.read())
    save_file(stored, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = quantization
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
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
