"""What ``import mcore_cpu_shim`` loads: only the package's light part. The fix modules and what
the decision needs wait for the first import of megatron, and the fixes still reach their states
from there. (How long the import takes is measured by benchmarks/bench_import.py, not here.)"""

import json

import pytest
from helpers import HAVE_BRIDGE, MODE, expected_state, megatron_source, once_per_python, run_python

pytestmark = [pytest.mark.cuda_hidden, once_per_python()]

FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
PRELOAD = f"{FS_ASYNC}:FileSystemWriterAsync.preload_tensors"

# Modules that ``import mcore_cpu_shim`` must not import (it may find some already imported by
# the interpreter's startup: only what the import adds counts). The heavy standard modules are
# those the decision, logging, wrapt's hooks or package metadata pull in; they wait for the first
# import of megatron. (The records are dataclasses: that module and what it imports are loaded
# before the measurement, as a cost bench_import.py counts against ``import torch``.)
NOT_IMPORTED = (
    "torch",
    "megatron",
    "transformer_engine",
    "wrapt",
    "asyncio",
    "ast",
    "inspect",
    "dis",
    "tokenize",
    "hashlib",
    "importlib.metadata",
    "importlib.util",
    "importlib.machinery",
    "typing",
    "logging",
    "threading",
    "copy",
    "textwrap",
    "functools",
    "contextlib",
    "traceback",
    "runpy",
    "re",
    "enum",
    # the package's own heavy parts: every fix module (and what they import), the tripwire
    "mcore_cpu_shim.fixes",
    "mcore_cpu_shim.tripwire",
)

IMPORT = """
import json, sys
import dataclasses  # the records' one standard dependency (see NOT_IMPORTED)
before = set(sys.modules)
import mcore_cpu_shim
added = sorted(set(sys.modules) - before)
print(json.dumps({
    "added": added,
    "meta_path": [type(f).__name__ for f in sys.meta_path[:3]],
    # what is loaded on first use works
    "forbid_cuda": mcore_cpu_shim.forbid_cuda is sys.modules["mcore_cpu_shim.tripwire"].forbid_cuda
                   and mcore_cpu_shim.tripwire is sys.modules["mcore_cpu_shim.tripwire"],
    "fix_names": list(mcore_cpu_shim.fix_names()),
    "all_fixes": [fix.name for fix in mcore_cpu_shim.ALL_FIXES],
}))
"""


def _is(module, name):
    return module == name or module.startswith(name + ".")


def test_import_loads_only_the_light_part():
    # A new interpreter (torch not preloaded), with the default switches (a disable list is
    # checked against the fix names at import, which loads the fix modules).
    result = run_python(IMPORT, fresh=True, MCORE_CPU_SHIM_DISABLE="", MCORE_CPU_SHIM_TE="auto")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    heavy = [m for m in report["added"] if any(_is(m, name) for name in NOT_IMPORTED)]
    assert heavy == [], report["added"]
    assert "mcore_cpu_shim.engine.install" in report["added"]
    # The finders in front: the TE guard, the module-target finder, the deferred start's trigger
    # (wrapt's post-import hook finder joins them at the first import of megatron).
    assert report["meta_path"] == ["TeGuard", "ModuleFinder", "Trigger"]
    assert report["forbid_cuda"]
    assert report["fix_names"] == report["all_fixes"] and "dcp_collective_device" in report["fix_names"]


def test_every_target_is_in_a_root_package():
    """The first import of a root package loads the fix modules: a target outside them would
    be imported before its fix is hooked."""
    import mcore_cpu_shim

    for fix in mcore_cpu_shim.ALL_FIXES:
        for target in fix.targets:
            assert target.module.split(".")[0] in mcore_cpu_shim.ROOTS, (fix.name, target.module)


ACTIVATION = f"""
import json, sys
import mcore_cpu_shim
waiting = "mcore_cpu_shim.fixes" in sys.modules
import {FS_ASYNC} as fs_async
from helpers import import_every_target
loaded = "mcore_cpu_shim.fixes" in sys.modules
preload = fs_async.FileSystemWriterAsync.__dict__["preload_tensors"].__func__
target = mcore_cpu_shim.status()["dcp_collective_device"]["targets"]["{PRELOAD}"]
import_every_target(mcore_cpu_shim)
print(json.dumps({{
    "waiting": waiting,
    "loaded": loaded,
    "target": target,
    "marked": hasattr(preload, "__mcore_cpu_shim__"),
    # the module keeps its own loader (the hook's wrapper is gone once the module ran)
    "loaders": [type(fs_async.__loader__).__name__, type(fs_async.__spec__.loader).__name__],
    "states": {{name: {{t: s["state"] for t, s in fix["targets"].items()}}
               for name, fix in mcore_cpu_shim.status().items()}},
}}))
"""


@pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: exercises the shim on unmodified megatron-core")
def test_fixes_load_with_megatron_and_reach_their_states():
    result = run_python(ACTIVATION, MCORE_CPU_SHIM_DISABLE="")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["waiting"] is False and report["loaded"] is True, report
    expected = expected_state("dcp_collective_device", PRELOAD)
    assert report["target"]["state"] == expected, report["target"]
    assert report["marked"] is (expected == "applied")
    assert report["loaders"] == ["SourceFileLoader", "SourceFileLoader"]
    # Every target as the engine decides it from this tree's source (as tools/coverage.py).
    from mcore_cpu_shim import engine
    from mcore_cpu_shim.fixes import BRIDGE_FIXES, FIXES

    static = engine.classify_source(FIXES + (BRIDGE_FIXES if HAVE_BRIDGE else ()), megatron_source)
    live = {name: report["states"][name] for name in static}
    assert live == {name: {t: s for t, (s, _) in targets.items()} for name, targets in static.items()}
