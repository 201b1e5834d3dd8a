"""rng_tracker_device: megatron-core's model-parallel RNG tracker works where CUDA is unavailable.

``tensor_parallel.random.CudaRNGStatesTracker`` keeps one CUDA generator state per name
("model-parallel-rng", "expert-parallel-rng", ...): ``add(name, seed)`` reads the CUDA
generator's state, reseeds it and reads it again; ``fork(name)`` swaps that state in around a
block. ``model_parallel_cuda_manual_seed`` (the usual set-up call, made by Megatron-Bridge's
providers and by megatron's training set-up) adds three states. On a host without CUDA the
first ``torch.cuda.get_rng_state()`` raises ("Torch not compiled with CUDA enabled" / "Found no
NVIDIA driver"), so a conversion that lets its tool set up model parallelism dies before the
model exists. Every release 0.13 … 0.19 and main.

Fix, only where ``torch.cuda.is_available()`` is false: ``add`` does the tracker's bookkeeping
(the same duplicate-seed and duplicate-name errors, which the original raises before it
touches CUDA) and keeps a CPU generator state seeded with the seed, for whoever reads
``get_states()``; ``fork`` switches nothing (there is no CUDA generator to switch) after the
same unknown-name check. Random numbers drawn on the CPU inside a fork come from the CPU's
default generator, as they do outside it: a CPU-initialised model (``use_cpu_initialization``)
draws all its weights there already, and a conversion overwrites them anyway. With CUDA
available both methods are the original, so GPU runs are unchanged bit for bit.

Both replacements wrap the original and delegate to it for every error, so drifted code gets
the same wrappers; the site checks make sure ``add`` still keeps ``seeds_`` and ``states_``
and ``fork`` still refuses a name it does not know.
"""

import contextlib

from ..engine import Fix, Target, occurs, takes

# How patch 0009 (and, we expect, upstream) branches: the methods handle the CPU themselves.
NO_CUDA = "if not torch.cuda.is_available():"


def _add(original, module):
    import torch

    def add(self, name, seed):
        if torch.cuda.is_available() or seed in self.seeds_ or name in self.states_:
            return original(self, name, seed)  # CUDA, or the original's own error
        if hasattr(self, "_is_initialized"):
            self._is_initialized = True
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    return add


def _fork(original, module):
    import torch

    def fork(self, *args, **kwargs):
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)
        name = (args[0] if args else kwargs.get("name", module._MODEL_PARALLEL_RNG_TRACKER_NAME))
        if name not in self.states_:
            return original(self, *args, **kwargs)  # raises "... is not added" on entry
        return contextlib.nullcontext()

    return fork


FIX = Fix(
    name="rng_tracker_device",
    summary="the model-parallel RNG tracker adds and forks states without CUDA where CUDA is "
    "unavailable (CPU set-up of model parallelism)",
    targets=(
        Target(
            module="megatron.core.tensor_parallel.random",
            qualname="CudaRNGStatesTracker.add",
            known_buggy={"15bd0eae79738d7a": "0.13.1-0.19.2, main d98e8a64"},
            bug=("torch.cuda.get_rng_state()",),
            fixed_by=(NO_CUDA,),
            replacement=_add,
            site=(
                takes("self", "name", "seed"),
                occurs("if seed in self.seeds_:"),
                occurs("if name in self.states_:"),
                occurs("torch.cuda.get_rng_state()", 2),
            ),
        ),
        Target(
            module="megatron.core.tensor_parallel.random",
            qualname="CudaRNGStatesTracker.fork",
            known_buggy={"cbdb0003aa2fefb9": "0.13.1-0.15.3", "50be5f1c0271c715": "0.16.1-0.19.2, main d98e8a64"},
            bug=("_set_cuda_rng_state(self.states_[name]",),
            fixed_by=(NO_CUDA,),
            replacement=_fork,
            site=(
                takes("self", "name"),
                occurs("if name not in self.states_:"),
                occurs("_set_cuda_rng_state(self.states_[name]"),
            ),
        ),
    ),
)
