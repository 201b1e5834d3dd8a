"""The CPU forward check: a GPT-OSS-like model (YaRN, learnable softmax offsets, alltoall MoE)
runs forward on the CPU with CUDA absent, is saved and reloaded with dist_checkpointing, and
the reloaded model gives exactly the same logits. Needs every fix of the shim (or patches/).

The same with 2 Gloo ranks and expert parallelism 2 is the demo's default run, which
tests/test_demo.py runs on every release and mode (saved, reloaded, tensors and logits equal)."""

import pathlib

import pytest
from helpers import (
    gpt_oss_like,
    inference_rng_tracker,
    init_gloo,
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
