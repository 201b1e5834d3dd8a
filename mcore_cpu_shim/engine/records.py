"""The engine's vocabulary: the states a target can be in, the records a fix is made of
(``Check``, ``Target``, ``Fix``), the package's warning class and its log line.

Records are plain ``dataclasses``. Nothing here imports torch or megatron.
"""

from __future__ import annotations

import dataclasses

from .._version import __version__

# For type checkers only (the annotations are strings).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from typing import Callable, Dict, Optional, Tuple

    from .source import Code

ENV_DISABLE = "MCORE_CPU_SHIM_DISABLE"
ENV_STRICT = "MCORE_CPU_SHIM_STRICT"
# For the project's tests only: decide as if no release were known, so that every release's
# own code goes through the site checks and the drift forms (tools/matrix.py's drift mode).
ENV_DRIFT_ONLY = "_MCORE_CPU_SHIM_DRIFT_ONLY"
REPORT_URL = "https://github.com/mcore-cpu-shim/mcore-cpu-shim/issues"
MARKER = "__mcore_cpu_shim__"
# The import name of this copy: "mcore_cpu_shim", or e.g. "bridge._vendor.mcore_cpu_shim".
PACKAGE = __name__.rsplit(".", 2)[0]
VERSION = __version__

# The fingerprint of a method a class does not define itself (it inherits it): a fix that
# adds an override lists INHERITED among its known_buggy shapes.
INHERITED = "inherited"

# The qualname of a target that is a module's top-level code; its replacement builds the new
# module syntax tree from the parsed module.
MODULE = "<module>"

PENDING = "pending"  # the target's module has not been imported yet
APPLIED = "applied"
UPSTREAM_FIXED = "upstream-fixed"
NOT_APPLICABLE = "not-applicable"
UNSUPPORTED = "unsupported"
# How the detail of a target applied by its site checks begins.
DRIFTED = "code differs from every known release"
DISABLED = "disabled"


class McoreCpuShimWarning(UserWarning):
    """A fix could not be applied; megatron-core runs unpatched at that spot."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One thing a fix's drift form relies on at the bug site, checked on the target's code."""

    description: str
    holds: Callable[[Code], bool]


@dataclasses.dataclass
class Target:
    """One function or method in megatron-core that a fix replaces."""

    module: str
    qualname: str
    # fingerprint -> the megatron-core releases it was read from
    known_buggy: Dict[str, str]
    # normalised source snippets; if none is left in the target, the bug is gone
    bug: Tuple[str, ...]
    # builds the replacement from (original function, its module)
    replacement: Callable[[Callable, types.ModuleType], Callable]
    # a snippet the target must contain for the fix to concern it at all
    feature: Optional[str] = None
    # snippets that say upstream fixed the spot in its own way, even with a bug snippet there,
    # or checks that say so from other code (e.g. a class that now declares the fields)
    fixed_by: Tuple[object, ...] = ()
    # the releases that lack this symbol altogether (e.g. a method added later); where it is
    # missing the target is not-applicable instead of unsupported
    absent_in: Optional[str] = None
    # On code with the bug but no known fingerprint: what must hold at the bug site (empty:
    # no drift form, such code is unsupported) ...
    site: Tuple[Check, ...] = ()
    # ... and what to apply there (None: ``replacement``, which must then be a wrapper that
    # does not depend on the body).
    drift: Optional[Callable[[Callable, types.ModuleType], Callable]] = None
    # The replacement wraps the original whole and relies on nothing at a bug site (e.g. it
    # post-processes what the original returns): ``bug`` then only names the function, and a
    # changed body is drift like any other (the site checks still apply).
    whole: bool = False
    state: str = PENDING
    detail: str = "module not imported yet"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"

    @property
    def project(self) -> str:
        """The project the target is in, as messages name it."""
        return "Megatron-Bridge" if self.module.startswith("megatron.bridge") else "megatron-core"


@dataclasses.dataclass
class Fix:
    name: str
    summary: str
    targets: Tuple[Target, ...]
    disabled: bool = False
    warned: bool = dataclasses.field(default=False, repr=False)

    @property
    def state(self) -> str:
        if self.disabled:
            return DISABLED
        return combined_state({t.state for t in self.targets})


def combined_state(states) -> str:
    """One state for a fix from its targets' states (as ``Fix.state``)."""
    for state in (PENDING, UNSUPPORTED, APPLIED, UPSTREAM_FIXED):
        if state in states:
            return state
    return NOT_APPLICABLE


def marker(**fields) -> dict:
    """What a replacement (or a rewritten module) carries under ``MARKER``: this copy's name and
    version, and what was applied."""
    return {**fields, "package": PACKAGE, "version": VERSION}


_logger = None


def log(message: str, *args) -> None:
    """One INFO line on the ``mcore_cpu_shim`` logger (logging is loaded on the first one)."""
    global _logger
    if _logger is None:
        import logging

        _logger = logging.getLogger("mcore_cpu_shim")
        _logger.addHandler(logging.NullHandler())
    _logger.info(message, *args)


def warn_unfixed(fix: Fix, target: Target, where: str, detail: str) -> None:
    """The one warning of a fix that left a spot unfixed (``where``: the tree it is in)."""
    import warnings

    fix.warned = True
    warnings.warn(
        f"mcore_cpu_shim: fix {fix.name!r} was not applied to {target.name} in {where}: "
        f"{detail}. This spot still assumes CUDA. Please report it at {REPORT_URL} with the "
        f"output of `python -m mcore_cpu_shim doctor`.",
        McoreCpuShimWarning,
        stacklevel=4,
    )

