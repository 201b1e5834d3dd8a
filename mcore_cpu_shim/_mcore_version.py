"""Which megatron-core this process imports, found without importing it.

A source tree or a git submodule (how Megatron-Bridge has megatron-core) has no package
metadata, and a tree on ``PYTHONPATH`` may shadow an installed release whose metadata would
then lie: the version is read from ``megatron/core/package_info.py`` of the tree Python would
import. That file is run on its own (a few constants), not as ``megatron.core.package_info``,
so ``megatron/core/__init__.py`` (which imports torch and, in newer trees, queries CUDA) does
not run. Only the standard library is used here: the project's tests load this file directly,
without importing (activating) the package.
"""

import importlib.metadata
import importlib.util
import os
import runpy
import sys


def mcore_version() -> str:
    """megatron-core's version: ``package_info.__version__`` of the imported (or importable)
    tree, else the installed distribution's metadata, else ``"unknown"``."""
    info = sys.modules.get("megatron.core.package_info")
    if getattr(info, "__version__", None):
        return info.__version__
    try:
        spec = importlib.util.find_spec("megatron")
        locations = list(spec.submodule_search_locations or []) if spec else []
    except Exception:  # a broken "megatron" package: fall back to the metadata
        locations = []
    for location in locations:
        path = os.path.join(location, "core", "package_info.py")
        if os.path.isfile(path):
            try:
                return str(runpy.run_path(path)["__version__"])
            except Exception:
                break
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
