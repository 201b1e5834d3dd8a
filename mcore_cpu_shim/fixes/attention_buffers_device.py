"""attention_buffers_device: the attention scores buffer and the causal masks without CUDA.

The local ``DotProductAttention.forward`` computes its raw scores into a scratch tensor from
megatron's global memory buffer, and ``FusedScaleMaskSoftmax``'s PyTorch path builds the causal
(or sliding-window) mask when none is given. All three allocate on CUDA whatever the inputs
are:

- ``utils.GlobalMemoryBuffer.get_tensor``: ``torch.empty(..., device=torch.cuda.current_device())``
  (0.13.1 ... 0.19.2, one code);
- ``transformer.utils.get_default_causal_mask``: ``torch.ones(sq, sq, device="cuda")``
  (0.13 ... 0.15 memoised with ``lru_cache``, 0.16 on not);
- ``transformer.utils.get_sliding_window_causal_mask``: the same for windowed attention
  (0.15 on; 0.13/0.14 have no such function: not-applicable there).

So the forward pass of a local-spec GPT model cannot run on a host without CUDA, even with
every weight and input on the CPU.

Fix: where CUDA is not available (``torch.cuda.is_available()`` is false; it initialises
nothing), the buffer and the masks are made on the CPU with the same shape, dtype and values;
where it is available, the original functions run unchanged (same device as before). None of
the three receives a tensor whose device it could follow, and the buffer is shared by every
caller (also ``tensor_parallel.mappings`` and the sequence-parallel linear layers), so the
decision is the host's, as in ``moe_dispatcher_device``. A CPU-placed model on a host *with*
CUDA still gets CUDA buffers and masks, as before.

On code that differs from every known release (drift), the live function is rewritten at the
device expression only (``torch.cuda.current_device()`` -> ``buffer_device()``, ``'cuda'`` ->
``mask_device()``: the same device where CUDA is available, the CPU where not), so what
upstream changed around it stays; an ``lru_cache`` decorator is kept. The site checks make sure
the device expression occurs once and ``torch.cuda`` is used for nothing else.
"""

import contextlib
import functools
import operator

from ..engine import Fix, Target, cuda_attributes, occurs, rewriting
from .common import buffer_device, cuda_or, cuda_usable  # noqa: F401  (buffer_device: reached by the rewrite)

_UTILS = "megatron.core.utils"
_TRANSFORMER_UTILS = "megatron.core.transformer.utils"


def mask_device():
    """The masks' device in drifted code: ``'cuda'``, or the CPU without CUDA."""
    return "cuda" if cuda_usable() else "cpu"


def _get_tensor(original, module):
    import torch

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        if cuda_usable():
            return original(self, tensor_shape, dtype, name, mem_alloc_context)
        required_len = functools.reduce(operator.mul, tensor_shape, 1)
        current = self.buffer.get((name, dtype), None)
        if current is None or current.numel() < required_len:
            with (mem_alloc_context or contextlib.nullcontext)():
                current = torch.empty(required_len, dtype=dtype, device="cpu", requires_grad=False)
            self.buffer[(name, dtype)] = current
        return current[0:required_len].view(*tensor_shape)

    return get_tensor


def _memoised_like(original, function):
    """``function`` with the original's lru_cache, if the original had one (0.13 ... 0.15)."""
    parameters = getattr(original, "cache_parameters", None)
    return functools.lru_cache(**parameters())(function) if parameters else function


def _default_causal_mask(original, module):
    import torch

    def on_cpu(sq):
        return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()

    return cuda_or(original, _memoised_like(original, on_cpu))


def _sliding_window_causal_mask(original, module):
    import torch

    def on_cpu(sq, skv, window_size):
        m = torch.ones(sq, skv, dtype=torch.bool, device="cpu")
        mu = torch.triu(m, diagonal=skv - sq - window_size[0])
        ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
        return ~ml

    return cuda_or(original, _memoised_like(original, on_cpu))


_MASK_SITE = (occurs("device='cuda'"), occurs("'cuda'"), cuda_attributes())
_MASK_REWRITE = rewriting(__name__, {"'cuda'": "_mcore_cpu_shim.mask_device()"})

FIX = Fix(
    name="attention_buffers_device",
    summary="attention scores buffer and causal/sliding-window masks on the CPU where CUDA is "
    "unavailable",
    targets=(
        Target(
            module=_UTILS,
            qualname="GlobalMemoryBuffer.get_tensor",
            known_buggy={"ce14aba4aeea50c2": "0.13.1-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            replacement=_get_tensor,
            site=(
                occurs("device=torch.cuda.current_device()"),
                occurs("torch.cuda.current_device()"),
                cuda_attributes("current_device"),
            ),
            drift=rewriting(__name__, {"torch.cuda.current_device()": "_mcore_cpu_shim.buffer_device()"}),
        ),
        Target(
            module=_TRANSFORMER_UTILS,
            qualname="get_default_causal_mask",
            known_buggy={"436f7192465b8639": "0.13.1-0.15.3", "1258ab6a0d4c38cf": "0.16.1-0.19.2"},
            bug=("device='cuda'",),
            replacement=_default_causal_mask,
            site=_MASK_SITE,
            drift=_MASK_REWRITE,
        ),
        Target(
            module=_TRANSFORMER_UTILS,
            qualname="get_sliding_window_causal_mask",
            known_buggy={"ea680aa02a025189": "0.15.3", "1a632973c6e623eb": "0.16.1-0.19.2"},
            bug=("device='cuda'",),
            absent_in="0.13.1-0.14.0",
            replacement=_sliding_window_causal_mask,
            site=_MASK_SITE,
            drift=_MASK_REWRITE,
        ),
    ),
)
