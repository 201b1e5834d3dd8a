"""mcore-cpu-shim: run Megatron-Core checkpoint conversion on hosts without a GPU.

``import mcore_cpu_shim`` before (or after) megatron-core activates every fix. Nothing from
torch or megatron is imported here: each fix waits for its target module to be imported.
Switch fixes off with ``MCORE_CPU_SHIM_DISABLE=name[,name]`` or ``all``. The import also
installs the Transformer Engine import guard (``MCORE_CPU_SHIM_TE=auto|block|off``, see
``_te_guard``).
"""

import os
import sys

from . import _engine, _te_guard
from ._engine import McoreCpuShimWarning
from ._version import __version__
from .fixes import BRIDGE_FIXES, FIXES
from .tripwire import CudaTouchedError, forbid_cuda

__all__ = [
    "__version__",
    "apply",
    "status",
    "fix_names",
    "forbid_cuda",
    "CudaTouchedError",
    "McoreCpuShimWarning",
]


ALL_FIXES = FIXES + BRIDGE_FIXES


def fix_names():
    """The names of all fixes: megatron-core's in the order of ``patches/series``, then
    Megatron-Bridge's in the order of ``patches/bridge/series``."""
    return tuple(fix.name for fix in ALL_FIXES)


def apply():
    """Activate every fix not disabled by the environment, and the TE import guard.

    Safe to call again. A bad switch value raises ValueError and activates nothing.
    """
    te_mode = _te_guard.mode_from_env()
    _engine.apply(ALL_FIXES)
    _te_guard.install(te_mode)


def status():
    """``{fix name: {"state", "summary", "targets": {target: {"state", "detail"}}}}``."""
    return _engine.status(ALL_FIXES)


def _started_as_cli():
    """Whether this process is the package's own command line (``python -m``, console script)."""
    argv = list(getattr(sys, "orig_argv", ()))
    if "-m" in argv and argv[argv.index("-m") + 1 :][:1] == [__name__]:
        return True
    return bool(sys.argv) and os.path.basename(sys.argv[0]).startswith("mcore-cpu-shim")


# A bad switch value: the CLI reports it (exit status 2); an import by a program raises it.
_config_error = None
try:
    apply()
except ValueError as exc:
    if not _started_as_cli():
        raise
    _config_error = exc
