"""mcore-cpu-shim: run Megatron-Core checkpoint conversion on hosts without a GPU.

``import mcore_cpu_shim`` before (or after) megatron-core activates every fix. Nothing from
torch or megatron is imported here: each fix waits for its target module to be imported.
Switch fixes off with ``MCORE_CPU_SHIM_DISABLE=name[,name]`` or ``all``. The import also
installs the Transformer Engine import guard (``MCORE_CPU_SHIM_TE=auto|block|off``, see
``te_guard``).

The import itself is kept light (about 2 % of ``import torch``, ``benchmarks/bench_import.py``): the fix
modules are loaded by the first import of ``megatron`` (before any target module can be
imported; right away if megatron is imported already, or when ``status()``, ``fix_names()`` or
the fix lists are asked for), and the tripwire when ``forbid_cuda`` is first used.
"""

import os
import sys

from . import te_guard, engine
from .engine import McoreCpuShimWarning
from ._version import __version__

__all__ = [
    "__version__",
    "apply",
    "status",
    "fix_names",
    "forbid_cuda",
    "CudaTouchedError",
    "McoreCpuShimWarning",
]

# The top-level packages that hold every fix's target modules: the first import of one of
# them loads the fix modules (tests/test_import_cost.py checks that every target is in one).
ROOTS = ("megatron",)


def _all_fixes():
    """Every fix, megatron-core's then Megatron-Bridge's (imports the fix modules)."""
    from .fixes import BRIDGE_FIXES, FIXES

    return FIXES + BRIDGE_FIXES


def _fixes():
    """Every fix, hooked (if ``apply`` is still waiting for megatron's import, now)."""
    engine.activate()
    return _all_fixes()


# Loaded on first use (module __getattr__): {name: where it comes from}.
_LAZY = {
    "tripwire": "tripwire",
    "forbid_cuda": "tripwire",
    "CudaTouchedError": "tripwire",
    "fixes": "fixes",
    "FIXES": "fixes",
    "BRIDGE_FIXES": "fixes",
    "ALL_FIXES": "fixes",
}


def __getattr__(name):
    source = _LAZY.get(name)
    if source == "tripwire":
        from .tripwire import CudaTouchedError, forbid_cuda  # (not `from . import`: it asks us)

        value = {"tripwire": sys.modules[__name__ + ".tripwire"], "forbid_cuda": forbid_cuda,
                 "CudaTouchedError": CudaTouchedError}[name]
    elif source == "fixes":
        every = _fixes()
        fixes = sys.modules[__name__ + ".fixes"]
        value = {"fixes": fixes, "FIXES": fixes.FIXES, "BRIDGE_FIXES": fixes.BRIDGE_FIXES,
                 "ALL_FIXES": every}[name]
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


def fix_names():
    """The names of all fixes: megatron-core's in the order of ``patches/series``, then
    Megatron-Bridge's in the order of ``patches/bridge/series``."""
    return tuple(fix.name for fix in _fixes())


def apply():
    """Activate every fix not disabled by the environment, and the TE import guard.

    Safe to call again. A bad switch value raises ValueError and activates nothing.
    """
    te_mode = te_guard.mode_from_env()
    engine.apply(_all_fixes, ROOTS)
    te_guard.install(te_mode)


def status():
    """``{fix name: {"state", "summary", "targets": {target: {"state", "detail"}}}}``."""
    return engine.status(_fixes())


def _started_as_cli():
    """Whether this process is the package's own command line (``python -m``, console script)."""
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv and argv[argv.index("-m") + 1 :][:1] == [__name__]:
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]).startswith("mcore-cpu-shim")


# A bad switch value: an import by a program raises it; the CLI (app.cli, which calls apply()
# again) reports it with exit status 2.
try:
    apply()
except ValueError:
    if not _started_as_cli():
        raise
