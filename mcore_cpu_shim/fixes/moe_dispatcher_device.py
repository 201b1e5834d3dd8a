"""moe_dispatcher_device: build the alltoall MoE token dispatcher on a host without CUDA.

``MoEAlltoAllTokenDispatcher.__init__`` assumes CUDA twice, in every release from 0.13 to 0.19:

- it creates a side stream for its device-to-host copies with ``torch.cuda.Stream()``: an
  instance attribute in 0.13; from 0.14 on the class attribute ``cuda_dtoh_stream``, which the
  first construction in a process creates and every later one reuses;
- with ``moe_permute_fusion`` it puts its two permutation index tensors on
  ``torch.device("cuda")``.

Both fail on a host without CUDA, so no model with an alltoall MoE layer can be built there,
``use_cpu_initialization=True`` or not.

Fix: where ``torch.cuda.is_available()`` is false, the constructor creates no stream (the
instance attribute of 0.13 is ``None``; the class attribute stays as it is: ``None``, or a
stream an earlier construction in this process left there) and puts the index tensors on the
CPU even if ``moe_permute_fusion`` is set. Where CUDA is available the original constructor
runs untouched, also with ``use_cpu_initialization=True``: such a model is usually moved to the
GPU afterwards, and ``.cuda()`` neither creates the stream nor moves the index tensors (they are
plain attributes), so they must be made as before. The key is the host, not that flag.

How, and why not a rewrite of the constructor: the six different constructor bodies of the
seven releases (parameter ``model_comm_pgs`` or ``pg_collection``, instance or class stream, a
CUDA-graph DtoH point from 0.16 under two enum spellings, a longer ``cudagraph_attrs`` list in
0.19) would each need a transcription, kept in step by hand. Instead, without CUDA the
replacement runs megatron-core's own compiled constructor (the same code object, with the
closure cell that zero-argument ``super()`` needs) as a new function object whose globals are a
copy of the module's globals in which only the name ``torch`` is bound to a stand-in. The
stand-in is torch except for two attributes: ``device(...)`` naming a CUDA device gives the CPU
device, and ``cuda.Stream(...)`` gives ``None``.

Why that is exact: a known fingerprint pins the constructor body, and in every known body
``torch`` is used for exactly three things: ``torch.device('cuda')`` in the fusion branch (now
the CPU device, so the index tensors are built there, as without fusion), ``torch.arange``
(forwarded to torch) and ``torch.cuda.Stream()`` (now ``None``). From 0.14 the stream is only
made while the class attribute is ``None``, so the code stores back the ``None`` it found, and
a stream already on the class is never reached. Every other line (checks, splits,
drop-and-pad, sync points, CUDA-graph settings) runs as upstream wrote it, the functions it
calls (``super().__init__`` first) run with their own, real globals, and errors point into
megatron-core's own source lines.

Why that is thread-safe: each construction without CUDA builds its own globals dict and its own
function object; neither the module, nor the class (beyond that write-back of ``None``), nor
torch is changed, so concurrent code sees real torch everywhere. The globals are copied per call
so that a later change to the module's globals is seen, as by the original (a dict of about a
hundred names, once per MoE layer). Swapping ``torch.cuda.Stream`` or the class attribute for
the duration of the call would change shared state instead, and would not cover the indices.

On code that differs from every known release (drift: upstream main added a batch-invariant
attribute and a ``cudagraph_attrs`` entry in July 2026) the same replacement runs, since it
runs upstream's own constructor and changes only what ``torch`` means inside it. The site
checks make sure that is still safe: the body names ``torch`` only for ``device``, ``arange``
and ``cuda``, ``torch.cuda`` only for ``Stream``, and creates the stream in one place.

Not covered (other constructors on the MoE path, left as they are): ``TopKRouter`` puts its
expert-bias, global-aux-loss and (0.19) quantile-balancing buffers on the current CUDA device
from 0.15 on; ``SharedExpertMLP`` creates a CUDA stream with ``moe_shared_expert_overlap``;
the flex dispatcher needs DeepEP, HybridEP or NCCL EP, which need a GPU anyway. With their
defaults none of them is reached.
"""

import types

from ..engine import Fix, Target, cuda_attributes, occurs, uses_only


class _HostCuda:
    """``torch.cuda`` as the constructor sees it on a host without CUDA: no streams."""

    def __init__(self, cuda):
        self._cuda = cuda

    def __getattr__(self, name):
        return getattr(self._cuda, name)

    @staticmethod
    def Stream(*args, **kwargs):  # noqa: N802 (the name the constructor calls)
        return None


class _HostTorch:
    """``torch`` as the constructor sees it on a host without CUDA: CUDA devices are the CPU."""

    def __init__(self, torch):
        self._torch = torch
        self.cuda = _HostCuda(torch.cuda)

    def __getattr__(self, name):
        return getattr(self._torch, name)

    def device(self, *args, **kwargs):
        device = self._torch.device(*args, **kwargs)
        return self._torch.device("cpu") if device.type == "cuda" else device


def _alltoall_dispatcher_init(original, module):
    import torch

    host_torch = _HostTorch(torch)

    def __init__(self, *args, **kwargs):
        if torch.cuda.is_available():
            return original(self, *args, **kwargs)
        namespace = dict(original.__globals__)
        namespace["torch"] = host_torch
        on_host = types.FunctionType(
            original.__code__,
            namespace,
            original.__name__,
            original.__defaults__,
            original.__closure__,
        )
        on_host.__kwdefaults__ = original.__kwdefaults__
        return on_host(self, *args, **kwargs)

    return __init__


FIX = Fix(
    name="moe_dispatcher_device",
    summary="alltoall MoE dispatcher without CUDA: no DtoH stream, permutation indices on CPU",
    targets=(
        Target(
            module="megatron.core.transformer.moe.token_dispatcher",
            qualname="MoEAlltoAllTokenDispatcher.__init__",
            known_buggy={
                "530b86dd72aeb0ea": "0.13.1",
                "09ce19a94fcc8628": "0.14.0",
                "9098da06723a3aab": "0.15.3",
                "6c17098ff1a657a0": "0.16.1-0.17.1",
                "9686d490ba2323f1": "0.18.2",
                "2cd1e84896d25bd3": "0.19.2",
            },
            # Whole lines, a stream line with the line before it (the normalised source has no
            # indentation): the same call under a new guard, or with a condition, reads as fixed.
            bug=(
                # 0.13: the stream on the instance, unconditionally
                "self.cuda_dtoh_point = 'before_permutation_1'\n"
                "self.cuda_dtoh_stream = torch.cuda.Stream()\n",
                # 0.14 on: the stream on the class, made by the first construction
                "if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:\n"
                "MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = torch.cuda.Stream()\n",
                # every release: the index tensors on CUDA with permute fusion
                "self.permute_idx_device = torch.device('cuda') if self.config.moe_permute_fusion "
                "else 'cpu'\n",
            ),
            replacement=_alltoall_dispatcher_init,
            site=(
                uses_only("torch", "arange", "cuda", "device"),
                cuda_attributes("Stream"),
                occurs("torch.cuda.Stream()"),
            ),
        ),
    ),
)
