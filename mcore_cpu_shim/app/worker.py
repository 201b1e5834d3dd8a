"""The worker side of every command that starts ranks: one rank's life and its event records.

torch's elastic agent (``launch``) starts each rank as ``python -m <package>.app.<worker> SPEC``
in a fresh interpreter with ``CUDA_VISIBLE_DEVICES=""`` and ``RANK`` set: ``-m`` imports the
package first, so the shim is active (or, with ``MCORE_CPU_SHIM_DISABLE``, deliberately not)
before torch, megatron-core or Megatron-Bridge is imported. SPEC is the JSON file the parent
wrote. The worker module (``convert_worker``, ``demo_worker``, ``demo_bridge``) calls ``main``
with its own ``run(spec, rank, phases)``; the rank's output (stdout too) goes to the agent's
``rank<RANK>.log``.

The one event format: each phase appends JSON lines to ``<events>/rank<RANK>.jsonl`` as it
starts and ends (``{"phase", "started"}``, then ``{"phase", "ok", "seconds", ...facts}`` or
``{"phase", "ok": false, "error", "where", "traceback", ...}``), so the parent can print
progress and knows where a rank it has to kill got to; the last line (``{"done": true}``)
holds the facts (versions, CUDA initialised, driver libraries mapped, fix states, what the
phases put in ``Phases.facts``). With ``strict`` in the spec every phase runs under
``forbid_cuda()``: a CUDA call that the code catches and hides still fails it.

Nothing is imported from torch, megatron or Bridge at module level: the parent imports this
module.
"""

import json
import os
import re
import sys
import time
import traceback


class InputProblem(Exception):
    """The source is at fault, not the conversion (e.g. an architecture Bridge cannot
    convert): the parent exits with status 2."""


class VerifyMismatch(Exception):
    """A comparison found values that differ; ``facts`` holds what it counted."""

    def __init__(self, message, facts):
        super().__init__(message)
        self.facts = facts


def _short(path):
    """A frame's file from its package on: ``megatron/...``, else below ``site-packages/``."""
    path = path.replace(os.sep, "/")
    if "megatron/" in path:
        return path[path.rfind("megatron/") :]
    if "site-packages/" in path:
        return path[path.rfind("site-packages/") + len("site-packages/") :]
    return path


def _innermost(exc):
    """``path:line in function`` of the innermost frame of ``exc`` in megatron, else its
    innermost frame ("" without a traceback)."""
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if "megatron/" in f.filename.replace(os.sep, "/")]
    if not frames:
        return ""
    frame = (inside or frames)[-1]
    return f"{_short(frame.filename)}:{frame.lineno} in {frame.name}"


def where(exc):
    """Where ``exc`` happened, as ``path:line in function``: in megatron (core or Bridge)
    where any exception of its chain was raised there (e.g. Bridge's failing import behind
    ``cannot import Megatron-Bridge``), or where the text of a ``forbid_cuda()`` error (a call
    that was caught) shows a megatron frame; else the innermost frame."""
    chain = []
    link = exc
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    for link in chain:
        found = _innermost(link)
        if found.startswith("megatron/"):
            return found
    frames = re.findall(r'File "([^"]*)", line (\d+), in (\S+)', str(exc))
    inside = [f for f in frames if "/megatron/" in f[0]]
    if inside or frames:
        path, line, name = (inside or frames)[-1]
        return f"{_short(path)}:{line} in {name}"
    return _innermost(exc)


class Phases:
    """The phase a rank is in. ``start`` ends the current phase (ok) and records the next
    one's start; ``fail`` records what ended the current phase. ``strict``: each phase runs
    under ``forbid_cuda()``. ``facts``: what the phases found, for the rank's last record."""

    def __init__(self, events_path, strict=False):
        self.events = open(events_path, "a")
        self.current, self.started = None, None
        self.strict, self.guard = strict, None
        self.facts = {}

    def record(self, **event):
        self.events.write(json.dumps(dict(event, t=time.time())) + "\n")
        self.events.flush()

    def start(self, name):
        if self.current is not None:
            self.end()
        self.current, self.started = name, time.perf_counter()
        self.record(phase=name, started=True)
        if self.strict:
            from ..tripwire import forbid_cuda

            self.guard = forbid_cuda()
            self.guard.__enter__()

    def _close(self, exc=None):
        guard, self.guard = self.guard, None
        if guard is None:
            return
        if exc is None:
            guard.__exit__(None, None, None)  # raises for a CUDA call the phase caught and hid
            return
        try:
            guard.__exit__(type(exc), exc, exc.__traceback__)
        except BaseException:  # noqa: BLE001  (the phase's own error is the one to report)
            pass

    def end(self, **facts):
        self._close()
        self.record(phase=self.current, ok=True, seconds=time.perf_counter() - self.started, **facts)
        self.current = None

    def fail(self, exc):
        self._close(exc)
        text = str(exc).strip()
        message = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
        mismatch = isinstance(exc, VerifyMismatch)  # a result, not a crash: no traceback
        self.record(
            phase=self.current,
            ok=False,
            seconds=time.perf_counter() - self.started if self.started is not None else None,
            error=text if mismatch else message,
            input=isinstance(exc, InputProblem),
            mismatch=mismatch,
            where="" if mismatch else where(exc),
            traceback="" if mismatch else traceback.format_exc()[-6000:],
            **getattr(exc, "facts", {}),
        )


def directory_size(path):
    """Bytes in the files below ``path``."""
    return sum(os.path.getsize(os.path.join(root, n)) for root, _, names in os.walk(path) for n in names)


def init_gloo(spec, rank):
    """The Gloo process group of the ranks, at the parent's address (under torchrun: where its
    rendezvous says, ``env://``; ``convert_torchrun`` joins it before the checks); every
    collective on it gives up after ``spec["timeout"]`` seconds (megatron-core's groups:
    ``timeout_minutes``)."""
    import datetime

    import torch

    if torch.distributed.is_initialized():
        return
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://{spec['address']}:{spec['port']}" if "address" in spec else "env://",
        rank=rank,
        world_size=spec["ranks"],
        timeout=datetime.timedelta(seconds=spec["timeout"]),
    )


def timeout_minutes(spec):
    return spec["timeout"] / 60


def final_facts():
    """What a rank reports at its end: versions, whether CUDA was initialised, the driver
    libraries mapped, the fix states and what the Transformer Engine import guard did."""
    import torch

    from .. import engine, status, te_guard
    from ..tripwire import driver_libraries

    facts = {
        "torch": torch.__version__,
        "megatron_core": engine.mcore_version(),  # package_info: a source tree has no metadata
        "cuda_initialized": torch.cuda.is_initialized(),
        "driver_libraries": driver_libraries(),
        "fixes": {name: fix["state"] for name, fix in status().items()},
        "te_guard": {k: v for k, v in te_guard.state().items() if k in ("mode", "reason")},
    }
    if "transformers" in sys.modules:
        facts["transformers"] = getattr(sys.modules["transformers"], "__version__", None)
    if "megatron.bridge" in sys.modules:
        facts["megatron_bridge"] = engine.bridge_version()
    return facts


def end_with_parent(interval=2.0, end=None):
    """End this rank, and what it started, once its parent (torch's agent) is gone (killed
    without a chance to stop its ranks): a rank must not convert, or wait for peers, for
    nobody. ``end``: what to do instead (the agent itself stops its ranks first)."""
    import signal
    import threading

    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval)
        if end is not None:
            return end()
        if os.getpgrp() == os.getpid():  # a session of its own, as the agent starts it
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def main(spec_path, rank, run, phases_class=Phases):
    """Run one rank: ``run(spec, rank, phases)``, its phases recorded by a ``phases_class``,
    then the facts; exits. Its stdout goes where its stderr goes (the agent gives a rank one
    log, its stderr)."""
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    end_with_parent()
    with open(spec_path) as f:
        spec = json.load(f)
    phases = phases_class(os.path.join(spec["events"], f"rank{rank}.jsonl"), strict=spec.get("strict", False))
    ok = False
    try:
        run(spec, rank, phases)
        if phases.current is not None:
            phases.end()
        ok = True
    except BaseException as exc:  # noqa: BLE001  (report whatever ended the phase)
        phases.fail(exc)
    facts = dict(phases.facts)
    try:
        facts.update(final_facts())
    except Exception as exc:  # noqa: BLE001
        facts["facts_error"] = f"{type(exc).__name__}: {exc}"
    phases.record(done=True, ok=ok, **facts)
    if ok:
        import torch

        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # A failed rank may leave others waiting in a collective, and its exit handlers with them:
    # leave at once (the parent ends the others), but not without the helper processes
    # megatron-core's checkpoint writer started.
    import multiprocessing

    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)
