"""Which megatron-core (and Megatron-Bridge) tree this process imports, and its version, found
without importing it.

A source tree or a git submodule (how Megatron-Bridge has megatron-core) has no package
metadata, and a tree on ``PYTHONPATH`` may shadow an installed release whose metadata would
then lie: the version is read from ``megatron/core/package_info.py`` of the tree Python would
import. That file is run on its own (a few constants), not as ``megatron.core.package_info``,
so ``megatron/core/__init__.py`` (which imports torch and, in newer trees, queries CUDA) does
not run. Only the standard library is used here: the project's tests load this file directly,
without importing (activating) the package. Nothing beyond os and sys is imported before a
function here runs (the package imports this module on every ``import mcore_cpu_shim``).
"""

import os
import sys


def _roots():
    """The folders that hold the ``megatron`` package Python would import."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("megatron")
        return list(spec.submodule_search_locations or []) if spec else []
    except Exception:  # a broken "megatron" package
        return []


def module_file(module: str):
    """The source file of a ``megatron...`` module in that tree, or None if it has none."""
    parts = module.split(".")[1:]
    for root in _roots():
        for path in (os.path.join(root, *parts) + ".py", os.path.join(root, *parts, "__init__.py")):
            if os.path.isfile(path):
                return path
    return None


def mcore_version() -> str:
    """megatron-core's version: ``package_info.__version__`` of the imported (or importable)
    tree, else the installed distribution's metadata, else ``"unknown"``."""
    return _version("megatron.core", "megatron-core")


def bridge_version() -> str:
    """Megatron-Bridge's version, found the same way (its tree has ``package_info`` too)."""
    return _version("megatron.bridge", "megatron-bridge")


def project(module: str) -> str:
    """The project a ``megatron...`` module belongs to, and its version, for messages."""
    if module.startswith("megatron.bridge"):
        return f"Megatron-Bridge {bridge_version()}"
    return f"megatron-core {mcore_version()}"


def _version(package: str, distribution: str) -> str:
    info = sys.modules.get(package + ".package_info")
    if getattr(info, "__version__", None):
        return info.__version__
    path = module_file(package + ".package_info")
    if path is not None:
        import runpy

        try:
            return str(runpy.run_path(path)["__version__"])
        except Exception:  # a broken package_info: fall back to the metadata
            pass
    import importlib.metadata

    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
