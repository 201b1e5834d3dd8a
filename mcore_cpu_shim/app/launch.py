"""The one launcher: start the ranks of a command, follow their phases, stop them, say why one failed.

``convert`` and ``demo`` both run their work in ranks: fresh interpreters, one per rank, with
CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), this package importable, a Gloo group on loopback
(``MASTER_ADDR``/``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``) and the host's cores shared out.
``start_ranks`` writes the spec and starts them, each in its own session with its output in
``rank<N>.log``; ``supervise`` follows the event records the ranks write (``worker.Phases``,
one format for every command) phase by phase, stops every rank as soon as one failed or died,
and returns the phases' summaries and the failure to report; ``report_failure`` says it.

Nothing here imports torch: the ranks do.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time


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


def free_port(tries=50):
    """A loopback port nobody listens on now, for rank 0 to listen on a moment later. Chosen
    below the kernel's ephemeral range where it can (``ip_local_port_range``): a port from
    that range may meanwhile be taken by any outgoing connection (Gloo opens many), and rank 0
    would then fail with EADDRINUSE."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = [random.randrange(10000, low) for _ in range(tries)] if low > 10000 else []
    for port in candidates + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]


def rank_environment(ranks, base=None):
    """The environment of every rank: CUDA hidden, this package importable, Gloo on loopback,
    and the host's cores shared out (each rank would otherwise start a thread per core)."""
    env = dict(os.environ if base is None else base, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root(), env.get("PYTHONPATH")]))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["WORLD_SIZE"] = str(ranks)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start_ranks(spec, folder, worker, command=None, env=None):
    """Write the spec and start one process per rank, each in its own session (so that
    killing it ends the helpers it started), output to ``rank<N>.log``: ``python -m`` the
    module ``worker`` of this package's application (or ``command(rank)``, an argument list).
    ``env``: the environment to start from (default: this process's)."""
    spec = dict(spec, events=folder, address="127.0.0.1", port=free_port())
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if command is None:
        def command(rank):
            return [sys.executable, "-m", f"{__package__}.{worker}", spec_path, str(rank)]
    env = rank_environment(spec["ranks"], base=env)
    env["MASTER_PORT"] = str(spec["port"])
    processes = []
    try:
        for rank in range(spec["ranks"]):
            with open(os.path.join(folder, f"rank{rank}.log"), "w") as log:
                processes.append(subprocess.Popen(
                    command(rank), env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)),
                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                ))
    except BaseException:
        stop(processes)
        raise
    return processes


def stop(processes):
    for p in processes:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


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


def supervise(processes, phases, folder, progress, grace=5.0, deadline=None):
    """Follow the ranks phase by phase until all ended, or one failed or died (then the others
    get ``grace`` seconds to record their own error before all are killed), or until
    ``time.monotonic()`` passes ``deadline`` (if given; then all are killed). Returns
    ``{"phases": {name: summary}, "failure": {...} or None, "facts": the last record of rank 0,
    "ranks": every rank's last record (None where a rank wrote none), "events": every record}``."""
    ranks = len(processes)
    summaries, died_at, failed_at = {}, {}, None

    def follow():
        every = rank_events(folder, ranks)
        while len(summaries) < len(phases) and all(s["ok"] for s in summaries.values()):
            name = phases[len(summaries)]
            ended = [dict(e, rank=r) for r, evs in enumerate(every) for e in evs if e.get("phase") == name and "ok" in e]
            if not any(not e["ok"] for e in ended) and len(ended) < ranks:
                started = [e["t"] for evs in every for e in evs if e.get("phase") == name and e.get("started")]
                if started:
                    progress.running(name, time.time() - min(started))
                break
            ok = all(e["ok"] for e in ended)
            summaries[name] = dict(ok=ok, seconds=max((e["seconds"] or 0) for e in ended), details=details(ended))
            progress.done(name, summaries[name])
        return every

    try:
        while True:
            follow()
            now = time.monotonic()
            for rank, p in enumerate(processes):
                if p.poll() not in (None, 0) and rank not in died_at:
                    died_at[rank] = time.time()
            codes = [p.poll() for p in processes]
            if None not in codes:
                break
            if died_at or not all(s["ok"] for s in summaries.values()):
                failed_at = failed_at or now
                if now - failed_at > grace:
                    break
            if deadline is not None and now > deadline:
                break
            time.sleep(0.2)
        every = follow()
    finally:
        stop(processes)
    done = [next((e for e in evs if e.get("done")), None) for evs in every]
    return {"phases": summaries, "failure": first_failure(every, processes, died_at, phases, folder),
            "facts": (done[0] or {}) if done else {}, "ranks": done, "events": every}


def first_failure(every, processes, died_at, phases, folder):
    """The failure to report: a rank that died without recording why (the others' errors
    follow from it), else the error recorded first."""
    recorded = {r for r, evs in enumerate(every) for e in evs if e.get("ok") is False and "phase" in e}
    silent = [r for r in died_at if r not in recorded]
    if silent:
        rank = min(silent, key=died_at.get)
        code = processes[rank].returncode
        how = f"was killed by {signal_name(code)}" if code < 0 else f"exited with status {code}"
        if code == -signal.SIGKILL:
            how += " (out of memory?)"
        started = [e["phase"] for e in every[rank] if e.get("started")]
        return dict(rank=rank, phase=started[-1] if started else None, error=f"the process {how}",
                    where="", traceback=log_tail(folder, rank), input=False)
    errors = [dict(e, rank=r) for r, evs in enumerate(every) for e in evs if e.get("ok") is False and "phase" in e]
    if errors:
        return min(errors, key=lambda e: e["t"])
    unfinished = [r for r, p in enumerate(processes) if p.returncode != 0]
    if unfinished:  # still running when stopped (cannot happen without a failure) or ended oddly
        return dict(rank=unfinished[0], phase=None, error="stopped before it finished", where="",
                    traceback=log_tail(folder, unfinished[0]), input=False)
    done = {e.get("phase") for evs in every for e in evs if e.get("ok")}
    lacking = [p for p in phases if p not in done]
    if lacking:
        return dict(rank=0, phase=lacking[0], error="the ranks ended without finishing this phase",
                    where="", traceback=log_tail(folder, 0), input=False)
    return None


def log_tail(folder, rank, lines=15):
    try:
        with open(os.path.join(folder, f"rank{rank}.log"), errors="replace") as f:
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


