"""``mcore-cpu-shim doctor`` with Megatron-Bridge installed: it imports Bridge as a conversion
does, reports its version and every Bridge fix, and says what to install when Bridge does not
import."""

import json
import os

import pytest
from helpers import expected_state, needs_bridge, run_python

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

DOCTOR = "import sys; from mcore_cpu_shim.app.cli import main; sys.exit(main(['doctor', '--json']))"


def test_doctor_reports_bridge_and_its_fixes():
    from mcore_cpu_shim.fixes import BRIDGE_FIXES

    result = run_python(DOCTOR)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["megatron_bridge"]["importable"] is True and report["megatron_bridge"]["version"]
    for fix in BRIDGE_FIXES:
        assert report["fixes"][fix.name]["state"] == expected_state(fix.name), report["fixes"][fix.name]
    assert report["problems"] == []


def test_doctor_says_what_to_install_when_bridge_does_not_import(tmp_path):
    missing = tmp_path / "omegaconf"
    missing.mkdir()
    (missing / "__init__.py").write_text("raise ImportError('stand-in: omegaconf is not installed')\n")
    result = run_python(DOCTOR, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ["PYTHONPATH"]]))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(result.stdout)
    assert report["megatron_bridge"]["importable"] is False
    (problem,) = [p for p in report["problems"] if "Megatron-Bridge" in p]
    assert "omegaconf is not installed" in problem and "mcore-cpu-shim[bridge]" in problem
