"""Putting the fixes in place: ``apply`` hooks every fix onto its target modules, each hook
decides its target once (``decide``) and installs the replacement, ``status`` reports.

Replacements carry a marker; a target that already carries one (from this copy of the package
or another) is left as is. Nothing here raises into the import of megatron-core: a decision
that fails leaves its target unsupported, with one warning.
"""

from __future__ import annotations

import _thread
import os
import sys

from .tree import module_file, project
from .decide import absent, classify, live_lookup, owner_of, strict_from_env
from .hooks import ModuleFinder, Trigger, when_imported
from .records import (
    APPLIED,
    DISABLED,
    ENV_DISABLE,
    ENV_DRIFT_ONLY,
    INHERITED,
    MARKER,
    MODULE,
    NOT_APPLICABLE,
    PACKAGE,
    PENDING,
    UNSUPPORTED,
    VERSION,
    Fix,
    Target,
    log,
    marker,
    warn_unfixed,
)
from .source import function_tree, top_level_imports

TYPE_CHECKING = False
if TYPE_CHECKING:
    import types
    from typing import Callable, Dict, Tuple

_lock = _thread.RLock()
_applied = False
_strict = False
_drift_only = False
_module_finder = None  # this copy's ModuleFinder, once in sys.meta_path
# A deferred apply: the function that loads the fixes (until it is called) and the finder that
# calls it on the first lookup of a root package.
_pending = None
_trigger = None


def apply(fixes, roots: Tuple[str, ...] = ()) -> None:
    """Hook every fix that is not disabled onto its target modules, once.

    ``fixes``: the fixes, or a function that returns them (and imports the fix modules to do
    so). With a function and ``roots`` (top-level packages that hold every target module),
    loading and hooking the fixes waits (see ``activate``) until the first import of one of
    those packages, unless one of them is imported already or ``MCORE_CPU_SHIM_DISABLE`` names
    fixes (checked against their names now). No target module can be imported before its root
    package, so every target is hooked in time; the environment is read here either way."""
    global _applied, _strict, _drift_only, _pending, _trigger, _module_finder
    with _lock:
        if _applied:
            return
        value = os.environ.get(ENV_DISABLE, "")
        defer = (
            callable(fixes)
            and bool(roots)
            and not value.replace(",", "").strip()
            and not any(root in sys.modules for root in roots)
        )
        if callable(fixes) and not defer:
            fixes = fixes()
        disabled = set() if defer else parse_disabled(value, tuple(f.name for f in fixes))
        _strict = strict_from_env()
        _drift_only = os.environ.get(ENV_DRIFT_ONLY) == "1"
        _applied = True
        if not defer:
            _hook(fixes, disabled)
            return
        _pending = fixes
        _trigger = Trigger(roots, activate)
        sys.meta_path.insert(0, _trigger)
        _module_finder = ModuleFinder({}, transform_module)
        sys.meta_path.insert(0, _module_finder)


def activate() -> None:
    """Load and hook the fixes now if ``apply`` deferred that (no-op otherwise). Called by the
    first lookup of a root package, and by the package before it hands out the fixes."""
    global _pending
    with _lock:
        load = _pending
        if load is None:
            return
        _pending = None  # (loading them imports modules, which asks the finders again)
        try:
            fixes = load()
        except BaseException:
            _pending = load
            raise
        _hook(fixes, set())
        _trigger.roots = ()


def _hook(fixes, disabled: set) -> None:
    """Hook every fix not in ``disabled`` onto its target modules (under ``_lock``)."""
    global _module_finder
    modules: Dict[str, list] = {}
    for fix in fixes:
        fix.disabled = fix.name in disabled
        if fix.disabled:
            log("%s: disabled by %s", fix.name, ENV_DISABLE)
            continue
        for target in fix.targets:
            if target.qualname == MODULE:
                if target.module in sys.modules:
                    settle(fix, target, *_imported_before(target))
                else:
                    modules.setdefault(target.module, []).append((fix, target))
                continue
            when_imported(target.module, _hook_of(fix, target))
    if not modules:
        return
    if _module_finder is None:
        _module_finder = ModuleFinder(modules, transform_module)
        sys.meta_path.insert(0, _module_finder)
    else:
        for name, entries in modules.items():
            _module_finder.entries.setdefault(name, []).extend(entries)


def _hook_of(fix: Fix, target: Target) -> Callable:
    def on_import(module):
        with _lock:
            if target.state != PENDING:
                return
            try:
                state, detail = decide(fix, target, module)
            except Exception as exc:  # never break the user's import of megatron-core
                state, detail = UNSUPPORTED, f"{type(exc).__name__}: {exc}"
            settle(fix, target, state, detail)

    return on_import


def decide(fix: Fix, target: Target, module: types.ModuleType) -> Tuple[str, str]:
    """Decide a function target on the imported module and install its replacement."""
    import functools
    import inspect

    try:
        owner, name = owner_of(module, target.qualname)
        raw = inspect.getattr_static(owner, name)
    except AttributeError:
        return absent(target, target.qualname)
    original = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    inherited = isinstance(owner, type) and name not in vars(owner)
    # (before the marker: a method inherited from a class another target wrapped is not this one)
    if inherited and INHERITED not in target.known_buggy:  # as classify_source decides it
        return absent(target, target.qualname)
    found = getattr(original, MARKER, None)
    if found is not None:
        if found["package"] == PACKAGE and found["version"] == VERSION:
            return APPLIED, "already applied"
        return APPLIED, f"applied by another copy: {found['package']} {found['version']}"
    if inherited:
        tree = None
    else:
        try:
            tree = function_tree(original)
        except (OSError, TypeError, SyntaxError) as exc:
            return UNSUPPORTED, f"cannot read the source of {target.name}: {exc}"
    state, detail, factory = classify(target, tree, live_lookup, _strict, not _drift_only)
    if factory is not None:
        new = functools.update_wrapper(factory(original, module), original)
        setattr(new, MARKER, marker(fix=fix.name))
        _put(module, owner, name, raw, original, new)
    return state, detail


def _put(module, owner, name: str, raw, original: Callable, new: Callable) -> None:
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


def transform_module(entries, source: Callable[[], str], path: str):
    """Decide the pending module targets ``entries`` of one module from its ``source()``: the
    syntax tree to compile (marked), or None where no fix applies (ModuleFinder's loader)."""
    import ast
    import copy

    tree = None
    applied = []
    with _lock:
        for fix, target in entries:
            if target.state != PENDING:
                continue
            try:
                if tree is None:
                    tree = ast.parse(source(), path)
                state, detail, factory = classify(
                    target, top_level_imports(tree), live_lookup, _strict, not _drift_only
                )
                if factory is not None:
                    tree = factory(copy.deepcopy(tree))
                    applied.append(fix.name)
            except Exception as exc:  # never break the import
                state, detail = UNSUPPORTED, f"{type(exc).__name__}: {exc}"
            settle(fix, target, state, detail)
    if not applied:
        return None
    tree.body.insert(0, ast.parse(f"{MARKER} = {marker(fixes=applied)!r}").body[0])
    return ast.fix_missing_locations(tree)


def settle(fix: Fix, target: Target, state: str, detail: str) -> None:
    """Settle a target: its state, one log line, and a warning if it stays unfixed."""
    target.state, target.detail = state, detail
    log("%s: %s %s (%s)", fix.name, target.name, state, detail)
    if state == UNSUPPORTED and not fix.warned:
        warn_unfixed(fix, target, project(target.module), detail)


def _imported_before(target: Target) -> Tuple[str, str]:
    """The state of a module target whose module was imported before the shim was."""
    found = getattr(sys.modules[target.module], MARKER, None)
    if found is not None:
        return APPLIED, f"applied by {found['package']} {found['version']}"
    return NOT_APPLICABLE, "imported before the shim was (its top-level imports succeeded)"


def _settle_absent_modules(fixes: Tuple[Fix, ...]) -> None:
    """Targets still pending whose module is never going to be imported (no hook would ever
    run), decided now: in a project that is not installed (``not-applicable``), or, once the
    project (or megatron-core) is imported, a module its tree does not have (``absent``)."""
    for fix in fixes:
        for target in fix.targets:
            if target.state != PENDING:
                continue
            package = ".".join(target.module.split(".")[:2])
            if module_file(package) is None:
                name = target.project if package in ("megatron.core", "megatron.bridge") else package
                target.state, target.detail = NOT_APPLICABLE, f"{name} is not installed"
            elif module_file(target.module) is None and (package in sys.modules or "megatron.core" in sys.modules):
                # (megatron.core imported: the tree is in use, e.g. its megatron/training lacks it)
                target.state, target.detail = absent(target, f"module {target.module}")


def status(fixes: Tuple[Fix, ...]) -> Dict[str, dict]:
    with _lock:
        _settle_absent_modules(fixes)
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
