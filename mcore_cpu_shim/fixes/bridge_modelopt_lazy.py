"""bridge_modelopt_lazy: Megatron-Bridge imports NVIDIA ModelOpt for every checkpoint it saves
or loads, whether the model or the checkpoint has anything of ModelOpt or not.

``training/checkpointing.py`` imports ``restore_modelopt_state``, ``save_modelopt_state`` and
``save_sharded_modelopt_state`` from ``modelopt.torch.opt.plugins`` at its top, and
``training/post_training/checkpointing.py`` (which ``load_megatron_model`` imports for
``has_modelopt_state`` on every load) imports ModelOpt inside a ``try:`` that re-raises.
``import modelopt.torch`` loads ModelOpt's plugins and, through them, ``datasets`` and
``pandas``: about 1 s of every conversion process on a CPU host (0.9-1.1 s, Bridge 0.3.1 on a
2-core VM, where ``import torch`` takes 1.0 s), and a conversion fails where ModelOpt is not
installed. Yet the
functions do nothing for a model ModelOpt never converted (``save_*``: ModelOpt's own
``is_converted`` check) or a checkpoint without ModelOpt state (``restore_modelopt_state``
reads ``modelopt_state`` keys of the common state dict; Bridge calls the sharded restore only
where ``has_modelopt_state`` found a ``modelopt_state`` folder). Megatron-Bridge 0.3.0 … 0.6.2
and main 067f987d (known fingerprints for 0.3.1 and main, the others through the site checks,
tools/coverage.py). Bridge main's ``megatron/bridge/__init__.py`` imports ``modelopt.torch``
itself, first thing: there ModelOpt is loaded anyway and the fix changes no timing.

Fix: each of these imports binds the same names to stand-ins that import ModelOpt when it is
needed. A module name (``import modelopt.torch.opt as mto``) is a module object that imports
the real one on its first attribute access; a function imports its module on its first call
and calls the real function, except in the two cases where the real one is known to return
at once: ``save_modelopt_state``/``save_sharded_modelopt_state`` while ``modelopt.torch.opt``
is not imported (a model carries ModelOpt state only once ModelOpt converted it, which needs
ModelOpt imported), and ``restore_modelopt_state`` for a state dict that has no key naming
ModelOpt. Where ModelOpt is imported, every stand-in is the real function's call. The
checkpoint is the same bytes: the same code runs wherever ModelOpt would do anything. Where
ModelOpt is not installed, the first call that needs it raises ``ImportError`` naming it.

A module target: the imports run while the module is imported, so the engine compiles the
module from its source with only those statements replaced.
"""

import sys
import types

from ..engine import MODULE, Check, Fix, Target, top_level_imports

PLUGINS = "modelopt.torch.opt.plugins"
# The functions the stand-ins may stand for, by the module they come from: any other name
# imported from ModelOpt leaves the target unsupported (it may not be a function).
FUNCTIONS = {
    PLUGINS: ("restore_modelopt_state", "save_modelopt_state", "save_sharded_modelopt_state",
              "restore_sharded_modelopt_state"),
    PLUGINS + ".mcore_dist_checkpointing": ("_load_extra_state_from_sharded_checkpoint",),
}


def _modelopt_imported(*args, **kwargs):
    return "modelopt.torch.opt" in sys.modules


def _restores(model, state_dict, *args, **kwargs):
    return _modelopt_imported() or any("modelopt" in str(key) for key in state_dict)


# When a function may do anything (else it returns None without importing ModelOpt).
NEEDED = {"save_modelopt_state": _modelopt_imported, "save_sharded_modelopt_state": _modelopt_imported,
          "restore_modelopt_state": _restores}


def _import(name):
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ImportError(
            f"Megatron-Bridge needs NVIDIA ModelOpt here ({name}: {exc}); install "
            f"nvidia-modelopt[torch]. (mcore_cpu_shim's fix bridge_modelopt_lazy imports it when "
            f"a model or a checkpoint has ModelOpt state; converting a plain checkpoint does not.)"
        ) from exc


class LazyModule(types.ModuleType):
    """Module ``name``, imported on the first access to one of its attributes."""

    def __getattr__(self, attribute):
        return getattr(_import(self.__name__), attribute)


def function(module, name):
    """The stand-in for ``from module import name``."""
    needed = NEEDED.get(name)

    def stand_in(*args, **kwargs):
        if needed is not None and not needed(*args, **kwargs):
            return None
        return getattr(_import(module), name)(*args, **kwargs)

    stand_in.__name__ = stand_in.__qualname__ = name
    stand_in.__module__ = module
    return stand_in


def _is_modelopt(node):
    import ast

    if isinstance(node, ast.ImportFrom):
        return (node.module or "").partition(".")[0] == "modelopt"
    return isinstance(node, ast.Import) and all(a.name.partition(".")[0] == "modelopt" for a in node.names)


def _statements(tree):
    """The module's ModelOpt imports at its top, or in a top-level ``try:`` that re-raises:
    ``(the body holding one, its index)``."""
    import ast

    for node in top_level_imports(tree).body:
        body = node.body if isinstance(node, ast.Try) else [node]
        holder = body if isinstance(node, ast.Try) else tree.body
        for statement in body:
            if _is_modelopt(statement):
                yield holder, holder.index(statement)


def _bindings(statement):
    """``(bound name, stand-in expression)`` for each name ``statement`` binds."""
    import ast

    helper = f"__import__({__name__!r}, fromlist=['function'])"
    for alias in statement.names:
        if isinstance(statement, ast.ImportFrom):
            yield alias.asname or alias.name, f"{helper}.function({statement.module!r}, {alias.name!r})"
        elif alias.asname:  # import a.b.c as x: x is a.b.c
            yield alias.asname, f"{helper}.LazyModule({alias.name!r})"
        else:  # import a.b.c: binds a
            yield alias.name.partition(".")[0], f"{helper}.LazyModule({alias.name.partition('.')[0]!r})"


def _lazy(tree):
    import ast

    found = list(_statements(tree))
    if not found:
        raise LookupError("no top-level import of ModelOpt")
    for body, i in reversed(found):  # later statements first: the indexes stay right
        lines = [f"{name} = {value}" for name, value in _bindings(body[i])]
        bindings = ast.parse("\n".join(lines)).body
        for node in bindings:
            for part in ast.walk(node):
                ast.copy_location(part, body[i])
        body[i : i + 1] = bindings
    return tree


def _only_known_functions(code):
    """Every name imported from a ModelOpt module is a function the stand-ins know."""
    import ast

    return all(
        alias.name in FUNCTIONS.get(statement.module, ())
        for body, i in _statements(code.tree)
        for statement in [body[i]]
        if isinstance(statement, ast.ImportFrom)
        for alias in statement.names
    )


def _bound_once(code):
    bound = [name for body, i in _statements(code.tree) for name, _ in _bindings(body[i])]
    return len(bound) == len(set(bound))


def _target(module, known):
    return Target(
        module=module,
        qualname=MODULE,
        known_buggy=known,
        bug=("import modelopt", "from modelopt"),
        replacement=_lazy,
        site=(
            Check("imports ModelOpt at its top", lambda code: any(True for _ in _statements(code.tree))),
            Check("ModelOpt is imported only for functions the stand-ins know", _only_known_functions),
            Check("no name is imported from ModelOpt twice", _bound_once),
        ),
    )


FIX = Fix(
    name="bridge_modelopt_lazy",
    summary="Megatron-Bridge's checkpoint save and load import NVIDIA ModelOpt only when the "
    "model or the checkpoint has ModelOpt state",
    targets=(
        _target("megatron.bridge.training.checkpointing",
                {"5b9a804af99cee55": "0.3.1", "295b25d74b039498": "main 067f987d"}),
        _target("megatron.bridge.training.post_training.checkpointing",
                {"bf9b284f12b55b48": "0.3.1", "55ee7941fc196a51": "main 067f987d"}),
    ),
)
