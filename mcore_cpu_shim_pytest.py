"""pytest plugin of mcore-cpu-shim: assert that a test touches no CUDA.

Registered through the ``pytest11`` entry point, so installing mcore-cpu-shim makes it
available in every pytest session (``-p no:mcore_cpu_shim_pytest`` switches it off):

- the ``forbid_cuda`` fixture: the test fails on any CUDA-initialising ``torch.cuda`` call
  while it runs, even one the code under test catches; it yields the list of calls;
- ``--forbid-cuda``: the same around the setup, call and teardown of every test.

This is a module of its own, outside the ``mcore_cpu_shim`` package: importing the package
activates its fixes, and a session that merely has the plugin installed must run megatron-core
unmodified. The tripwire (``mcore_cpu_shim/tripwire.py``, plain Python that needs only torch) is
taken from the package if the session imported it, and otherwise loaded from its file on its
own, without the package.
"""

import importlib.util
import os
import sys

import pytest

_PRIVATE = "mcore_cpu_shim_pytest._tripwire"
_tripwire = None


def tripwire():
    """The tripwire module, without importing (and so activating) the mcore_cpu_shim package.

    Chosen once per process, so that the blocks this plugin opens always share one state.
    """
    global _tripwire
    if _tripwire is not None:
        return _tripwire
    package = sys.modules.get("mcore_cpu_shim")
    if package is not None:
        _tripwire = package.tripwire
        return _tripwire
    module = sys.modules.get(_PRIVATE)
    if module is None:
        found = importlib.util.find_spec("mcore_cpu_shim")  # finds the folder, runs nothing
        if found is None or not found.submodule_search_locations:
            raise RuntimeError("mcore_cpu_shim_pytest: the mcore_cpu_shim package is not installed")
        path = os.path.join(list(found.submodule_search_locations)[0], "tripwire.py")
        spec = importlib.util.spec_from_file_location(_PRIVATE, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[_PRIVATE] = module
    _tripwire = module
    return module


def pytest_addoption(parser):
    parser.getgroup("mcore-cpu-shim").addoption(
        "--forbid-cuda",
        action="store_true",
        default=False,
        help="fail every test whose setup, call or teardown makes a CUDA-initialising torch.cuda call",
    )


def pytest_configure(config):
    config.addinivalue_line("markers", "allow_cuda: exempt this test from --forbid-cuda")


@pytest.fixture
def forbid_cuda():
    """Fail the test on any CUDA-initialising torch.cuda call inside it; yields the calls."""
    with tripwire().forbid_cuda() as touched:
        yield touched


def _guarded(item):
    return item.config.getoption("forbid_cuda") and item.get_closest_marker("allow_cuda") is None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    if not _guarded(item):
        return (yield)
    with tripwire().forbid_cuda():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    if not _guarded(item):
        return (yield)
    with tripwire().forbid_cuda():
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    if not _guarded(item):
        return (yield)
    with tripwire().forbid_cuda():
        return (yield)
