"""router_buffers_device: a MoE model whose router keeps buffers (expert bias for aux-loss-free
routing, global aux loss, quantile balancing) is built on a host without CUDA; the buffers are
CPU zeros, the expert bias routes and goes through a checkpoint, and CUDA hosts are unchanged.
"""

import importlib
import inspect

import pytest
from helpers import (
    MCORE_VERSION,
    MODE,
    NO_CUDA,
    init_gloo,
    mcore_version,
    megatron_source,
    needs_unfixed,
    run_without_fix,
    save_and_reload,
    tiny_gpt,
)

FIX = "router_buffers_device"
MODULE = "megatron.core.transformer.moe.router"
TARGET = f"{MODULE}:TopKRouter.__init__"
SHIM_ONLY = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: needs the unpatched code")
# Where an unpatched TopKRouter.__init__ gives its buffers the current CUDA device.
BUGGY_FROM = (0, 15)

EXPERTS = 4
# A 2-layer local-spec MoE GPTModel: 4 experts, top-2, alltoall (0.13 refuses biases in MoE).
MOE = dict(
    num_moe_experts=EXPERTS,
    moe_router_topk=2,
    ffn_hidden_size=64,
    add_bias_linear=False,
    moe_token_dispatcher_type="alltoall",
)
# DeepSeek-V3's router: sigmoid scores, aux-loss-free expert bias, a small sequence aux loss.
EXPERT_BIAS = dict(
    moe_router_enable_expert_bias=True,
    moe_router_score_function="sigmoid",
    moe_router_load_balancing_type="seq_aux_loss",
    moe_aux_loss_coeff=1e-3,
)
# Per router setting: the settings, the buffers it registers ({name: (persistent, shape, dtype
# name)}) and a text of the router module that a release with the feature has.
VARIANTS = {
    "expert-bias": (
        EXPERT_BIAS,
        {
            "expert_bias": (True, (EXPERTS,), "float32"),
            "local_tokens_per_expert": (False, (EXPERTS,), "float32"),
        },
        "expert_bias",
    ),
    "global-aux-loss": (
        dict(moe_router_load_balancing_type="global_aux_loss", moe_aux_loss_coeff=1e-2),
        {
            "global_tokens_per_expert": (False, (EXPERTS,), "float32"),
            "ga_steps": (False, (), "float32"),
        },
        "global_tokens_per_expert",
    ),
    "quantile-balancing": (
        dict(moe_router_load_balancing_type="quantile_balancing", moe_aux_loss_coeff=0.0),
        {
            "qb_beta": (True, (EXPERTS,), "float32"),
            "qb_beta_accum": (False, (EXPERTS,), "float32"),
            "qb_beta_count": (False, (), "int64"),
        },
        "qb_beta_count",
    ),
}


def router_module():
    return importlib.import_module(MODULE)


def moe_model(seed=1, **router):
    """The MoE GPTModel, built on the CPU (use_cpu_initialization), with these router settings
    (default: DeepSeek-V3's expert bias)."""
    return tiny_gpt(seed, **MOE, **(router or EXPERT_BIAS))


def routers(model):
    return [layer.mlp.router for layer in model.decoder.layers]


def has_variant(name):
    """Whether this release's router has the feature (read from source, in every mode)."""
    return VARIANTS[name][2] in (megatron_source(MODULE) or "")


@pytest.mark.cuda_hidden
@pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: about the shim's replacement")
def test_constructor_rewritten_in_place():
    import mcore_cpu_shim

    init = router_module().TopKRouter.__init__
    fix = mcore_cpu_shim.status()[FIX]
    original = inspect.unwrap(init)
    names_cuda = "torch.cuda.current_device()" in inspect.getsource(original)
    if MCORE_VERSION < BUGGY_FROM:
        # 0.13/0.14 make the buffers on the CPU (no device given): nothing to fix.
        assert not names_cuda and fix["state"] == "upstream-fixed", fix
        assert init is original
    elif fix["state"] == "applied":
        assert names_cuda
        # Rewritten in place: upstream's file and lines, so tracebacks point there.
        assert init is not original
        assert init.__code__.co_filename == original.__code__.co_filename
        assert init.__code__.co_firstlineno == original.__code__.co_firstlineno


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_router_buffers_are_cpu_zeros(tmp_path, forbid_cuda, variant):
    import torch

    if not has_variant(variant):
        pytest.skip(f"this megatron-core ({mcore_version()}) has no {variant} router buffers")
    settings, buffers, _ = VARIANTS[variant]
    init_gloo(str(tmp_path))
    model = moe_model(**settings)
    state = model.state_dict()
    sharded = model.sharded_state_dict()
    for layer, router in enumerate(routers(model)):
        assert type(router) is router_module().TopKRouter
        own = dict(router.named_buffers())
        assert set(buffers) <= set(own), own.keys()
        for name, (persistent, shape, dtype) in buffers.items():
            buffer = own[name]
            assert buffer.device == torch.device("cpu"), name
            assert buffer.dtype == getattr(torch, dtype) and tuple(buffer.shape) == shape, name
            assert not buffer.any(), name
            key = f"decoder.layers.{layer}.mlp.router.{name}"
            # Persistent buffers are checkpoint tensors (HF's e_score_correction_bias).
            assert (key in state) == persistent, key
            assert (key in sharded) == persistent, key
    assert forbid_cuda == []
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_expert_bias_routes_on_cpu(tmp_path, forbid_cuda):
    """The CPU expert bias is the one routing reads, and the CPU token counts are the ones a
    training step adds to."""
    import torch

    init_gloo(str(tmp_path))
    router = routers(moe_model())[0]
    tokens = torch.randn(6, 1, 32, generator=torch.Generator().manual_seed(2))
    router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 100.0]))

    router.eval()
    with torch.no_grad():
        probs, routing_map = router(tokens)
    assert probs.device.type == routing_map.device.type == "cpu"
    assert routing_map.shape == (6, EXPERTS)
    assert routing_map[:, 3].all(), "the expert bias did not steer the routing"
    assert routing_map.sum(dim=1).eq(2).all()

    router.train()
    _, routing_map = router(tokens)
    counts = routing_map.sum(dim=0).to(torch.float32)
    assert router.local_tokens_per_expert.device.type == "cpu"
    assert torch.equal(router.local_tokens_per_expert, counts)
    assert forbid_cuda == []


@pytest.mark.cuda_hidden
def test_expert_bias_round_trips_through_a_checkpoint(tmp_path, forbid_cuda):
    """A conversion builds the model, then the checkpoint overwrites the zeros."""
    import torch

    init_gloo(str(tmp_path))
    model = moe_model(seed=1)
    for layer, router in enumerate(routers(model)):
        router.expert_bias.copy_(torch.arange(EXPERTS, dtype=torch.float32) / 8 - layer)
    fresh = save_and_reload(model, moe_model(seed=2), tmp_path / "checkpoint")
    for saved, loaded in zip(routers(model), routers(fresh)):
        assert loaded.expert_bias.device.type == "cpu" and loaded.expert_bias.dtype == torch.float32
        assert torch.equal(loaded.expert_bias, saved.expert_bias)
        assert torch.equal(loaded.weight, saved.weight)
    assert forbid_cuda == []


@SHIM_ONLY
@needs_unfixed(TARGET)
@pytest.mark.cuda_hidden
def test_without_the_fix_the_build_needs_cuda(tmp_path):
    """The tests above are real checks: unfixed megatron-core cannot even build the model."""
    stderr = run_without_fix(
        FIX,
        f"""
        from helpers import init_gloo
        from test_router_buffers_device import moe_model
        init_gloo({str(tmp_path)!r})
        moe_model()
        """,
    )
    assert "current_device" in stderr and "router.py" in stderr, stderr[-3000:]
    assert any(marker in stderr for marker in NO_CUDA), stderr[-3000:]


@pytest.mark.cuda_visible
def test_with_cuda_the_buffers_are_made_where_upstream_makes_them(tmp_path):
    """On a GPU host nothing changes: from 0.15 on the buffers are on the current CUDA device
    (even with use_cpu_initialization, as upstream), before that on the CPU."""
    import torch

    torch.cuda.set_device(0)
    init_gloo(str(tmp_path))
    router = routers(moe_model())[0]
    if MCORE_VERSION >= BUGGY_FROM:
        expected = torch.device("cuda", torch.cuda.current_device())
    else:
        expected = torch.device("cpu")
    assert router.expert_bias.device == expected
    assert router.local_tokens_per_expert.device == expected
    assert not router.expert_bias.any()
