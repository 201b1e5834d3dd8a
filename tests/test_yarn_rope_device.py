"""yarn_rope_device: YaRN rotary tables built without CUDA, rebuilt where the module lives, and
a forward memo that follows the module when it moves; values unchanged bit for bit."""

import importlib
import math
import os

import pytest
from helpers import MCORE_VERSION, MODE, needs_unfixed, upstream_fixed

FIX = "yarn_rope_device"
MODULE = "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding"
SHIM_ONLY = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: needs the unpatched code")
# The function upstream_emb runs unpatched: before 0.16 the table is computed in forward.
EMB_TARGET = f"{MODULE}:YarnRotaryEmbedding.{'forward' if MCORE_VERSION < (0, 16) else 'get_emb'}"
# tools/matrix.py's drift mode: every fix through its site checks and drift form.
DRIFT_ONLY = os.environ.get("_MCORE_CPU_SHIM_DRIFT_ONLY") == "1"

# Small, and far enough from the defaults that every part of the formula matters: a scaling
# factor > 1 (extra and inter frequencies differ, mscale != 1), a ramp that is neither all 0
# nor all 1, and mscale_all_dim != mscale.
INITIAL = 256  # original_max_position_embeddings: the length of the cache the constructor builds
SETTINGS = dict(
    kv_channels=64,
    rotary_base=10000.0,
    scaling_factor=40.0,
    original_max_position_embeddings=INITIAL,
    beta_fast=32.0,
    beta_slow=1.0,
    mscale=1.0,
    mscale_all_dim=0.707,
)


def yarn_class():
    module = importlib.import_module(MODULE)
    return module.YarnRotaryEmbedding


def yarn(use_cpu_initialization=True, **overrides):
    return yarn_class()(use_cpu_initialization=use_cpu_initialization, **dict(SETTINGS, **overrides))


def reference(max_seq_len, offset=0, round_to_int=True, **overrides):
    """(emb, mscale) by the YaRN formulas, written out here operation by operation in the order
    megatron-core runs them, on the CPU in float32."""
    import torch

    s = dict(SETTINGS, **overrides)
    dim, base, factor = s["kv_channels"], s["rotary_base"], s["scaling_factor"]
    extra = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    inter = 1.0 / (factor * base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))

    def correction_dim(rotations):
        positions = s["original_max_position_embeddings"]
        return (dim * math.log(positions / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    mask = 1.0 - ramp
    inv_freq = inter * (1 - mask) + extra * mask

    seq = torch.arange(max_seq_len, dtype=torch.float32) + offset
    freqs = torch.outer(seq, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, None, :]

    def mscale(m):
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    return emb, float(mscale(s["mscale"]) / mscale(s["mscale_all_dim"]))


def reference_cos_sin(max_seq_len, dtype, **kwargs):
    emb, mscale = reference(max_seq_len, **kwargs)
    return (emb.cos() * mscale).to(dtype), (emb.sin() * mscale).to(dtype)


def upstream_emb(module, max_seq_len, offset=0):
    """(emb, mscale) from megatron-core's own unpatched function (shim mode only); it moves the
    frequencies to ``torch.cuda.current_device()``, which the caller may redirect."""
    cls = yarn_class()
    if MCORE_VERSION < (0, 16):
        # Our memoised forward wraps upstream's memoised forward, which wraps the function.
        return cls.forward.__wrapped__.__wrapped__(module, max_seq_len, offset)
    return cls.get_emb.__wrapped__(module, max_seq_len, offset)


def assert_same(expected, actual):
    import torch

    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected)


@pytest.mark.cuda_hidden
def test_cpu_construction_touches_no_cuda(forbid_cuda):
    import torch

    rope = yarn()
    for name in ("inv_freq_extra", "inv_freq_inter", "cos_cached", "sin_cached"):
        assert getattr(rope, name).device == torch.device("cpu"), name
    assert rope.cos_cached.shape == (INITIAL, 1, 1, SETTINGS["kv_channels"])
    emb, _ = rope(INITIAL)
    assert emb.device == torch.device("cpu")
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_rebuild_beyond_the_initial_length_stays_on_cpu(forbid_cuda):
    import torch

    rope = yarn()
    cos, sin = rope.get_cached_cos_sin(2 * INITIAL)
    assert rope.max_seq_len_cached == 2 * INITIAL
    assert cos.device == sin.device == torch.device("cpu")
    want_cos, want_sin = reference_cos_sin(2 * INITIAL, torch.get_default_dtype())
    assert_same(want_cos, cos)
    assert_same(want_sin, sin)
    assert rope.inv_freq_extra.device == torch.device("cpu")


@pytest.mark.cuda_hidden
@pytest.mark.skipif(
    DRIFT_ONLY,
    reason="drift mode (_MCORE_CPU_SHIM_DRIFT_ONLY=1): on drifted code the YaRN fix moves the "
    "frequencies to the meta device too, a documented difference",
)
@pytest.mark.xfail(
    MCORE_VERSION >= (0, 16) and upstream_fixed(EMB_TARGET),
    reason=f"megatron-core fixed {EMB_TARGET} itself (upstream-fixed, PR 6270) by moving "
    "inv_freq_extra/inv_freq_inter to the cache's device for good: after to('meta') a rebuild "
    "leaves them meta tensors, to_empty does not restore them (plain attributes, not buffers), "
    "and the next CPU rebuild raises 'Cannot copy out of meta tensor'",
    strict=True,
)
def test_identical_call_after_move_to_meta_returns_meta(forbid_cuda):
    import torch

    rope = yarn()
    before, mscale = rope(300)
    assert before.device == torch.device("cpu")

    rope.to("meta")
    after, mscale_after = rope(300)
    assert after.device == torch.device("meta"), "the forward memo survived the move"
    assert after.shape == before.shape and mscale_after == mscale
    assert rope.cos_cached.device == torch.device("meta")
    cos, _ = rope.get_cached_cos_sin(2 * INITIAL)
    assert cos.device == torch.device("meta") and cos.shape[0] == 2 * INITIAL

    # The frequencies keep their values through the meta excursion: after to_empty, a rebuild
    # on the CPU gives the real tables again.
    assert rope.inv_freq_extra.device == torch.device("cpu")
    rope.to_empty(device="cpu")
    cos, sin = rope.get_cached_cos_sin(3 * INITIAL)
    want_cos, want_sin = reference_cos_sin(3 * INITIAL, torch.get_default_dtype())
    assert_same(want_cos, cos)
    assert_same(want_sin, sin)
    again, _ = rope(300)
    assert again.device == torch.device("cpu")
    assert_same(before, again)


@pytest.mark.cuda_hidden
def test_identical_call_after_dtype_change_is_computed_again(forbid_cuda):
    import torch

    rope = yarn()
    before, _ = rope(300)
    rope.to(torch.float64)

    # The cos/sin buffers follow the module's dtype, as upstream.
    assert rope.cos_cached.dtype == rope.sin_cached.dtype == torch.float64
    cos, sin = rope.get_cached_cos_sin(INITIAL)
    assert cos.dtype == sin.dtype == torch.float64
    # forward is computed again, not served from the memo; like upstream it computes in the
    # frequencies' float32, so the values are the same.
    after, _ = rope(300)
    assert after is not before, "the forward memo survived the dtype change"
    assert_same(before, after)
    # A rebuild in float64 gives float64 tables of the same values.
    cos, sin = rope.get_cached_cos_sin(2 * INITIAL, dtype=torch.float64)
    want_cos, want_sin = reference_cos_sin(2 * INITIAL, torch.float64)
    assert_same(want_cos, cos)
    assert_same(want_sin, sin)


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("round_to_int", [True, False])
def test_values_bit_identical_to_the_formula(forbid_cuda, round_to_int):
    import torch

    options = {}
    if not round_to_int:
        if MCORE_VERSION < (0, 15):
            pytest.skip("correction_range_round_to_int arrived in megatron-core 0.15")
        options["correction_range_round_to_int"] = False
    rope = yarn(**options)
    dtype = torch.get_default_dtype()

    want_cos, want_sin = reference_cos_sin(INITIAL, dtype, round_to_int=round_to_int)
    assert_same(want_cos, rope.cos_cached)
    assert_same(want_sin, rope.sin_cached)

    emb, mscale = rope(300, 7)
    want_emb, want_mscale = reference(300, offset=7, round_to_int=round_to_int)
    assert_same(want_emb, emb)
    assert mscale == want_mscale and mscale != 1.0

    cos, sin = rope.get_cached_cos_sin(3 * INITIAL, offset=5)
    want_cos, want_sin = reference_cos_sin(3 * INITIAL, dtype, offset=5, round_to_int=round_to_int)
    assert_same(want_cos, cos)
    assert_same(want_sin, sin)


@SHIM_ONLY
@needs_unfixed(EMB_TARGET)
@pytest.mark.cuda_hidden
def test_values_bit_identical_to_the_unpatched_code(monkeypatch):
    import torch

    rope = yarn()
    emb, mscale = rope(300, 7)
    cos, sin = rope.get_cached_cos_sin(2 * INITIAL)

    # The unpatched code, with its move to "the GPU" sent to the CPU.
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    want_emb, want_mscale = upstream_emb(rope, 300, 7)
    assert_same(want_emb, emb)
    assert mscale == want_mscale
    want, want_mscale = upstream_emb(rope, 2 * INITIAL)
    assert_same((want.cos() * want_mscale).to(torch.get_default_dtype()), cos)
    assert_same((want.sin() * want_mscale).to(torch.get_default_dtype()), sin)


@SHIM_ONLY
@needs_unfixed(EMB_TARGET)
@pytest.mark.cuda_hidden
def test_unpatched_code_needs_cuda():
    """The tripwire tests above are real checks: without the fix these paths call CUDA."""
    from mcore_cpu_shim import CudaTouchedError, forbid_cuda

    rope = yarn()
    with pytest.raises(CudaTouchedError):
        with forbid_cuda():
            upstream_emb(rope, 300)
    if MCORE_VERSION < (0, 15):
        cls = yarn_class()
        with pytest.raises(CudaTouchedError):
            with forbid_cuda():
                cls.__init__.__wrapped__(cls.__new__(cls), 64, use_cpu_initialization=True)


@pytest.mark.cuda_visible
def test_cpu_built_module_moved_to_cuda_computes_there():
    import torch

    rope = yarn()
    on_cpu, mscale = rope(300)
    rope.cuda()
    on_gpu, mscale_gpu = rope(300)
    assert on_gpu.is_cuda, "the forward memo survived the move"
    assert mscale_gpu == mscale
    torch.testing.assert_close(on_gpu.cpu(), on_cpu)
    assert rope.inv_freq_extra.is_cuda and rope.inv_freq_inter.is_cuda

    cos, sin = rope.get_cached_cos_sin(2 * INITIAL)
    assert cos.is_cuda and sin.is_cuda
    want_cos, want_sin = reference_cos_sin(2 * INITIAL, torch.get_default_dtype())
    torch.testing.assert_close(cos.cpu(), want_cos)
    torch.testing.assert_close(sin.cpu(), want_sin)


@pytest.mark.cuda_visible
def test_default_initialisation_on_gpu_moves_nothing():
    import torch

    torch.cuda.set_device(0)
    gpu = torch.device("cuda", torch.cuda.current_device())
    rope = yarn(use_cpu_initialization=False)
    extra, inter = rope.inv_freq_extra, rope.inv_freq_inter
    assert extra.device == inter.device == rope.cos_cached.device == gpu

    emb, _ = rope(300, 7)
    cos, _ = rope.get_cached_cos_sin(2 * INITIAL)
    assert emb.device == cos.device == gpu
    assert rope.inv_freq_extra is extra and rope.inv_freq_inter is inter
    torch.testing.assert_close(emb.cpu(), reference(300, offset=7)[0])
    if MODE == "shim" and not upstream_fixed(EMB_TARGET):
        # The same operations on the same device as the unpatched code.
        assert torch.equal(emb, upstream_emb(rope, 300, 7)[0])
