"""forbid_cuda(): make "this code touches no CUDA" an assertion instead of an assumption.

Inside the context every torch.cuda entry point that initialises CUDA or needs a device raises
CudaTouchedError, and each call is recorded, so a call that the code under test catches and
hides still fails the block on exit. Querying (is_available, device_count) stays allowed.
"""

import contextlib
import traceback

# _lazy_init is what every CUDA-initialising path ends in (tensor creation on "cuda", .cuda(),
# streams on CUDA builds); the others fail differently on CPU-only builds, so guard them too.
GUARDED = (
    "_lazy_init",
    "init",
    "synchronize",
    "current_device",
    "set_device",
    "Stream",
    "Event",
    "current_stream",
    "default_stream",
    "get_device_properties",
)


class CudaTouchedError(RuntimeError):
    """A torch.cuda call happened where none is allowed."""


# The touched-lists of the open forbid_cuda() blocks, and the torch.cuda entry points saved
# while any is open. Blocks may overlap without nesting (the pytest plugin opens one per test
# phase while a fixture's block spans them): the entry points are replaced when the first block
# opens and restored when the last one closes; a call is recorded in every open block.
_open = []
_saved = {}


def _tripwire(name):
    def tripped(*args, **kwargs):
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        for touched in _open:
            touched.append(f"torch.cuda.{name}() at\n{stack}")
        raise CudaTouchedError(f"torch.cuda.{name}() called inside forbid_cuda()")

    return tripped


@contextlib.contextmanager
def forbid_cuda():
    """Fail on any CUDA-initialising torch.cuda call in the block; yields the list of calls."""
    import torch

    touched = []
    was_initialized = torch.cuda.is_initialized()
    if not _open:
        _saved.update({name: getattr(torch.cuda, name) for name in GUARDED if hasattr(torch.cuda, name)})
        for name in _saved:
            setattr(torch.cuda, name, _tripwire(name))
    _open.append(touched)
    try:
        yield touched
    finally:
        _open[:] = [block for block in _open if block is not touched]
        if not _open:
            for name, value in _saved.items():
                setattr(torch.cuda, name, value)
            _saved.clear()
    if touched:
        raise CudaTouchedError(f"{len(touched)} CUDA call(s) inside forbid_cuda(); first: {touched[0]}")
    if torch.cuda.is_initialized() and not was_initialized:
        raise CudaTouchedError("CUDA was initialised inside forbid_cuda()")
