"""The CPU forward check: a GPT-OSS-like model (YaRN, learnable softmax offsets, alltoall MoE)
runs forward on the CPU with CUDA absent, is saved and reloaded with dist_checkpointing, and
the reloaded model gives exactly the same logits. Needs every fix of the shim (or patches/)."""

import pathlib

import pytest
from helpers import (
    gpt_oss_like,
    inference_rng_tracker,
    init_gloo,
    run_ranks,
    save_and_reload,
)


def round_trip_logits(workdir):
    """(logits of the model, logits of a fresh model, logits of it reloaded)."""
    inference_rng_tracker()
    model, fresh = gpt_oss_like(seed=1), gpt_oss_like(seed=2)
    before = cpu_logits_of(model)
    fresh_logits = cpu_logits_of(fresh)
    save_and_reload(model, fresh, pathlib.Path(workdir) / "ckpt")
    return before, fresh_logits, cpu_logits_of(fresh)


def cpu_logits_of(model):
    from helpers import cpu_logits

    return cpu_logits(model)


@pytest.mark.cuda_hidden
def test_forward_round_trip_one_rank(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    before, fresh, after = round_trip_logits(tmp_path)

    assert before.shape == (2, 8, 64) and before.device.type == "cpu"
    assert torch.isfinite(before).all()
    assert not torch.equal(before, fresh)  # a different model, before the reload
    assert torch.equal(before, after)
    assert not torch.cuda.is_initialized()


def ep2_forward_rank(rank, world_size, workdir):
    """One rank of test_forward_round_trip_ep2 (runs in its own interpreter)."""
    import mcore_cpu_shim  # noqa: F401  (first, as in conftest)
    import torch
    from mcore_cpu_shim.tripwire import forbid_cuda

    with forbid_cuda():
        init_gloo(workdir, rank=rank, world_size=world_size, expert_parallel=2)
        before, fresh, after = round_trip_logits(workdir)
        assert before.device.type == "cpu" and torch.isfinite(before).all()
        assert not torch.equal(before, fresh)
        assert torch.equal(before, after), f"rank {rank}: logits differ after reload"
        torch.distributed.barrier()
    assert not torch.cuda.is_initialized()
    print(f"rank {rank}: logits equal after reload")


@pytest.mark.cuda_hidden
def test_forward_round_trip_ep2(tmp_path):
    """Two Gloo ranks, expert parallelism 2: the token all-to-all runs between processes."""
    results = run_ranks(f"{__name__}:ep2_forward_rank", 2, str(tmp_path), timeout=300)
    for rank, (returncode, output) in enumerate(results):
        assert returncode == 0, f"rank {rank} failed:\n{output[-6000:]}"
        assert "logits equal after reload" in output
