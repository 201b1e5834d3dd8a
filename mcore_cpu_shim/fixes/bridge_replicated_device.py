"""bridge_replicated_device: Megatron-Bridge copies a replicated weight at TP > 1 without CUDA.

``ReplicatedMapping.hf_to_megatron`` (``models/conversion/param_mapping.py``) loads a weight
that every tensor-parallel rank holds whole: layer norms, biases, a MoE router. At
``tensor_model_parallel_size`` 1 it returns the Hugging Face tensor on the parameter's device;
above 1 it first moves the tensor to ``torch.cuda.current_device()`` whenever the parameter is
not on that device (a parameter on the CPU never is), so that NCCL can broadcast it from TP
rank 0. On a host without a usable CUDA device that call raises ("Found no NVIDIA driver", or
"Torch not compiled with CUDA enabled" on a CPU build of torch), and every ``--tp 2`` import
stops in its first layer norm. Megatron-Bridge 0.3.0 … 0.6.2 and main 067f987d (2026-08-22),
the same code in each.

Fix: the move's condition is rewritten where it stands: where ``torch.cuda.is_available()``
is false the tensor stays on the parameter's device (the CPU, what a Gloo group broadcasts);
where it is true, the condition is upstream's and the tensor moves as before. The broadcast
copies bytes, so the weight every rank ends with is the one TP rank 0 read, bit for bit, on
either path; nothing else in the method changes.
"""

from ..engine import Fix, Target, cuda_attributes, occurs, rewriting
from .common import cuda_usable

MOVES = "target_device.index != torch.cuda.current_device()"
NO_CUDA = "torch.cuda.is_available()"  # code that asks it (as patch 0006 does) is fixed


def moves_to_cuda(target_device):
    """Upstream's condition for moving the weight to the current CUDA device before the TP
    broadcast, asked only where CUDA is usable (it is never true without)."""
    import torch

    return cuda_usable() and target_device.index != torch.cuda.current_device()


_rewrite = rewriting(__name__, {MOVES: "_mcore_cpu_shim.moves_to_cuda(target_device)"})

FIX = Fix(
    name="bridge_replicated_device",
    summary="Megatron-Bridge broadcasts a replicated weight to the other TP ranks from the CPU "
    "where CUDA is unavailable",
    targets=(
        Target(
            module="megatron.bridge.models.conversion.param_mapping",
            qualname="ReplicatedMapping.hf_to_megatron",
            known_buggy={"a5286a1e0fadc55b": "0.3.0 … 0.6.2, main 067f987d (2026-08-22)"},
            bug=(MOVES,),
            fixed_by=(NO_CUDA,),
            replacement=_rewrite,
            drift=_rewrite,
            site=(occurs(MOVES), cuda_attributes("current_device")),
        ),
    ),
)
