"""moe_forward_device: an alltoall MoE layer runs its forward on CPU tensors with CUDA absent,
and CUDA input takes the original code."""


import pytest
from helpers import MCORE_VERSION, gpt_oss_like, inference_rng_tracker, init_gloo, run_without_fix

FIX = "moe_forward_device"
TARGETS = (
    "megatron.core.transformer.moe.router:Router.gating",
    "megatron.core.transformer.moe.token_dispatcher:"
    "MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
    "megatron.core.tensor_parallel.mappings:_gather_along_first_dim",
    "megatron.core.tensor_parallel.mappings:_AllToAll.forward",
)


def moe_layer(model):
    return model.decoder.layers[0].mlp


@pytest.mark.cuda_hidden
def test_gating_on_cpu_equals_a_plain_matmul(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    router = moe_layer(gpt_oss_like(seed=1)).router
    weight = router.weight.detach().clone()
    tokens = torch.randn(5, 32, generator=torch.Generator().manual_seed(3))

    logits = router.gating(tokens)

    assert router.weight.device.type == "cpu" and torch.equal(router.weight, weight)
    assert logits.device.type == "cpu" and logits.shape == (5, 4)
    assert torch.equal(logits, torch.mm(tokens, weight.t()))


@pytest.mark.cuda_hidden
def test_moe_layer_forward_on_cpu(tmp_path, forbid_cuda):
    """The dispatcher hands its counts on as the CUDA path does: CPU tensors, NumPy splits."""
    import torch

    init_gloo(tmp_path)
    inference_rng_tracker()
    layer = moe_layer(gpt_oss_like(seed=1)).eval()
    hidden = torch.randn(6, 2, 32, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        output, _ = layer(hidden)
    assert output.device.type == "cpu" and output.shape == hidden.shape
    assert torch.isfinite(output).all()
    dispatcher = layer.token_dispatcher
    assert dispatcher.cuda_dtoh_stream is None
    # 12 tokens, top-2 routing, one rank: 24 routed token copies, all local.
    assert int(dispatcher.num_out_tokens) == 24
    if hasattr(dispatcher.num_out_tokens, "device"):
        assert dispatcher.num_out_tokens.device.type == "cpu"
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_moe_forward_fails_without_the_fix(tmp_path):
    """The tests above are real checks: unfixed megatron-core cannot route here."""
    stderr = run_without_fix(
        FIX,
        f"""
        import mcore_cpu_shim, torch
        from helpers import init_gloo, gpt_oss_like
        init_gloo({str(tmp_path)!r})
        router = gpt_oss_like(seed=1).decoder.layers[0].mlp.router
        router.gating(torch.randn(5, 32))
        """,
    )
    markers = ("NVIDIA driver", "not compiled with CUDA", "te_general_gemm")
    assert any(marker in stderr for marker in markers), stderr


@pytest.mark.cuda_visible
def test_gating_with_cuda_input_moves_cpu_weights_as_before(tmp_path):
    import torch

    torch.cuda.set_device(0)
    init_gloo(tmp_path)
    router = moe_layer(gpt_oss_like(seed=1)).router
    weight = router.weight.detach().clone()
    tokens = torch.randn(5, 32, device="cuda")
    logits = router.gating(tokens)
    device = torch.device("cuda", torch.cuda.current_device())
    assert router.weight.device == device and logits.device == device
    assert torch.equal(router.weight.cpu(), weight)


@pytest.mark.cuda_visible
def test_cpu_input_on_a_gpu_host_stays_on_cpu(tmp_path):
    import torch

    init_gloo(tmp_path)
    router = moe_layer(gpt_oss_like(seed=1)).router
    tokens = torch.randn(5, 32)
    logits = router.gating(tokens)
    assert router.weight.device.type == "cpu" and logits.device.type == "cpu"
    if MCORE_VERSION >= (0, 17):
        assert torch.equal(logits, torch.mm(tokens, router.weight.detach().t()))
