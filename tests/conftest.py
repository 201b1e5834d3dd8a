"""Shared test setup: delivery mode, CUDA legs; forbid_cuda comes from mcore_cpu_shim_pytest.

Every test runs in its own forked process (pytest-forked): CUDA visibility and patches are
process-wide. tools/matrix.py runs the two legs as two sessions: ``-m cuda_hidden`` with
``CUDA_VISIBLE_DEVICES=""`` for the whole session, and ``-m cuda_visible`` as the host is.
In a hidden session each test process imports the megatron-core modules every test needs once
(pytest_configure), so each forked test starts with them, and starts a preloaded interpreter
for the tests' child processes (tests/preloaded.py).

Modes (MCORE_CPU_SHIM_MODE): ``shim`` = unmodified megatron-core + the shim (default),
``patched`` = megatron-core with patches/ applied and the shim disabled, ``patched+shim``.
"""

import gc
import importlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import preloaded
import pytest
from helpers import run_python, with_tests_dir

MODE = os.environ.get("MCORE_CPU_SHIM_MODE", "shim")
SHIM_ACTIVE = MODE != "patched"

if SHIM_ACTIVE:
    import mcore_cpu_shim  # noqa: F401  (activates the fixes before any megatron import)

HIDDEN_SESSION = os.environ.get("CUDA_VISIBLE_DEVICES") == ""


def pytest_configure(config):
    """In a hidden session: the main pytest process (the xdist controller, or pytest itself
    without xdist) starts the preloaded interpreter that helpers.run_python/run_ranks fork
    children from; xdist workers find it through the environment they inherit. Each process
    that runs tests (a worker, or pytest itself) imports the megatron-core modules every test
    needs (no device can be seen, so nothing is cached about one): each forked test starts
    with them."""
    if not HIDDEN_SESSION:
        return
    worker = hasattr(config, "workerinput")
    if not worker:
        env = dict(os.environ, PYTHONPATH=with_tests_dir(os.environ.get("PYTHONPATH")))
        config.preloaded_server = preloaded.start(env)
        if STATES_FILE:
            config.recorded_states = start_recording_states()
        if getattr(config.option, "numprocesses", None):
            return  # the xdist controller runs no tests
    for name in (
        "megatron.core.parallel_state",
        "megatron.core.dist_checkpointing",
        "megatron.core.models.gpt.gpt_model",
        "megatron.core.models.gpt.gpt_layer_specs",
        "megatron.core.transformer.transformer_config",
    ):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # the tests that need it fail with the real error
    gc.freeze()  # what every forked test shares stays out of its collections (no copying)


# Where tools/matrix.py wants the fix states of this session's megatron-core (its table).
STATES_FILE = os.environ.get("MCORE_CPU_SHIM_STATES_FILE")
RECORD_STATES = """
import json
import mcore_cpu_shim
from helpers import import_every_target
import_every_target(mcore_cpu_shim)
print(json.dumps({name: fix["state"] for name, fix in mcore_cpu_shim.status().items()}))
"""


def start_recording_states():
    """Each fix's state, recorded in a child interpreter with this session's environment (so the
    mode's MCORE_CPU_SHIM_DISABLE) while the tests run: it imports every target (~10 s of CPU),
    which at the session's end would be time with every core idle. Returns its future."""
    pool = ThreadPoolExecutor(1)
    recording = pool.submit(run_python, RECORD_STATES)
    pool.shutdown(wait=False)
    return recording


def pytest_sessionfinish(session):
    """For tools/matrix.py: the fix states (start_recording_states), written to STATES_FILE."""
    recording = getattr(session.config, "recorded_states", None)
    if recording is not None:
        result = recording.result(300)
        if result.returncode != 0:
            raise RuntimeError(f"recording the fix states failed:\n{result.stderr}")
        with open(STATES_FILE, "w") as out:
            out.write(result.stdout.strip().splitlines()[-1])


def pytest_unconfigure(config):
    server = getattr(config, "preloaded_server", None)
    if server is not None:
        server.terminate()
        server.wait(30)


HERE = os.path.dirname(os.path.abspath(__file__))

# The forbid_cuda fixture comes from the package's own pytest plugin (it activates nothing:
# in patched mode the shim stays off).
pytest_plugins = ["mcore_cpu_shim_pytest"]


def _devices_seen_by_a_fresh_interpreter():
    """torch.cuda.device_count() in a child process (this one must not initialise CUDA before
    forking the tests), or None if the probe itself failed."""
    probe = "import torch; print(torch.cuda.device_count())"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    return int(result.stdout.split()[-1]) if result.returncode == 0 and result.stdout.split() else None


# The test files whose tests run whole conversions or several ranks (up to a minute and more
# each) go first: pytest-xdist hands out tests in this order, and a session that ends on one of
# them leaves the other workers idle.
LONG_FIRST = ("test_convert_torchrun.py", "test_bridge_replicated_device.py", "test_demo.py",
              "test_bridge_export_complete.py", "test_convert.py", "test_multirank.py")


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: LONG_FIRST.index(item.path.name) if item.path.name in LONG_FIRST else len(LONG_FIRST))
    visible = []
    for item in items:
        if not str(item.path).startswith(HERE + os.sep):
            continue  # e.g. the megatron unit tests that patches/ adds, run in patched modes
        legs = {m.name for m in item.iter_markers()} & {"cuda_hidden", "cuda_visible"}
        if len(legs) != 1:
            raise pytest.UsageError(f"{item.nodeid}: mark it cuda_hidden or cuda_visible (exactly one)")
        if legs == {"cuda_visible"}:
            visible.append(item)
    # Ask once per session, not in every forked test (each would import torch for it).
    if visible and os.environ.get("CUDA_VISIBLE_DEVICES") != "" and _devices_seen_by_a_fresh_interpreter() == 0:
        skip = pytest.mark.skip(reason="cuda_visible: needs a usable CUDA device; this host has none")
        for item in visible:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def cuda_leg(request):
    """cuda_hidden: hide every device before torch looks; cuda_visible: skip without a device."""
    if request.node.get_closest_marker("cuda_hidden"):
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        import torch

        if torch.cuda.is_available():
            pytest.fail("cuda_hidden test sees CUDA: it was queried before the device was hidden")
    else:
        import torch

        if not torch.cuda.is_available():
            pytest.skip("cuda_visible: needs a usable CUDA device; this host has none")
    yield


@pytest.fixture(autouse=True)
def end_child_processes():
    """Stop the processes a test started through multiprocessing (megatron's checkpoint writer
    starts a spawned helper): pytest-forked ends each test with os._exit, which skips the
    exit handlers that would stop them, and they would outlive the run holding ~0.5 GB each."""
    yield
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(10)
