"""bridge_rng_state: Megatron-Bridge collects RNG states for a checkpoint without CUDA.

``training/checkpointing.get_rng_state`` builds the RNG part of a checkpoint and always reads
``torch.cuda.get_rng_state()``. ``save_megatron_model`` (what ``AutoBridge.import_ckpt`` and
``save_megatron_model`` call) reaches it even with ``save_rng=False``, so every CPU save dies
there ("Found no NVIDIA driver"). Megatron-Bridge 0.3.1 and main 067f987d.

Fix: where ``torch.cuda.is_available()`` is false the ``cuda_rng_state`` entry is ``None``
(there is no CUDA generator whose state could be saved); with CUDA it is read as before. The
rest of the dictionary (Python, NumPy, torch CPU and the tracker's states) is unchanged. A
conversion saves no RNG state (``save_rng=False``), so its checkpoint is the same on both hosts;
a checkpoint written with ``save_rng=True`` on a CPU host says ``None`` where there was nothing,
and resuming from it on a GPU needs ``--no-load-rng`` (as for any checkpoint without RNG state).
"""


from ..engine import Fix, Target, cuda_attributes, occurs, rewriting

READ = "torch.cuda.get_rng_state()"


def cuda_rng_state():
    """The CUDA generator's state where CUDA is available; ``None`` otherwise."""
    import torch

    return torch.cuda.get_rng_state() if torch.cuda.is_available() else None


_rewrite = rewriting(
    __name__, {READ: "_mcore_cpu_shim.cuda_rng_state()"}
)

FIX = Fix(
    name="bridge_rng_state",
    summary="Megatron-Bridge's checkpoint RNG state leaves out the CUDA generator where CUDA "
    "is unavailable",
    targets=(
        Target(
            module="megatron.bridge.training.checkpointing",
            qualname="get_rng_state",
            known_buggy={"1e6730ae395a1a12": "0.3.1", "c01ed946ce35ea6d": "main 067f987d (2026-08-22)"},
            bug=(READ,),
            replacement=_rewrite,
            drift=_rewrite,
            site=(occurs(READ), cuda_attributes("get_rng_state")),
        ),
    ),
)
