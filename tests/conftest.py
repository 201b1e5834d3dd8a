"""Shared test setup: delivery mode, CUDA legs, and the forbid_cuda fixture.

Every test runs in its own forked process (pytest-forked): CUDA visibility and patches are
process-wide. Megatron-core is imported inside the tests, never at collection, so the parent
process stays light and never touches CUDA.

Modes (MCORE_CPU_SHIM_MODE): ``shim`` = unmodified megatron-core + the shim (default).
"""

import os

import pytest

MODE = os.environ.get("MCORE_CPU_SHIM_MODE", "shim")
SHIM_ACTIVE = MODE != "patched"

if SHIM_ACTIVE:
    import mcore_cpu_shim  # noqa: F401  (activates the fixes before any megatron import)


HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not str(item.path).startswith(HERE + os.sep):
            continue  # e.g. the megatron unit tests that patches/ adds, run in patched modes
        legs = {m.name for m in item.iter_markers()} & {"cuda_hidden", "cuda_visible"}
        if len(legs) != 1:
            raise pytest.UsageError(f"{item.nodeid}: mark it cuda_hidden or cuda_visible (exactly one)")


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


@pytest.fixture
def forbid_cuda():
    """Fail the test on any CUDA-initialising torch.cuda call inside it."""
    from mcore_cpu_shim.tripwire import forbid_cuda as tripwire

    with tripwire() as touched:
        yield touched
