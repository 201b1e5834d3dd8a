"""How the engine gets to a target module: at the right moment of its import.

- Function targets: a post-import hook (``wrapt.register_post_import_hook``) runs the decision
  right after the module's code has run, or at once if the module is imported already.
- Module targets (a module's own top-level code, e.g. an unguarded import of an optional
  package): that code runs while the module is imported, so it is decided before.
  ``ModuleFinder``, first on ``sys.meta_path``, finds such a module as the other finders would
  and hands Python a ``SourceFileLoader`` whose ``get_code`` compiles the module from the
  syntax tree the fixes return. wrapt has no hook before a module runs; this is the one job
  the engine keeps a finder of its own for.
- The deferred start: ``import mcore_cpu_shim`` loads no fix module. ``Trigger`` (on
  ``sys.meta_path``) calls back on the first lookup of a root package (``megatron``), before
  anything of it runs, and the callback loads and hooks the fixes. A post-import hook on
  ``megatron`` would come too late for a tree whose ``megatron/__init__.py`` imports a target.

Finders of this copy carry ``MARKER``: a second copy of the package (vendored) skips them when
it looks for a module's spec, so the two never wrap each other's loaders.
"""

from __future__ import annotations

import sys

from .records import MARKER, PACKAGE, PENDING

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Dict, List, Optional


def when_imported(name: str, hook: Callable) -> None:
    """Run ``hook(module)`` once module ``name`` has been imported: right away if it already
    is, else as soon as its code has run."""
    import wrapt

    wrapt.register_post_import_hook(hook, name)


class Trigger:
    """Calls ``fire()`` on the first lookup of a name in one of ``roots`` (then never again);
    finds nothing itself. The triggers of copies imported earlier sit behind this one in
    ``sys.meta_path``: they fire first, so the hooks of the copy imported first run first (it
    applies a fix, the later copy finds its marker and stands down)."""

    def __init__(self, roots, fire: Callable[[], None]):
        self.roots, self.fire = tuple(roots), fire
        setattr(self, MARKER, PACKAGE)

    def find_spec(self, name, path=None, target=None):
        if self.roots and name.partition(".")[0] in self.roots:
            behind = sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else []
            for other in behind:
                if hasattr(other, MARKER) and callable(getattr(other, "fire", None)):
                    other.find_spec(name, path, target)
            self.fire()
        return None


class ModuleFinder:
    """Finds a module with module targets still pending as the other finders would, and gives
    its spec a loader that compiles the module from ``transform(entries, source, path)`` (a
    syntax tree; None: the module's own code)."""

    def __init__(self, entries: Dict[str, List], transform: Callable):
        self.entries = entries  # {module name: [(fix, target)]}
        self.transform = transform
        setattr(self, MARKER, PACKAGE)

    def find_spec(self, name, path=None, target=None):
        entries = self.entries.get(name)
        if not entries or all(t.state != PENDING for _, t in entries):
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if hasattr(finder, MARKER) or find is None:  # this copy's finders, or another copy's
                continue
            spec = find(name, path, target)
            if spec is not None:
                break
        else:
            return None
        from importlib.machinery import SourceFileLoader

        if type(spec.loader) is SourceFileLoader:
            spec.loader = _loader_class()(name, spec.origin, entries, self.transform)
        return spec


_ModuleLoader = None


def _loader_class():
    """The class of ModuleFinder's loaders (made on first use: importing the package does not
    import importlib.machinery)."""
    global _ModuleLoader
    if _ModuleLoader is None:
        from importlib.machinery import SourceFileLoader

        class ModuleLoader(SourceFileLoader):
            """A ``SourceFileLoader`` whose code comes from the fixes' syntax tree."""

            def __init__(self, fullname, path, entries, transform):
                super().__init__(fullname, path)
                self.entries, self.transform = entries, transform

            def get_code(self, fullname):
                tree: Optional[object] = self.transform(self.entries, lambda: self.get_source(fullname), self.path)
                if tree is None:
                    return super().get_code(fullname)
                return compile(tree, self.path, "exec", dont_inherit=True)

        _ModuleLoader = ModuleLoader
    return _ModuleLoader
