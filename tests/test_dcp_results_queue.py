"""dcp_results_queue: a synchronous torch_dist save starts no Manager server and writes the
same bytes as upstream's code; an async save keeps upstream's shared queue.

A failed write of a synchronous save still reaches the caller through the in-process queue:
test_multirank.py (one of two ranks fails its writes) runs on every release with this fix.
"""

import json
import pickle

import pytest
from helpers import MCORE_VERSION, MODE, assert_same_tensors, init_gloo, run_python, save_and_reload, tensors, tiny_gpt

pytestmark = pytest.mark.cuda_hidden

FIX = "dcp_results_queue"
in_process = pytest.mark.skipif(
    MCORE_VERSION < (0, 15),
    reason="megatron-core < 0.15 runs a sync save's writes in a forked process (not-applicable)",
)


def getter():
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    return getattr(filesystem_async, "get_write_results_queue", None) or filesystem_async._get_write_results_queue


def assert_same_checkpoint(expected, actual):
    """The two torch_dist folders hold the same files: the data files the same bytes, the DCP
    metadata equal but for its storage_meta (the folder's path and a random save id). (Its
    pickle may differ where objects that came back from the Manager are copies, not shared.)"""
    names = sorted(p.name for p in expected.iterdir())
    assert names == sorted(p.name for p in actual.iterdir()) and ".metadata" in names, names
    for name in names:
        if name == ".metadata":
            a, b = (pickle.loads((folder / name).read_bytes()) for folder in (expected, actual))
            a.storage_meta = b.storage_meta = None
            assert vars(a) == vars(b)
        else:
            assert (expected / name).read_bytes() == (actual / name).read_bytes(), name


@in_process
def test_sync_save_starts_no_process(tmp_path, forbid_cuda, monkeypatch):
    import multiprocessing.managers

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    def no_server(self, *args, **kwargs):
        raise AssertionError("a synchronous save started a multiprocessing Manager server")

    monkeypatch.setattr(multiprocessing.managers.BaseManager, "start", no_server)
    init_gloo(str(tmp_path))
    model = tiny_gpt(seed=1)
    fresh = save_and_reload(model, tiny_gpt(seed=2), tmp_path / "ckpt")
    assert_same_tensors(tensors(model), tensors(fresh))
    assert filesystem_async._results_queue is None  # upstream's shared queue was never made
    assert multiprocessing.active_children() == []
    assert forbid_cuda == []


SAVE = """
import json, sys
from pathlib import Path
import mcore_cpu_shim
from helpers import import_every_target, init_gloo, tiny_gpt
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.strategies import filesystem_async
folder = Path(sys.argv[1])
init_gloo(str(folder))
(folder / "ckpt").mkdir()
dist_checkpointing.save(tiny_gpt(seed=1).sharded_state_dict(), str(folder / "ckpt"))
import_every_target(mcore_cpu_shim, "dcp_results_queue")  # (0.17/0.18: the save never imports strategies.base)
print(json.dumps({"shared queue": filesystem_async._results_queue is not None,
                  "state": mcore_cpu_shim.status()["dcp_results_queue"]["state"]}))
"""


@in_process
def test_same_bytes_as_upstream(tmp_path):
    """The checkpoint equals, byte for byte, the one upstream's code writes (the fix switched
    off, in its own process: it makes the Manager queue there)."""
    if MODE != "shim":
        pytest.skip(f"mode {MODE}: there is no unfixed megatron-core to compare with")
    runs = {}
    for name, env in (("fixed", {}), ("upstream", {"MCORE_CPU_SHIM_DISABLE": FIX})):
        (tmp_path / name).mkdir()
        result = run_python(SAVE, args=(str(tmp_path / name),), **env)
        assert result.returncode == 0, result.stderr[-4000:]
        runs[name] = json.loads(result.stdout.strip().splitlines()[-1])
    assert runs == {"fixed": {"shared queue": False, "state": "applied"},
                    "upstream": {"shared queue": True, "state": "disabled"}}, runs
    assert_same_checkpoint(tmp_path / "upstream" / "ckpt", tmp_path / "fixed" / "ckpt")


def test_outside_a_sync_save_the_queue_is_upstreams():
    """What an async save's writer process reports into: the one shared Manager queue."""
    first = getter()()
    assert getter()() is first
    assert type(first).__name__.startswith("AutoProxy"), type(first)
