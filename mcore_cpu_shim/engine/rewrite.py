"""The drift form of a fix whose known-release replacement is a rewritten body: on drifted code
it would drop what upstream added, so the live function is compiled again from its own source
with only the bug expressions replaced. Every other line is upstream's, and tracebacks point
into megatron-core's source.
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Dict, Union

# The name under which rewritten code reaches the fix's helpers (a closure variable of the
# rewritten function, so megatron-core's module namespace stays as it is).
HELPERS = "_mcore_cpu_shim"


def rewriting(helpers: Union[str, object], replacements: Dict[str, str]):
    """A drift factory: ``rewrite`` with these replacements and helpers (a fix's module, or its
    name: a fix module passes its own ``__name__``)."""
    return lambda original, module: rewrite(original, replacements, helpers)


def rewrite(original: Callable, replacements: Dict[str, str], helpers: Union[str, object]) -> Callable:
    """``original`` compiled again from its own source, with every expression whose normalised
    text is a key of ``replacements`` replaced by the value (an expression that may use the
    function's parameters and ``_mcore_cpu_shim.<helper>``, an attribute of ``helpers``, a module
    or a module's name).

    The new function has the original's globals (the live module namespace), closure values
    (``__class__`` for zero-argument ``super()``), decorators (but staticmethod/classmethod,
    which the installer keeps) and file name and line numbers. Raises if a key is not found
    (the site checks make sure it is)."""
    import ast
    import inspect

    from .source import function_tree

    if isinstance(helpers, str):
        helpers = sys.modules[helpers]
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
