"""rope_device: the forward pass of a plain-RoPE (Llama-style) model and the build and forward of
an M-RoPE (Qwen2.5-VL-style) model on a host without CUDA; rotary values unchanged bit for bit.
"""

import importlib

import pytest
from helpers import (
    MCORE_VERSION,
    MODE,
    cpu_logits,
    inference_rng_tracker,
    init_gloo,
    needs_unfixed,
    run_without_fix,
    upstream_fixed,
)

FIX = "rope_device"
MODULE = "megatron.core.models.common.embeddings.rotary_pos_embedding"
SHIM_ONLY = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: needs the unpatched code")
# Where the frequencies are moved: forward up to 0.15, get_emb from 0.16 on.
EMB_METHOD = "forward" if MCORE_VERSION < (0, 16) else "get_emb"
EMB_TARGET = f"{MODULE}:RotaryEmbedding.{EMB_METHOD}"
MROPE_TARGET = f"{MODULE}:MultimodalRotaryEmbedding.__init__"

KV_CHANNELS = 8  # hidden 32 / 4 heads: 4 frequencies
MROPE_SECTION = [2, 1, 1]  # temporal, height, width: sums to the 4 frequencies
# Llama-style: GQA, SwiGLU, RMSNorm, no biases, untied output layer, RoPE.
LLAMA_LIKE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    add_bias_linear=False,
    gated_linear_unit=True,
    normalization="RMSNorm",
)


def rope_module():
    return importlib.import_module(MODULE)


def llama_like(seed, position_embedding_type="rope", **config):
    """A Llama-style local-spec GPTModel built on the CPU (use_cpu_initialization)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    settings = dict(LLAMA_LIKE, activation_func=F.silu, **config)
    cfg = TransformerConfig(use_cpu_initialization=True, params_dtype=torch.float32, **settings)
    return GPTModel(
        config=cfg,
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type=position_embedding_type,
        rotary_base=500000,
        share_embeddings_and_output_weights=False,
    )


def mrope_logits(model, batch=2, tokens=8):
    """Logits of a fixed token batch with M-RoPE positions ([3, batch, tokens]: text positions,
    the same on the temporal, height and width axes, as for text-only input)."""
    import torch

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 64, (batch, tokens), generator=generator)
    position_ids = torch.arange(tokens).expand(3, batch, -1)
    model.eval()
    with torch.no_grad():
        return model(input_ids, position_ids, None)


def frequencies(dim, base):
    """inv_freq as every release makes it."""
    import torch

    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))


def reference_emb(inv_freq, max_seq_len, offset=0):
    """The rotary embedding, operation by operation as megatron-core computes it (not
    interleaved), on inv_freq's device."""
    import torch

    seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
    freqs = torch.outer(seq, inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def upstream_emb(rope, max_seq_len, offset=0):
    """The embedding from megatron-core's own unpatched function (shim mode only; the installed
    replacement's ``__wrapped__``). It moves the frequencies to ``torch.cuda.current_device()``,
    which the caller may redirect."""
    cls = rope_module().RotaryEmbedding
    return getattr(cls, EMB_METHOD).__wrapped__(rope, max_seq_len, offset)


def assert_same(expected, actual):
    import torch

    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.device == expected.device
    assert torch.equal(actual, expected)


@pytest.mark.cuda_hidden
def test_llama_like_forward_on_cpu(tmp_path, forbid_cuda):
    import torch

    init_gloo(str(tmp_path))
    inference_rng_tracker()
    model = llama_like(seed=1)
    rope = model.rotary_pos_emb
    assert type(rope) is rope_module().RotaryEmbedding
    inv_freq = rope.inv_freq
    assert inv_freq.device == torch.device("cpu")

    logits = cpu_logits(model)
    assert logits.shape == (2, 8, 64) and logits.device == torch.device("cpu")
    assert torch.isfinite(logits).all()
    # The frequencies stayed where they were (the move is a no-op without CUDA), with the
    # values every release computes; the embedding the model used is the formula's, bit for bit.
    assert rope.inv_freq is inv_freq
    assert_same(frequencies(KV_CHANNELS, 500000), rope.inv_freq)
    assert_same(reference_emb(rope.inv_freq, 8), rope(8))
    # Another model of the same weights gives the same logits (nothing depends on a memo).
    assert torch.equal(logits, cpu_logits(llama_like(seed=1)))
    assert forbid_cuda == []
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("rope_scaling", [False, True], ids=["llama2-style", "llama3.1-scaling"])
def test_rotary_embedding_values_on_cpu(forbid_cuda, rope_scaling):
    import torch

    rope = rope_module().RotaryEmbedding(
        kv_channels=64,
        rotary_percent=1.0,
        rotary_base=500000,
        rope_scaling=rope_scaling,
        rope_scaling_factor=8.0,
        use_cpu_initialization=True,
    )
    inv_freq = rope.inv_freq
    if not rope_scaling:
        assert_same(frequencies(64, 500000), inv_freq)
    emb = rope(300, 7)
    assert emb.shape == (300, 1, 1, 64) and emb.device == torch.device("cpu")
    assert rope.inv_freq is inv_freq
    assert_same(reference_emb(inv_freq, 300, 7), emb)
    cos, sin = rope.get_cos_sin(300)
    freqs = reference_emb(inv_freq, 300)[:, 0, 0, :32]
    assert_same(torch.cos(freqs), cos)
    assert_same(torch.sin(freqs), sin)
    assert forbid_cuda == []


@pytest.mark.cuda_hidden
def test_mrope_model_builds_and_runs_on_cpu(tmp_path, forbid_cuda):
    import torch

    init_gloo(str(tmp_path))
    inference_rng_tracker()
    model = llama_like(seed=1, position_embedding_type="mrope", mrope_section=MROPE_SECTION)
    rope = model.rotary_pos_emb
    assert type(rope) is rope_module().MultimodalRotaryEmbedding
    assert_same(frequencies(KV_CHANNELS, 500000), rope.inv_freq)

    logits = mrope_logits(model)
    assert logits.shape == (2, 8, 64) and logits.device == torch.device("cpu")
    assert torch.isfinite(logits).all()
    # With equal positions on the three axes M-RoPE is plain RoPE: the same embedding.
    positions = torch.arange(8).expand(3, 1, -1)
    assert torch.equal(rope(positions, MROPE_SECTION)[:, 0], reference_emb(rope.inv_freq, 8)[:, 0])
    assert forbid_cuda == []
    assert not torch.cuda.is_initialized()


@SHIM_ONLY
@needs_unfixed(EMB_TARGET)
@pytest.mark.cuda_hidden
def test_values_bit_identical_to_the_unpatched_code(monkeypatch):
    import torch

    rope = rope_module().RotaryEmbedding(
        kv_channels=64, rotary_percent=1.0, rope_scaling=True, use_cpu_initialization=True
    )
    emb = rope(300, 7)
    # The unpatched code, with its move to "the GPU" sent to the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    assert_same(upstream_emb(rope, 300, 7), emb)


@SHIM_ONLY
@needs_unfixed(MROPE_TARGET)
@pytest.mark.cuda_hidden
def test_mrope_frequencies_bit_identical_to_the_unpatched_code(monkeypatch):
    import torch

    cls = rope_module().MultimodalRotaryEmbedding
    rope = cls(kv_channels=64, rotary_percent=1.0, rotary_base=1000000)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    original = cls.__new__(cls)
    cls.__init__.__wrapped__(original, kv_channels=64, rotary_percent=1.0, rotary_base=1000000)
    assert_same(original.inv_freq, rope.inv_freq)


@SHIM_ONLY
@pytest.mark.cuda_hidden
@pytest.mark.parametrize(
    "what, target",
    [("rope", EMB_TARGET), ("mrope", MROPE_TARGET)],
    ids=["llama-like forward", "mrope build"],
)
def test_without_the_fix_cpu_rope_needs_cuda(tmp_path, what, target):
    if upstream_fixed(target):
        pytest.skip(f"megatron-core fixed {target} itself (upstream-fixed)")
    code = f"""
    from helpers import inference_rng_tracker, init_gloo, cpu_logits
    from test_rope_device import llama_like, mrope_logits, MROPE_SECTION
    init_gloo({str(tmp_path)!r})
    inference_rng_tracker()
    if {what!r} == "rope":
        cpu_logits(llama_like(seed=1))
    else:
        model = llama_like(seed=1, position_embedding_type="mrope", mrope_section=MROPE_SECTION)
        mrope_logits(model)
    """
    stderr = run_without_fix(FIX, code)
    assert "current_device" in stderr, stderr[-3000:]
    assert "NVIDIA driver" in stderr or "not compiled with CUDA" in stderr, stderr[-3000:]


@pytest.mark.cuda_visible
def test_with_cuda_a_cpu_built_rope_moves_to_the_gpu_as_before():
    """Where CUDA is available nothing changes: the first forward moves the frequencies to the
    current CUDA device (a model moved with .cuda() or by FSDP2 needs that), and the values are
    the unpatched code's, bit for bit."""
    import torch

    torch.cuda.set_device(0)
    gpu = torch.device("cuda", torch.cuda.current_device())
    cls = rope_module().RotaryEmbedding
    rope = cls(kv_channels=64, rotary_percent=1.0, rope_scaling=True, use_cpu_initialization=True)
    assert rope.inv_freq.device == torch.device("cpu")
    emb = rope(300, 7)
    assert emb.device == gpu and rope.inv_freq.device == gpu
    assert_same(reference_emb(rope.inv_freq, 300, 7), emb)
    if MODE == "shim" and not upstream_fixed(EMB_TARGET):
        twin = cls(
            kv_channels=64, rotary_percent=1.0, rope_scaling=True, use_cpu_initialization=True
        )
        assert_same(upstream_emb(twin, 300, 7), emb)
        assert twin.inv_freq.device == gpu


@pytest.mark.cuda_visible
def test_with_cuda_mrope_is_built_on_the_current_device_as_before():
    import torch

    torch.cuda.set_device(0)
    gpu = torch.device("cuda", torch.cuda.current_device())
    cls = rope_module().MultimodalRotaryEmbedding
    rope = cls(kv_channels=64, rotary_percent=1.0, rotary_base=1000000)
    assert rope.inv_freq.device == gpu
    if MODE == "shim" and not upstream_fixed(MROPE_TARGET):
        original = cls.__new__(cls)
        cls.__init__.__wrapped__(original, kv_channels=64, rotary_percent=1.0, rotary_base=1000000)
        assert_same(original.inv_freq, rope.inv_freq)
    emb = rope(torch.arange(8, device=gpu).expand(3, 2, -1), [16, 8, 8])
    assert emb.device == gpu and emb.shape == (8, 2, 1, 64)
