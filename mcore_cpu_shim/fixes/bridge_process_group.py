"""bridge_process_group: a Megatron-Bridge provider sets up its process group without CUDA.

``ModelProviderMixin.provide_distributed_model`` and ``initialize_model_parallel`` (in
``models/model_provider.py``) start ``torch.distributed`` themselves when no process group
exists yet, which is the path ``AutoBridge.import_ckpt`` and a plain conversion script take:
they call ``torch.cuda.set_device(local rank)`` and ``init_process_group("nccl")``. On a host
without a usable CUDA device the first raises ("Found no NVIDIA driver"), and NCCL has no CPU
transport anyway. Megatron-Bridge 0.3.1 and main 067f987d (main's own CPU conversion script
starts a Gloo group before it calls Bridge, so only callers that do not are hit there).

Fix: the two calls are rewritten where they stand: where ``torch.cuda.is_available()`` is
false the device is not set and the backend is ``gloo``; where it is true, both are as before
(``set_device`` of the local rank, ``nccl``). Nothing else in either method changes, so a GPU
host starts exactly the group it started before. A caller that made its own group first is
not affected on any host (the branch is not taken).
"""


from ..engine import Fix, Target, cuda_attributes, occurs, rewriting

SET_DEVICE = "torch.cuda.set_device(get_local_rank_preinit())"
INIT = "torch.distributed.init_process_group('nccl')"


def set_device(index):
    """``torch.cuda.set_device(index)`` where CUDA is available; nothing otherwise."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.set_device(index)


def backend():
    """The backend a process group can use here: ``nccl`` with CUDA, ``gloo`` without."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


_rewrite = rewriting(
    __name__,
    {
        SET_DEVICE: "_mcore_cpu_shim.set_device(get_local_rank_preinit())",
        INIT: "torch.distributed.init_process_group(_mcore_cpu_shim.backend())",
    },
)


def _target(qualname, known):
    return Target(
        module="megatron.bridge.models.model_provider",
        qualname=f"ModelProviderMixin.{qualname}",
        known_buggy=known,
        bug=(SET_DEVICE, INIT),
        replacement=_rewrite,
        drift=_rewrite,
        site=(occurs(SET_DEVICE), occurs(INIT), cuda_attributes("set_device")),
    )


FIX = Fix(
    name="bridge_process_group",
    summary="a Megatron-Bridge provider starts its own process group with Gloo and sets no "
    "CUDA device where CUDA is unavailable",
    targets=(
        _target("provide_distributed_model", {"c1aab622386d0622": "0.3.1", "10297091fbfd3262": "main 067f987d (2026-08-22)"}),
        _target("initialize_model_parallel", {"7b597382d4f54325": "0.3.1, main 067f987d (2026-08-22)"}),
    ),
)
