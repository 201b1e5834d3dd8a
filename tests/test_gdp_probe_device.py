"""gdp_probe_device: importing megatron-core main asks no device on a host without CUDA.

Only megatron-core main (and branches off it) has the GDP kernels: on the releases the fix is
not-applicable. Where the tree under test has them (the snapshot legs), the shim is checked on
it, and patch 0008 is applied to a copy of the main snapshot and checked the same way with the
shim switched off, together with the unit test the patch adds.
"""

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from helpers import MODE, mcore_tree, expected_state, run_python, run_without_fix

pytestmark = pytest.mark.cuda_hidden

MODULE = "megatron.core.ssm.ops.gdp.common"
HAS_GDP = mcore_tree.module_file(MODULE) is not None
ROOT = Path(__file__).resolve().parent.parent
MAIN_SNAPSHOT = sorted((ROOT.parent / "shared" / "upstream").glob("megatron-core-main-*.tar.xz"))

# Import what a conversion imports, inside the tripwire; report the probe's answer.
IMPORT_UNDER_TRIPWIRE = """
import json, sys
import mcore_cpu_shim_pytest
tripwire = mcore_cpu_shim_pytest.tripwire()
with tripwire.forbid_cuda() as touched:
    import megatron.core
    from megatron.core.ssm.ops.gdp import common
    answer = common.check_shared_mem()
    import torch
print(json.dumps({"answer": answer, "touched": touched, "initialized": torch.cuda.is_initialized(),
                  "fixes": sorted(m for m in sys.modules if m.startswith("mcore_cpu_shim."))}))
"""


@pytest.mark.skipif(HAS_GDP, reason="this megatron-core has the GDP kernels (tested below)")
def test_not_applicable_where_megatron_core_has_no_gdp_kernels():
    import megatron.core  # noqa: F401  (the tree is in use: absent modules are settled)
    import mcore_cpu_shim

    fix = mcore_cpu_shim.status()["gdp_probe_device"]
    expected = "disabled" if MODE == "patched" else "not-applicable"
    assert fix["state"] == expected, fix


@pytest.mark.skipif(not HAS_GDP, reason="this megatron-core has no GDP kernels (megatron-core main only)")
def test_conversion_import_asks_no_device():
    result = run_python("import mcore_cpu_shim\n" + IMPORT_UNDER_TRIPWIRE)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["answer"] is False and report["touched"] == [] and not report["initialized"], report
    import mcore_cpu_shim
    from megatron.core.ssm.ops.gdp import common  # noqa: F401

    assert mcore_cpu_shim.status()["gdp_probe_device"]["state"] == expected_state("gdp_probe_device")


@pytest.mark.skipif(not HAS_GDP, reason="this megatron-core has no GDP kernels (megatron-core main only)")
def test_fails_without_the_fix():
    stderr = run_without_fix("gdp_probe_device", "import mcore_cpu_shim\n" + IMPORT_UNDER_TRIPWIRE)
    assert "CudaTouchedError: 1 CUDA call(s) inside forbid_cuda(); first: torch.cuda.get_device_properties() at" in stderr
    assert "gdp/common.py" in stderr


@pytest.mark.skipif(not (HAS_GDP and MAIN_SNAPSHOT), reason="needs ../shared/upstream's megatron-core main and a tree with GDP kernels")
def test_patch_0008_does_the_same_without_the_shim(tmp_path):
    tree = tmp_path / "tree"
    with tarfile.open(MAIN_SNAPSHOT[-1]) as archive:
        archive.extractall(tree, filter="data")
    patch = ROOT / "patches" / "0008-gdp-probe-device.patch"
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path))
    applied = subprocess.run(["git", "apply", str(patch)], cwd=tree, env=env, capture_output=True, text=True)
    assert applied.returncode == 0, applied.stderr
    off = dict(MCORE_CPU_SHIM_DISABLE="all", MCORE_CPU_SHIM_TE="off", PYTHONPATH=str(tree))
    result = run_python(IMPORT_UNDER_TRIPWIRE, **off)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report == {"answer": False, "touched": [], "initialized": False, "fixes": []}, report
    # The unit test the patch adds, run on the patched tree.
    unit = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:forked",
         "tests/unit_tests/ssm/test_gdp_probe_cpu.py"],
        cwd=tree, env=dict(env, **off, CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True,
    )
    assert unit.returncode == 0 and "2 passed" in unit.stdout, unit.stdout[-3000:] + unit.stderr[-3000:]
