"""dcp_results_queue: a synchronous save hands its write results over without another process.

``FileSystemWriterAsync.prepare_write_data`` takes the queue the write function reports into
from ``get_write_results_queue`` (``_get_write_results_queue`` in 0.13 … 0.16): one
``multiprocessing`` Manager queue per process, its server started with ``spawn``, so that an
async save's writer process can reach it. A synchronous save (``dist_checkpointing.save``
without ``async_sharded_save``, which is what Megatron-Bridge and every converter run) uses the
same queue although its writes run in the calling process (``AsyncRequest.execute_sync``, 0.15
and later): it starts that server, and every save then pickles its write results to it, where
the server, a fresh interpreter, has to import torch to unpickle them. About 3 s per rank at
the first save of a process and more than 2 s at every later one, on a save of a few hundred
kilobytes; with several ranks on a small host, that many torch imports at once. Nothing of it
needs CUDA, but nothing of it is needed at all.

Fix: the synchronous ``save`` of the torch_dist strategy (``AsyncSaveShardedStrategy.save``
in 0.15 … 0.18, ``TorchDistSaveShardedStrategy.save`` from 0.17 on) marks the current thread
while it runs, and while it is marked the queue getter answers a fresh in-process
``queue.Queue``: the same ``put``/``get_nowait`` the writer and ``retrieve_write_results`` use,
with no process behind it. Async saves are not marked and get upstream's Manager queue as
before (the getter's cached queue is never replaced). The written files are the same bytes:
the queue carries only the write results (which file holds which item), never tensor data, and
the coordinator writes the metadata from the same results either way.

megatron-core 0.13 and 0.14 run a synchronous save in a forked process too (``async_utils``'
``TemporalAsyncCaller``), which needs the shared queue: their ``save`` has no
``execute_sync()``, the mark is not-applicable there and their saves keep upstream's queue.

Both replacements only wrap the original, so drifted code gets the same wrappers; the site
checks make sure the save still runs its request in this process and the getter still makes
upstream's Manager queue (what the fix stands in for).
"""

import threading

from ..engine import Fix, Target, occurs

_SYNC_SAVE = threading.local()
IN_PROCESS = "async_request.execute_sync()"
MANAGER_QUEUE = ".Manager().Queue()"
# How patch 0013 (and, we expect, upstream) does it: the save marks itself, the getter answers.
SAVE_FIXED = "write_results_in_process()"
QUEUE_FIXED = "queue.Queue()"


def in_sync_save() -> bool:
    """Whether this thread is inside a synchronous save (its writes run in this process)."""
    return getattr(_SYNC_SAVE, "active", False)


def _save(original, module):
    def save(self, *args, **kwargs):
        outer = in_sync_save()
        _SYNC_SAVE.active = True
        try:
            return original(self, *args, **kwargs)
        finally:
            _SYNC_SAVE.active = outer

    return save


def _results_queue(original, module):
    import queue

    def get_write_results_queue(*args, **kwargs):
        if in_sync_save():
            return queue.Queue()
        return original(*args, **kwargs)

    return get_write_results_queue


_STRATEGIES = "megatron.core.dist_checkpointing.strategies"
# What the two save targets share, and what the two getter targets share: they differ only in
# where the function lives in which releases.
_SAVE = dict(bug=(IN_PROCESS,), fixed_by=(SAVE_FIXED,), replacement=_save,
             site=(occurs(IN_PROCESS), occurs("self.async_save(")))
_QUEUE = dict(bug=(MANAGER_QUEUE,), fixed_by=(QUEUE_FIXED,), replacement=_results_queue,
              site=(occurs(MANAGER_QUEUE), occurs("_results_queue = ")))

FIX = Fix(
    name="dcp_results_queue",
    summary="a synchronous torch_dist save reports its write results in process: no Manager "
    "server spawned, no torch import in it at each save",
    targets=(
        Target(
            module=f"{_STRATEGIES}.base",
            qualname="AsyncSaveShardedStrategy.save",
            known_buggy={"3f3a3e2d28452842": "0.15.3-0.16.1", "a65ed57d69d26aa1": "0.17.1-0.18.2"},
            feature=IN_PROCESS,
            absent_in="0.19.2, main d98e8a64 and the Megatron-Bridge pin 2a75ac12 (no strategies.base)",
            **_SAVE,
        ),
        Target(
            module=f"{_STRATEGIES}.torch",
            qualname="TorchDistSaveShardedStrategy.save",
            known_buggy={"55a62ae12f5fb5f8": "0.17.1-0.19.2, main d98e8a64"},
            absent_in="0.13.1-0.16.1 (the strategy inherits the sync save)",
            **_SAVE,
        ),
        Target(
            module=f"{_STRATEGIES}.filesystem_async",
            qualname="_get_write_results_queue",
            known_buggy={"c0fa054d267b9f95": "0.13.1-0.16.1"},
            absent_in="0.17.1 and later (get_write_results_queue)",
            **_QUEUE,
        ),
        Target(
            module=f"{_STRATEGIES}.filesystem_async",
            qualname="get_write_results_queue",
            known_buggy={"412452f30fb3fd55": "0.17.1-0.19.2, main d98e8a64"},
            absent_in="0.13.1-0.16.1 (_get_write_results_queue)",
            **_QUEUE,
        ),
    ),
)
