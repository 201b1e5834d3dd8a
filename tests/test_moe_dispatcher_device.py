"""moe_dispatcher_device: an alltoall MoE model builds, saves and reloads with CUDA absent, and
builds exactly as before with CUDA present."""

import pathlib

import pytest
from helpers import (
    MCORE_VERSION,
    MODE,
    assert_same_tensors,
    init_gloo,
    leave_group,
    needs_unfixed,
    run_ranks,
    run_without_fix,
    save_and_reload,
    tensors,
    tiny_gpt,
)

FIX = "moe_dispatcher_device"
TARGET = "megatron.core.transformer.moe.token_dispatcher:MoEAlltoAllTokenDispatcher.__init__"
# 0.13 refuses biases in MoE layers.
MOE = dict(num_moe_experts=4, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
# From 0.14 the DtoH stream is one class attribute shared by every dispatcher.
CLASS_STREAM = MCORE_VERSION >= (0, 14)


def dispatcher_class():
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    return MoEAlltoAllTokenDispatcher


def moe_config(permute_fusion):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        **MOE,
    )
    if permute_fusion:
        # TransformerConfig refuses moe_permute_fusion=True unless Transformer Engine's fused
        # permutation imports, which it cannot on a host without CUDA (0.13 raises ImportError,
        # later releases ValueError). A config validated elsewhere, or changed after validation,
        # still reaches the dispatcher with the flag set: set it the same way here.
        config.moe_permute_fusion = True
    return config


def default_process_groups():
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "get_default_pg_collection"):  # 0.15 and later
        return moe_utils.get_default_pg_collection()
    return moe_utils.get_default_model_comm_pgs()


def build_dispatcher(permute_fusion, init=None, config=None, groups=None):
    """Two local experts (0 and 1) of four, on a one-rank group; ``init`` overrides __init__."""
    cls = dispatcher_class()
    dispatcher = cls.__new__(cls)
    config = config or moe_config(permute_fusion)
    (init or cls.__init__)(dispatcher, 2, [0, 1], config, groups or default_process_groups())
    return dispatcher


def assert_cpu_indices(dispatcher):
    import torch

    assert torch.device(dispatcher.permute_idx_device).type == "cpu"
    # Chunks of 4 experts x 1 rank, grouped by the 2 local experts: [0, 2, 1, 3] both ways.
    for name in ("sort_input_by_local_experts", "restore_output_by_local_experts"):
        indices = getattr(dispatcher, name)
        assert indices.device.type == "cpu", name
        assert indices.tolist() == [0, 2, 1, 3], name


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("permute_fusion", [False, True], ids=["unfused", "permute_fusion"])
def test_dispatcher_builds_without_cuda(tmp_path, forbid_cuda, permute_fusion):
    import torch

    init_gloo(tmp_path)
    dispatcher = build_dispatcher(permute_fusion)

    assert dispatcher.config.moe_permute_fusion is permute_fusion
    assert dispatcher.cuda_dtoh_stream is None
    if CLASS_STREAM:
        assert vars(dispatcher_class())["cuda_dtoh_stream"] is None
        assert "cuda_dtoh_stream" not in vars(dispatcher)
    assert_cpu_indices(dispatcher)
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_stream_left_on_the_class_is_kept(tmp_path, forbid_cuda, monkeypatch):
    """A stream an earlier (GPU-visible) construction put on the class survives a CPU one."""
    earlier_stream = object()
    monkeypatch.setattr(dispatcher_class(), "cuda_dtoh_stream", earlier_stream, raising=False)
    init_gloo(tmp_path)
    dispatcher = build_dispatcher(permute_fusion=True)

    assert vars(dispatcher_class())["cuda_dtoh_stream"] is earlier_stream
    if CLASS_STREAM:
        assert dispatcher.cuda_dtoh_stream is earlier_stream
    else:
        # 0.13 keeps its stream on the instance: none there, the class is not involved.
        assert vars(dispatcher)["cuda_dtoh_stream"] is None
    assert_cpu_indices(dispatcher)


@pytest.mark.cuda_hidden
@needs_unfixed(TARGET)
def test_same_dispatcher_as_the_original_apart_from_the_stream(tmp_path, monkeypatch):
    """Without fusion the original constructor runs on CPU once it gets a stream from
    somewhere: every attribute it sets, the fixed one sets alike."""
    if MODE != "shim":
        pytest.skip(f"mode {MODE}: no original constructor next to the fixed one")
    import torch

    init_gloo(tmp_path)
    config, groups = moe_config(permute_fusion=False), default_process_groups()
    fixed = build_dispatcher(False, config=config, groups=groups)
    assert fixed.cuda_dtoh_stream is None

    stand_in_stream = object()
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: stand_in_stream)
    original_init = dispatcher_class().__init__.__wrapped__
    original = build_dispatcher(False, init=original_init, config=config, groups=groups)

    assert original.cuda_dtoh_stream is stand_in_stream
    expected, actual = dict(vars(original)), dict(vars(fixed))
    if not CLASS_STREAM:
        expected.pop("cuda_dtoh_stream"), actual.pop("cuda_dtoh_stream")
    assert expected.keys() == actual.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert value.device == actual[name].device and torch.equal(value, actual[name]), name
        else:
            assert value == actual[name], name


def ep2_round_trip_rank(rank, world_size, workdir):
    """One rank of test_ep2_moe_model_round_trip (runs in its own interpreter)."""
    import mcore_cpu_shim  # noqa: F401  (first, as in conftest; MCORE_CPU_SHIM_DISABLE applies)
    import torch
    from mcore_cpu_shim.tripwire import forbid_cuda

    with forbid_cuda():
        init_gloo(workdir, rank=rank, world_size=world_size, expert_parallel=2)
        # The same seeds on every rank: the non-expert weights are replicated across ranks.
        model, fresh = tiny_gpt(seed=1, **MOE), tiny_gpt(seed=2, **MOE)
        dispatcher = model.decoder.layers[0].mlp.token_dispatcher
        assert type(dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
        assert dispatcher.ep_size == 2
        assert dispatcher.local_expert_indices == [2 * rank, 2 * rank + 1]
        assert dispatcher.cuda_dtoh_stream is None
        assert dispatcher.sort_input_by_local_experts.device.type == "cpu"

        expected = tensors(model)
        assert any(not torch.equal(v, tensors(fresh)[k]) for k, v in expected.items())
        save_and_reload(model, fresh, pathlib.Path(workdir) / "ckpt")
        assert_same_tensors(expected, tensors(fresh))
        torch.distributed.barrier()
    assert not torch.cuda.is_initialized()
    print(f"rank {rank}: {len(expected)} tensors reloaded exactly")
    leave_group()


@pytest.mark.cuda_hidden
def test_ep2_moe_model_round_trip(tmp_path):
    """A GPT model with a 4-expert alltoall MoE layer, built on CPU in a 2-rank Gloo group with
    expert parallelism 2, saved with dist_checkpointing and reloaded exactly, by 2 processes."""
    results = run_ranks(f"{__name__}:ep2_round_trip_rank", 2, str(tmp_path), timeout=300)

    for rank, (returncode, output) in enumerate(results):
        assert returncode == 0, f"rank {rank} failed:\n{output[-6000:]}"
        assert "tensors reloaded exactly" in output
    assert (tmp_path / "ckpt" / ".metadata").exists()
    # Each rank wrote its own experts.
    assert {p.name.split("_")[2] for p in (tmp_path / "ckpt").glob("__*_*.distcp")} == {"0", "1"}


@pytest.mark.cuda_hidden
@needs_unfixed(TARGET)
def test_model_construction_fails_without_the_fix(tmp_path):
    """The tests above are real checks: unfixed megatron-core cannot build the dispatcher here."""
    stderr = run_without_fix(
        FIX,
        f"""
        import mcore_cpu_shim
        from helpers import init_gloo, tiny_gpt
        init_gloo({str(tmp_path)!r})
        tiny_gpt(seed=1, **{MOE!r})
        """,
    )
    assert "torch.cuda.Stream()" in stderr, stderr


@pytest.mark.cuda_visible
@pytest.mark.parametrize("permute_fusion", [False, True], ids=["unfused", "permute_fusion"])
def test_cpu_weights_on_a_gpu_host_build_as_before(tmp_path, permute_fusion):
    """use_cpu_initialization=True with CUDA present: the stream exists, fused indices on CUDA."""
    import torch

    init_gloo(tmp_path)
    dispatcher = build_dispatcher(permute_fusion)

    assert isinstance(dispatcher.cuda_dtoh_stream, torch.cuda.Stream)
    if CLASS_STREAM:
        assert vars(dispatcher_class())["cuda_dtoh_stream"] is dispatcher.cuda_dtoh_stream
        # Later dispatchers share the one stream, as before.
        assert build_dispatcher(permute_fusion).cuda_dtoh_stream is dispatcher.cuda_dtoh_stream
    device = "cuda" if permute_fusion else "cpu"
    assert torch.device(dispatcher.permute_idx_device).type == device
    assert dispatcher.sort_input_by_local_experts.device.type == device
    assert dispatcher.restore_output_by_local_experts.device.type == device
    assert dispatcher.sort_input_by_local_experts.tolist() == [0, 2, 1, 3]


@pytest.mark.cuda_visible
def test_cpu_initialised_moe_model_on_a_gpu_host_has_its_stream(tmp_path):
    import torch

    init_gloo(tmp_path)
    model = tiny_gpt(seed=1, **MOE)

    for layer in model.decoder.layers:
        assert isinstance(layer.mlp.token_dispatcher.cuda_dtoh_stream, torch.cuda.Stream)
    assert all(p.device.type == "cpu" for p in model.parameters())
