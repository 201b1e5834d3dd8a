"""attention_buffers_device: the attention scores buffer and the causal masks are made on the
CPU where CUDA is unavailable, and exactly as before where it is."""


import pytest
from helpers import MCORE_VERSION, init_gloo, run_without_fix

FIX = "attention_buffers_device"
BUFFER = "megatron.core.utils:GlobalMemoryBuffer.get_tensor"
CAUSAL = "megatron.core.transformer.utils:get_default_causal_mask"
WINDOW = "megatron.core.transformer.utils:get_sliding_window_causal_mask"

needs_window = pytest.mark.skipif(
    MCORE_VERSION < (0, 15), reason="megatron-core < 0.15 has no sliding-window mask"
)


def transformer_utils():
    from megatron.core.transformer import utils

    return utils


def reference_causal_mask(sq):
    """Position j is hidden from position i when j > i, written out element by element."""
    import torch

    return torch.tensor([[j > i for j in range(sq)] for i in range(sq)])


def reference_window_mask(sq, skv, window):
    """Hidden unless i + (skv - sq) - window[0] <= j <= i + (skv - sq) + window[1]."""
    import torch

    shift = skv - sq
    return torch.tensor(
        [
            [not (i + shift - window[0] <= j <= i + shift + window[1]) for j in range(skv)]
            for i in range(sq)
        ]
    )


def attention(**settings):
    import torch
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    values = dict(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        attention_dropout=0.0,
    )
    values.update(settings)
    config = TransformerConfig(**values)
    return DotProductAttention(
        config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self"
    )


@pytest.mark.cuda_hidden
def test_buffer_is_a_reused_cpu_tensor(tmp_path, forbid_cuda):
    import torch
    from megatron.core import parallel_state

    init_gloo(tmp_path)
    buffer = parallel_state.get_global_memory_buffer()
    first = buffer.get_tensor((4, 6), torch.float32, "mpu")
    assert first.device == torch.device("cpu")
    assert first.shape == (4, 6) and first.dtype == torch.float32
    smaller = buffer.get_tensor((2, 3), torch.float32, "mpu")
    assert smaller.data_ptr() == first.data_ptr()  # the same storage, as on a GPU
    other_dtype = buffer.get_tensor((2, 3), torch.bfloat16, "mpu")
    assert other_dtype.dtype == torch.bfloat16 and other_dtype.device.type == "cpu"
    larger = buffer.get_tensor((5, 6), torch.float32, "mpu")
    assert larger.shape == (5, 6) and larger.device.type == "cpu"


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("sq", [1, 5, 16])
def test_causal_mask_on_cpu_equals_reference(forbid_cuda, sq):
    import torch

    mask = transformer_utils().get_default_causal_mask(sq)
    assert mask.device == torch.device("cpu") and mask.dtype == torch.bool
    assert torch.equal(mask, reference_causal_mask(sq))


@pytest.mark.cuda_hidden
@needs_window
@pytest.mark.parametrize("sq,skv,window", [(6, 6, (2, 0)), (4, 7, (3, 1)), (5, 5, (0, 0))])
def test_sliding_window_mask_on_cpu_equals_reference(forbid_cuda, sq, skv, window):
    import torch

    mask = transformer_utils().get_sliding_window_causal_mask(sq, skv, window)
    assert mask.device == torch.device("cpu") and mask.dtype == torch.bool
    assert torch.equal(mask, reference_window_mask(sq, skv, window))


@pytest.mark.cuda_hidden
def test_attention_forward_on_cpu(tmp_path, forbid_cuda):
    """The causal attention builds its own mask: the same result as with the mask given."""
    import torch

    from helpers import inference_rng_tracker

    init_gloo(tmp_path)
    inference_rng_tracker()
    torch.manual_seed(5)
    module = attention().eval()
    sq, b, heads, dim = 6, 2, 4, 8
    query, key, value = (torch.randn(sq, b, heads, dim) for _ in range(3))
    with torch.no_grad():
        built = module(query, key, value, None, attn_mask_type=module.attn_mask_type)
        given = module(
            query, key, value, reference_causal_mask(sq), attn_mask_type=module.attn_mask_type
        )
    assert built.device.type == "cpu" and built.shape == (sq, b, heads * dim)
    assert torch.equal(built, given)
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_attention_forward_fails_without_the_fix(tmp_path):
    """The tests above are real checks: unfixed megatron-core cannot run the attention here."""
    stderr = run_without_fix(
        FIX,
        f"""
        import mcore_cpu_shim, torch
        from helpers import init_gloo, inference_rng_tracker
        from test_attention_buffers_device import attention
        init_gloo({str(tmp_path)!r})
        inference_rng_tracker()
        q = torch.randn(4, 1, 4, 8)
        attention().eval()(q, q, q, None)
        """,
    )
    assert "NVIDIA driver" in stderr or "not compiled with CUDA" in stderr, stderr
    assert "get_tensor" in stderr or "causal_mask" in stderr, stderr


@pytest.mark.cuda_visible
def test_gpu_buffer_and_masks_as_before(tmp_path):
    import torch
    from megatron.core import parallel_state

    torch.cuda.set_device(0)
    init_gloo(tmp_path)
    device = torch.device("cuda", torch.cuda.current_device())
    tensor = parallel_state.get_global_memory_buffer().get_tensor((3, 4), torch.float32, "mpu")
    assert tensor.device == device
    mask = transformer_utils().get_default_causal_mask(5)
    assert mask.device == device and torch.equal(mask.cpu(), reference_causal_mask(5))
    if MCORE_VERSION >= (0, 15):
        window = transformer_utils().get_sliding_window_causal_mask(4, 7, (3, 1))
        assert window.device == device
        assert torch.equal(window.cpu(), reference_window_mask(4, 7, (3, 1)))
