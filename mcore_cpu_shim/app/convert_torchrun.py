"""``convert`` under torchrun: every process torchrun starts is one rank of the conversion.

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        -m mcore_cpu_shim convert import --hf DIR --out DIR --tp 2 --ep 4 --verify

torchrun (``torch.distributed.run``) starts the processes of each node, sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` and ``TORCHELASTIC_RUN_ID`` in
each, and ends every process on every node once one of them fails. ``convert`` sees that
environment and, instead of starting ranks of its own, runs as one of them:

1. CUDA is hidden (``CUDA_VISIBLE_DEVICES=""``, before torch is imported) and the rank joins
   the Gloo group of torchrun's rendezvous (``env://``), ``--timeout`` on every collective.
2. Every rank checks the arguments and folders (``convert_spec.check``) and the ranks compare
   what they found: a rank that sees other input (another node's files) is an input error
   that names it.
3. Rank 0 readies ``--out`` (an old one moved aside with ``--overwrite``) and writes a marker
   in it that every rank must read back: DCP writes each rank's part of the checkpoint into
   ``--out``, so it must be one folder, on a filesystem every node mounts.
4. The phases run as ``convert_worker.run`` runs them for convert's own ranks; rank 0 prints a
   line per phase when its part of the phase ends.
5. After a last barrier rank 0 keeps ``--out``. A rank that fails prints its error and exits
   (torchrun then ends the others); rank 0, stopped by torchrun's SIGTERM or by Ctrl-C, even
   while it waits in a collective, removes what was written and puts the old ``--out`` back.

Exit status as ``convert``'s: 0, 1 (the conversion or verification failed), 2 (bad input).
Output per rank is torchrun's (``--tee``, ``--log-dir``); each rank's event records go to a
temporary folder of its own, kept where the rank failed. Nothing is imported from torch at
module level.
"""

import multiprocessing
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid

from . import launch
from .convert_spec import check, describe, facts_line, move_aside, settle
from .convert_worker import run as convert
from .inputs import InputError
from .worker import Phases, final_facts, init_gloo

TORCHRUN = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
MARKER = ".mcore-cpu-shim-every-rank-sees-this"
STOPS = {signal.SIGTERM, signal.SIGINT}


def launched():
    """Whether torchrun started this process (its rendezvous environment is set)."""
    return all(name in os.environ for name in TORCHRUN)


def leave(code):
    """End this rank now (a peer may still wait in a collective, and its exit handlers with
    it), with the helper processes megatron-core's checkpoint writer started."""
    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class Printed(Phases):
    """Rank 0's phases: recorded, and a line printed as each one ends."""

    progress = launch.Progress(sys.stdout)

    def end(self, **facts):
        name, seconds = self.current, time.perf_counter() - self.started
        super().end(**facts)
        self.progress.done(name, dict(ok=True, seconds=seconds, details=launch.details([facts])))


def hold(prog, out, temporary):
    """Rank 0 readies ``out`` and holds it: returns ``finish(success)``, which keeps it (or
    removes what was written and puts the old one back) and removes the ``temporary`` folders,
    once. SIGTERM and SIGINT are taken by a thread of their own, so that they finish(False) and
    end the rank even while the main thread waits inside a collective."""
    existed = os.path.isdir(out)
    lock, finished = threading.Lock(), []
    signal.pthread_sigmask(signal.SIG_BLOCK, STOPS)  # (threads started later inherit it)
    backup = move_aside(out)

    def finish(success):
        with lock:
            if finished:
                return False
            finished.append(success)
            for folder in temporary:
                shutil.rmtree(folder, ignore_errors=True)
            settle(out, backup, existed, success)
            return True

    def stopped():
        signum = signal.sigwait(STOPS)
        if finish(False):
            print(f"{prog}: stopped by {signal.Signals(signum).name}; every rank ends, {out} left as it was",
                  file=sys.stderr, flush=True)
        leave(128 + signum)

    threading.Thread(target=stopped, name="hold-out", daemon=True).start()
    return finish


def agree(prog, found):
    """Every rank's ``found`` (an error text or what it read), gathered; returns the input
    error to report (None where every rank found the same and none an error)."""
    import torch

    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, (found, socket.gethostname()))
    errors = [(rank, host, text) for rank, ((kind, text), host) in enumerate(every) if kind == "error"]
    if errors:
        rank, host, text = errors[0]
        return text if len(errors) == len(every) else f"rank {rank} (host {host}): {text}"
    different = [(rank, host, text) for rank, ((_, text), host) in enumerate(every) if text != every[0][0][1]]
    if different:
        rank, host, text = different[0]
        return (f"the ranks do not see the same input: rank 0 (host {every[0][1]}) reads {every[0][0][1]}; "
                f"rank {rank} (host {host}) reads {text}. Every node must see the same folders")
    return None


def run(args):
    prog = f"mcore-cpu-shim convert {args.direction}"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    lead = rank == 0
    if not lead:  # as torchrun's SIGTERM: end at once, even inside a collective
        signal.signal(signal.SIGINT, signal.SIG_DFL)
    init_gloo({"timeout": args.timeout, "ranks": world}, rank)
    import torch

    try:
        spec, config, source = check(args, world)
        found = ("ok", describe(spec, source))
    except InputError as exc:
        found = ("error", str(exc))
    problem = agree(prog, found)
    if problem is not None:
        if lead:
            print(f"{prog}: error: {problem}", file=sys.stderr)
        leave(2)
    out = spec["out"]
    shared = [None, None]
    if lead:
        print(f"{prog}: {found[1]} under torchrun", flush=True)
        if spec.get("dequantize"):  # beside --out, where check_room found the space
            spec["dequantize"] = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.dequantized-",
                                                  dir=os.path.dirname(out))
        finish = hold(prog, out, [spec["dequantize"]] if spec.get("dequantize") else [])
        shared = [uuid.uuid4().hex, spec.get("dequantize")]
        with open(os.path.join(out, MARKER), "w") as f:
            f.write(shared[0])
    torch.distributed.broadcast_object_list(shared, src=0)
    try:
        with open(os.path.join(out, MARKER)) as f:
            seen = f.read() == shared[0]
    except OSError:
        seen = False
    problem = agree(prog, ("ok", "") if seen else ("error", f"it does not see the file {MARKER} rank 0 wrote there"))
    if problem is not None:
        if lead:
            print(f"{prog}: error: --out {out} is not the same folder on every node ({problem}). DCP writes "
                  "each rank's part of the checkpoint into --out: put it on a filesystem that every node "
                  "mounts at the same path", file=sys.stderr)
            finish(False)
        leave(2)
    torch.distributed.barrier()
    if lead:
        os.remove(os.path.join(out, MARKER))
    if spec.get("dequantize"):
        spec["dequantize"] = shared[1]

    work = tempfile.mkdtemp(prefix=f"mcore-cpu-shim-convert-rank{rank}-")
    spec.update(events=work)
    phases = (Printed if lead else Phases)(os.path.join(work, f"rank{rank}.jsonl"))
    try:
        convert(spec, rank, phases)
        if phases.current is not None:
            phases.end()
        torch.distributed.barrier()  # every rank's part is written
    except BaseException as exc:  # noqa: BLE001  (report whatever ended the phase)
        phases.fail(exc)
        failure = dict(launch.read_events(os.path.join(work, f"rank{rank}.jsonl"))[-1], rank=rank)
        code = launch.report_failure(prog, failure, work)
        if code == 1 and not failure.get("mismatch"):
            print("  (a peer that ended first shows here as a lost connection: torchrun's report of "
                  "every node names the rank that failed first)", file=sys.stderr)
        if lead:
            finish(False)
        leave(code)
    facts = final_facts()
    shutil.rmtree(work, ignore_errors=True)
    if lead:
        finish(True)
        print(facts_line(facts))
        print(f"done: {out}", flush=True)
    torch.distributed.destroy_process_group()
    leave(0)
