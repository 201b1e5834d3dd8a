"""The fix engine.

A fix names one or more targets (a module and a symbol in megatron-core or Megatron-Bridge).
When a target's module is imported (or right away, if it already is), the engine reads the
target's source and decides, once, what to do with it:

- the source has the feature the fix is about?     no  -> ``not-applicable``
- its fingerprint is one the fix knows as buggy?   yes -> replace it        -> ``applied``
- the CUDA assumption is no longer in the source?      -> leave it alone     -> ``upstream-fixed``
- the code differs from every known release, but the bug site is there as the fix expects it
  (each of the target's site checks holds)             -> apply the drift form -> ``applied``
  (the detail says so and names the checks that passed)
- otherwise the code changed at the bug site           -> leave it alone     -> ``unsupported``
  (and warn once, so the user knows this spot is unfixed).

A fingerprint is a hash of the function's syntax tree without docstrings and comments, so
reformatting does not matter but any change of code does. Upstream changes code the fixes do
not touch all the time (a new attribute in a constructor, a new keyword argument): the site
checks let a fix follow such drift while making sure that what its replacement relies on (the
bug expression, how often and where it occurs, the parameters and calls it uses) is still as
the fix was written against. ``MCORE_CPU_SHIM_STRICT=1`` turns the drift path off (known
fingerprints only).

On drifted code a fix whose known-release replacement is a rewritten body does not use it (it
would drop what upstream added): it rewrites the live function at the bug expressions instead
(``rewrite``), compiled with the function's own globals, closure and file name, so every other
line is upstream's and tracebacks point into megatron-core's source. A fix whose replacement
only wraps the original uses the same wrapper on drifted code.

A target can also be a module's own top-level code (``qualname=MODULE``; e.g. an unguarded
import of an optional package). Such code runs while the module is imported, so it is decided
before: the engine's finder hands Python a loader that reads the module's source, decides on
its top-level import statements (the "code" of such a target; fingerprints and site checks as
above) and compiles the module from the syntax tree the fix's replacement returns.

Replacements carry a marker; a target that already carries one (from this copy of the package
or another) is left as is. Nothing here raises into the import of megatron-core. The decision
itself needs only source text (``classify``), so ``tools/coverage.py`` can run it over
megatron-core trees it does not import.

Import cost: ``import mcore_cpu_shim`` runs first in every conversion process, most of which
never meet a fix, so it loads only this module's light part (plain classes, the finders).
Post-import hooks are the engine's own finder (``_PostImportFinder``, what wrapt's were), the
fix modules are loaded by the first import of ``megatron`` (``apply``'s deferral), and what
the decision needs (ast, inspect, hashlib, copy, textwrap, functools, logging, warnings,
importlib.machinery) each function imports when it first runs.
"""

from __future__ import annotations

import _thread
import os
import sys

from ._mcore_tree import mcore_version, module_file, project
from ._version import __version__

# For type checkers only: typing, ast and types are not imported at run time (see "Import
# cost" above; the annotations are strings).
TYPE_CHECKING = False
if TYPE_CHECKING:
    import ast
    import types
    from typing import Callable, Dict, Optional, Tuple

ENV_DISABLE = "MCORE_CPU_SHIM_DISABLE"
ENV_STRICT = "MCORE_CPU_SHIM_STRICT"
REPORT_URL = "https://github.com/mcore-cpu-shim/mcore-cpu-shim/issues"
MARKER = "__mcore_cpu_shim__"
# The import name of this copy: "mcore_cpu_shim", or e.g. "bridge._vendor.mcore_cpu_shim".
PACKAGE = __name__.rpartition(".")[0]

# The fingerprint of a method a class does not define itself (it inherits it): a fix that
# adds an override lists INHERITED among its known_buggy shapes.
INHERITED = "inherited"

# The qualname of a target that is a module's top-level code; its replacement builds the new
# module syntax tree from (the parsed module, the fix's helpers module name).
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


_MISSING = object()


class _Field:
    """A field's default where the field is left out of the repr (as ``dataclasses.field``)."""

    def __init__(self, default, repr: bool = True):
        self.default, self.repr = default, repr


def _record(frozen: bool = False):
    """What ``@dataclass`` gives Check, Target and Fix (``__init__`` taking the annotated
    fields in order, by position or keyword, with their defaults; ``__repr__``; ``__eq__``;
    with ``frozen``, immutability and ``__hash__``), without importing ``dataclasses`` (which
    imports ``inspect``) when the package is imported."""

    def make(cls):
        fields = []  # (name, default or _MISSING, shown in the repr)
        for name in cls.__annotations__:
            default, shown = cls.__dict__.get(name, _MISSING), True
            if isinstance(default, _Field):
                default, shown = default.default, default.repr
                setattr(cls, name, default)
            fields.append((name, default, shown))
        names = tuple(name for name, _, _ in fields)

        def __init__(self, *args, **kwargs):
            if len(args) > len(fields):
                raise TypeError(f"{cls.__name__}() takes {len(fields)} arguments, {len(args)} given")
            for name, value in zip(names, args):
                if name in kwargs:
                    raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
                kwargs[name] = value
            unknown = set(kwargs) - set(names)
            if unknown:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {sorted(unknown)[0]!r}")
            for name, default, _ in fields:
                value = kwargs.get(name, default)
                if value is _MISSING:
                    raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
                object.__setattr__(self, name, value)

        def __repr__(self):
            shown = ", ".join(f"{name}={getattr(self, name)!r}" for name, _, show in fields if show)
            return f"{cls.__qualname__}({shown})"

        def values(self):
            return tuple(getattr(self, name) for name in names)

        def __eq__(self, other):
            if other.__class__ is not self.__class__:
                return NotImplemented
            return values(self) == values(other)

        def __setattr__(self, name, value):
            raise AttributeError(f"cannot assign to field {name!r} of a frozen {cls.__name__}")

        def __delattr__(self, name):
            raise AttributeError(f"cannot delete field {name!r} of a frozen {cls.__name__}")

        cls.__init__, cls.__repr__, cls.__eq__ = __init__, __repr__, __eq__
        if frozen:
            cls.__setattr__, cls.__delattr__ = __setattr__, __delattr__
            cls.__hash__ = lambda self: hash(values(self))
        else:
            cls.__hash__ = None  # mutable and compared by value, as a dataclass
        return cls

    return make


@_record(frozen=True)
class Check:
    """One thing a fix's drift form relies on at the bug site, checked on the target's code."""

    description: str
    holds: Callable[["Code"], bool]


@_record()
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


@_record()
class Fix:
    name: str
    summary: str
    targets: Tuple[Target, ...]
    disabled: bool = False
    warned: bool = _Field(default=False, repr=False)

    @property
    def state(self) -> str:
        if self.disabled:
            return DISABLED
        return combined_state({t.state for t in self.targets})


def _without_docstrings(tree: ast.AST) -> ast.AST:
    import ast

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
    return tree


def normalise(tree: ast.AST) -> str:
    """A syntax tree as ast.unparse writes it, without docstrings or indentation."""
    import ast
    import copy

    tree = _without_docstrings(copy.deepcopy(tree))
    return "\n".join(line.strip() for line in ast.unparse(tree).splitlines())


def function_tree(func: Callable) -> ast.AST:
    """The syntax tree of a function's own source (decorators included)."""
    import ast
    import inspect
    import textwrap

    return ast.parse(textwrap.dedent(inspect.getsource(func))).body[0]


def normalised_source(func: Callable) -> str:
    """The function's code as ast.unparse writes it, without docstrings or indentation."""
    return normalise(function_tree(func))


def fingerprint(source: str) -> str:
    """A short hash of a normalised source."""
    import hashlib

    return hashlib.sha256(source.encode()).hexdigest()[:16]


def find_definition(tree: ast.AST, qualname: str) -> Tuple[Optional[ast.AST], bool]:
    """The definition of ``qualname`` in a module's syntax tree, and whether its owner (the
    module, or the class named before the last dot) exists there. Top-level definitions only,
    the last one of a name winning, as at run time."""
    import ast

    node: Optional[ast.AST] = tree
    *path, name = qualname.split(".")
    for part in path:
        node = _last_def(node, part)
        if not isinstance(node, ast.ClassDef):
            return None, False
    return _last_def(node, name), True


def _last_def(node: ast.AST, name: str) -> Optional[ast.AST]:
    import ast

    found = None
    for child in getattr(node, "body", ()):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and child.name == name:
            found = child
    return found


def top_level_imports(tree: ast.Module) -> ast.Module:
    """What a module target's decision looks at: the module's top-level import statements
    (an import inside ``try:`` or ``if`` is guarded already and not among them)."""
    import ast

    return ast.Module(
        body=[node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))],
        type_ignores=[],
    )


class Code:
    """A target's code as the decision sees it: its syntax tree and normalised source, and a
    way to look up another function's definition (for checks on what the fix calls)."""

    def __init__(self, tree: ast.AST, lookup: Callable[[str, str], Optional[ast.AST]]):
        self.tree = tree
        self.text = normalise(tree)
        self.lookup = lookup

    def parameters(self, tree: Optional[ast.AST] = None) -> Tuple[str, ...]:
        args = (tree or self.tree).args
        every = args.posonlyargs + args.args + args.kwonlyargs
        return tuple(a.arg for a in every)


# Site checks, by what they look at. Counting is on the normalised source, whole lines where
# the snippet ends in a newline (lines there carry no indentation).
def occurs(snippet: str, times: int = 1) -> Check:
    """The snippet occurs exactly ``times`` times."""
    plural = "once" if times == 1 else f"{times} times"
    return Check(f"{snippet.strip()!r} {plural}", lambda code: code.text.count(snippet) == times)


def takes(*names: str) -> Check:
    """The function has these parameters."""
    return Check(
        f"parameters {', '.join(names)}", lambda code: set(names) <= set(code.parameters())
    )


def uses_only(base: str, *allowed: str) -> Check:
    """Every ``<base>.X`` the function names is one of ``allowed``."""

    def holds(code):
        import ast

        used = {
            node.attr
            for node in ast.walk(code.tree)
            if isinstance(node, ast.Attribute) and ast.unparse(node.value) == base
        }
        return used <= set(allowed)

    return Check(f"{base} used only for {', '.join(allowed)}", holds)


def cuda_attributes(*allowed: str) -> Check:
    """Every ``torch.cuda.X`` the function names is one of ``allowed``."""
    return uses_only("torch.cuda", *allowed)


def other_takes(module: str, qualname: str, *names: str) -> Check:
    """Another function (one the replacement calls) has these parameters."""

    def holds(code):
        tree = code.lookup(module, qualname)
        return tree is not None and set(names) <= set(code.parameters(tree))

    return Check(f"{qualname} takes {', '.join(names)}", holds)


def declares(module: str, qualname: str, *names: str) -> Check:
    """A class declares these fields (annotated names in its body)."""

    def holds(code):
        import ast

        tree = code.lookup(module, qualname)
        declared = {
            node.target.id
            for node in getattr(tree, "body", ())
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
        }
        return set(names) <= declared

    return Check(f"{qualname} declares {', '.join(names)}", holds)


def _live_lookup(module_name: str, qualname: str) -> Optional[ast.AST]:
    import importlib
    import inspect

    try:
        owner, name = _owner(importlib.import_module(module_name), qualname)
        raw = inspect.getattr_static(owner, name)
        return function_tree(getattr(raw, "__func__", raw))
    except Exception:
        return None


def classify(
    target: Target, tree: Optional[ast.AST], lookup, strict: bool = False, releases: bool = True
):
    """The decision for a target's definition ``tree`` (None: the class inherits it, see
    INHERITED): ``(state, detail, factory)``, where factory builds what to install (None where
    nothing is installed). Needs only source, not the live function."""
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
    (None: the tree has no such module; see ``_absent``)."""
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
                states[target.name] = _absent(target, f"module {target.module}")
                continue
            if target.qualname == MODULE:
                state, detail, _ = classify(target, top_level_imports(tree), lookup, strict)
                states[target.name] = (state, detail)
                continue
            node, owner_found = find_definition(tree, target.qualname)
            # Only a fix that adds an override asks about an inherited method here.
            inherited = owner_found and "." in target.qualname and INHERITED in target.known_buggy
            if node is None and not inherited:
                states[target.name] = _absent(target, target.qualname)
                continue
            state, detail, _ = classify(target, node, lookup, strict)
            states[target.name] = (state, detail)
    return result


def _absent(target: Target, what: str) -> Tuple[str, str]:
    """The decision for a target whose function (or whole module, ``what``) this megatron-core
    does not have: not-applicable where the fix expects releases without it, else unsupported."""
    if target.absent_in is not None:
        return NOT_APPLICABLE, f"this {target.project} has no {what} (as {target.absent_in})"
    return UNSUPPORTED, f"this {target.project} has no {what}"


def combined_state(states) -> str:
    """One state for a fix from its targets' states (as ``Fix.state``)."""
    for state in (PENDING, UNSUPPORTED, APPLIED, UPSTREAM_FIXED):
        if state in states:
            return state
    return NOT_APPLICABLE


def strict_from_env() -> bool:
    value = os.environ.get(ENV_STRICT, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_STRICT}={value!r}: use 1 (known code only) or 0 (the default)")
    return value == "1"


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
    import functools
    import inspect

    try:
        owner, name = _owner(module, target.qualname)
        raw = inspect.getattr_static(owner, name)
    except AttributeError:
        return _absent(target, target.qualname)
    original = raw.__func__ if isinstance(raw, (staticmethod, classmethod)) else raw
    marker = getattr(original, MARKER, None)
    if marker is not None:
        if marker["package"] == PACKAGE and marker["version"] == __version__:
            return APPLIED, "already applied"
        return APPLIED, f"applied by another copy: {marker['package']} {marker['version']}"
    if isinstance(owner, type) and name not in vars(owner):
        if INHERITED not in target.known_buggy:  # as classify_source decides it from source
            return _absent(target, target.qualname)
        tree = None
    else:
        try:
            tree = function_tree(original)
        except (OSError, TypeError, SyntaxError) as exc:
            return UNSUPPORTED, f"cannot read the source of {target.name}: {exc}"
    state, detail, factory = classify(target, tree, _live_lookup, _strict, not _drift_only)
    if factory is not None:
        new = functools.update_wrapper(factory(original, module), original)
        setattr(new, MARKER, {"fix": fix.name, "package": PACKAGE, "version": __version__})
        _install(module, owner, name, raw, original, new)
    return state, detail


# The name under which rewritten code reaches the fix's helpers (a closure variable of the
# rewritten function, so megatron-core's module namespace stays as it is).
HELPERS = "_mcore_cpu_shim"


def rewriting(helpers: object, replacements: Dict[str, str]):
    """A drift factory: ``rewrite`` with these replacements and helpers (a fix's module)."""
    return lambda original, module: rewrite(original, replacements, helpers)


def rewrite(original: Callable, replacements: Dict[str, str], helpers: object) -> Callable:
    """``original`` compiled again from its own source, with every expression whose normalised
    text is a key of ``replacements`` replaced by the value (an expression that may use the
    function's parameters and ``_mcore_cpu_shim.<helper>``, an attribute of ``helpers``).

    The new function has the original's globals (the live module namespace), closure values
    (``__class__`` for zero-argument ``super()``), decorators (but staticmethod/classmethod,
    which ``_install`` keeps) and file name and line numbers, so tracebacks point into
    megatron-core's source. Raises if a key is not found (the site checks make sure it is)."""
    import ast
    import inspect

    func = inspect.unwrap(original)
    tree = function_tree(original)
    ast.increment_lineno(tree, func.__code__.co_firstlineno - 1)
    tree.decorator_list = [
        d for d in tree.decorator_list if ast.unparse(d) not in ("staticmethod", "classmethod")
    ]
    found = dict.fromkeys(replacements, 0)

    class Replace(ast.NodeTransformer):
        def visit(self, node):
            if isinstance(node, ast.expr):
                text = ast.unparse(node)
                if text in replacements:
                    found[text] += 1
                    new = ast.parse(replacements[text], mode="eval").body
                    for part in ast.walk(new):
                        ast.copy_location(part, node)
                    return new
            return self.generic_visit(node)

    tree = Replace().visit(tree)
    missing = [text for text, count in found.items() if not count]
    if missing:
        raise LookupError(f"not in {func.__qualname__}: {', '.join(missing)}")
    freevars = func.__code__.co_freevars
    factory = ast.FunctionDef(
        name="_mcore_cpu_shim_factory",
        args=ast.arguments(
            posonlyargs=[],
            args=[ast.arg(arg=n) for n in (*freevars, HELPERS)],
            kwonlyargs=[],
            kw_defaults=[],
            defaults=[],
        ),
        body=[tree, ast.Return(value=ast.Name(id=tree.name, ctx=ast.Load()))],
        decorator_list=[],
        returns=None,
        **({"type_params": []} if "type_params" in ast.FunctionDef._fields else {}),
    )
    factory = ast.fix_missing_locations(ast.copy_location(factory, tree))
    code = compile(ast.Module(body=[factory], type_ignores=[]), func.__code__.co_filename, "exec")
    namespace: dict = {}
    exec(code, func.__globals__, namespace)  # defines only the factory, in ``namespace``
    cells = [cell.cell_contents for cell in func.__closure__ or ()]
    return namespace["_mcore_cpu_shim_factory"](*cells, helpers)


def _on_import(fix: Fix, target: Target, module: types.ModuleType) -> None:
    with _lock:
        if target.state != PENDING:
            return
        try:
            state, detail = _decide(fix, target, module)
        except Exception as exc:  # never break the user's import of megatron-core
            state, detail = UNSUPPORTED, f"{type(exc).__name__}: {exc}"
        _record(fix, target, state, detail)


def _record(fix: Fix, target: Target, state: str, detail: str) -> None:
    """Settle a target: its state, one log line, and a warning if it stays unfixed."""
    target.state, target.detail = state, detail
    _log("%s: %s %s (%s)", fix.name, target.name, state, detail)
    if state == UNSUPPORTED and not fix.warned:
        import warnings

        fix.warned = True
        warnings.warn(
            f"mcore_cpu_shim: fix {fix.name!r} was not applied to {target.name} in "
            f"{project(target.module)}: {detail}. This spot still assumes "
            f"CUDA. Please report it at {REPORT_URL} with the output of "
            f"`python -m mcore_cpu_shim doctor`.",
            McoreCpuShimWarning,
            stacklevel=3,
        )


_logger = None


def _log(message: str, *args) -> None:
    """One INFO line on the ``mcore_cpu_shim`` logger (logging is loaded on the first one)."""
    global _logger
    if _logger is None:
        import logging

        _logger = logging.getLogger("mcore_cpu_shim")
        _logger.addHandler(logging.NullHandler())
    _logger.info(message, *args)


# The class of _module_loader(): made on first use, so that importing the package does not
# import importlib.machinery.
_ModuleLoader = None


def _module_loader(fullname: str, path: str, entries):
    """A loader for a module with module targets: its code compiled from the fixes' syntax
    tree (a ``SourceFileLoader`` in every other way)."""
    global _ModuleLoader
    if _ModuleLoader is None:
        _ModuleLoader = _module_loader_class()
    return _ModuleLoader(fullname, path, entries)


def _module_loader_class():
    from importlib.machinery import SourceFileLoader

    class _ModuleLoader(SourceFileLoader):
        """Loads a module with module targets: its code compiled from the fixes' syntax tree."""

        def __init__(self, fullname: str, path: str, entries):
            super().__init__(fullname, path)
            self.entries = entries  # [(fix, target)] whose target is this module's top-level code

        def get_code(self, fullname):
            import ast
            import copy

            tree = None
            applied = []
            with _lock:
                for fix, target in self.entries:
                    if target.state != PENDING:
                        continue
                    try:
                        if tree is None:
                            tree = ast.parse(self.get_source(fullname), self.path)
                        state, detail, factory = classify(
                            target, top_level_imports(tree), _live_lookup, _strict, not _drift_only
                        )
                        if factory is not None:
                            tree = factory(copy.deepcopy(tree))
                            applied.append(fix.name)
                    except Exception as exc:  # never break the import
                        state, detail = UNSUPPORTED, f"{type(exc).__name__}: {exc}"
                    _record(fix, target, state, detail)
            if not applied:
                return super().get_code(fullname)
            marker = {"fixes": applied, "package": PACKAGE, "version": __version__}
            tree.body.insert(0, ast.parse(f"{MARKER} = {marker!r}").body[0])
            return compile(ast.fix_missing_locations(tree), self.path, "exec", dont_inherit=True)

    return _ModuleLoader


def _find_elsewhere(finder, name, path, target):
    """The spec the finders of ``sys.meta_path`` other than ``finder`` give ``name``."""
    for other in list(sys.meta_path):
        find = getattr(other, "find_spec", None)
        if other is finder or find is None:
            continue
        spec = find(name, path, target)
        if spec is not None:
            return spec
    return None


class _ModuleFinder:
    """First on ``sys.meta_path``: finds a module with module targets as the other finders
    would, and hands Python a ``_ModuleLoader`` for it."""

    def __init__(self, entries):
        self.entries = entries  # {module name: [(fix, target)]}
        setattr(self, MARKER, PACKAGE)

    def find_spec(self, name, path=None, target=None):
        entries = self.entries.get(name)
        if not entries or all(t.state != PENDING for _, t in entries):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if hasattr(finder, MARKER) or find is None:  # this copy's finder, or another copy's
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        from importlib.machinery import SourceFileLoader

        if type(spec.loader) is SourceFileLoader:
            spec.loader = _module_loader(name, spec.origin, entries)
        return spec


class _PostImportFinder:
    """On ``sys.meta_path``: runs hooks on a module right after its code has run (post-import
    hooks, as ``wrapt.register_post_import_hook`` has them; see ``_when_imported``).

    For a module with hooks waiting it finds the spec as the other finders would and wraps the
    loader: ``exec_module`` runs the module, then the module's hooks, in the order they were
    registered. (A second copy of the package has a finder of its own in front of this one: it
    wraps the loader this one wrapped, so the hooks of the copy imported first run first.) It
    is also the trigger of a deferred ``apply``: the first lookup of a name in one of the
    deferred root packages loads and hooks the fixes (``activate``) before anything else."""

    def __init__(self):
        self.hooks = {}  # module name -> [hook(module)], until the module has been imported
        self._local = _thread._local()  # the names this thread is finding elsewhere right now

    def find_spec(self, name, path=None, target=None):
        if _deferred and name.partition(".")[0] in _roots:
            activate()
        if name not in self.hooks:
            return None
        busy = getattr(self._local, "names", None)
        if busy is None:
            busy = self._local.names = set()
        if name in busy:  # our own lookup, come back through another finder
            return None
        busy.add(name)
        try:
            spec = _find_elsewhere(self, name, path, target)
        finally:
            busy.discard(name)
        if spec is not None and spec.loader:
            spec.loader = _HookedLoader(spec.loader, self)
        return spec

    def loaded(self, module) -> None:
        """``module`` has run: its hooks, once (they are forgotten here first)."""
        with _hooks_lock:
            hooks = self.hooks.pop(getattr(module, "__name__", None), ())
        for hook in hooks:
            hook(module)


class _HookedLoader:
    """A loader that runs the post-import hooks after the loader it wraps ran the module. It
    answers for that loader in every other way, and gives the module the original back as
    ``__loader__`` and ``__spec__.loader``."""

    def __init__(self, loader, finder: _PostImportFinder):
        self.__wrapped__, self._finder = loader, finder
        # Only what the wrapped loader has (the import system asks with hasattr).
        if hasattr(loader, "create_module"):
            self.create_module = loader.create_module
        if hasattr(loader, "exec_module"):
            self.exec_module = self._exec_module
        if hasattr(loader, "load_module"):
            self.load_module = self._load_module

    def __getattr__(self, name):
        loader = self.__dict__.get("__wrapped__")
        if loader is None:
            raise AttributeError(name)
        return getattr(loader, name)

    def _unwrapped(self, module) -> None:
        if getattr(module, "__loader__", None) in (None, self):
            try:
                module.__loader__ = self.__wrapped__
            except AttributeError:
                pass
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "loader", None) is self:
            spec.loader = self.__wrapped__

    def _exec_module(self, module) -> None:
        self._unwrapped(module)
        self.__wrapped__.exec_module(module)
        self._finder.loaded(module)

    def _load_module(self, fullname):
        module = self.__wrapped__.load_module(fullname)
        self._unwrapped(module)
        self._finder.loaded(module)
        return module


def _when_imported(name: str, hook: Callable) -> None:
    """Run ``hook(module)`` once module ``name`` has been imported: right away if it already
    is, else as soon as its code has run (the first import of it that succeeds)."""
    global _post_finder
    with _hooks_lock:
        if _post_finder is None:
            _post_finder = _PostImportFinder()
            sys.meta_path.insert(0, _post_finder)
        module = sys.modules.get(name)
        if module is None:
            _post_finder.hooks.setdefault(name, []).append(hook)
    if module is not None:  # outside the lock: the hook may import
        hook(module)


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


_lock = _thread.RLock()
_hooks_lock = _thread.RLock()
_applied = False
_strict = False
# For the project's tests only: decide as if no release were known, so that every release's
# own code goes through the site checks and the drift forms (tools/matrix.py's drift mode).
ENV_DRIFT_ONLY = "_MCORE_CPU_SHIM_DRIFT_ONLY"
_drift_only = False
_post_finder = None  # this copy's _PostImportFinder, once in sys.meta_path
_module_finder = None  # this copy's _ModuleFinder, once in sys.meta_path
# A deferred apply (see apply): the function that loads the fixes (until it is called), the
# root packages whose first import calls it, and whether the fixes are still to be hooked.
_pending = None
_roots = ()
_deferred = False


def apply(fixes, roots: Tuple[str, ...] = ()) -> None:
    """Hook every fix that is not disabled onto its target modules, once.

    ``fixes``: the fixes, or a function that returns them (and imports the fix modules to do
    so). With a function and ``roots`` (top-level packages that hold every target module),
    loading and hooking the fixes waits (see ``activate``) until the first import of one of
    those packages (the import system asks this copy's finder about it first), unless one of
    them is imported already or ``MCORE_CPU_SHIM_DISABLE`` names fixes (checked against their
    names now). No target module can be imported before its root package, so every target
    is hooked in time, as if it had been hooked here; the environment is read here either
    way."""
    global _applied, _strict, _drift_only, _pending, _roots, _deferred, _post_finder, _module_finder
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
        _pending, _roots, _deferred = fixes, tuple(roots), True
        # Where the hooking at import time would have put them, in the same order.
        with _hooks_lock:
            _post_finder = _PostImportFinder()
            sys.meta_path.insert(0, _post_finder)
        _module_finder = _ModuleFinder({})
        sys.meta_path.insert(0, _module_finder)


def activate() -> None:
    """Load and hook the fixes now if ``apply`` deferred that (no-op otherwise). Called by
    the first lookup of a root package, and by the package before it hands out the fixes."""
    global _pending, _deferred
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
        _deferred = False


def _hook(fixes, disabled: set) -> None:
    """Hook every fix not in ``disabled`` onto its target modules (under ``_lock``)."""
    global _module_finder
    modules: Dict[str, list] = {}
    for fix in fixes:
        fix.disabled = fix.name in disabled
        if fix.disabled:
            _log("%s: disabled by %s", fix.name, ENV_DISABLE)
            continue
        for target in fix.targets:
            if target.qualname == MODULE:
                if target.module in sys.modules:
                    _record(fix, target, *_imported_before(target))
                else:
                    modules.setdefault(target.module, []).append((fix, target))
                continue
            _when_imported(target.module, _on_import_of(fix, target))
    if not modules:
        return
    if _module_finder is None:
        _module_finder = _ModuleFinder(modules)
        sys.meta_path.insert(0, _module_finder)
    else:
        for name, entries in modules.items():
            _module_finder.entries.setdefault(name, []).extend(entries)


def _on_import_of(fix: Fix, target: Target) -> Callable:
    return lambda module: _on_import(fix, target, module)


def _imported_before(target: Target) -> Tuple[str, str]:
    """The state of a module target whose module was imported before the shim was."""
    marker = getattr(sys.modules[target.module], MARKER, None)
    if marker is not None:
        return APPLIED, f"applied by {marker['package']} {marker['version']}"
    return NOT_APPLICABLE, "imported before the shim was (its top-level imports succeeded)"


def _settle_absent_modules(fixes: Tuple[Fix, ...]) -> None:
    """Targets still pending whose module is never going to be imported (no hook would ever
    run), decided now: in a project that is not installed (``not-applicable``), or, once the
    project (or megatron-core) is imported, a module its tree does not have (``_absent``)."""
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
                target.state, target.detail = _absent(target, f"module {target.module}")


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
