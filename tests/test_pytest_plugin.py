"""The pytest plugin (``mcore_cpu_shim_pytest``): the ``forbid_cuda`` fixture and
``--forbid-cuda`` in a downstream test session, which must otherwise run megatron-core
unmodified. Each check runs a small inner pytest session in a child interpreter."""

import pathlib

import pytest
from helpers import MODE, run_python

pytest_plugins = ["pytester"]
pytestmark = [
    pytest.mark.cuda_hidden,
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the plugin is part of the shim package"),
]

ROOT = pathlib.Path(__file__).resolve().parent.parent

DOWNSTREAM_TESTS = '''
import sys

import pytest

# Imported at collection, outside every forbid_cuda block: unmodified megatron-core main asks
# the device at import (its GDP probe, which the shim's gdp_probe_device fixes), and this
# session runs megatron-core unmodified.
from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync


def test_hides_a_cuda_call():
    import torch

    try:
        torch.cuda.current_device()
    except Exception:
        pass  # swallowed: only the tripwire can notice


def test_cpu_only():
    import torch

    assert torch.ones(2).sum().item() == 2


def test_fixture_leaves_megatron_unmodified(forbid_cuda):
    preload = FileSystemWriterAsync.__dict__["preload_tensors"].__func__
    assert not hasattr(preload, "__mcore_cpu_shim__")
    assert not any(name.split(".")[0] == "mcore_cpu_shim" for name in sys.modules)
    assert forbid_cuda == []


def test_fixture_catches_a_hidden_cuda_call(forbid_cuda):
    import torch

    try:
        torch.cuda.synchronize()
    except Exception:
        pass
    assert len(forbid_cuda) == 1


@pytest.mark.allow_cuda
def test_exempt(forbid_cuda):
    assert forbid_cuda == []
'''


def downstream(pytester, *args):
    """``python -m pytest`` on DOWNSTREAM_TESTS in a child interpreter (helpers.run_python)."""
    pytester.makepyfile(test_downstream=DOWNSTREAM_TESTS)
    args = ["-p", "mcore_cpu_shim_pytest", "-p", "no:cacheprovider", "--tb=line", *args]
    code = f"import os, sys, pytest; os.chdir({str(pytester.path)!r}); sys.exit(pytest.main({args!r}))"
    result = run_python(code)
    return pytest.RunResult(result.returncode, result.stdout.splitlines(), result.stderr.splitlines(), 0.0)


def test_forbid_cuda_option_fails_a_test_that_hides_a_cuda_call(pytester):
    result = downstream(pytester, "--forbid-cuda")
    # Both tests that call CUDA fail in their call; the fixture's own check adds a teardown error.
    result.assert_outcomes(failed=2, passed=3, errors=1, warnings=None)
    touched = "*CudaTouchedError: 1 CUDA call(s) inside forbid_cuda(); first: torch.cuda.{}() at"
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_fixture_catches_a_hidden_cuda_call*", touched.format("synchronize")])
    result.stdout.fnmatch_lines(["*= FAILURES =*", touched.format("current_device"), touched.format("synchronize")])
    result.stdout.fnmatch_lines(["FAILED *test_hides_a_cuda_call*", "FAILED *test_fixture_catches_a_hidden_cuda_call*"])


def test_plugin_without_the_option_changes_nothing_but_the_fixture(pytester):
    result = downstream(pytester)
    result.assert_outcomes(passed=5, errors=1, warnings=None)  # the fixture fails at teardown
    result.stdout.fnmatch_lines(["*CudaTouchedError: 1 CUDA call(s) inside forbid_cuda(); first: torch.cuda.synchronize() at"])
    result.stdout.fnmatch_lines(["ERROR *test_fixture_catches_a_hidden_cuda_call*"])


def test_plugin_is_registered_as_a_pytest11_entry_point():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["entry-points"]["pytest11"] == {"mcore_cpu_shim_pytest": "mcore_cpu_shim_pytest"}
    assert "mcore_cpu_shim_pytest" in project["tool"]["setuptools"]["py-modules"]
