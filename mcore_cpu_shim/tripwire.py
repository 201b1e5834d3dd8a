"""forbid_cuda(): make "this code touches no CUDA" an assertion instead of an assumption.

Inside the context every torch.cuda entry point that initialises CUDA or needs a device raises
CudaTouchedError, and each call is recorded, so a call that the code under test catches and
hides still fails the block on exit. Querying (is_available, device_count) stays allowed.

The other evidence: ``driver_libraries()``, the NVIDIA driver libraries mapped into this
process, which a process that asked the driver nothing has none of.
"""

import contextlib
import os
import traceback

# Libraries of the NVIDIA driver: mapped only when something asked the driver (a process
# that "touches no CUDA" on a driverless host maps none of these).
DRIVER_LIBRARIES = ("libcuda.so", "libcudadebugger.so", "libnvidia-")
# CUDA toolkit libraries: a CUDA build of torch maps these at import, with or without a driver.
CUDA_LIBRARIES = (
    "libcudart.so", "libnvrtc", "libnvJitLink", "libcublas", "libcudnn", "libnccl", "libcufft",
    "libcufile", "libcurand", "libcusolver", "libcusparse", "libcupti", "libnvshmem",
    "libnvToolsExt", "libnvjpeg",
)



# _lazy_init is what every CUDA-initialising path ends in (tensor creation on "cuda", .cuda(),
# streams on CUDA builds); the others fail differently on CPU-only builds, so guard them too.
GUARDED = (
    "_lazy_init",
    "init",
    "synchronize",
    "current_device",
    "set_device",
    "current_stream",
    "default_stream",
    "get_device_properties",
    # These reach _lazy_init through a name their own module imported (torch/cuda/random.py,
    # torch/cuda/memory.py), which replacing torch.cuda._lazy_init does not catch.
    "get_rng_state",
    "get_rng_state_all",
    "set_rng_state",
    "set_rng_state_all",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "empty_cache",
    "mem_get_info",
)

# Classes whose construction is guarded. They must stay the very same class objects: code
# imported inside a block uses them as types (``torch.cuda.Event | None`` in a class body,
# isinstance, subclassing), which a function in their place breaks. So each one keeps its
# identity and only its own ``__new__`` is replaced; that trips for subclasses too, and for
# ``from torch.cuda import Stream`` done before the block. ExternalStream too: its own __new__
# enters torch.cuda.device() before it reaches Stream's, which fails otherwise on CPU builds.
GUARDED_CLASSES = ("Stream", "ExternalStream", "Event")


class CudaTouchedError(RuntimeError):
    """A torch.cuda call happened where none is allowed."""


# The touched-lists of the open forbid_cuda() blocks, and the torch.cuda entry points saved
# while any is open. Blocks may overlap without nesting (the pytest plugin opens one per test
# phase while a fixture's block spans them): the entry points are replaced when the first block
# opens and restored when the last one closes; a call is recorded in every open block.
# _saved_new maps each guarded class to the ``__new__`` entry of its own __dict__ (_NONE: none).
_open = []
_saved = {}
_saved_new = {}
_NONE = object()


def _tripwire(name):
    def tripped(*args, **kwargs):
        stack = "".join(traceback.format_stack(limit=12)[:-1])
        for touched in _open:
            touched.append(f"torch.cuda.{name}() at\n{stack}")
        raise CudaTouchedError(f"torch.cuda.{name}() called inside forbid_cuda()")

    return tripped


def _arm(cuda):
    _saved.update({name: getattr(cuda, name) for name in GUARDED if hasattr(cuda, name)})
    for name in _saved:
        setattr(cuda, name, _tripwire(name))
    for name in GUARDED_CLASSES:
        cls = getattr(cuda, name, None)
        if isinstance(cls, type):
            # The raw __dict__ entry (a staticmethod), not getattr's unwrapped function; the
            # replacement is a staticmethod too, as Python makes of a __new__ in a class body.
            _saved_new[cls] = cls.__dict__.get("__new__", _NONE)
            cls.__new__ = staticmethod(_tripwire(name))


def _disarm(cuda):
    for name, value in _saved.items():
        setattr(cuda, name, value)
    for cls, original in _saved_new.items():
        if original is _NONE:
            del cls.__new__
        else:
            cls.__new__ = original
    _saved.clear()
    _saved_new.clear()


@contextlib.contextmanager
def forbid_cuda():
    """Fail on any CUDA-initialising torch.cuda call in the block; yields the list of calls."""
    import torch

    touched = []
    was_initialized = torch.cuda.is_initialized()
    if not _open:
        _arm(torch.cuda)
    _open.append(touched)
    try:
        yield touched
    finally:
        _open[:] = [block for block in _open if block is not touched]
        if not _open:
            _disarm(torch.cuda)
    if touched:
        raise CudaTouchedError(f"{len(touched)} CUDA call(s) inside forbid_cuda(); first: {touched[0]}")
    if torch.cuda.is_initialized() and not was_initialized:
        raise CudaTouchedError("CUDA was initialised inside forbid_cuda()")


def mapped_libraries():
    """Base names of the shared libraries mapped into this process (Linux /proc), or None."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.read().splitlines()
    except OSError:
        return None
    names = set()
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and ".so" in fields[5]:
            names.add(os.path.basename(fields[5].strip()))
    return sorted(names)


def driver_libraries():
    """The NVIDIA driver libraries mapped into this process ([] where /proc is absent)."""
    return [name for name in mapped_libraries() or [] if name.startswith(DRIVER_LIBRARIES)]
