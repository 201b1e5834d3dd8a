"""megatron-core as a source tree: a git checkout or submodule (how Megatron-Bridge users have
it), with no ``megatron_core-*.dist-info`` on the path. The doctor, ``mcore_cpu_shim.status()``
and the ranks' report work there, with the version from ``megatron.core.package_info``.

Once per Python (the first release leg): the upstream snapshot legs run every test on a source
tree without package metadata, and each release's fix states are its own legs' test_fix_states."""

import importlib
import importlib.util
import json
import os
import shutil

import pytest
from helpers import expected_state, once_per_python, run_python
from test_cli import cli

# In a child whose path holds the copy and no package metadata of megatron-core: what the
# shim and the demo's rank make of it.
REPORT = """
import importlib, importlib.metadata, json
import mcore_cpu_shim
from mcore_cpu_shim.app import worker
from mcore_cpu_shim.engine import mcore_version
import megatron.core
from megatron.core import package_info

try:
    importlib.metadata.version("megatron-core")
    metadata = True
except importlib.metadata.PackageNotFoundError:
    metadata = False
from helpers import import_every_target
import_every_target(mcore_cpu_shim)
# What a rank of convert or the demo records at its end, the version with it (once read from
# package metadata).
rank = worker.final_facts()
print(json.dumps({
    "metadata": metadata,
    "path": megatron.core.__file__,
    "package_info": package_info.__version__,
    "version": mcore_version(),
    "fixes": {name: fix["state"] for name, fix in mcore_cpu_shim.status().items()},
    "rank": {"mcore": rank["megatron_core"], "fixes": rank["fixes"]},
}))
"""


def source_tree(tmp_path):
    """A copy of the megatron package this session imports, without its package metadata,
    as a checkout has it; returns the PYTHONPATH for a child: the copy, and the folder this
    package is imported from (no megatron-core metadata is there)."""
    origin = importlib.util.find_spec("megatron.core").origin
    source = os.path.dirname(os.path.dirname(origin))
    shutil.copytree(source, tmp_path / "tree" / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    package = importlib.util.find_spec("mcore_cpu_shim").submodule_search_locations[0]
    shim_root = os.path.dirname(os.path.abspath(package))
    return os.pathsep.join([str(tmp_path / "tree"), shim_root])


@pytest.mark.cuda_hidden
@once_per_python()
def test_doctor_and_status_on_a_source_tree(tmp_path):
    from mcore_cpu_shim import fix_names

    path = source_tree(tmp_path)
    core = os.path.realpath(tmp_path / "tree" / "megatron" / "core")
    version = importlib.import_module("megatron.core.package_info").__version__

    result = run_python(REPORT, PYTHONPATH=path)
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    if report["metadata"]:
        pytest.skip("megatron-core's package metadata is still found beside the copy (in site-packages?): "
                    "this environment cannot show a source tree")
    assert os.path.realpath(os.path.dirname(report["path"])) == core, report["path"]
    assert report["package_info"] == report["version"] == report["rank"]["mcore"] == version
    assert list(report["fixes"]) == list(fix_names())
    for name, state in report["fixes"].items():
        assert state in {expected_state(name), "not-applicable"}, (name, state)
    assert any(state == expected_state(name) for name, state in report["fixes"].items())
    assert report["rank"]["fixes"] == report["fixes"]

    result = cli("doctor", "--json", PYTHONPATH=path)  # a fresh interpreter, as a user runs it
    assert result.returncode == 0, result.stderr[-5000:]
    doctor = json.loads(result.stdout)
    assert doctor["megatron_core"]["version"] == version
    assert os.path.realpath(doctor["megatron_core"]["path"]) == core
    assert {name: fix["state"] for name, fix in doctor["fixes"].items()} == report["fixes"]
    assert doctor["problems"] == []
