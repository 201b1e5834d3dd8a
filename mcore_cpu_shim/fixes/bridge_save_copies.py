"""bridge_save_copies: Megatron-Bridge's low-memory save copies tensors it could keep, and
collects garbage over and over.

``save_megatron_model(..., low_memory_save=True)`` (``training/model_load_save.py``: what
``AutoBridge.import_ckpt`` and ``convert`` save with) builds the model's sharded state dict, then
lets go of the model parameter by parameter so that the weights are held once while torch_dist
writes them: it ``clone()``s the tensor the state dict holds and then empties the parameter
(``param.data = torch.empty(0)``, which also empties the state dict's tensor when that is the
parameter itself). For a tensor that spans its whole storage (every parameter but the SwiGLU
``linear_fc1`` gate/up halves, which a factory hands out as views) the clone frees nothing: it
copies the bytes, holds them twice for a moment and drops the original, about a second per
GiB. It also runs ``gc.collect()`` after every 20 factories and every 50 tensors: a full
collection of a heap that holds the model (~0.3 s each at a few GiB), where reference counting
already frees each parameter's memory as it is emptied (the save's peak does not rise without
them: 1B benchmark). Megatron-Bridge 0.3.0 … 0.6.2 and main 067f987d (the same code; known
fingerprints for 0.3.1 and main, the others through the drift form, tools/coverage.py).

Fix: a tensor that spans its storage is kept without a copy, as a new tensor on the same
storage (``detach()``), so emptying the parameter leaves it intact and the memory is held
once, as before; a view of part of a storage (the SwiGLU halves) is still cloned, so the rest
of that storage can be freed. The periodic collections go; the two after all factories and
after the model is emptied stay. The checkpoint is the same bytes: the state dict holds the
same values, on the storage they were copied from instead of a copy of it.
"""

from ..engine import Check, Fix, Target, occurs, rewriting

CLONES = ("sh_ten.data.clone()", "result.data.clone()")
PERIODIC = ("(idx + 1) % 20 == 0", "(idx + 1) % 50 == 0")
EMPTIES = "param.data = torch.empty(0, device=param.device, dtype=param.dtype)"


def keep(tensor):
    """``tensor`` where it spans its whole storage (a new tensor on that storage), else a copy."""
    whole = (
        tensor.is_contiguous()
        and tensor.storage_offset() == 0
        and tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size()
    )
    return tensor.detach() if whole else tensor.clone()


_rewrite = rewriting(
    __name__,
    {
        **{clone: f"_mcore_cpu_shim.keep({clone[: -len('.clone()')]})" for clone in CLONES},
        **dict.fromkeys(PERIODIC, "False"),
    },
)

FIX = Fix(
    name="bridge_save_copies",
    summary="Megatron-Bridge's low-memory save keeps a tensor that owns its storage instead of "
    "copying it, and does not collect garbage every 20 factories and 50 tensors",
    targets=(
        Target(
            module="megatron.bridge.training.model_load_save",
            qualname="save_megatron_model",
            known_buggy={"74af9e7ea50ef8a4": "0.3.1", "c266bc67a476d115": "main 067f987d"},
            bug=CLONES + PERIODIC,
            replacement=_rewrite,
            drift=_rewrite,
            site=(
                occurs("sh_ten.data.clone()", 2),
                occurs("result.data.clone()"),
                *(occurs(p) for p in PERIODIC),
                # the parameters are let go by swapping their data, never by resizing storage
                # (which would empty the tensor kept without a copy too)
                occurs(EMPTIES, 2),
                Check("no storage resized", lambda code: "resize_(" not in code.text),
            ),
        ),
    ),
)
