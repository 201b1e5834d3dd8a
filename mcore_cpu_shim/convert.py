"""``mcore-cpu-shim convert``: Hugging Face <-> Megatron ``torch_dist`` with Megatron-Bridge, on the CPU.

``convert import --hf DIR --out DIR`` writes a Megatron ``torch_dist`` checkpoint of a Hugging
Face model folder (config.json and safetensors); ``convert export --megatron DIR --hf-config DIR
--out DIR`` writes such a checkpoint back as Hugging Face safetensors, with the config and
tokenizer of the ``--hf-config`` folder. The conversion is Megatron-Bridge's own, through its
public API (``AutoBridge``); this command runs it in fresh worker processes with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``) and the shim active, ``--ranks`` of them in a Gloo group on
loopback, and prints a line per phase. ``--verify`` reloads what was written and compares
every tensor with the source, exactly.

With ``--overwrite`` an existing ``--out`` is moved aside (a hidden folder next to it) and
deleted only once every phase passed: a failed conversion removes what it wrote and puts the old
``--out`` back. A collective
waits at most ``--timeout`` seconds for a peer; when a rank fails or dies the others are
stopped at once and the error of the rank that failed first is shown (rank logs are kept).

Exit status: 0 converted (and verified, with ``--verify``); 1 the conversion or verification
failed; 2 bad input (the message says what and how to fix it). Nothing here imports torch: the
workers do.
"""

import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from ._convert_rank import phases_of
from .demo import _package_root, _positive, _read_events, _size

DTYPES = ("bfloat16", "float32", "float16")
INSTALL_BRIDGE = "pip install --no-deps megatron-bridge && pip install 'mcore-cpu-shim[bridge]'"


class InputError(Exception):
    """Bad input: the command prints the message and exits 2."""


def add_parser(subparsers):
    p = subparsers.add_parser(
        "convert",
        help="convert Hugging Face <-> Megatron torch_dist checkpoints with Megatron-Bridge on the CPU",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    directions = p.add_subparsers(dest="direction", metavar="DIRECTION", required=True)

    imp = directions.add_parser(
        "import",
        help="Hugging Face model folder -> Megatron torch_dist checkpoint",
        description="Convert a Hugging Face model folder (config.json + *.safetensors) into a "
        "Megatron torch_dist checkpoint with Megatron-Bridge, on the CPU.",
    )
    imp.add_argument("--hf", required=True, metavar="DIR", help="the Hugging Face model folder")
    imp.add_argument("--out", required=True, metavar="DIR", help="where to write the Megatron checkpoint")
    imp.add_argument("--dtype", choices=DTYPES, help="parameter dtype of the checkpoint (default: the model's)")
    imp.add_argument("--ranks", type=_positive, help="worker processes (default: TP x EP)")
    imp.add_argument("--tp", type=_positive, default=1, help="tensor parallelism (default 1)")
    imp.add_argument("--ep", type=_positive, default=1, help="expert parallelism (default 1)")
    _common(imp)

    exp = directions.add_parser(
        "export",
        help="Megatron torch_dist checkpoint -> Hugging Face safetensors",
        description="Convert a Megatron torch_dist checkpoint written by `convert import` (or by "
        "Megatron-Bridge's save_megatron_model) back into a Hugging Face model folder, on the CPU.",
    )
    exp.add_argument("--megatron", required=True, metavar="DIR", help="the Megatron checkpoint folder")
    exp.add_argument("--hf-config", required=True, metavar="DIR",
                     help="the original Hugging Face model folder, or any folder with its config.json (and tokenizer)")
    exp.add_argument("--out", required=True, metavar="DIR", help="where to write the Hugging Face model")
    _common(exp)
    return p


def _common(p):
    p.add_argument("--verify", action="store_true",
                   help="reload what was written and compare every tensor with the source")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out (never a source folder)")
    p.add_argument("--timeout", type=_positive, default=300,
                   help="seconds a rank waits for its peers in a collective (default 300)")
    p.set_defaults(func=run, parser=p)


# --- Input checks (no torch) ---


def _real(path):
    return os.path.realpath(os.path.abspath(os.path.expanduser(path)))


def _within(inner, outer):
    """Whether ``inner`` is ``outer`` or below it (both real paths)."""
    return inner == outer or inner.startswith(outer.rstrip(os.sep) + os.sep)


def _folder(path, option, what):
    real = _real(path)
    if not os.path.exists(real):
        raise InputError(f"{option} {path}: no such folder (give {what})")
    if not os.path.isdir(real):
        raise InputError(f"{option} {path} is a file, not a folder (give {what})")
    return real


def read_config(folder, option):
    """The parsed config.json of a Hugging Face model folder."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise InputError(
            f"{option} {folder} has no config.json: not a Hugging Face model folder "
            "(a folder written by save_pretrained or downloaded from the Hub has one)"
        )
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(f"{path} cannot be read as JSON ({exc}): copy or download it again") from None
    architectures = config.get("architectures") if isinstance(config, dict) else None
    if not architectures or not isinstance(architectures, list):
        raise InputError(
            f"{path} names no \"architectures\": Megatron-Bridge picks the conversion by it; "
            "add the model class, e.g. \"architectures\": [\"LlamaForCausalLM\"]"
        )
    return config


def safetensors_header(path):
    """``(tensor names, data bytes)`` of a safetensors file; InputError if it is not whole."""
    fix = "copy or download it again"
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise InputError(f"{path} is corrupt: {size} bytes, not even a safetensors header; {fix}")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise InputError(f"{path} is corrupt: its header should be {length} bytes, the file has "
                             f"{size - 8} after the length (truncated?); {fix}")
        try:
            header = json.loads(f.read(length))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise InputError(f"{path} is corrupt: its header is not valid JSON; {fix}") from None
    if not isinstance(header, dict):
        raise InputError(f"{path} is corrupt: its header is not a table of tensors; {fix}")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    try:
        needed = max((int(v["data_offsets"][1]) for v in tensors.values()), default=0)
    except (TypeError, KeyError, IndexError, ValueError):
        raise InputError(f"{path} is corrupt: its header has a tensor without valid data offsets; {fix}") from None
    have = size - 8 - length
    if have != needed:
        problem = "truncated" if have < needed else "has extra bytes at the end"
        raise InputError(f"{path} is corrupt ({problem}): its header describes {needed} bytes of tensor "
                         f"data, the file holds {have}; {fix}")
    return list(tensors), needed


def check_safetensors(folder, option, required=True):
    """Check every ``*.safetensors`` file (and the shard index) of a model folder; returns
    ``{"files", "tensors", "bytes"}``."""
    names = sorted(n for n in os.listdir(folder) if n.endswith(".safetensors"))
    index_path = os.path.join(folder, "model.safetensors.index.json")
    weight_map = None
    if os.path.exists(index_path):
        try:
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise InputError(f"{index_path} is corrupt (no readable \"weight_map\"): copy or download it again") from None
        absent = sorted(set(weight_map.values()) - set(names))
        if absent:
            raise InputError(f"{folder}: model.safetensors.index.json lists shard(s) that are not there: "
                             f"{', '.join(absent[:5])}; copy or download the missing files")
    if not names:
        if not required:
            return {"files": 0, "tensors": 0, "bytes": 0}
        others = [n for n in os.listdir(folder) if n.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = (f" It has {', '.join(sorted(others)[:3])}: load the model with transformers and save it "
                "with save_pretrained(folder, safe_serialization=True) first." if others else "")
        raise InputError(f"{option} {folder} has no *.safetensors weights: the conversion reads "
                         f"safetensors checkpoints.{hint}")
    count, total = 0, 0
    for name in names:
        tensors, size = safetensors_header(os.path.join(folder, name))
        if weight_map is not None:
            stray = [t for t, shard in weight_map.items() if shard == name and t not in tensors]
            if stray:
                raise InputError(f"{os.path.join(folder, name)} lacks tensor(s) the index puts there "
                                 f"(e.g. {stray[0]}): copy or download it again")
        count, total = count + len(tensors), total + size
    return {"files": len(names), "tensors": count, "bytes": total}


def check_megatron(path):
    real = _folder(path, "--megatron", "the folder `convert import --out` wrote")
    candidates = [real] + sorted(
        os.path.join(real, n) for n in os.listdir(real)
        if n.startswith("iter_") and os.path.isdir(os.path.join(real, n))
    )
    if not any(os.path.isfile(os.path.join(c, "run_config.yaml")) for c in candidates):
        raise InputError(
            f"--megatron {path} is not a Megatron-Bridge checkpoint (no run_config.yaml in it or in "
            "an iter_* folder): export reads checkpoints written by `mcore-cpu-shim convert import` "
            "or Megatron-Bridge's save_megatron_model"
        )
    return real


def check_out(path, sources, overwrite):
    """The real path of ``--out``; refuses a non-empty one without ``overwrite`` and anything
    that would write into, or delete, a source folder."""
    out = _real(path)
    for option, source in sources:
        if out == source:
            raise InputError(f"--out {path} is the {option} folder: give another --out")
        if _within(source, out):
            raise InputError(f"--out {path} contains the {option} folder {source}: "
                             "replacing it would delete the source; give another --out")
        if overwrite and _within(out, source) and os.path.exists(out):
            raise InputError(f"--out {path} is inside the {option} folder {source}: --overwrite "
                             "would delete part of the source; give another --out")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise InputError(f"--out {path} is a file: give a folder")
        if os.listdir(out) and not overwrite:
            raise InputError(f"--out {path} exists and is not empty: pass --overwrite to replace it, "
                             "or give another --out")
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
    except OSError as exc:
        raise InputError(f"--out {path}: cannot create its parent folder ({exc.strerror or exc})") from None
    return out


def _missing(module):
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def check_packages():
    """What the workers need, looked up without importing it."""
    if _missing("megatron.bridge"):
        raise InputError(
            f"Megatron-Bridge is not installed in this Python ({sys.executable}): install it "
            f"without its GPU-only dependencies, then what the conversion needs: {INSTALL_BRIDGE}"
        )
    missing = [m for m in ("torch", "megatron.core", "transformers", "safetensors") if _missing(m)]
    if missing:
        raise InputError(f"not installed in this Python ({sys.executable}): {', '.join(missing)}; "
                         f"install them with: pip install 'mcore-cpu-shim[bridge]'")


def check(args):
    """Check the arguments and folders; returns the spec for the ranks (without the paths of
    this run's own files)."""
    if args.direction == "import":
        ranks = args.ranks or args.tp * args.ep
        if ranks % (args.tp * args.ep):
            raise InputError(f"--ranks {ranks} is not a multiple of --tp {args.tp} x --ep {args.ep}")
        hf = _folder(args.hf, "--hf", "the Hugging Face model folder: config.json and *.safetensors")
        config = read_config(hf, "--hf")
        source = check_safetensors(hf, "--hf")
        out = check_out(args.out, [("--hf", hf)], args.overwrite)
        spec = dict(hf=hf, dtype=args.dtype, tp=args.tp, ep=args.ep, ranks=ranks)
    else:
        megatron = check_megatron(args.megatron)
        hf = _folder(args.hf_config, "--hf-config", "the original Hugging Face model folder, or one with its config.json")
        config = read_config(hf, "--hf-config")
        check_safetensors(hf, "--hf-config", required=False)
        source = None
        out = check_out(args.out, [("--megatron", megatron), ("--hf-config", hf)], args.overwrite)
        spec = dict(megatron=megatron, hf_config=hf, ranks=1, tp=1, ep=1)
    check_packages()
    spec.update(direction=args.direction, out=out, verify=args.verify, timeout=args.timeout)
    return spec, config, source


# --- The ranks ---


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(ranks, base=None):
    """The environment of every rank: CUDA hidden, this package importable, Gloo on loopback,
    and the host's cores shared out (each rank would otherwise start a thread per core)."""
    env = dict(os.environ if base is None else base, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env["WORLD_SIZE"] = str(ranks)
    if "GLOO_SOCKET_IFNAME" not in env and os.path.exists("/sys/class/net/lo"):
        env["GLOO_SOCKET_IFNAME"] = "lo"
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def start_ranks(spec, folder, command=None, env=None):
    """Write the spec and start one process per rank, each in its own session (so that
    killing it ends the helpers it started), output to ``rank<N>.log``. ``env``: the
    environment to start from (default: this process's)."""
    spec = dict(spec, events=folder, address="127.0.0.1", port=free_port())
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    if command is None:
        def command(rank):
            return [sys.executable, "-m", f"{__package__}._convert_rank", spec_path, str(rank)]
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


def _signal_name(code):
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


def _details(records):
    sizes = [r["size"] for r in records if r.get("size") is not None]
    counted = [r for r in records if "tensors" in r]
    parts = []
    if sizes:
        parts.append(_size(sizes[0]))
    if counted:
        parts.append(f"{counted[0]['equal']}/{counted[0]['tensors']} tensors equal")
    return ", ".join(parts)


def supervise(processes, phases, folder, progress, grace=5.0, deadline=None):
    """Follow the ranks phase by phase until all ended, or one failed or died (then the others
    get ``grace`` seconds to record their own error before all are killed), or until
    ``time.monotonic()`` passes ``deadline`` (if given; then all are killed). Returns
    ``{"phases": {name: summary}, "failure": {...} or None, "facts": done record of rank 0}``."""
    ranks = len(processes)
    summaries, died_at, failed_at = {}, {}, None

    def events():
        return [_read_events(os.path.join(folder, f"rank{r}.jsonl")) for r in range(ranks)]

    def follow():
        every = events()
        while len(summaries) < len(phases) and all(s["ok"] for s in summaries.values()):
            name = phases[len(summaries)]
            ended = [dict(e, rank=r) for r, evs in enumerate(every) for e in evs if e.get("phase") == name and "ok" in e]
            if not any(not e["ok"] for e in ended) and len(ended) < ranks:
                started = [e["t"] for evs in every for e in evs if e.get("phase") == name and e.get("started")]
                if started:
                    progress.running(name, time.time() - min(started))
                break
            ok = all(e["ok"] for e in ended)
            summaries[name] = dict(ok=ok, seconds=max((e["seconds"] or 0) for e in ended), details=_details(ended))
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
    return {"phases": summaries, "failure": _first_failure(every, processes, died_at, phases, folder),
            "facts": next((e for e in every[0] if e.get("done")), {}) if every else {}}


def _first_failure(every, processes, died_at, phases, folder):
    """The failure to report: a rank that died without recording why (the others' errors
    follow from it), else the error recorded first."""
    recorded = {r for r, evs in enumerate(every) for e in evs if e.get("ok") is False and "phase" in e}
    silent = [r for r in died_at if r not in recorded]
    if silent:
        rank = min(silent, key=died_at.get)
        code = processes[rank].returncode
        how = f"was killed by {_signal_name(code)}" if code < 0 else f"exited with status {code}"
        if code == -signal.SIGKILL:
            how += " (out of memory?)"
        started = [e["phase"] for e in every[rank] if e.get("started")]
        return dict(rank=rank, phase=started[-1] if started else None, error=f"the process {how}",
                    where="", traceback=_log_tail(folder, rank), input=False)
    errors = [dict(e, rank=r) for r, evs in enumerate(every) for e in evs if e.get("ok") is False and "phase" in e]
    if errors:
        return min(errors, key=lambda e: e["t"])
    unfinished = [r for r, p in enumerate(processes) if p.returncode != 0]
    if unfinished:  # still running when stopped (cannot happen without a failure) or ended oddly
        return dict(rank=unfinished[0], phase=None, error="stopped before it finished", where="",
                    traceback=_log_tail(folder, unfinished[0]), input=False)
    done = {e.get("phase") for evs in every for e in evs if e.get("ok")}
    lacking = [p for p in phases if p not in done]
    if lacking:
        return dict(rank=0, phase=lacking[0], error="the ranks ended without finishing this phase",
                    where="", traceback=_log_tail(folder, 0), input=False)
    return None


def _log_tail(folder, rank, lines=15):
    try:
        with open(os.path.join(folder, f"rank{rank}.log"), errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def execute(spec, folder, stream=None, command=None):
    """Run the ranks of ``spec`` in ``folder`` with progress on ``stream``; returns the
    outcome of ``supervise``."""
    stream = stream or sys.stdout
    processes = start_ranks(spec, folder, command)
    return supervise(processes, phases_of(spec), folder, Progress(stream))


def report_failure(prog, failure, folder):
    if failure.get("input"):
        print(f"{prog}: error: {failure['error'].split(': ', 1)[-1]}", file=sys.stderr)
        return 2
    if failure.get("mismatch"):
        print(f"{prog}: verify failed, the output was not kept: {failure['error']}", file=sys.stderr)
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


def _facts_line(facts):
    versions = [f"{name} {facts[key]}" for name, key in (("megatron-core", "megatron_core"),
                ("Megatron-Bridge", "megatron_bridge"), ("torch", "torch")) if facts.get(key)]
    cuda = {True: "yes", False: "no"}.get(facts.get("cuda_initialized"), "unknown")
    return f"{', '.join(versions)}; CUDA initialised: {cuda}"


def _describe(spec, source):
    if spec["direction"] == "import":
        parallel = f"{spec['ranks']} rank{'s' if spec['ranks'] > 1 else ''}, TP {spec['tp']}, EP {spec['ep']}"
        dtype = spec["dtype"] or "the model's dtype"
        weights = f"{source['tensors']} tensors, {_size(source['bytes'])} in {source['files']} file(s)"
        return f"{spec['hf']} ({weights}) -> {spec['out']} ({parallel}, {dtype})"
    return f"{spec['megatron']} -> {spec['out']} (config and tokenizer from {spec['hf_config']})"


def _move_aside(out):
    """Make ``out`` an empty folder; an existing non-empty one (``--overwrite``) is renamed to
    a hidden sibling first and returned, to be deleted on success or put back on failure."""
    backup = None
    if os.path.isdir(out) and os.listdir(out):
        backup = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.replaced-", dir=os.path.dirname(out))
        os.rmdir(backup)
        os.rename(out, backup)
    os.makedirs(out, exist_ok=True)
    return backup


def _settle(out, backup, existed, success):
    if success:
        if backup:
            shutil.rmtree(backup, ignore_errors=True)
        return
    shutil.rmtree(out, ignore_errors=True)  # what the failed conversion wrote
    if backup:
        os.rename(backup, out)
    elif existed:
        os.makedirs(out, exist_ok=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def run(args):
    prog = f"mcore-cpu-shim convert {args.direction}"
    try:
        spec, config, source = check(args)
    except InputError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    out = spec["out"]
    existed = os.path.isdir(out)
    backup = _move_aside(out)
    folder = tempfile.mkdtemp(prefix="mcore-cpu-shim-convert-")
    print(f"{prog}: {_describe(spec, source)}", flush=True)
    outcome = None
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM stops the ranks as Ctrl-C does
    try:
        outcome = execute(spec, folder)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; every rank stopped, {out} left as it was", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
        failure = outcome["failure"] if outcome else {}
        _settle(out, backup, existed, success=failure is None)
        if failure is None or failure.get("input") or failure.get("mismatch"):
            shutil.rmtree(folder, ignore_errors=True)
    if failure is not None:
        return report_failure(prog, failure, folder)
    print(_facts_line(outcome["facts"]))
    print(f"done: {out}")
    return 0
