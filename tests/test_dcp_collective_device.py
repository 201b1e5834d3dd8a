"""dcp_collective_device: dist_checkpointing.save/load with CUDA absent, and unchanged with CUDA."""

import io

import pytest
from helpers import (
    MCORE_VERSION,
    assert_same_tensors,
    init_gloo,
    needs_unfixed,
    run_without_fix,
    save_and_reload,
    tensors,
    tiny_gpt,
)

FIX = "dcp_collective_device"
FINALIZE = "megatron.core.dist_checkpointing.strategies.state_dict_saver:save_state_dict_async_finalize"
PRELOAD = "megatron.core.dist_checkpointing.strategies.filesystem_async:FileSystemWriterAsync.preload_tensors"


def writer_class():
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    return FileSystemWriterAsync


def buckets(*tensors_):
    payload = [("bytes-item", io.BytesIO(b"payload"))]
    return [("file_0", "key_0", (payload, [(f"item_{i}", t) for i, t in enumerate(tensors_)]))]


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("non_blocking", [True, False])
def test_preload_passes_cpu_tensors_through_untouched(forbid_cuda, non_blocking):
    import torch

    first, second = torch.arange(6.0), torch.ones(2, 3, dtype=torch.bfloat16)
    given = buckets(first, second)
    [(file_name, key, (payload, preloaded))] = writer_class().preload_tensors(given, non_blocking)
    assert (file_name, key, payload) == given[0][:2] + (given[0][2][0],)
    assert [item for item, _ in preloaded] == ["item_0", "item_1"]
    # The same objects: no copy of CPU tensors.
    assert preloaded[0][1] is first and preloaded[1][1] is second
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_save_and_load_round_trip_without_cuda(tmp_path, forbid_cuda):
    import torch

    init_gloo(tmp_path)
    model, fresh = tiny_gpt(seed=1), tiny_gpt(seed=2)
    expected = tensors(model)
    assert any(not torch.equal(v, tensors(fresh)[k]) for k, v in expected.items())

    save_and_reload(model, fresh, tmp_path / "ckpt")

    assert_same_tensors(expected, tensors(fresh))
    assert (tmp_path / "ckpt" / ".metadata").exists()
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda_hidden
def test_failed_write_raises_and_leaves_no_complete_checkpoint(tmp_path, forbid_cuda, monkeypatch):
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.api import CheckpointException

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    init_gloo(tmp_path)
    model = tiny_gpt(seed=1)
    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)

    (tmp_path / "ckpt").mkdir()
    # 0.13 raises a local worker failure right away (RuntimeError "Worker failure: ..."),
    # later releases gather it from every rank and raise CheckpointException.
    expected = RuntimeError if MCORE_VERSION < (0, 14) else CheckpointException
    with pytest.raises(expected, match="Worker failure: .*(No space left on device|OSError)"):
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path / "ckpt"))

    assert not (tmp_path / "ckpt" / ".metadata").exists()
    assert not (tmp_path / "ckpt" / "metadata.json").exists()


@pytest.mark.cuda_hidden
@needs_unfixed(PRELOAD, FINALIZE)  # (0.13 has no FINALIZE to fix: not-applicable there)
def test_save_fails_without_the_fix(tmp_path):
    """The round trip above is a real check: unfixed megatron-core cannot save here."""
    stderr = run_without_fix(
        FIX,
        f"""
        import pathlib
        import mcore_cpu_shim
        from helpers import init_gloo, save_and_reload, tiny_gpt
        init_gloo({str(tmp_path)!r})
        save_and_reload(tiny_gpt(seed=1), tiny_gpt(seed=2), pathlib.Path({str(tmp_path / "ckpt")!r}))
        """,
    )
    assert "NVIDIA driver" in stderr or "not compiled with CUDA" in stderr, stderr


@pytest.mark.cuda_visible
def test_preload_copies_cuda_tensors_and_synchronises_once(monkeypatch):
    import torch

    calls = []
    real_synchronize = torch.cuda.synchronize
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append(a) or real_synchronize(*a))
    on_gpu, on_cpu = torch.arange(6.0, device="cuda"), torch.ones(3)

    [(_, _, (_, preloaded))] = writer_class().preload_tensors(buckets(on_gpu, on_cpu), True)
    assert preloaded[0][1].device.type == "cpu" and torch.equal(preloaded[0][1], on_gpu.cpu())
    assert preloaded[1][1] is on_cpu
    assert len(calls) == 1

    writer_class().preload_tensors(buckets(on_cpu), True)
    assert len(calls) == 1, "CPU-only buckets need no synchronize, even with CUDA present"


@pytest.mark.cuda_visible
def test_nccl_save_round_trip_and_failure_flag_on_cuda(tmp_path, monkeypatch):
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.api import CheckpointException

    torch.cuda.set_device(0)
    torch.distributed.init_process_group(
        "nccl", init_method=f"file://{tmp_path}/store", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    model, fresh = tiny_gpt(seed=1).cuda(), tiny_gpt(seed=2).cuda()
    expected = tensors(model)
    save_and_reload(model, fresh, tmp_path / "ckpt")
    assert_same_tensors(expected, tensors(fresh))

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(filesystem_async, "_write_item", disk_full)
    with pytest.raises(CheckpointException):
        dist_checkpointing.save(model.sharded_state_dict(), str(tmp_path))
