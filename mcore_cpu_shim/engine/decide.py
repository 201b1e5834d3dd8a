"""The decision: what to do with one target, from its code.

- the source has the feature the fix is about?     no  -> ``not-applicable``
- its fingerprint is one the fix knows as buggy?   yes -> replace it        -> ``applied``
- the CUDA assumption is no longer in the source?      -> leave it alone     -> ``upstream-fixed``
- the code differs from every known release, but the bug site is there as the fix expects it
  (each of the target's site checks holds)             -> apply the drift form -> ``applied``
  (the detail says so and names the checks that passed)
- otherwise the code changed at the bug site           -> leave it alone     -> ``unsupported``

Upstream changes code the fixes do not touch all the time (a new attribute in a constructor, a
new keyword argument): the site checks let a fix follow such drift while making sure that what
its replacement relies on (the bug expression, how often and where it occurs, the parameters
and calls it uses) is still as the fix was written against. ``MCORE_CPU_SHIM_STRICT=1`` turns
the drift path off (known fingerprints only).

``classify`` needs only source, so ``classify_source`` decides every target of a tree that is
read, not imported (``tools/coverage.py``); ``install`` decides on the live function the same way.
"""

from __future__ import annotations

import os

from .records import (
    APPLIED,
    DRIFTED,
    ENV_STRICT,
    INHERITED,
    MODULE,
    NOT_APPLICABLE,
    UNSUPPORTED,
    UPSTREAM_FIXED,
    Check,
    Target,
)
from .source import Code, find_definition, fingerprint, function_tree, top_level_imports

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ast
    import types
    from typing import Callable, Dict, Optional, Tuple


def classify(
    target: Target, tree: Optional[ast.AST], lookup, strict: bool = False, releases: bool = True
):
    """The decision for a target's definition ``tree`` (None: the class inherits it, see
    INHERITED): ``(state, detail, factory)``, where factory builds what to install (None where
    nothing is installed). ``releases=False`` decides as if no release were known."""
    if tree is None:
        code, fp = None, INHERITED
    else:
        code = Code(tree, lookup)
        fp = fingerprint(code.text)
    source = code.text if code else ""
    if target.feature is not None and target.feature not in source:
        return NOT_APPLICABLE, f"this {target.project} has no {target.feature!r} in {target.qualname}", None
    if fp in target.known_buggy and (releases or fp == INHERITED):
        return APPLIED, f"replaced (code as in {target.project} {target.known_buggy[fp]})", target.replacement
    for fix in target.fixed_by:
        if isinstance(fix, Check) and code is not None and fix.holds(code):
            return UPSTREAM_FIXED, f"fixed upstream: {fix.description}", None
    if not any(snippet in source for snippet in target.bug) or any(
        fix in source for fix in target.fixed_by if isinstance(fix, str)
    ):
        return UPSTREAM_FIXED, "the CUDA assumption is no longer in this code", None
    unfamiliar = f"unfamiliar code (fingerprint {fp}) still holding the CUDA assumption"
    if strict:
        return UNSUPPORTED, f"{unfamiliar}; {ENV_STRICT}=1 applies fixes to known code only", None
    if not target.site:
        return UNSUPPORTED, unfamiliar, None
    failed = [check.description for check in target.site if not check.holds(code)]
    if failed:
        return UNSUPPORTED, f"{unfamiliar}; at the bug site, not as the fix expects: {'; '.join(failed)}", None
    passed = "; ".join(check.description for check in target.site)
    how = "rewritten at the bug site" if target.drift else "wrapped as on the known releases"
    detail = f"{DRIFTED} (fingerprint {fp}): {how}; site checks passed: {passed}"
    return APPLIED, detail, target.drift or target.replacement


def classify_source(fixes, read: Callable[[str], Optional[str]], strict: bool = False):
    """Every target's decision on a megatron-core tree that is read, not imported:
    ``{fix name: {target name: (state, detail)}}``. ``read(module)`` gives a module's source
    (None: the tree has no such module; see ``absent``)."""
    import ast

    trees: Dict[str, Optional[ast.AST]] = {}

    def module_tree(module):
        if module not in trees:
            text = read(module)
            trees[module] = None if text is None else ast.parse(text)
        return trees[module]

    def lookup(module, qualname):
        tree = module_tree(module)
        return None if tree is None else find_definition(tree, qualname)[0]

    result: Dict[str, Dict[str, Tuple[str, str]]] = {}
    for fix in fixes:
        states = result[fix.name] = {}
        for target in fix.targets:
            tree = module_tree(target.module)
            if tree is None:
                states[target.name] = absent(target, f"module {target.module}")
                continue
            if target.qualname == MODULE:
                state, detail, _ = classify(target, top_level_imports(tree), lookup, strict)
                states[target.name] = (state, detail)
                continue
            node, owner_found = find_definition(tree, target.qualname)
            # Only a fix that adds an override asks about an inherited method here.
            inherited = owner_found and "." in target.qualname and INHERITED in target.known_buggy
            if node is None and not inherited:
                states[target.name] = absent(target, target.qualname)
                continue
            state, detail, _ = classify(target, node, lookup, strict)
            states[target.name] = (state, detail)
    return result


def absent(target: Target, what: str) -> Tuple[str, str]:
    """The decision for a target whose function (or whole module, ``what``) this megatron-core
    does not have: not-applicable where the fix expects releases without it, else unsupported."""
    if target.absent_in is not None:
        return NOT_APPLICABLE, f"this {target.project} has no {what} (as {target.absent_in})"
    return UNSUPPORTED, f"this {target.project} has no {what}"


def owner_of(module: types.ModuleType, qualname: str) -> Tuple[object, str]:
    """The object that holds ``qualname`` in ``module`` (the module or a class), and the name."""
    *path, name = qualname.split(".")
    owner: object = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def live_lookup(module_name: str, qualname: str) -> Optional[ast.AST]:
    """A ``lookup`` for ``Code`` on the imported tree: the definition's syntax tree, or None."""
    import importlib
    import inspect

    try:
        owner, name = owner_of(importlib.import_module(module_name), qualname)
        raw = inspect.getattr_static(owner, name)
        return function_tree(getattr(raw, "__func__", raw))
    except Exception:
        return None


def strict_from_env() -> bool:
    value = os.environ.get(ENV_STRICT, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_STRICT}={value!r}: use 1 (known code only) or 0 (the default)")
    return value == "1"
