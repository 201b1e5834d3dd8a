"""The fix engine.

A fix names one or more targets (a module and a symbol in megatron-core). When a target's
module is imported (or right away, if it already is), the engine reads the target's source
and decides, once, what to do with it:

- the source has the feature the fix is about?  no  -> ``not-applicable``
- its fingerprint is one the fix knows as buggy? yes -> replace it        -> ``applied``
- the CUDA assumption is no longer in the source?   -> leave it alone     -> ``upstream-fixed``
- otherwise the code changed shape around the bug   -> leave it alone     -> ``unsupported``
  (and warn once, so the user knows this spot is unfixed).

A fingerprint is a hash of the function's syntax tree without docstrings and comments, so
reformatting does not matter but any change of code does. Replacements carry a marker; a
target that already carries one (from this copy of the package or another) is left as is.
Nothing here raises into the import of megatron-core.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import inspect
import logging
import os
import sys
import textwrap
import threading
import types
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Tuple

import wrapt

from ._version import __version__

logger = logging.getLogger("mcore_cpu_shim")
logger.addHandler(logging.NullHandler())

ENV_DISABLE = "MCORE_CPU_SHIM_DISABLE"
REPORT_URL = "https://github.com/mcore-cpu-shim/mcore-cpu-shim/issues"
MARKER = "__mcore_cpu_shim__"
# The import name of this copy: "mcore_cpu_shim", or e.g. "bridge._vendor.mcore_cpu_shim".
PACKAGE = __name__.rpartition(".")[0]

# The fingerprint of a method a class does not define itself (it inherits it): a fix that
# adds an override lists INHERITED among its known_buggy shapes.
INHERITED = "inherited"

PENDING = "pending"  # the target's module has not been imported yet
APPLIED = "applied"
UPSTREAM_FIXED = "upstream-fixed"
NOT_APPLICABLE = "not-applicable"
UNSUPPORTED = "unsupported"
DISABLED = "disabled"


class McoreCpuShimWarning(UserWarning):
    """A fix could not be applied; megatron-core runs unpatched at that spot."""


@dataclass
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
    # the releases that lack this symbol altogether (e.g. a method added later); where it is
    # missing the target is not-applicable instead of unsupported
    absent_in: Optional[str] = None
    state: str = PENDING
    detail: str = "module not imported yet"

    @property
    def name(self) -> str:
        return f"{self.module}:{self.qualname}"


@dataclass
class Fix:
    name: str
    summary: str
    targets: Tuple[Target, ...]
    disabled: bool = False
    warned: bool = field(default=False, repr=False)

    @property
    def state(self) -> str:
        if self.disabled:
            return DISABLED
        states = {t.state for t in self.targets}
        for state in (PENDING, UNSUPPORTED, APPLIED, UPSTREAM_FIXED):
            if state in states:
                return state
        return NOT_APPLICABLE


def normalised_source(func: Callable) -> str:
    """The function's code as ast.unparse writes it, without docstrings or indentation."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:] or [ast.Pass()]
    return "\n".join(line.strip() for line in ast.unparse(tree).splitlines())


def fingerprint(source: str) -> str:
    """A short hash of a normalised source."""
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def mcore_version() -> str:
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        info = sys.modules.get("megatron.core.package_info")
        return getattr(info, "__version__", "unknown")


def _owner(module: types.ModuleType, qualname: str) -> Tuple[object, str]:
    *path, name = qualname.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def _install(module, owner, name: str, raw, original: Callable, new: Callable) -> None:
    """Put ``new`` where ``original`` was, keeping staticmethod/classmethod wrapping."""
    if isinstance(raw, (staticmethod, classmethod)):
        new = type(raw)(new)
    setattr(owner, name, new)
    if owner is module:
        # Modules that did `from <target module> import name` before we got here.
        for other in list(sys.modules.values()):
            namespace = getattr(other, "__dict__", None)
            if isinstance(namespace, dict) and namespace.get(name) is original:
                setattr(other, name, new)


def _decide(fix: Fix, target: Target, module: types.ModuleType) -> Tuple[str, str]:
    try:
        owner, name = _owner(module, target.qualname)
        raw = inspect.getattr_static(owner, name)
    except AttributeError:
        if target.absent_in is not None:
            return NOT_APPLICABLE, f"this megatron-core has no {target.qualname} (as {target.absent_in})"
        return UNSUPPORTED, f"{target.qualname} not found in {target.module}"
    original = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    marker = getattr(original, MARKER, None)
    if marker is not None:
        if marker["package"] == PACKAGE and marker["version"] == __version__:
            return APPLIED, "already applied"
        return APPLIED, f"applied by another copy: {marker['package']} {marker['version']}"
    if isinstance(owner, type) and name not in vars(owner):
        source, fp = "", INHERITED
    else:
        try:
            source = normalised_source(original)
        except (OSError, TypeError, SyntaxError) as exc:
            return UNSUPPORTED, f"cannot read the source of {target.name}: {exc}"
        fp = fingerprint(source)
    if target.feature is not None and target.feature not in source:
        return NOT_APPLICABLE, f"this megatron-core has no {target.feature!r} in {target.qualname}"
    if fp in target.known_buggy:
        new = functools.update_wrapper(target.replacement(original, module), original)
        setattr(new, MARKER, {"fix": fix.name, "package": PACKAGE, "version": __version__})
        _install(module, owner, name, raw, original, new)
        return APPLIED, f"replaced (code as in megatron-core {target.known_buggy[fp]})"
    if not any(snippet in source for snippet in target.bug):
        return UPSTREAM_FIXED, "the CUDA assumption is no longer in this code"
    return UNSUPPORTED, f"unfamiliar code (fingerprint {fp}) still holding the CUDA assumption"


def _on_import(fix: Fix, target: Target, module: types.ModuleType) -> None:
    with _lock:
        if target.state != PENDING:
            return
        try:
            target.state, target.detail = _decide(fix, target, module)
        except Exception as exc:  # never break the user's import of megatron-core
            target.state, target.detail = UNSUPPORTED, f"{type(exc).__name__}: {exc}"
        logger.info("%s: %s %s (%s)", fix.name, target.name, target.state, target.detail)
        if target.state == UNSUPPORTED and not fix.warned:
            fix.warned = True
            warnings.warn(
                f"mcore_cpu_shim: fix {fix.name!r} was not applied to {target.name} in "
                f"megatron-core {mcore_version()}: {target.detail}. This spot still assumes "
                f"CUDA. Please report it at {REPORT_URL} with the output of "
                f"`python -m mcore_cpu_shim doctor`.",
                McoreCpuShimWarning,
                stacklevel=2,
            )


def parse_disabled(value: str, valid: Tuple[str, ...]) -> set:
    names = {n.strip().replace("-", "_") for n in value.split(",") if n.strip()}
    if "all" in names:
        return set(valid)
    unknown = names - set(valid)
    if unknown:
        raise ValueError(
            f"{ENV_DISABLE}={value!r}: unknown fix name(s) {', '.join(sorted(unknown))}; "
            f"valid names are {', '.join(valid)}, or 'all'"
        )
    return names


_lock = threading.RLock()
_applied = False


def apply(fixes: Tuple[Fix, ...]) -> None:
    """Hook every fix that is not disabled onto its target modules, once."""
    global _applied
    with _lock:
        if _applied:
            return
        disabled = parse_disabled(os.environ.get(ENV_DISABLE, ""), tuple(f.name for f in fixes))
        _applied = True
        for fix in fixes:
            fix.disabled = fix.name in disabled
            if fix.disabled:
                logger.info("%s: disabled by %s", fix.name, ENV_DISABLE)
                continue
            for target in fix.targets:
                hook = functools.partial(_on_import, fix, target)
                wrapt.register_post_import_hook(hook, target.module)


def status(fixes: Tuple[Fix, ...]) -> Dict[str, dict]:
    with _lock:
        return {
            fix.name: {
                "state": fix.state,
                "summary": fix.summary,
                "targets": {
                    t.name: {"state": DISABLED if fix.disabled else t.state, "detail": t.detail}
                    for t in fix.targets
                },
            }
            for fix in fixes
        }
