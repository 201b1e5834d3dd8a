"""bridge_te_optional: Megatron-Bridge imports without Transformer Engine.

Megatron-Bridge's LoRA modules import Transformer Engine unconditionally at their top
(``import transformer_engine.pytorch as te`` in ``peft/lora_layers.py``, and in 0.3.1 also in
``peft/lora.py``), and ``import megatron.bridge`` reaches them (``__init__`` -> ``AutoBridge``
-> ``model_bridge`` -> ``peft_bridge`` -> ``canonical_lora`` -> ``lora_layers``). So on a host
without TE, or where TE is installed but unusable (no CUDA device: the shim's TE guard then
treats it as absent), Bridge cannot be imported at all, although converting a checkpoint never
touches a LoRA adapter. Every Bridge release up to 0.3.1 and main 067f987d (2026-08-22).

Fix: the import is guarded. Where it fails, ``te`` is a stand-in whose attributes are
placeholder classes: ``class TELinearAdapter(te.Linear)`` and the ``te.ops.Sequential``
annotations still define, ``isinstance(x, te.Linear)`` is False (nothing is a TE module here),
and creating one of the TE-only adapters raises ``ImportError`` naming Transformer Engine and
why it is unavailable. Where TE imports, ``te`` is the real module: nothing changes.

This is a module target: the import runs while the module is imported, so the engine compiles
the module from its source with only that statement replaced (every other line is Bridge's).
"""

from ..engine import MODULE, Fix, Target, occurs

STATEMENT = "import transformer_engine.pytorch as te"


class _Unavailable(type):
    """The type of the stand-ins: classes that cannot be instantiated, whose unknown
    attributes are further stand-ins (``te.ops.Sequential``)."""

    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        child = _Unavailable(name, (), {"_path": f"{cls._path}.{name}", "_reason": cls._reason})
        type.__setattr__(cls, name, child)  # one stand-in per name: te.Linear is te.Linear
        return child

    def __call__(cls, *args, **kwargs):
        raise ImportError(
            f"{cls.__name__} needs Transformer Engine ({cls._path}), which is unavailable "
            f"here: {cls._reason}. Megatron-Bridge's TE-only PEFT adapters need Transformer "
            f"Engine on a host with a usable CUDA device; checkpoint conversion does not."
        )


def unavailable(module: str, exc: BaseException):
    """The stand-in for ``module``, whose import failed with ``exc``."""
    return _Unavailable(module.rpartition(".")[2], (), {"_path": module, "_reason": f"{type(exc).__name__}: {exc}"})


def _guard(tree):
    import ast

    guarded = ast.parse(
        f"try:\n    {STATEMENT}\n"
        f"except ImportError as _mcore_cpu_shim_reason:\n"
        f"    te = __import__({__name__!r}, fromlist=['unavailable']).unavailable("
        f"'transformer_engine.pytorch', _mcore_cpu_shim_reason)\n"
    ).body[0]
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import) and ast.unparse(node) == STATEMENT:
            tree.body[i] = ast.copy_location(guarded, node)
            for part in ast.walk(guarded):
                ast.copy_location(part, node)
            return tree
    raise LookupError(STATEMENT)


def _target(module, known, absent_in=None):
    return Target(
        module=module,
        qualname=MODULE,
        known_buggy=known,
        bug=(STATEMENT,),
        absent_in=absent_in,
        replacement=_guard,
        site=(occurs(STATEMENT),),
    )


FIX = Fix(
    name="bridge_te_optional",
    summary="Megatron-Bridge imports without a usable Transformer Engine (its TE-only PEFT "
    "adapters raise a clear error if used)",
    targets=(
        _target(
            "megatron.bridge.peft.lora_layers",
            {"5829015b04e81ca5": "0.3.1", "438c90ec7cbc2313": "main 067f987d (2026-08-22)"},
        ),
        _target(
            "megatron.bridge.peft.lora",
            {"d84005d6c3fd7047": "0.3.1"},
        ),
    ),
)
