"""``python -m mcore_cpu_shim demo``: the whole CPU-only round trip, as a user runs it.

One run of the demo per test (it starts its own rank interpreters, two passes of two ranks):
what it prints as JSON must say that every step passed with the shim, every tensor and the
logits are equal, CUDA was never initialised and no driver library was mapped, and where
unfixed megatron-core stops.
"""

import json
import subprocess
import sys

import pytest
from helpers import MODE, upstream_fixed_here

STEPS = ["build model", "save torch_dist", "build fresh + load", "compare tensors", "forward compare"]
# The fixes of the CUDA spots met while building the model (YaRN tables, softmax offsets, the
# dispatcher's stream).
BUILD_FIXES = {"yarn_rope_device", "softmax_offsets_device", "moe_dispatcher_device"}


def run_demo(*options):
    result = subprocess.run(
        [sys.executable, "-m", "mcore_cpu_shim", "demo", "--json", *options],
        capture_output=True,
        text=True,
        timeout=500,
    )
    try:
        summary = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the demo printed no JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}")
    return result, summary


def ok_flags(summary, label):
    return [summary["passes"][label]["steps"][step]["ok"] for step in STEPS]


def failures(summary, label):
    return {
        step: f"{s['error']} at {s.get('where')}"
        for step, s in summary["passes"][label]["steps"].items()
        if s["ok"] is False
    }


def assert_demo_passed(result, summary):
    assert ok_flags(summary, "with shim") == [True] * len(STEPS), failures(summary, "with shim")
    assert result.returncode == 0, result.stderr[-6000:]
    assert summary["passed"], summary["checks"]
    assert summary["tensors_compared"] > 0
    assert summary["tensors_equal"] == summary["tensors_compared"]
    assert summary["parameters"] > 0
    assert summary["cuda_initialized"] is False
    assert summary["driver_libraries"] == []
    # One progress line per step and pass, on stderr next to the JSON on stdout.
    assert "[with shim] forward compare: ok" in result.stderr


@pytest.mark.cuda_hidden
def test_demo_round_trip_without_cuda():
    result, summary = run_demo()

    assert_demo_passed(result, summary)
    without = summary["passes"]["without shim"]["steps"]
    if MODE == "shim":
        assert summary["delivery"] == {"without shim": "shim disabled", "with shim": "shim applied"}
        failed_at = summary["without_shim_failed_at"]
        if BUILD_FIXES <= upstream_fixed_here():
            # megatron-core fixed the spots of the build itself (PR 6270's branch): without the
            # shim the model builds, and a later step meets a spot only the shim fixes.
            assert failed_at in STEPS[1:], failures(summary, "without shim")
        else:
            # Unfixed megatron-core cannot even build the model on a CPU-only host.
            assert failed_at == "build model", failures(summary, "without shim")
        # The demo says where, in megatron-core's own code, and skips the rest.
        assert without[failed_at]["where"].startswith("megatron/core/"), without[failed_at]
        at = STEPS.index(failed_at)
        assert ok_flags(summary, "without shim") == [True] * at + [False] + [None] * (len(STEPS) - at - 1)
    else:
        # Patched megatron-core: both passes run the same fixed code (the shim is disabled in
        # "patched" and stands down in "patched+shim"), so both pass, and the demo says so.
        expected = "shim disabled" if MODE == "patched" else "megatron-core already fixed (upstream-fixed)"
        assert summary["delivery"]["with shim"] == expected
        assert summary["without_shim_failed_at"] is None, failures(summary, "without shim")
        assert ok_flags(summary, "without shim") == [True] * len(STEPS)


@pytest.mark.cuda_hidden
def test_bad_options_exit_2():
    result = subprocess.run(
        [sys.executable, "-m", "mcore_cpu_shim", "demo", "--ranks", "3", "--ep", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "--ranks 3 is not a multiple of --ep 2" in result.stderr


@pytest.mark.cuda_visible
def test_demo_on_a_gpu_host_stays_off_the_gpu():
    """On a host with a GPU the demo's ranks still hide it: the same result as without one."""
    result, summary = run_demo()

    assert_demo_passed(result, summary)


@pytest.mark.cuda_hidden
def test_cli_starts_without_torch():
    code = "import sys, mcore_cpu_shim.cli; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
