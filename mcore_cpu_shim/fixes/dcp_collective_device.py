"""dcp_collective_device: saving a checkpoint must not need CUDA when nothing lives on CUDA.

Every ``dist_checkpointing.save`` (sync saves too) runs two functions that assume CUDA:

- ``FileSystemWriterAsync.preload_tensors`` moves the tensors to host memory and then calls
  ``torch.cuda.synchronize()`` whenever ``non_blocking`` is set, even when every tensor was
  already on the CPU. On a host without a driver that call fails.
  Fix: synchronise only if at least one tensor was on CUDA. CPU tensors pass through as the
  same objects (``Tensor.to("cpu")`` of a CPU tensor copies nothing).
- ``save_state_dict_async_finalize`` broadcasts its "a rank failed" flag in a tensor on
  ``torch.cuda.current_device()``. A Gloo group needs that tensor on the CPU.
  Fix: put the flag on the group's collective device: the CPU for a Gloo group, the current
  CUDA device otherwise (NCCL), exactly as before. megatron-core 0.13 has no broadcast there.

megatron-core 0.13 and 0.14 run sync saves through the async machinery in ``async_utils``
(0.15 and later only for async saves), which has the same two assumptions:

- ``TemporalAsyncCaller.schedule_async_call`` calls ``torch.cuda.synchronize()`` to wait for
  device-to-host copies. Fix: wait only if CUDA was initialised; if it never was, no CUDA
  work can be pending.
- ``AsyncCaller.sync_all_async_calls`` and ``AsyncCallsQueue.maybe_finalize_async_calls``
  all-reduce small tensors on ``torch.cuda.current_device()`` in the default group.
  Fix: use the default group's collective device, as above.

On code that differs from every known release but still has the bug (drift), the live function
is rewritten at the bug expression only, keeping everything upstream changed elsewhere:
``torch.cuda.synchronize()`` becomes ``synchronize_if_initialized()`` (in ``preload_tensors``
too: a tensor on CUDA means CUDA is initialised, so no needed wait is skipped; on a host where
CUDA was never initialised nothing waits) and ``device=torch.cuda.current_device()`` becomes the
group's collective device. The site checks make sure the expression occurs as often as in the
releases, ``torch.cuda`` is used for nothing else, and the finalize broadcasts in
``dist_wrapper.group`` (whose device it takes) while the async calls reduce in the default group.
"""

from time import time

from ..engine import Fix, Target, cuda_attributes, normalised_source, occurs, rewriting, takes


def collective_device(group):
    """The device a tensor must be on for a collective in ``group`` (None: the default group)."""
    import torch

    if torch.distributed.get_backend(group) == torch.distributed.Backend.GLOO:
        return torch.device("cpu")
    return torch.device("cuda", torch.cuda.current_device())


def synchronize_if_initialized():
    """Wait for the device only where CUDA was initialised: if it never was, nothing is pending."""
    import torch

    if torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _preload_tensors(original, module):
    import torch

    def preload_tensors(write_buckets, non_blocking=True):
        result = []
        any_on_cuda = False
        for file_name, storage_key, (bytes_data, tensor_data) in write_buckets:
            on_host = []
            for item, tensor in tensor_data:
                any_on_cuda = any_on_cuda or tensor.device.type == "cuda"
                on_host.append((item, tensor.to("cpu", non_blocking=non_blocking)))
                # Hold no reference to the source tensor once it is copied (async saves rely on it).
                del tensor
            result.append((file_name, storage_key, (bytes_data, on_host)))
        if non_blocking and any_on_cuda:
            torch.cuda.synchronize()
        return result

    return preload_tensors


def _save_state_dict_async_finalize(original, module):
    import torch

    def save_state_dict_async_finalize(storage_writer, global_metadata, dist_wrapper):
        write_results = storage_writer.retrieve_write_results()

        gather_start = time()
        all_results = dist_wrapper.gather_object(write_results)
        gather_end = time()
        module.logger.debug(
            f"{gather_end}, {torch.distributed.get_rank()}, gather: {gather_end - gather_start}"
        )

        node_failures = {}
        if dist_wrapper.is_coordinator:
            node_failures = module._get_failure_dict(all_results)
            if len(node_failures) == 0:
                assert global_metadata is not None
                write_start = time()
                storage_writer.finish(global_metadata, all_results)
                write_end = time()
                module.logger.debug(f"{write_end}, metadata_write: {write_end - write_start}")

        # Every rank learns whether any rank failed; details are raised on the coordinator.
        failures_occurred = torch.tensor(
            [int(len(node_failures) > 0)],
            dtype=torch.int,
            device=collective_device(dist_wrapper.group),
        )
        torch.distributed.broadcast(
            failures_occurred, src=dist_wrapper.coordinator_rank, group=dist_wrapper.group
        )
        if failures_occurred:
            raise module.CheckpointException("write", node_failures)

    return save_state_dict_async_finalize


def _schedule_async_call(original, module):
    import torch

    # 0.15 and later also keep the preloaded tensors on the caller (released when it finishes).
    holds_preloaded = "self.preloaded_holder = async_fn_args[1]" in normalised_source(original)

    @module._disable_gc()
    def schedule_async_call(self, async_req):
        if async_req.async_fn is None:
            return
        async_fn_args = list(async_req.async_fn_args)
        if async_req.preload_fn:
            async_fn_args[1] = async_req.preload_fn()
            if holds_preloaded:
                self.preloaded_holder = async_fn_args[1]

        rank = torch.distributed.get_rank()
        start_sync = time()
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        end_sync = time()
        module.logger.debug(f"rank: {rank}, takes {end_sync - start_sync} to finish D2H ")

        ctx = module.mp.get_context("fork")
        self.start_time = time()
        self.process = ctx.Process(
            target=async_req.async_fn, args=async_fn_args, kwargs=async_req.async_fn_kwargs
        )
        self.process.start()
        init_time = time()
        module.logger.debug(
            f"rank: {rank}, takes {init_time - self.start_time} to schedule async ckpt "
        )

    return schedule_async_call


def _sync_all_async_calls(original, module):
    import torch

    def sync_all_async_calls(self, is_alive):
        ten = torch.tensor([is_alive], dtype=torch.int, device=collective_device(None))
        torch.distributed.all_reduce(ten)
        return ten[0] == 0

    return sync_all_async_calls


def _maybe_finalize_async_calls(original, module):
    import torch

    def maybe_finalize_async_calls(self, blocking=False, no_dist=False):
        call_idx_finalized = []
        while self.async_calls:
            next_async_done = self.async_calls[0].async_caller.is_current_async_call_done(
                blocking, no_dist
            )
            if not next_async_done:
                break
            with module.debug_time("finalize", module.logger):
                call_idx, _, async_request = self.async_calls.popleft()
                for finalize_fn in async_request.finalize_fns:
                    finalize_fn()
                ten = torch.tensor([call_idx], dtype=torch.int, device=collective_device(None))
                torch.distributed.all_reduce(ten, op=torch.distributed.ReduceOp.MAX)
                assert ten.item() == call_idx, (
                    "Unmatched async calls. "
                    "That probably means not all ranks are participating in async finalization"
                )
                call_idx_finalized.append(call_idx)
        return call_idx_finalized

    return maybe_finalize_async_calls


_STRATEGIES = "megatron.core.dist_checkpointing.strategies"
_SYNCHRONIZE = {"torch.cuda.synchronize()": "_mcore_cpu_shim.synchronize_if_initialized()"}
_SYNCHRONIZE_SITE = (occurs("torch.cuda.synchronize()"), cuda_attributes("synchronize"))
_DEFAULT_GROUP_DEVICE = {"torch.cuda.current_device()": "_mcore_cpu_shim.collective_device(None)"}
_DEFAULT_GROUP_SITE = (
    occurs("device=torch.cuda.current_device())"),
    occurs("torch.cuda.current_device()"),
    occurs("torch.distributed.all_reduce(ten"),
    occurs("group=", 0),
    cuda_attributes("current_device"),
)

FIX = Fix(
    name="dcp_collective_device",
    summary="dist_checkpointing.save without CUDA: no needless synchronize, Gloo-side failure flag",
    targets=(
        Target(
            module=f"{_STRATEGIES}.filesystem_async",
            qualname="FileSystemWriterAsync.preload_tensors",
            known_buggy={"6090d2f20074d3ec": "0.13.1-0.16.1", "af987556126ce1a8": "0.17.1-0.19.2"},
            bug=("if non_blocking:\ntorch.cuda.synchronize()",),
            replacement=_preload_tensors,
            site=(occurs("if non_blocking:\ntorch.cuda.synchronize()"), *_SYNCHRONIZE_SITE),
            drift=rewriting(__name__, _SYNCHRONIZE),
        ),
        Target(
            module=f"{_STRATEGIES}.state_dict_saver",
            qualname="save_state_dict_async_finalize",
            known_buggy={"bbbf0abce1877dda": "0.14.0-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            feature="torch.distributed.broadcast(",
            replacement=_save_state_dict_async_finalize,
            site=(
                takes("dist_wrapper"),
                occurs("device=torch.cuda.current_device())"),
                occurs("torch.cuda.current_device()"),
                occurs("torch.distributed.broadcast("),
                occurs("group=dist_wrapper.group)"),
                cuda_attributes("current_device"),
            ),
            drift=rewriting(
                __name__,
                {"torch.cuda.current_device()": "_mcore_cpu_shim.collective_device(dist_wrapper.group)"},
            ),
        ),
        Target(
            module=f"{_STRATEGIES}.async_utils",
            qualname="TemporalAsyncCaller.schedule_async_call",
            known_buggy={"84d51cd83e75539a": "0.13.1-0.16.1", "54305b0f99de743a": "0.17.1-0.19.2"},
            bug=("start_sync = time()\ntorch.cuda.synchronize()",),
            replacement=_schedule_async_call,
            site=_SYNCHRONIZE_SITE,
            drift=rewriting(__name__, _SYNCHRONIZE),
        ),
        Target(
            module=f"{_STRATEGIES}.async_utils",
            qualname="AsyncCaller.sync_all_async_calls",
            known_buggy={"845a64689f812d90": "0.13.1-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            replacement=_sync_all_async_calls,
            site=_DEFAULT_GROUP_SITE,
            drift=rewriting(__name__, _DEFAULT_GROUP_DEVICE),
        ),
        Target(
            module=f"{_STRATEGIES}.async_utils",
            qualname="AsyncCallsQueue.maybe_finalize_async_calls",
            known_buggy={"a8e9e75a275c5434": "0.13.1-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            replacement=_maybe_finalize_async_calls,
            site=_DEFAULT_GROUP_SITE,
            drift=rewriting(__name__, _DEFAULT_GROUP_DEVICE),
        ),
    ),
)
