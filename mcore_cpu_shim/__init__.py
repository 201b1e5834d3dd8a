"""mcore-cpu-shim: run Megatron-Core checkpoint conversion on hosts without a GPU.

``import mcore_cpu_shim`` before (or after) megatron-core activates every fix. Nothing from
torch or megatron is imported here: each fix waits for its target module to be imported.
Switch fixes off with ``MCORE_CPU_SHIM_DISABLE=name[,name]`` or ``all``.
"""

from . import _engine
from ._engine import McoreCpuShimWarning
from ._version import __version__
from .fixes import FIXES
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


def fix_names():
    """The names of all fixes, in patch order."""
    return tuple(fix.name for fix in FIXES)


def apply():
    """Activate every fix not disabled by the environment. Safe to call again."""
    _engine.apply(FIXES)


def status():
    """``{fix name: {"state", "summary", "targets": {target: {"state", "detail"}}}}``."""
    return _engine.status(FIXES)


apply()
