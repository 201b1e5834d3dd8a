"""What several fixes share: whether CUDA is usable here, and where a buffer that upstream puts
on the current CUDA device goes instead. Both ask ``torch.cuda.is_available()``, which
initialises nothing (no driver is needed to ask), so a GPU host keeps upstream's devices exactly.
"""


def cuda_usable() -> bool:
    import torch

    return torch.cuda.is_available()


def buffer_device():
    """The current CUDA device (upstream's device), or the CPU without CUDA."""
    import torch

    return torch.cuda.current_device() if cuda_usable() else "cpu"


def cuda_or(original, on_cpu):
    """A replacement that calls ``original`` where CUDA is usable (upstream's code, unchanged)
    and ``on_cpu`` with the same arguments where it is not."""

    def gated(*args, **kwargs):
        if cuda_usable():
            return original(*args, **kwargs)
        return on_cpu(*args, **kwargs)

    return gated
