"""What a decision reads: a function's syntax tree and normalised source, its fingerprint, a
definition found in a module's source, and the site checks a fix's drift form relies on.

A fingerprint is a hash of the function's syntax tree without docstrings and comments, so
reformatting does not matter but any change of code does. Everything here works on source
text alone (``tools/coverage.py`` runs it over trees it does not import); ast, inspect,
hashlib, copy and textwrap are imported when a function first runs.
"""

from __future__ import annotations

from .records import Check

TYPE_CHECKING = False
if TYPE_CHECKING:
    import ast
    from typing import Callable, Optional, Tuple


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
    """What a module target's decision looks at: the module's top-level import statements,
    and a top-level ``try:`` whose every handler raises (it guards nothing: the module still
    fails to import). An import inside ``if``, or in a ``try:`` that carries on without it,
    is guarded already and not among them."""
    import ast

    def unguarded(node):
        return isinstance(node, ast.Try) and all(h.body and isinstance(h.body[-1], ast.Raise) for h in node.handlers)

    return ast.Module(
        body=[node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)) or unguarded(node)],
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
