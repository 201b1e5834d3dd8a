"""The Transformer Engine import guard: "TE cannot load on this host" becomes "TE is absent".

megatron-core imports Transformer Engine (TE) inside ``try: ... except ImportError`` (in places
``except ModuleNotFoundError``) and falls back to its local implementations when TE is missing.
On a host without a usable CUDA driver an installed TE does not go missing politely: loading
its libraries raises OSError, RuntimeError or FileNotFoundError (libcuda.so.1, cuDNN, NCCL,
Triton's "0 active drivers"), which escape those handlers, and ``import megatron.core`` dies.
A leftover ``transformer_engine/`` folder without ``__init__.py`` imports as an empty namespace
package and fails later (no ``__version__``, no package metadata).

The guard is a ``sys.meta_path`` finder for TE's top-level names (the ``transformer_engine``
package and its submodules, and TE's torch extension module, ``transformer_engine_torch``, in
older releases ``transformer_engine_extensions``). It lets the normal finders find them and
wraps the loader. Only when loading fails with something other than ModuleNotFoundError does
it look at the host (a plain ImportError counts: the dlopen failure of TE's torch extension is
one, and megatron-core's ``tensor_parallel/random.py`` catches only ModuleNotFoundError): if CUDA is usable (``torch.cuda.is_available()``, which does not initialise CUDA),
the error goes on unchanged, since a broken TE on a GPU node must stay loud. Otherwise it
removes every partly imported TE module from ``sys.modules``, warns once, remembers that TE is
unusable, and raises ``ModuleNotFoundError`` chained to the original error. Every later import
of a TE name raises ``ModuleNotFoundError`` at once (``importlib.util.find_spec`` still returns
a spec for it: it only looks). Only the outermost TE import decides: TE's own ``__init__``
catches ImportError around ``from . import pytorch``, so a nested conversion would leave a
half-working ``transformer_engine`` behind.

``MCORE_CPU_SHIM_TE``: ``auto`` (default, as above), ``block`` (TE counts as absent even where
it would import; e.g. to force the local layer spec), ``off`` (no guard). The guard only
sees imports that happen after it is installed: a TE imported before ``mcore_cpu_shim`` stays.
One guard per process: a second copy of this package (vendored) leaves the first one's guard.
"""

from __future__ import annotations

import importlib.machinery
import logging
import os
import sys
import threading
import warnings

from ._engine import PACKAGE, McoreCpuShimWarning
from ._version import __version__

logger = logging.getLogger("mcore_cpu_shim")

ENV_TE = "MCORE_CPU_SHIM_TE"
MODES = ("auto", "block", "off")
# The top-level import names of TE's python package and its torch extension module.
PACKAGE_NAME = "transformer_engine"
EXTENSIONS = ("transformer_engine_torch", "transformer_engine_extensions")
# Found on the guard object: how another copy of this package recognises an installed guard.
GUARD_MARKER = "__mcore_cpu_shim_te_guard__"


def mode_from_env() -> str:
    value = os.environ.get(ENV_TE, "")
    mode = value.strip().lower() or "auto"
    if mode not in MODES:
        raise ValueError(f"{ENV_TE}={value!r}: unknown value; valid values are {', '.join(MODES)}")
    return mode


def is_te_name(name: str) -> bool:
    return name == PACKAGE_NAME or name.startswith(PACKAGE_NAME + ".") or name in EXTENSIONS


def cuda_usable() -> bool:
    """Whether this process can use a CUDA device; never initialises CUDA."""
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # a torch that cannot even say: no usable CUDA
        return False


class _Refuse:
    """The loader of a TE module that counts as absent: raises ModuleNotFoundError."""

    def __init__(self, guard: "TeGuard"):
        self.guard = guard

    def create_module(self, spec):
        raise self.guard.absent(spec.name)

    def exec_module(self, module):  # never reached: create_module raises
        raise self.guard.absent(module.__name__)


class _Guarded:
    """Wraps the real loader of a TE module; decides what a failure to load means."""

    def __init__(self, guard: "TeGuard", loader, leftover: bool):
        self.guard = guard
        self.loader = loader
        self.leftover = leftover  # a namespace package: a folder without __init__.py

    def __getattr__(self, name):  # get_resource_reader, is_package, ... of the real loader
        if name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def create_module(self, spec):
        if self.leftover:  # the finders give a namespace package no loader
            if not cuda_usable():
                places = ", ".join(spec.submodule_search_locations)
                reason = f"{places} holds no __init__.py (left over from a removed install)"
                raise self.guard.unusable(spec.name, reason, None)
            return None
        return self.guard.load(spec.name, self.loader.create_module, spec)

    def exec_module(self, module):
        if not self.leftover:
            self.guard.load(module.__name__, self.loader.exec_module, module)


class TeGuard:
    """The finder in sys.meta_path. ``mode``: auto or block; ``reason``: why TE is unusable."""

    def __init__(self, mode: str):
        self.mode = mode
        self.reason = None  # set once TE failed to load here (auto) or is blocked
        self.cause = None  # the original error, chained to every later refusal
        self.owner = f"{PACKAGE} {__version__}"
        setattr(self, GUARD_MARKER, True)
        self._local = threading.local()

    def find_spec(self, name, path=None, target=None):
        if not is_te_name(name) or getattr(self._local, "finding", False):
            return None
        if self.reason is not None:
            return importlib.machinery.ModuleSpec(name, _Refuse(self))
        self._local.finding = True
        try:
            spec = None
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None:
                    break
        finally:
            self._local.finding = False
        if spec is None:
            return None
        leftover = spec.loader is None and spec.submodule_search_locations is not None
        if spec.loader is not None or (leftover and name == PACKAGE_NAME):
            spec.loader = _Guarded(self, spec.loader, leftover)
        return spec

    def load(self, name, step, arg):
        """Run one loading step of a TE module; turn a driverless failure into absence."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            return step(arg)
        except ModuleNotFoundError:  # megatron-core falls back on that by itself
            raise
        except Exception as exc:
            # Nested TE imports let the error through: the outermost one decides, once.
            if depth > 0 or cuda_usable():
                raise
            raise self.unusable(name, f"{type(exc).__name__}: {exc}", exc) from exc
        finally:
            self._local.depth = depth

    def unusable(self, name, reason, cause):
        """Record that TE cannot load here, forget its partial modules, warn once."""
        for loaded in [m for m in sys.modules if is_te_name(m)]:
            del sys.modules[loaded]
        if self.reason is None:
            self.reason, self.cause = reason, cause
            warnings.warn(
                f"mcore_cpu_shim: Transformer Engine is installed but cannot be used on this host "
                f"(no usable CUDA): importing {name} failed with {reason}. megatron-core falls back "
                f"to its local implementations (use the local layer spec). Set {ENV_TE}=off to see "
                f"the original error, or {ENV_TE}=block to skip Transformer Engine altogether.",
                McoreCpuShimWarning,
                stacklevel=2,
            )
            logger.info("transformer_engine unusable: %s", reason)
        return self.absent(name)

    def absent(self, name):
        error = ModuleNotFoundError(
            f"No module named {name!r}: Transformer Engine counts as absent on this host "
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
    if mode == "block":
        guard.reason = f"{ENV_TE}=block"
        imported = sorted(m for m in sys.modules if is_te_name(m) and sys.modules[m] is not None)
        if imported:
            warnings.warn(
                f"mcore_cpu_shim: {ENV_TE}=block, but {', '.join(imported[:3])} was imported "
                f"before mcore_cpu_shim and stays usable; import mcore_cpu_shim first.",
                McoreCpuShimWarning,
                stacklevel=3,
            )
    sys.meta_path.insert(0, guard)


def state() -> dict:
    """What the guard of this process knows: mode, owner, and why TE is unusable (or None)."""
    guard = installed_guard()
    if guard is None:
        return {"mode": "off", "owner": None, "reason": None}
    return {"mode": guard.mode, "owner": guard.owner, "reason": guard.reason}
