"""``convert`` under torchrun: two "nodes" on this machine (two ``torch.distributed.run``
invocations with ``--nnodes 2 --node-rank 0/1``, rendezvous on 127.0.0.1, Gloo on loopback).

A ``--tp 2`` import across the two nodes and an export on two ranks give back every tensor of
the source exactly; ranks that disagree about their input, or do not see one ``--out``, stop
before any work with an error that says so; a rank killed in the middle of the save ends every
rank of both nodes, and ``--out`` is left as it was.
"""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from helpers import MODE, assert_same_as, free_port, needs_bridge

pytestmark = [
    pytest.mark.cuda_hidden,
    needs_bridge(),
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the command line is part of the shim"),
]


def torchrun(tmp_path, name, *args, nodes=1, node_rank=0, nproc=1, port, wrap=()):
    """``torchrun ... -m mcore_cpu_shim convert ARGS`` as one node, started (not waited for);
    its output goes to ``tmp_path/<name>.log``. ``wrap``: a command to run it under."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", GLOO_SOCKET_IFNAME="lo", OMP_NUM_THREADS="1")
    command = [*wrap, sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes), "--node-rank",
               str(node_rank), "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port",
               str(port), "-m", "mcore_cpu_shim", "convert", *map(str, args)]
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(processes, timeout=600):
    """Wait for every node; their exit statuses."""
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.monotonic())) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def two_nodes(tmp_path, *args, wrap_second=()):
    port = free_port()
    return [torchrun(tmp_path, f"node{r}", *args, nodes=2, node_rank=r, port=port, wrap=() if r == 0 else wrap_second)
            for r in range(2)]


def log(tmp_path, name):
    return (tmp_path / f"{name}.log").read_text(errors="replace")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from mcore_cpu_shim.app import hf_models

    return hf_models.write("llama", tmp_path_factory.mktemp("source") / "hf")


def test_import_on_two_nodes_and_export_on_two_ranks_are_exact(tmp_path, llama):
    from mcore_cpu_shim.app import hf_models

    count = len(hf_models.tensors(llama))
    codes = finish(two_nodes(tmp_path, "import", "--hf", llama, "--out", tmp_path / "mg", "--tp", 2, "--verify"))
    assert codes == [0, 0], log(tmp_path, "node0") + log(tmp_path, "node1")
    lead = log(tmp_path, "node0")
    assert "2 ranks, TP 2, EP 1" in lead and "under torchrun" in lead
    assert "verify: ok" in lead and f"{count}/{count} tensors equal" in lead and "CUDA initialised: no" in lead
    assert "done:" not in log(tmp_path, "node1")  # one rank prints the summary
    assert not list((tmp_path / "mg").glob(".mcore-cpu-shim-*"))
    # Back on two ranks of one node, resharded from TP 2 to TP 1 (data parallel 2).
    [code] = finish([torchrun(tmp_path, "export", "export", "--megatron", tmp_path / "mg", "--hf-config", llama,
                              "--out", tmp_path / "back", "--verify", nproc=2, port=free_port())])
    assert code == 0, log(tmp_path, "export")
    assert f"{count}/{count} tensors equal" in log(tmp_path, "export")
    assert assert_same_as(llama, tmp_path / "back") == count


def test_input_errors_are_said_once_before_any_work(tmp_path, llama):
    [code] = finish([torchrun(tmp_path, "ranks", "import", "--hf", llama, "--out", tmp_path / "mg", "--ranks", 3,
                              port=free_port())])
    text = log(tmp_path, "ranks")
    assert code != 0 and "--ranks 3: under torchrun the ranks are the processes torchrun started" in text, text
    [code] = finish([torchrun(tmp_path, "tp", "import", "--hf", llama, "--out", tmp_path / "mg", "--tp", 2,
                              port=free_port())])
    text = log(tmp_path, "tp")
    assert code != 0 and "torchrun started 1 process (WORLD_SIZE), not a multiple of --tp 2 x --ep 1" in text, text
    assert not (tmp_path / "mg").exists()


def test_nodes_that_see_another_source_are_named(tmp_path, llama):
    """Node 1 is given another folder at the source's path (a bind mount of its own)."""
    other = tmp_path / "other"
    other.mkdir()
    wrap = unshared_mount(other, llama)
    codes = finish(two_nodes(tmp_path, "import", "--hf", llama, "--out", tmp_path / "mg", wrap_second=wrap))
    text = log(tmp_path, "node0")
    assert codes[0] != 0 and "rank 1 (host" in text and "config.json" in text, text
    assert not (tmp_path / "mg").exists()


def test_an_out_that_is_not_shared_is_refused(tmp_path, llama):
    """Node 1 sees another folder where --out's parent is (a node-local disk at that path)."""
    shared, local = tmp_path / "shared", tmp_path / "local"
    shared.mkdir()
    local.mkdir()
    (shared / "mg").mkdir()
    (shared / "mg" / "keep.txt").write_text("old")
    codes = finish(two_nodes(tmp_path, "import", "--hf", llama, "--out", shared / "mg", "--overwrite",
                             wrap_second=unshared_mount(local, shared)))
    text = log(tmp_path, "node0")
    assert codes[0] != 0 and f"--out {shared / 'mg'} is not the same folder on every node" in text, text
    assert "rank 1 (host" in text and "a filesystem that every node mounts" in text
    assert [p.name for p in (shared / "mg").iterdir()] == ["keep.txt"]
    assert [p.name for p in shared.iterdir()] == ["mg"]


def unshared_mount(source, target):
    """A command prefix that runs the rest with ``source`` mounted over ``target`` (a mount
    namespace of its own); skips where this host does not allow it."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount --bind '{source}' '{target}'"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a mount namespace (unshare -m, mount --bind) to give one node other files: "
                    f"{probe.stderr.strip()}")
    return ["unshare", "-m", "sh", "-c", f"mount --bind '{source}' '{target}' && exec \"$@\"", "sh"]


def test_a_rank_killed_while_saving_ends_both_nodes_and_keeps_out(tmp_path, llama):
    out = tmp_path / "mg"
    out.mkdir()
    (out / "keep.txt").write_text("old")
    nodes = two_nodes(tmp_path, "import", "--hf", llama, "--out", out, "--tp", 2, "--overwrite")
    deadline = time.monotonic() + 300
    while "copy weights: ok" not in log(tmp_path, "node0"):
        assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), log(tmp_path, "node0")
        time.sleep(0.1)
    [worker] = psutil.Process(nodes[1].pid).children()  # node 1's one rank, in its save
    worker.kill()
    killed = time.monotonic()
    codes = finish(nodes, timeout=120)
    assert time.monotonic() - killed < 60
    assert codes[0] != 0 and codes[1] != 0
    text = log(tmp_path, "node0")
    assert "rank 0 failed in 'save'" in text or "stopped by SIGTERM" in text, text
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and (out / "keep.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".mg.")] == []
