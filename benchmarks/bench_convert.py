"""Benchmark (not a test): what ``mcore-cpu-shim convert import`` costs, against the floor.

The conversion users run: a Llama-like Hugging Face model folder (random bfloat16 weights in
safetensors shards, written locally by ``mcore_cpu_shim.app.hf_models``) converted to a Megatron
``torch_dist`` checkpoint with ``--verify``, by the ranks of ``mcore-cpu-shim convert``
(``convert.check``, ``launch.start_ranks``, ``launch.supervise``; Megatron-Bridge's public API in a fresh
process with CUDA hidden, the shim active). Per phase, the wall time and the peak RSS:

  start + imports   process start, the shim, torch, megatron-core, Megatron-Bridge, transformers,
                    and Bridge's checkpointing module (with NVIDIA ModelOpt), which the first
                    save_megatron_model would otherwise import
  load HF           AutoBridge.from_hf_pretrained (config, lazy safetensors index), Gloo group
  build model       the provider, model-parallel state, the megatron model (CPU initialisation)
  copy weights      Bridge's hook: every HF tensor read, mapped (QKV / gate-up fused) and copied
  save              save_megatron_model (torch_dist, low_memory_save)
  reload + verify   load_megatron_model into a fresh model, export_hf_weights, exact comparison

Side by side, in the same run, three floors, each a fresh process (same environment): the
disk's own limit (the safetensors files' bytes read whole and written once to one file, no
tensor library imported), and a process that reads the same safetensors
(``safetensors.torch.load_file``: the files are mapped, so the reading shows in the write,
which touches every page, as Bridge's reads do) and writes them once with ``torch.save`` and
once (another process) with ``safetensors.torch.save_file``; each then fsyncs the file
(megatron-core's writer fsyncs what it writes; the fsync is a row of its own). Repetitions
alternate (convert, raw, torch.save, save_file, convert, ...) so that drift on a shared machine
hits all of them; medians are reported. The ratios:

  time   conversion / floor: end to end (process start to the end of save, i.e. without
         verify; the floor's start to its fsync), and the work alone (load HF .. save against
         read + write + fsync)
  memory peak RSS / model bytes (the safetensors data), for the conversion and the floors

Peak RSS per phase: the process's own high-water mark (``VmHWM``, exact: reset at every phase
start through ``/proc/self/clear_refs``; sampled where that is not allowed) plus the peak of
its children's private memory (megatron-core's checkpoint writer: a spawned queue manager and
forked writer processes; sampled every 0.25 s; private pages only, as a forked child's RSS
counts the pages it shares with the rank again): an upper bound of the two at the same time.
Both include the interpreter with its libraries (the "start + imports" row shows how much).
The model files are in the page cache for every side (just written, or read by the last run).

    python benchmarks/bench_convert.py --size tiny                # smoke run, seconds
    python benchmarks/bench_convert.py --size 1B --reps 3
    python benchmarks/bench_convert.py --hf DIR --export          # + convert export --verify
    python benchmarks/bench_convert.py --size 0.5B --json         # JSON alone on stdout
    python benchmarks/bench_convert.py --hf ~/models/SomeLlama    # a model folder you have
    python benchmarks/bench_convert.py --size 3B --reps 2 --compare-save
                                    # + a conversion whose save has Bridge's low_memory_save=False

Run it where ``mcore-cpu-shim convert`` runs (Megatron-Bridge, megatron-core, torch,
transformers, safetensors and psutil importable), e.g. ``PYTHONPATH=.:.mcore/bridge-0.3.1:.mcore/0.16.1``.
Memory: the conversion peaks at about 0.7 GB + 1.5 x the model bytes (in verify; see
docs/benchmark.md); writing the model folder first takes 4 bytes a parameter (float32) plus
the interpreter (``--hf`` skips it). Disk: the model folder and one checkpoint.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# First, before torch (a measured process imports torch later): the shim is active from here on.
from mcore_cpu_shim.app.worker import Phases  # noqa: E402

# Llama-like shapes (hf_models' "llama" family with these overrides), untied embeddings and a
# 32000-word vocabulary throughout: 0.5B of our own, 1B as TinyLlama-1.1B, 3B as Llama-3.2-3B.
SIZES = {
    "tiny": {},  # hf_models' own tiny llama
    "0.5B": dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=12,
                 num_key_value_heads=4, head_dim=128, vocab_size=32000),
    "1B": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, head_dim=64, vocab_size=32000),
    "3B": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, vocab_size=32000),
}
CONVERT_ROWS = (("imports", "start + imports"), ("load HF", "load HF"), ("build model", "build model"),
                ("copy weights", "copy weights"), ("save", "save"), ("verify", "reload + verify"))
EXPORT_ROWS = (("imports", "start + imports"), ("load HF config", "load HF config"),
               ("load Megatron", "load Megatron"), ("save HF", "save HF"), ("verify", "reload + verify"))
EXPORT_WORK = ("load HF config", "load Megatron", "save HF")
FLOOR_ROWS = (("imports", "start + imports"), ("read", "read safetensors"), ("write", "write"), ("fsync", "fsync"))
FLOORS = {"raw": "raw read + write", "torch": "torch.save", "safetensors": "safetensors save_file"}
FIGURES = ("seconds", "peak", "rss_peak", "children_peak", "rss_end")  # per phase (bytes, but seconds)
WORK = ("load HF", "build model", "copy weights", "save")  # the conversion without imports and verify
# Set for --compare-save's second conversion: Bridge's save without its low-memory flow.
PLAIN_SAVE = "MCORE_CPU_SHIM_BENCH_PLAIN_SAVE"


def parameter_count(config):
    """The parameters of a Llama ``config`` (a transformers config), by its shapes."""
    h, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or h // config.num_attention_heads
    attention = 2 * h * config.num_attention_heads * head_dim + 2 * h * config.num_key_value_heads * head_dim
    layer = attention + 3 * h * config.intermediate_size + 2 * h  # q, k, v, o; gate, up, down; 2 norms
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + layers * layer + h


# ---------------------------------------------------------------- in the measured processes


def _status_bytes(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return None


def _reset_high_water_mark():
    """Reset this process's VmHWM to its current RSS (Linux, ``clear_refs`` 5); False where
    that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM") is not None
    except OSError:
        return False


def _private_bytes(process):
    """The memory only ``process`` (a psutil.Process) holds: its private pages (USS). A forked
    child shares the pages of its parent until it writes them; its RSS counts them again."""
    try:
        total = 0
        with open(f"/proc/{process.pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:", "Private_Hugetlb:")):
                    total += int(line.split()[1]) * 1024
        return total
    except FileNotFoundError:
        return process.memory_info().rss
    except OSError:  # gone, or not allowed
        return 0


class MeasuredPhases(Phases):
    """``worker.Phases`` whose end records also hold the phase's peak memory, in bytes:
    ``rss_peak`` (this process: VmHWM, exact), ``children_peak`` (the sum of its children's
    private memory, sampled every ``interval`` seconds), ``peak`` (their sum: an upper bound of
    the two at the same time) and ``rss_end``. The phase "imports" starts at once."""

    def __init__(self, events_path, strict=False, interval=0.25):
        import psutil

        super().__init__(events_path, strict=strict)
        self.me, self.interval = psutil.Process(), interval
        self.exact = _reset_high_water_mark()  # else this process's RSS is sampled as well
        self.lock = threading.Lock()
        self._reset()
        threading.Thread(target=self._sample, name="bench-rss", daemon=True).start()
        self.start("imports")

    def _reset(self):
        with self.lock:
            self.self_peak = self.me.memory_info().rss
            self.children_peak = 0

    def _sample(self):
        while True:
            children = sum(_private_bytes(child) for child in self.me.children(recursive=True))
            own = 0 if self.exact else self.me.memory_info().rss
            with self.lock:
                self.children_peak = max(self.children_peak, children)
                self.self_peak = max(self.self_peak, own)
            time.sleep(self.interval)

    def start(self, name):
        super().start(name)  # ends the current phase (recording its memory)
        if self.exact:
            _reset_high_water_mark()
        self._reset()

    def end(self, **facts):
        with self.lock:
            own = max(self.self_peak, _status_bytes("VmHWM") if self.exact else 0)
            children = self.children_peak
        super().end(**facts, rss_peak=own, children_peak=children, peak=own + children,
                    rss_end=_status_bytes("VmRSS"))


def rank_main(spec_path, rank):
    """One rank of the conversion: ``worker.main`` with the imports as a phase of their own
    and ``MeasuredPhases``."""
    from mcore_cpu_shim.app import convert_worker, worker

    def run(spec, rank, phases):
        import torch  # noqa: F401
        import transformers  # noqa: F401
        from megatron.bridge import AutoBridge  # noqa: F401
        # save_megatron_model imports this on its first call (with NVIDIA ModelOpt: seconds)
        import megatron.bridge.training.model_load_save  # noqa: F401

        if os.environ.get(PLAIN_SAVE) == "1":  # --compare-save's second conversion
            save = AutoBridge.save_megatron_model

            def save_megatron_model(self, *args, **kwargs):
                return save(self, *args, **dict(kwargs, low_memory_save=False))

            AutoBridge.save_megatron_model = save_megatron_model
        # (their first phase ends "imports")
        (convert_worker.run_import if spec["direction"] == "import" else convert_worker.run_export)(spec, rank, phases)

    worker.main(spec_path, rank, run, phases_class=MeasuredPhases)


def floor_main(kind, hf, out, events_path):
    """The floor: read every safetensors file of ``hf`` into memory, write it all to ``out``
    (``raw``: the files' bytes as they are, one after another, without torch)."""
    phases = MeasuredPhases(events_path)
    files = [os.path.join(hf, name) for name in sorted(os.listdir(hf)) if name.endswith(".safetensors")]
    if kind == "raw":
        phases.start("read")
        contents = []
        for path in files:
            with open(path, "rb") as f:
                contents.append(f.read())
        phases.start("write")
        with open(out, "wb") as f:
            for data in contents:
                f.write(data)
    else:
        import torch
        from safetensors.torch import load_file, save_file

        phases.start("read")
        state = {}
        for path in files:
            state.update(load_file(path))
        phases.start("write")
        if kind == "torch":
            torch.save(state, out)
        else:
            save_file(state, out)
    phases.start("fsync")  # megatron-core's writer fsyncs every file it writes
    fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    phases.end(size=os.path.getsize(out))
    phases.record(done=True, ok=True)


def write_main(size, folder):
    """Write the model of ``size`` to ``folder``; first a JSON line with its parameter count."""
    from mcore_cpu_shim.app import hf_models

    print(json.dumps({"parameters": parameter_count(hf_models.config("llama", **SIZES[size]))}), flush=True)
    hf_models.write("llama", folder, dtype="bfloat16", seed=0, **SIZES[size])


# ---------------------------------------------------------------- driver


def write_model(size, hf, say):
    """Write the ``size`` preset to ``hf`` in a process of its own; ``(parameters, seconds)``."""
    start = time.perf_counter()
    writer = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--write", size, hf],
                              env=environment(), stdout=subprocess.PIPE, text=True)
    line = writer.stdout.readline()
    expected = json.loads(line)["parameters"] if line else None
    if expected:
        say(f"writing the llama {size} preset ({expected:,} parameters, bfloat16) ...")
    writer.communicate()  # whatever else it printed
    if writer.returncode != 0:
        raise SystemExit(f"bench_convert: writing the model failed (exit status {writer.returncode})")
    return expected, time.perf_counter() - start


def environment():
    """The environment of every measured process: the ranks' own (CUDA hidden, this package
    importable, the cores shared out) for one rank."""
    from mcore_cpu_shim.app.launch import rank_environment

    return rank_environment(1)


def phase_table(events, spawned):
    """``{phase: {figure: value}}`` (``FIGURES``) of one process's events; "imports" counts
    from ``spawned`` (the parent's clock before it started the process)."""
    table = {}
    for event in events:
        if event.get("ok") and "phase" in event and "seconds" in event:
            row = {k: event.get(k) for k in FIGURES}
            if event["phase"] == "imports":
                row["seconds"] = event["t"] - spawned
            table[event["phase"]] = row
    return table


def run_convert(hf, out, folder, stream, plain_save=False, layout=(), export=None):
    """One ``convert import --verify`` of ``hf`` (``layout``: more options, e.g. ``--ranks 2
    --tp 2``). ``phases`` is rank 0's phase table, ``ranks`` every rank's. ``export``: a
    folder to ``convert export --verify`` the checkpoint into next (its run under "export")."""
    shutil.rmtree(out, ignore_errors=True)
    result, source = run_command(["import", "--hf", hf, "--out", out, "--verify", *layout], folder, stream, plain_save)
    if export:
        print("  convert export --verify:", file=stream, flush=True)
        result["export"], _ = run_command(["export", "--megatron", out, "--hf-config", hf, "--out", export, "--verify"],
                                          folder + "-export", stream)
        shutil.rmtree(export, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    return result, source


def run_command(argv, folder, stream, plain_save=False):
    """``convert ARGV`` through the command's own checks, launcher and supervisor, each rank
    measured; ``(result, the source's facts)``."""
    from mcore_cpu_shim.app import cli, convert, launch
    from mcore_cpu_shim.app.convert_worker import phases_of

    os.makedirs(folder)
    args = cli.build_parser().parse_args(["convert", *argv])
    spec, _, source = convert.check(args)
    spec_path = os.path.join(folder, "spec.json")  # start_ranks writes it there

    spawned = time.time()
    env = dict(os.environ, **{PLAIN_SAVE: "1"}) if plain_save else None
    ranks = launch.start_ranks(spec, folder, "convert_worker", env=env,
                               command=[sys.executable, os.path.abspath(__file__), "--rank", spec_path])
    outcome = launch.supervise(ranks, ("imports",) + phases_of(spec), launch.Progress(stream))
    ended = time.time()
    if outcome["failure"] is not None:  # keep the rank logs: the working folder goes
        logs = shutil.move(folder, tempfile.mkdtemp(prefix="mcore-cpu-shim-bench-convert-logs-"))
        raise SystemExit(launch.report_failure(f"bench_convert: convert {argv[0]}", outcome["failure"], logs))
    events = [launch.read_events(os.path.join(folder, f"rank{rank}.jsonl")) for rank in range(spec["ranks"])]
    tables = [phase_table(each, spawned) for each in events]
    written = "save" if argv[0] == "import" else "save HF"
    size = next((e.get("size") for e in events[0] if e.get("phase") == written and e.get("ok")), None)
    return dict(phases=tables[0], ranks=tables, wall=ended - spawned, out_bytes=size, facts=outcome["facts"]), source


def run_floor(kind, hf, workdir, stream):
    from mcore_cpu_shim.app.launch import read_events

    out = os.path.join(workdir, f"floor.{dict(raw='bin', torch='pt').get(kind, 'safetensors')}")
    events = os.path.join(workdir, f"floor-{kind}.jsonl")
    log = os.path.join(workdir, f"floor-{kind}.log")
    for path in (out, events):
        if os.path.exists(path):
            os.remove(path)
    spawned = time.time()
    with open(log, "w") as f:
        code = subprocess.call([sys.executable, os.path.abspath(__file__), "--floor", kind, hf, out, events],
                               env=environment(), stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    ended = time.time()
    if code != 0:
        with open(log) as f:
            sys.stderr.write(f.read()[-6000:])
        raise SystemExit(f"bench_convert: the {FLOORS[kind]} floor failed (exit status {code}; its log is above)")
    table = phase_table(read_events(events), spawned)
    size = os.path.getsize(out)
    os.remove(out)
    print(f"  {FLOORS[kind]}: " + ", ".join(f"{name} {row['seconds']:.1f} s" for name, row in table.items()),
          file=stream, flush=True)
    return dict(phases=table, wall=ended - spawned, out_bytes=size)


def medians(runs):
    """Per phase, the median of each figure over ``runs``."""
    names = [name for name in runs[0]["phases"]]
    return {name: {key: statistics.median(r["phases"][name][key] for r in runs)
                   for key in FIGURES}
            for name in names}


def end_to_end(runs, last):
    """Median seconds from the process start to the end of phase ``last`` (imports included)."""
    def one(run):
        total = 0.0
        for name, row in run["phases"].items():
            total += row["seconds"]
            if name == last:
                return total
        raise KeyError(last)

    return statistics.median(one(r) for r in runs)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="tiny",
                        help="the Llama-like model to write and convert (default tiny: a smoke run)")
    parser.add_argument("--hf", metavar="DIR", help="convert this Hugging Face model folder instead of writing one")
    parser.add_argument("--reps", type=int, default=1, help="repetitions of each side (default 1); medians reported")
    parser.add_argument("--dir", help="where to write the model and checkpoints (default: a temporary folder)")
    parser.add_argument("--keep-model", action="store_true",
                        help="keep the written model folder (its path is printed) for --hf next time")
    parser.add_argument("--no-floor", action="store_true", help="the conversion alone (no ratios)")
    parser.add_argument("--compare-save", action="store_true",
                        help="also convert with Bridge's save_megatron_model(low_memory_save=False), side by side")
    parser.add_argument("--export", action="store_true",
                        help="also convert each checkpoint back (convert export --verify), measured the same way")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (the rest on stderr)")
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be 1 or more")
    stream = sys.stderr if args.json else sys.stdout

    def say(text=""):
        print(text, file=stream, flush=True)

    workdir = tempfile.mkdtemp(prefix="mcore-cpu-shim-bench-convert-", dir=args.dir)
    written = None
    try:
        if args.hf:
            hf, label, write_seconds = os.path.abspath(args.hf), args.hf, None
        else:
            label = f"llama {args.size} preset"
            hf = written = os.path.join(workdir, f"llama-{args.size}")
            expected, write_seconds = write_model(args.size, hf, say)
        runs = {"convert": [], "plain": [], **{kind: [] for kind in FLOORS}}
        source = None
        sides = ["convert"] + (["plain"] if args.compare_save else []) + ([] if args.no_floor else list(FLOORS))
        for rep in range(args.reps):
            say(f"rep {rep + 1}/{args.reps}")
            for side in sides[rep % len(sides):] + sides[: rep % len(sides)]:
                if side in ("convert", "plain"):
                    say("  convert import --verify" + (" (low_memory_save=False):" if side == "plain" else ":"))
                    result, source = run_convert(hf, os.path.join(workdir, "megatron"),
                                                 os.path.join(workdir, f"{side}-{rep}"), stream,
                                                 plain_save=side == "plain",
                                                 export=os.path.join(workdir, "exported") if args.export and side == "convert" else None)
                else:
                    result = run_floor(side, hf, workdir, stream)
                runs[side].append(result)
    finally:
        if written and args.keep_model:
            kept = os.path.join(args.dir or tempfile.gettempdir(), os.path.basename(written))
            if os.path.isdir(written) and not os.path.exists(kept):
                shutil.move(written, kept)
            print(f"model kept in {kept} (pass --hf {kept} next time)", file=stream)
        shutil.rmtree(workdir, ignore_errors=True)

    model_bytes = source["bytes"]
    parameters = model_bytes // 2 if not args.hf else None  # bfloat16 throughout
    if not args.hf and parameters != expected:
        say(f"note: {parameters:,} parameters in the files, {expected:,} by the shapes")
    gib = 2**30
    report = {
        "model": label, "hf": None if written else hf, "parameters": parameters, "model_bytes": model_bytes,
        "files": source["files"], "tensors": source["tensors"], "write_seconds": write_seconds, "reps": args.reps,
        "facts": {k: runs["convert"][0]["facts"].get(k) for k in ("torch", "megatron_core", "megatron_bridge",
                                                                  "cuda_initialized")},
        "checkpoint_bytes": runs["convert"][0]["out_bytes"],
        "convert": medians(runs["convert"]),
    }
    convert_e2e = end_to_end(runs["convert"], "save")
    convert_work = statistics.median(sum(r["phases"][p]["seconds"] for p in WORK) for r in runs["convert"])
    peak_convert = max(report["convert"][p]["peak"] for p, _ in CONVERT_ROWS if p != "verify")
    report["convert_seconds"] = {"end_to_end_to_save": convert_e2e, "work": convert_work,
                                 "verify": report["convert"]["verify"]["seconds"]}
    base = report["convert"]["imports"]["peak"]  # the interpreter with its libraries
    report["ratios"] = {
        "peak_rss_over_model_bytes": {"convert": peak_convert / model_bytes,
                                      "verify": report["convert"]["verify"]["peak"] / model_bytes},
        "added_rss_over_model_bytes": {"convert": (peak_convert - base) / model_bytes,
                                       "verify": (report["convert"]["verify"]["peak"] - base) / model_bytes},
    }
    if args.export:
        exports = [r["export"] for r in runs["convert"]]
        report["export"] = medians(exports)
        report["export_seconds"] = {
            "end_to_end_to_save": end_to_end(exports, "save HF"),
            "work": statistics.median(sum(r["phases"][p]["seconds"] for p in EXPORT_WORK) for r in exports)}
        peak_export = max(row["peak"] for p, row in report["export"].items() if p != "verify")
        report["ratios"]["peak_rss_over_model_bytes"]["export"] = peak_export / model_bytes
        report["ratios"]["added_rss_over_model_bytes"]["export"] = (
            (peak_export - report["export"]["imports"]["peak"]) / model_bytes)
    for kind in ([] if args.no_floor else FLOORS):
        report[f"floor_{kind}"] = medians(runs[kind])
        e2e = end_to_end(runs[kind], "fsync")
        work = statistics.median(sum(r["phases"][p]["seconds"] for p in ("read", "write", "fsync")) for r in runs[kind])
        report[f"floor_{kind}_seconds"] = {"end_to_end": e2e, "work": work}
        report["ratios"][f"convert_over_{kind}_end_to_end"] = convert_e2e / e2e
        report["ratios"][f"convert_over_{kind}_work"] = convert_work / work
        if args.export:
            report["ratios"][f"export_over_{kind}_end_to_end"] = report["export_seconds"]["end_to_end_to_save"] / e2e
            report["ratios"][f"export_over_{kind}_work"] = report["export_seconds"]["work"] / work
        peak = max(row["peak"] for row in report[f"floor_{kind}"].values())
        report["ratios"]["peak_rss_over_model_bytes"][kind] = peak / model_bytes
        report["ratios"]["added_rss_over_model_bytes"][kind] = (
            (peak - report[f"floor_{kind}"]["imports"]["peak"]) / model_bytes)

    # ---- the table
    facts = report["facts"]
    say()
    say(f"model: {label}" + (f", {parameters:,} parameters" if parameters else "")
        + f", {model_bytes / gib:.2f} GiB in {source['files']} safetensors file(s), {source['tensors']} tensors"
        + (f"; written in {write_seconds:.0f} s" if write_seconds else ""))
    say(f"megatron-core {facts['megatron_core']}, Megatron-Bridge {facts['megatron_bridge']}, torch {facts['torch']}, "
        f"CUDA initialised: {facts['cuda_initialized']}; {os.cpu_count()} cores; "
        f"median of {args.reps} rep(s)")
    say(f"{'':26}{'seconds':>9}{'peak GiB':>10}{'process':>10}{'children':>10}{'peak / model':>14}"
        f"{'added / model':>15}")

    def rows(title, table, names, total_label, total):
        say(title)
        base = table["imports"]["peak"]
        for key, name in names:
            row = table[key]
            say(f"  {name:24}{row['seconds']:9.1f}{row['peak'] / gib:10.2f}{row['rss_peak'] / gib:10.2f}"
                f"{row['children_peak'] / gib:10.2f}{row['peak'] / model_bytes:14.2f}"
                f"{(row['peak'] - base) / model_bytes:15.2f}")
        say(f"  {total_label:24}{total:9.1f}")

    rows("convert import --verify", report["convert"], CONVERT_ROWS, "start to end of save", convert_e2e)
    if args.compare_save:
        report["convert_plain_save"] = plain = medians(runs["plain"])
        rows("the same, Bridge's save with low_memory_save=False (verify: the model stays alive)", plain,
             CONVERT_ROWS, "start to end of save", end_to_end(runs["plain"], "save"))
    if args.export:
        rows("convert export --verify", report["export"], EXPORT_ROWS, "start to end of save HF",
             report["export_seconds"]["end_to_end_to_save"])
    for kind in ([] if args.no_floor else FLOORS):
        rows(f"floor: {FLOORS[kind]}", report[f"floor_{kind}"], FLOOR_ROWS, "start to end of fsync",
             report[f"floor_{kind}_seconds"]["end_to_end"])
    ratios = report["ratios"]
    if not args.no_floor:
        say("conversion time / floor time (conversion without verify):")
        for kind in FLOORS:
            say(f"  vs {FLOORS[kind]:22} end to end {ratios[f'convert_over_{kind}_end_to_end']:6.2f}"
                f"   work only (load HF..save / read+write+fsync) {ratios[f'convert_over_{kind}_work']:6.2f}")
        if args.export:
            say("export time / floor time (export without verify):")
            for kind in FLOORS:
                say(f"  vs {FLOORS[kind]:22} end to end {ratios[f'export_over_{kind}_end_to_end']:6.2f}"
                    f"   work only (load HF config..save HF / read+write+fsync) {ratios[f'export_over_{kind}_work']:6.2f}")
    peaks, added = ratios["peak_rss_over_model_bytes"], ratios["added_rss_over_model_bytes"]
    say("peak RSS / model bytes (in brackets: above the process after its imports): " + ", ".join(
        f"{name} {peaks[key]:.2f} ({added[key]:.2f})"
        for key, name in (("convert", "conversion to save"), ("verify", "verify"), ("export", "export to save HF"),
                          ("raw", "raw floor"),
                          ("torch", "torch.save floor"), ("safetensors", "save_file floor")) if key in peaks))
    if args.compare_save:
        low, plain = report["convert"]["save"], report["convert_plain_save"]["save"]
        report["ratios"]["save_plain_over_low_memory"] = {"seconds": plain["seconds"] / low["seconds"],
                                                          "peak": plain["peak"] / low["peak"]}
        say(f"save with low_memory_save=False / True (Bridge's default for import_ckpt and convert): "
            f"seconds {plain['seconds'] / low['seconds']:.2f}, peak RSS {plain['peak'] / low['peak']:.2f}")
    if args.json:
        report["runs"] = runs
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        rank_main(sys.argv[2], int(os.environ["RANK"]))
    elif sys.argv[1:2] == ["--floor"]:
        floor_main(*sys.argv[2:6])
    elif sys.argv[1:2] == ["--write"]:
        write_main(sys.argv[2], sys.argv[3])
    else:
        sys.exit(main())
