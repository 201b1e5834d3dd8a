"""The Transformer Engine import guard: on a process without usable CUDA, TE counts as absent.

megatron-core imports Transformer Engine (TE) inside ``try: ... except ImportError`` (in places
``except ModuleNotFoundError``) and takes its local code paths when TE is missing. On a host
without a usable CUDA device neither outcome of that import is right:

- TE fails to load (no driver, no cuDNN, a core without its torch extension, a leftover
  ``transformer_engine/`` folder): the error is an OSError, RuntimeError, FileNotFoundError
  or a plain ImportError, which escapes those handlers, and ``import megatron.core`` dies.
- TE loads (a complete install, core and torch extension, imports fine once torch is loaded):
  megatron-core then believes it can use TE. It builds the final layer norm as ``TENorm`` even
  with the local layer spec, binds ``moe_utils.te_general_gemm``, picks TE's FusedAdam, and
  every one of those fails the moment it runs (TE modules need CUDA); the checkpoint gains
  keys (``decoder.final_layernorm._extra_state``) that the local model never writes.

So in ``auto`` mode, on a process without usable CUDA, TE counts as absent whether its import
succeeds or fails, and megatron-core takes its local paths everywhere. With usable CUDA the
guard changes nothing (a broken TE on a GPU node stays loud). "Usable" is
``torch.cuda.is_available()``, which does not initialise CUDA.

How: the guard is the first ``sys.meta_path`` finder for TE's top-level names (the
``transformer_engine`` package and its submodules, and TE's torch extension module,
``transformer_engine_torch``, in older releases ``transformer_engine_extensions``). The first
lookup of an installed TE decides, once per process: it imports torch (TE's core needs the
libraries torch loads) and asks whether CUDA is usable. If not, it tries what megatron-core
imports (``transformer_engine``, ``transformer_engine.pytorch``, ``transformer_engine_torch``),
only to name the truth in one ``McoreCpuShimWarning`` ("installed and importable", or the real
exception), then drops every TE module from ``sys.modules`` and puts ``None`` under the
top-level names. That is Python's own "this module is absent" mark: every later ``import``
raises ModuleNotFoundError and ``importlib.util.find_spec`` returns None, so every HAVE_TE,
``is_te_min_version`` and find_spec probe agrees. The lookup that decided raises
ModuleNotFoundError chained to the exception the try met (if any).

A TE imported before the guard was installed cannot be taken back (objects already hold it):
the guard leaves TE alone in that process and warns with the fix (import ``mcore_cpu_shim``
first, or start the program with ``mcore-cpu-shim run``). A TE that a torch plugin
(``torch.backends`` entry point) imports while torch itself is being imported is decided like
any other lookup when the guard is already installed.

``MCORE_CPU_SHIM_TE``: ``auto`` (default, as above), ``block`` (TE counts as absent without
trying, even with usable CUDA; e.g. to force the local layer spec), ``off`` (no guard). One
guard per process: a second copy of this package (vendored) leaves it to the first.
"""

from __future__ import annotations

import _thread
import os
import sys

from .engine import PACKAGE, McoreCpuShimWarning, log
from ._version import __version__

# importlib, importlib.metadata, importlib.machinery and warnings are imported where they are used:
# ``import mcore_cpu_shim`` installs the guard and must stay light.

ENV_TE = "MCORE_CPU_SHIM_TE"
MODES = ("auto", "block", "off")
# The top-level import names of TE's python package and its torch extension module.
PACKAGE_NAME = "transformer_engine"
EXTENSIONS = ("transformer_engine_torch", "transformer_engine_extensions")
TOP_LEVEL = (PACKAGE_NAME, *EXTENSIONS)
# What megatron-core imports from TE, in the order it does: the package, its PyTorch part,
# and the torch extension (``import transformer_engine_torch as tex``).
MEGATRON_IMPORTS = ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch")
# The distributions a TE install consists of: the Python package, the binary core (one per
# CUDA major version), the torch extension.
DISTRIBUTIONS = ("transformer-engine", "transformer-engine-cu12", "transformer-engine-cu13",
                 "transformer-engine-torch")
# Found on the guard object: how another copy of this package recognises an installed guard.
GUARD_MARKER = "__mcore_cpu_shim_te_guard__"
FIX_ADVICE = ("import mcore_cpu_shim before anything imports transformer_engine (as the "
              "program's first import), or start the program with `mcore-cpu-shim run -- ...`")


def mode_from_env() -> str:
    value = os.environ.get(ENV_TE, "")
    mode = value.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_TE}={value!r}: unknown value; valid values are {', '.join(MODES)}")
    return mode


def is_te_name(name: str) -> bool:
    """TE's package, its torch extension module, or a submodule of either (the extension
    registers some itself, e.g. ``transformer_engine_torch.grouped_mlp_experimental``)."""
    return name.partition(".")[0] in TOP_LEVEL


def cuda_usable() -> bool:
    """Whether this process can use a CUDA device; never initialises CUDA."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a torch that cannot even say: no usable CUDA
        return False


def imported_te_modules() -> list:
    return sorted(m for m in sys.modules if is_te_name(m) and sys.modules[m] is not None)


def installed_distributions() -> dict:
    """``{distribution: version}`` of the TE distributions installed here (package metadata)."""
    import importlib.metadata

    found = {}
    for name in DISTRIBUTIONS:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def installed_version():
    """TE's version: the imported package's ``__version__``, else its package metadata."""
    module = sys.modules.get(PACKAGE_NAME)
    version = getattr(module, "__version__", None)
    return str(version) if version else installed_distributions().get("transformer-engine")


def error_text(exc) -> str:
    return f"{type(exc).__name__}: {exc}"


def try_imports() -> dict:
    """Import what megatron-core imports from TE, in its order, until one fails.

    Returns ``{name: None}`` for each import that worked and ``{name: exception}`` for the
    one that failed; names after a failure are not tried (they would only repeat it)."""
    import importlib

    results = {}
    for name in MEGATRON_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception as exc:  # whatever TE raises here is the answer
            results[name] = exc
            break
        results[name] = None
    return results


def summarise_imports(results: dict) -> dict:
    """The JSON-able form of ``try_imports()``: importable, the first error, each import."""
    failed = [(name, exc) for name, exc in results.items() if exc is not None]
    return {
        "importable": not failed and len(results) == len(MEGATRON_IMPORTS),
        "error": f"{failed[0][0]}: {error_text(failed[0][1])}" if failed else None,
        "imports": {name: "ok" if exc is None else error_text(exc) for name, exc in results.items()},
    }


def te_label(version) -> str:
    return f"Transformer Engine {version}" if version else "Transformer Engine (version unknown)"


class _Refuse:
    """The loader of a TE module that counts as absent: raises ModuleNotFoundError."""

    def __init__(self, guard: "TeGuard"):
        self.guard = guard

    def create_module(self, spec):
        raise self.guard.absent(spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise self.guard.absent(module.__name__)


class TeGuard:
    """The finder in sys.meta_path. ``mode``: auto or block; ``reason``: why TE counts as
    absent (None while undecided, or where TE is used); ``te``: what trying TE found."""

    def __init__(self, mode: str):
        self.mode = mode
        self.reason = None
        self.cause = None  # the exception trying TE met, chained to the refusal
        self.te = None  # {"version", "importable", "error", "imports"} once tried
        self.imported_before = []  # TE modules imported before the guard: left alone
        self.cuda_ok = False  # CUDA was found usable: the guard stays out of the way
        self.owner = f"{PACKAGE} {__version__}"
        setattr(self, GUARD_MARKER, True)
        self._local = _thread._local()  # threading.local, without importing threading

    def find_spec(self, name, path=None, target=None):
        if not is_te_name(name) or getattr(self._local, "busy", False):
            return None
        if self.reason is not None:
            if self.mode == "block" and sys.modules.get(PACKAGE_NAME, ...) is not None:
                self.make_absent(self.reason, None)  # block's first lookup: mark TE absent
            return self.refuse(name)
        if self.imported_before or self.cuda_ok:
            return None
        self._local.busy = True
        try:
            spec = self._find_elsewhere(name, path, target)
            if spec is None:
                return None  # not installed: absent without our help
            if cuda_usable():
                self.cuda_ok = True
                return spec
            self.decide(name, spec)
        finally:
            self._local.busy = False
        return self.refuse(name)

    @staticmethod
    def _find_elsewhere(name, path, target):
        for finder in sys.meta_path:
            if getattr(finder, GUARD_MARKER, False) or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                return spec
        return None

    def decide(self, name, spec):
        """No usable CUDA: find out what TE would have done, then make it absent."""
        leftover = spec.loader is None and spec.submodule_search_locations is not None
        if leftover and name == PACKAGE_NAME:  # a namespace package: a folder without __init__.py
            places = ", ".join(spec.submodule_search_locations)
            self.te = {"version": installed_version(), "importable": False,
                       "error": f"{places} holds no __init__.py (left over from a removed install)",
                       "imports": {}}
            cause = None
        else:
            results = try_imports()
            self.te = dict(version=installed_version(), **summarise_imports(results))
            cause = next((exc for exc in results.values() if exc is not None), None)
        if self.te["importable"]:
            reason = f"{te_label(self.te['version'])} installed and importable, CUDA not usable: treated as absent"
        else:
            reason = (f"{te_label(self.te['version'])} installed, not importable ({self.te['error']}), "
                      f"CUDA not usable: treated as absent")
        self.make_absent(reason, cause)
        import warnings

        warnings.warn(
            f"mcore_cpu_shim: {reason}. megatron-core takes its local code paths instead (TE "
            f"modules cannot run without CUDA; build the model with the local layer spec). Set "
            f"{ENV_TE}=off to let megatron-core import Transformer Engine anyway, or "
            f"{ENV_TE}=block to skip it without trying.",
            McoreCpuShimWarning,
            stacklevel=3,
        )
        log("transformer_engine: %s", reason)

    def make_absent(self, reason, cause):
        """Forget every TE module and mark TE's top-level names absent in sys.modules."""
        self.reason, self.cause = reason, cause
        for loaded in [m for m in sys.modules if is_te_name(m)]:
            del sys.modules[loaded]
        for top in TOP_LEVEL:
            sys.modules[top] = None

    def refuse(self, name):
        """A spec whose loading raises our ModuleNotFoundError (the decision's own lookup, or
        a lookup after someone removed the ``None`` marks)."""
        from importlib.machinery import ModuleSpec

        return ModuleSpec(name, _Refuse(self))

    def absent(self, name):
        error = ModuleNotFoundError(
            f"No module named {name!r}: Transformer Engine counts as absent in this process "
            f"(mcore_cpu_shim, {ENV_TE}={self.mode}: {self.reason})",
            name=name,
        )
        error.__cause__ = self.cause
        return error


def installed_guard():
    """The guard in sys.meta_path, from this copy of the package or another; or None."""
    for finder in sys.meta_path:
        if getattr(finder, GUARD_MARKER, False):
            return finder
    return None


def install(mode: str) -> None:
    """Put a guard in front of sys.meta_path, unless the mode is off or one is there already."""
    if mode == "off" or installed_guard() is not None:
        return
    guard = TeGuard(mode)
    imported = imported_te_modules()
    if mode == "block" and not imported:
        guard.reason = f"{ENV_TE}=block"
    elif imported:
        # Too late to make TE absent: whoever imported it holds it. Leave TE alone and say so,
        # unless TE is usable here anyway (torch already loaded and CUDA usable).
        guard.imported_before = imported
        usable = "torch" in sys.modules and cuda_usable()
        if mode == "block" or not usable:
            shown = ", ".join(imported[:3]) + (", ..." if len(imported) > 3 else "")
            why = f"{ENV_TE}=block" if mode == "block" else "CUDA is not usable here"
            import warnings

            warnings.warn(
                f"mcore_cpu_shim: {te_label(installed_version())} was imported before "
                f"mcore_cpu_shim ({shown}), so the guard cannot make it absent although {why}: "
                f"megatron-core will use it, and TE modules fail without CUDA. To fix, "
                f"{FIX_ADVICE}.",
                McoreCpuShimWarning,
                stacklevel=3,
            )
    sys.meta_path.insert(0, guard)


def state() -> dict:
    """What the guard of this process knows: mode, owner, why TE counts as absent (or None),
    what trying TE found, and the TE modules imported before the guard."""
    guard = installed_guard()
    if guard is None:
        return {"mode": "off", "owner": None, "reason": None, "te": None, "imported_before": []}
    return {"mode": guard.mode, "owner": guard.owner, "reason": guard.reason,
            "te": getattr(guard, "te", None),  # a guard of an older copy knows less
            "imported_before": list(getattr(guard, "imported_before", []))}
