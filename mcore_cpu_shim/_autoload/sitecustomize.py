"""Started by ``mcore-cpu-shim run``: Python imports this at startup, before the user's script.

``mcore-cpu-shim run`` puts this folder first on PYTHONPATH and names the shim's package in
MCORE_CPU_SHIM_AUTOLOAD ("import name:folder it lives in"). Every Python started under it,
torchrun workers included, imports the shim here and then runs the sitecustomize module it
would have run without us, if there is one. Not a package module: only ever run as
``sitecustomize``.
"""

import importlib
import importlib.machinery
import importlib.util
import os
import sys


def _activate():
    name, _, folder = os.environ.get("MCORE_CPU_SHIM_AUTOLOAD", "mcore_cpu_shim:").partition(":")
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not folder or exc.name != name.split(".")[0]:
            raise
        sys.path.append(folder)  # a Python whose own path lacks the shim: use the same copy
        importlib.import_module(name)


def _chain():
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_activate()
_chain()
