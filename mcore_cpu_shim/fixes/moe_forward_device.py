"""moe_forward_device: the forward pass of an alltoall MoE layer with CUDA absent.

Once ``moe_dispatcher_device`` lets the layer be built, its forward still assumes CUDA at
four spots (megatron-core 0.13.1 ... 0.19.2 unless noted):

- ``Router.gating`` moves the router weight (and bias, 0.15 on) to
  ``torch.cuda.current_device()`` whenever it is on the CPU, also for CPU input. Before it,
  on 0.13 ... 0.16 without Transformer Engine, ``router_gating_linear`` fails with
  ``NameError: te_general_gemm`` (``moe_utils`` only binds the name when TE imports; 0.17 binds
  it to ``None`` and uses its PyTorch path).
- ``MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize`` waits on and records into the
  CUDA side stream the dispatcher made for device-to-host copies, and leaves the split sizes
  as CPU tensors if they already were (``maybe_move_tensor_to_cpu`` only converts CUDA tensors
  to NumPy), which ``torch.distributed.all_to_all_single`` rejects.
- ``tensor_parallel.mappings._gather_along_first_dim`` (the expert-parallel gather of token
  counts) and ``_AllToAll.forward`` (the token all-to-all, with more than one expert-parallel
  rank) allocate their outputs on ``torch.cuda.current_device()``.

Fix, each time following the tensors the code already has, so CUDA inputs take exactly the
original code:

- ``gating`` with CPU input computes the logits on the CPU with the weights where they are
  (the original ``router_gating_linear``, same ops); other input runs the original. Where
  ``moe_utils`` has no ``te_general_gemm`` (TE did not import) it is bound to ``None``, the
  value 0.17 on gives it: ``router_gating_linear`` then takes its PyTorch path, as designed.
- a dispatcher without a DtoH stream (built where CUDA is unavailable, see
  ``moe_dispatcher_device``) synchronises nothing and hands on what the CUDA path would: the
  token counts as CPU tensors, the split sizes as NumPy arrays. With a stream: the original.
- the two collectives allocate their outputs on the input's device when it is not a CUDA
  device; CUDA input runs the original.

On code that differs from every known release (drift), the live functions are rewritten at the
bug expressions, so what upstream changed around them stays:

- ``gating``, ``_gather_along_first_dim``, ``_AllToAll.forward``: ``torch.cuda.current_device()``
  becomes ``device_for(<input>)``: the current CUDA device for CUDA input (as before), the
  input's own device otherwise (the weight moves are then no-ops on the CPU). Checked: every
  use is a weight move (``.data.to(device=...)``) or an output allocation (``device=...)``),
  and the input parameter has the name the rewrite uses. ``gating`` also binds
  ``te_general_gemm`` as above.
- ``_maybe_dtoh_and_synchronize``: the side-stream calls go through helpers that do nothing for
  a dispatcher without a stream (``current_stream``, ``stream``, ``record_event``,
  ``synchronize``) and call CUDA exactly as before with one; ``maybe_move_tensor_to_cpu``
  also turns CPU split sizes into NumPy arrays. Checked: the stream is used at exactly the four
  places the releases use it, and ``torch.cuda`` for nothing else.
"""

import contextlib
import functools
import importlib
import inspect

from ..engine import Check, Fix, Target, cuda_attributes, occurs, rewrite, rewriting, takes

_ROUTER = "megatron.core.transformer.moe.router"
_DISPATCHER = "megatron.core.transformer.moe.token_dispatcher"
_MAPPINGS = "megatron.core.tensor_parallel.mappings"


def device_for(tensor):
    """Where drifted code allocates for ``tensor``: the current CUDA device for a CUDA tensor
    (as upstream), the tensor's own device otherwise."""
    import torch

    return torch.cuda.current_device() if tensor.is_cuda else tensor.device


def current_stream(side_stream):
    """What drifted code compares its side stream with: nothing to compare without one."""
    import torch

    return None if side_stream is None else torch.cuda.current_stream()


def stream(side_stream):
    import torch

    return contextlib.nullcontext() if side_stream is None else torch.cuda.stream(side_stream)


def record_event(side_stream):
    return None if side_stream is None else side_stream.record_event()


def synchronize(event):
    if event is not None:
        event.synchronize()


def host_mover(move):
    """``maybe_move_tensor_to_cpu`` for drifted code: a CPU tensor is already there, and
    becomes a NumPy array where one is asked for (the CUDA path's result)."""
    import torch

    def moved(tensor, as_numpy=False, **kwargs):
        if torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy() if as_numpy else tensor
        return move(tensor, as_numpy=as_numpy, **kwargs)

    return moved


def _bind_te_general_gemm():
    moe_utils = importlib.import_module("megatron.core.transformer.moe.moe_utils")
    if "te_general_gemm" not in vars(moe_utils):
        # TE did not import (0.13 ... 0.16): the name the PyTorch path checks for.
        moe_utils.te_general_gemm = None
    return moe_utils


def _gating(original, module):
    import torch

    moe_utils = _bind_te_general_gemm()
    takes_bias = "bias" in inspect.signature(moe_utils.router_gating_linear).parameters

    def gating(self, input):
        if input.device.type != "cpu":
            return original(self, input)
        router_dtype = input.dtype
        if self.config.moe_router_dtype == "fp32":
            router_dtype = torch.float32
        elif self.config.moe_router_dtype == "fp64":
            router_dtype = torch.float64
        if takes_bias:
            return module.router_gating_linear(input, self.weight, self.bias, router_dtype)
        return module.router_gating_linear(input, self.weight, router_dtype)

    return gating


def _dtoh_and_synchronize(original, module):
    import torch

    def as_numpy(value):
        return value.numpy() if torch.is_tensor(value) else value

    def _maybe_dtoh_and_synchronize(self, point, tokens_per_expert=None):
        if self.cuda_dtoh_stream is not None:
            return original(self, point, tokens_per_expert)
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            to_cpu = module.maybe_move_tensor_to_cpu
            tokens_per_expert = to_cpu(tokens_per_expert)
            self.input_splits = as_numpy(to_cpu(self.input_splits))
            self.output_splits = as_numpy(to_cpu(self.output_splits))
            self.output_splits_tp = as_numpy(to_cpu(self.output_splits_tp))
            self.num_out_tokens = to_cpu(self.num_out_tokens)
            if self.num_local_experts > 1 and not self.config.moe_permute_fusion:
                self.num_global_tokens_per_local_expert = to_cpu(
                    self.num_global_tokens_per_local_expert
                )
        return tokens_per_expert

    return _maybe_dtoh_and_synchronize


def _gather_along_first_dim(original, module):
    import torch

    def _gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False):
        if input_.is_cuda:
            return original(input_, group, output_split_sizes, use_global_buffer)
        assert group is not None, "group should not be None"
        world_size = group.size()
        if world_size == 1:
            return input_
        dim_size = list(input_.size())
        if output_split_sizes is None:
            dim_size[0] = dim_size[0] * world_size
        else:
            dim_size[0] = sum(output_split_sizes)
        if use_global_buffer:
            output = module.get_global_memory_buffer().get_tensor(dim_size, input_.dtype, "mpu")
        else:
            output = torch.empty(dim_size, dtype=input_.dtype, device=input_.device)
        if output_split_sizes is None:
            module.dist_all_gather_func(output, input_.contiguous(), group=group)
        else:
            outputs = list(torch.split(output, output_split_sizes, dim=0))
            torch.distributed.all_gather(outputs, input_, group=group)
        return output

    return _gather_along_first_dim


def _all_to_all_forward(original, module):
    import torch

    # 0.18 on: a use_nccl_stream flag (wait on an async handle), kept on ctx for backward.
    takes_stream_flag = "use_nccl_stream" in inspect.signature(original).parameters

    def forward(ctx, group, input, output_split_sizes, input_split_sizes, *flag):
        if input.is_cuda:
            return original(ctx, group, input, output_split_sizes, input_split_sizes, *flag)
        ctx.group = group
        ctx.output_split_sizes = output_split_sizes
        ctx.input_split_sizes = input_split_sizes
        if takes_stream_flag:
            ctx.use_nccl_stream = flag[0] if flag else False
        if group.size() == 1:
            return input
        input = input.contiguous()
        if output_split_sizes is None:
            output = torch.empty_like(input)
        else:
            size = [sum(output_split_sizes)] + list(input.size()[1:])
            output = input.new_empty(size=size, dtype=input.dtype, device=input.device)
        torch.distributed.all_to_all_single(
            output,
            input,
            output_split_sizes=output_split_sizes,
            input_split_sizes=input_split_sizes,
            group=group,
        )
        return output

    if not takes_stream_flag:

        @functools.wraps(forward)
        def forward_without_flag(ctx, group, input, output_split_sizes, input_split_sizes):
            return forward(ctx, group, input, output_split_sizes, input_split_sizes)

        return forward_without_flag
    return forward


def _only_allocations(*forms):
    """Every ``torch.cuda.current_device()`` is the device of one of ``forms``."""
    call = "torch.cuda.current_device()"
    return Check(
        f"{call} only in {' or '.join(forms)}",
        lambda code: code.text.count(call) == sum(code.text.count(f) for f in forms) > 0,
    )


def _device_of(parameter):
    return {"torch.cuda.current_device()": f"_mcore_cpu_shim.device_for({parameter})"}


def _drifted_gating(original, module):
    _bind_te_general_gemm()
    return rewrite(original, _device_of("input"), __name__)


_DTOH = "self.cuda_dtoh_stream"

FIX = Fix(
    name="moe_forward_device",
    summary="alltoall MoE forward with CPU tensors: router gating, DtoH step and the "
    "expert-parallel collectives stay on the CPU",
    targets=(
        Target(
            module=_ROUTER,
            qualname="Router.gating",
            known_buggy={"6753f7dd3e63782d": "0.13.1-0.14.0", "dd802c6a78cda6e8": "0.15.3-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            replacement=_gating,
            site=(
                takes("input"),
                _only_allocations(".data.to(device=torch.cuda.current_device())\n"),
                cuda_attributes("current_device"),
            ),
            drift=_drifted_gating,
        ),
        Target(
            module=_DISPATCHER,
            qualname="MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize",
            known_buggy={"df437323f7120bfb": "0.13.1-0.15.3", "b686a6ec3b7a9b53": "0.16.1-0.19.2"},
            # The DtoH branch as released; patches/0007 puts a stream-less branch before it.
            bug=("\nif point == self.cuda_dtoh_point:\non_side_stream = torch.cuda.current_stream()",),
            replacement=_dtoh_and_synchronize,
            site=(
                occurs(f"on_side_stream = torch.cuda.current_stream() != {_DTOH}\n"),
                occurs(f"if on_side_stream:\n{_DTOH}.wait_stream(torch.cuda.current_stream())\n"),
                occurs(f"with torch.cuda.stream({_DTOH}):\n"),
                occurs(f"self.d2h_event = {_DTOH}.record_event()\n"),
                occurs("self.d2h_event.synchronize()"),
                occurs(_DTOH, 4),
                cuda_attributes("current_stream", "stream"),
            ),
            drift=rewriting(
                __name__,
                {
                    "torch.cuda.current_stream()": f"_mcore_cpu_shim.current_stream({_DTOH})",
                    f"torch.cuda.stream({_DTOH})": f"_mcore_cpu_shim.stream({_DTOH})",
                    f"{_DTOH}.record_event()": f"_mcore_cpu_shim.record_event({_DTOH})",
                    "self.d2h_event.synchronize()": "_mcore_cpu_shim.synchronize(self.d2h_event)",
                    "maybe_move_tensor_to_cpu": "_mcore_cpu_shim.host_mover(maybe_move_tensor_to_cpu)",
                },
            ),
        ),
        Target(
            module=_MAPPINGS,
            qualname="_gather_along_first_dim",
            known_buggy={"f6106c8e7bf71177": "0.13.1-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            replacement=_gather_along_first_dim,
            site=(
                takes("input_"),
                _only_allocations("device=torch.cuda.current_device())"),
                cuda_attributes("current_device"),
            ),
            drift=rewriting(__name__, _device_of("input_")),
        ),
        Target(
            module=_MAPPINGS,
            qualname="_AllToAll.forward",
            known_buggy={"34451a47e5f6f7a3": "0.13.1-0.17.1", "8e72e875765b2080": "0.18.2-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            replacement=_all_to_all_forward,
            site=(
                takes("input"),
                _only_allocations("device=torch.cuda.current_device())"),
                cuda_attributes("current_device"),
            ),
            drift=rewriting(__name__, _device_of("input")),
        ),
    ),
)
