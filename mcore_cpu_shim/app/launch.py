"""The one launcher: start the ranks of a command, follow their phases, stop them, say why one failed.

``convert`` and ``demo`` both run their work in ranks: fresh interpreters, one per rank, with
CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), this package importable, a Gloo group on loopback
and the host's cores shared out. The ranks are started, watched and stopped by torch's own
launcher, the elastic agent behind torchrun (``launch_agent``), which runs in a process of its
own (``python -m`` ``agent``): it sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` (a c10d rendezvous on 127.0.0.1), stops every rank once one failed or died and
says which failed first. ``start_ranks`` writes the spec and starts the agent; ``supervise``
follows the event records the ranks write (``worker.Phases``, one format for every command)
phase by phase until the agent ended, and returns the phases' summaries and the failure to
report; ``report_failure`` says it. Under torchrun itself, ``convert_torchrun`` runs instead.

Nothing here imports torch at module level: the agent and the ranks do.
"""

import json
import os
import signal
import subprocess
import sys
import time

from .agent import SHUTDOWN


def package_root():
    """The folder to put on a rank's PYTHONPATH so that this package imports by its name."""
    here = os.path.dirname(os.path.abspath(__file__))
    for _ in __package__.split("."):
        here = os.path.dirname(here)
    return here


def read_events(path):
    """The event records of one rank (``worker.Phases``), the complete lines only."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def rank_events(folder, ranks):
    return [read_events(os.path.join(folder, f"rank{r}.jsonl")) for r in range(ranks)]


def size_text(value):
    """``1.5 MB``: a size in bytes as people read it (``-`` for None)."""
    if value is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024


def rank_environment(ranks, base=None):
    """The environment of every rank (the agent adds its rendezvous): CUDA hidden, this
    package importable, Gloo on loopback, and the host's cores shared out (each rank would
    otherwise start a thread per core)."""
    env = dict(os.environ if base is None else base, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root(), env.get("PYTHONPATH")]))
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


class Ranks:
    """The ranks of one launch: torch's elastic agent (``agent``, a ``Popen``) and, once it
    ended, what it said of each rank (``result()``)."""

    def __init__(self, agent, count, folder):
        self.agent, self.count, self.folder = agent, count, folder

    def result(self):
        """``{"codes": [exit code or None per rank], "first": the rank that failed first or
        None, "stopped": the signal that stopped the agent or None}`` (codes None where the
        agent wrote nothing: it was killed)."""
        try:
            with open(os.path.join(self.folder, "agent.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {"codes": [None] * self.count, "first": None, "stopped": "the agent's own end"}

    def stop(self, wait=SHUTDOWN + 15):
        """End the agent, and with it every rank: SIGTERM (it stops the ranks, SIGKILL after
        ``SHUTDOWN`` seconds), SIGKILL if it has not ended ``wait`` seconds later (the ranks
        then end themselves, ``worker.end_with_parent``)."""
        if self.agent.poll() is None:
            self.agent.terminate()
            try:
                self.agent.wait(wait)
            except subprocess.TimeoutExpired:
                self.agent.kill()
        self.agent.wait()


def start_ranks(spec, folder, worker, command=None, env=None):
    """Write the spec and start torch's elastic agent (``python -m`` ``agent``, in a session
    of its own, output to ``agent.log``) with one rank per ``spec["ranks"]``: ``python -m`` the
    module ``worker`` of this package's application, or ``command`` (an argument list, the
    same for every rank: a rank reads ``RANK`` from its environment). ``env``: the environment
    to start from (default: this process's). Returns a ``Ranks``."""
    spec = dict(spec, events=folder)
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    command = command or [sys.executable, "-m", f"{__package__}.{worker}", spec_path]
    with open(os.path.join(folder, "agent.log"), "w") as log:
        agent = subprocess.Popen(
            [sys.executable, "-m", f"{__package__}.agent", folder, str(spec["ranks"]), *command],
            env=rank_environment(spec["ranks"], base=env),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )
    return Ranks(agent, spec["ranks"], folder)


def signal_name(code):
    try:
        return signal.Signals(-code).name
    except ValueError:
        return f"signal {-code}"


class Progress:
    """The parent's lines: one per phase when it ends; on a terminal also a running line with
    the time spent in the current phase."""

    def __init__(self, stream):
        self.stream = stream
        self.live = stream.isatty()
        self.shown = None

    def running(self, name, seconds):
        text = f"  {name} ... {seconds:.0f} s"
        if self.live and text != self.shown:
            self.stream.write(f"\r\033[K{text}")
            self.stream.flush()
            self.shown = text

    def done(self, name, summary):
        if self.live and self.shown:
            self.stream.write("\r\033[K")
        self.shown = None
        if summary["ok"]:
            details = ", ".join(filter(None, [f"{summary['seconds']:.1f} s", summary.get("details")]))
            print(f"  {name}: ok ({details})", file=self.stream, flush=True)
        else:
            print(f"  {name}: FAILED", file=self.stream, flush=True)


def details(records):
    sizes = [r["size"] for r in records if r.get("size") is not None]
    counted = [r for r in records if "tensors" in r]
    parts = []
    if sizes:
        parts.append(size_text(sizes[0]))
    if counted:
        parts.append(f"{counted[0]['equal']}/{counted[0]['tensors']} tensors equal")
    return ", ".join(parts)


def supervise(ranks, phases, progress, deadline=None):
    """Follow the ranks phase by phase until the agent ended (it ends every rank once one
    failed or died), or until ``time.monotonic()`` passes ``deadline`` (if given; then all are
    stopped). Returns ``{"phases": {name: summary}, "failure": {...} or None, "facts": the last
    record of rank 0, "ranks": every rank's last record (None where a rank wrote none),
    "events": every record, "codes": every rank's exit code}``."""
    folder, summaries = ranks.folder, {}

    def follow():
        every = rank_events(folder, ranks.count)
        while len(summaries) < len(phases) and all(s["ok"] for s in summaries.values()):
            name = phases[len(summaries)]
            ended = [dict(e, rank=r) for r, evs in enumerate(every) for e in evs if e.get("phase") == name and "ok" in e]
            if not any(not e["ok"] for e in ended) and len(ended) < ranks.count:
                started = [e["t"] for evs in every for e in evs if e.get("phase") == name and e.get("started")]
                if started:
                    progress.running(name, time.time() - min(started))
                break
            ok = all(e["ok"] for e in ended)
            summaries[name] = dict(ok=ok, seconds=max((e["seconds"] or 0) for e in ended), details=details(ended))
            progress.done(name, summaries[name])
        return every

    try:
        while ranks.agent.poll() is None and (deadline is None or time.monotonic() < deadline):
            follow()
            time.sleep(0.2)
    finally:
        ranks.stop()
    every = follow()
    result = ranks.result()
    done = [next((e for e in evs if e.get("done")), None) for evs in every]
    return {"phases": summaries, "failure": first_failure(every, result, phases, folder),
            "facts": (done[0] or {}) if done else {}, "ranks": done, "events": every, "codes": result["codes"]}


def first_failure(every, result, phases, folder):
    """The failure to report: the rank that failed first (the agent's word) where it died
    without recording why (the others' errors follow from it), else the error recorded first."""
    codes, first = result["codes"], result["first"]
    recorded = {r for r, evs in enumerate(every) for e in evs if e.get("ok") is False and "phase" in e}
    if first is not None and first not in recorded:
        code = codes[first]
        how = f"was killed by {signal_name(code)}" if code < 0 else f"exited with status {code}"
        if code == -signal.SIGKILL:
            how += " (out of memory?)"
        started = [e["phase"] for e in every[first] if e.get("started")]
        return dict(rank=first, phase=started[-1] if started else None, error=f"the process {how}",
                    where="", traceback=log_tail(folder, first), input=False)
    errors = [dict(e, rank=r) for r, evs in enumerate(every) for e in evs if e.get("ok") is False and "phase" in e]
    if errors:
        return min(errors, key=lambda e: e["t"])
    unfinished = [r for r, code in enumerate(codes) if code != 0]
    if unfinished:  # stopped (a deadline, or the agent itself was stopped) or ended oddly
        return dict(rank=unfinished[0], phase=None, error="stopped before it finished", where="",
                    traceback=log_tail(folder, unfinished[0]) or log_tail(folder, "agent"), input=False)
    done = {e.get("phase") for evs in every for e in evs if e.get("ok")}
    lacking = [p for p in phases if p not in done]
    if lacking:
        return dict(rank=0, phase=lacking[0], error="the ranks ended without finishing this phase",
                    where="", traceback=log_tail(folder, 0), input=False)
    return None


def log_tail(folder, rank, lines=15):
    """The last lines of ``rank<N>.log`` (``rank`` "agent": of ``agent.log``)."""
    name = "agent.log" if rank == "agent" else f"rank{rank}.log"
    try:
        with open(os.path.join(folder, name), errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def report_failure(prog, failure, folder):
    if failure.get("input"):
        print(f"{prog}: error: {failure['error'].split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    if failure.get("mismatch"):
        step = "verify" if failure.get("phase") in (None, "verify") else f"the check in '{failure['phase']}'"
        print(f"{prog}: {step} failed, the output was not kept: {failure['error']}", file=sys.stderr)
        return 1
    phase = f" in '{failure['phase']}'" if failure.get("phase") else ""
    print(f"{prog}: rank {failure['rank']} failed{phase}: {failure['error']}", file=sys.stderr)
    if failure.get("where"):
        print(f"  at {failure['where']}", file=sys.stderr)
    tail = [line for line in (failure.get("traceback") or "").rstrip().splitlines() if line.strip()][-12:]
    if tail:
        print("  last lines of its traceback / log:", file=sys.stderr)
        for line in tail:
            print(f"    {line}", file=sys.stderr)
    print(f"  rank logs kept in {folder}", file=sys.stderr)
    return 1
