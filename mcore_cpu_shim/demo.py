"""``mcore-cpu-shim demo``: a CPU-only torch_dist round trip of a GPT-OSS-like model, twice.

The model (local spec, YaRN RoPE, learnable softmax offsets, alltoall MoE) is built with
``use_cpu_initialization=True`` by N ranks in a Gloo group (expert parallelism E), saved with
``dist_checkpointing``, reloaded into a freshly built model, compared tensor by tensor, and run
forward (original and reloaded, logits compared). Once without the shim (every fix disabled
and the Transformer Engine import guard off: ``MCORE_CPU_SHIM_DISABLE=all``,
``MCORE_CPU_SHIM_TE=off``, so what megatron-core does on its own, including dying at import
on a Transformer Engine that cannot load) and once with the shim as this environment
configures it. Each rank is a fresh interpreter with CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``), so the demo is safe on a GPU host too; in the second pass every
step runs under ``forbid_cuda()``.

Exit status: 0 if every step of the shim pass passed, every tensor and the logits are equal,
CUDA was never initialised and no driver library was mapped; 1 otherwise; 2 for bad options.
Nothing here imports torch: the ranks do.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from ._demo_rank import STEPS

PASSES = (("without shim", "without-shim"), ("with shim", "with-shim"))
# The pass without the shim: no fix and no Transformer Engine guard.
WITHOUT_SHIM = {"MCORE_CPU_SHIM_DISABLE": "all", "MCORE_CPU_SHIM_TE": "off"}


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo",
        help="save and reload a GPT-OSS-like MoE model on the CPU, without and with the shim",
        description=__doc__.split("\n\n")[1],
    )
    size = p.add_argument_group("model size")
    size.add_argument("--layers", type=_positive, default=2, help="transformer layers (default 2)")
    size.add_argument("--hidden", type=_positive, default=64, help="hidden size (default 64)")
    size.add_argument("--heads", type=_positive, default=4, help="attention heads (default 4)")
    size.add_argument("--query-groups", type=_positive, default=2, help="key/value heads (default 2)")
    size.add_argument("--ffn", type=_positive, default=128, help="expert FFN size (default 128)")
    size.add_argument("--experts", type=_positive, default=4, help="MoE experts (default 4)")
    size.add_argument("--topk", type=_positive, default=2, help="experts per token (default 2)")
    size.add_argument("--vocab", type=_positive, default=256, help="vocabulary size (default 256)")
    size.add_argument("--seq-len", type=_positive, default=32, help="sequence length (default 32)")
    p.add_argument("--ranks", type=_positive, default=2, help="Gloo ranks (default 2)")
    p.add_argument("--ep", type=_positive, default=2, help="expert parallelism (default 2)")
    p.add_argument("--output-dir", help="where to write (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and rank logs")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--timeout", type=_positive, default=600, help="seconds per pass (default 600)")
    p.set_defaults(func=run, parser=p)
    return p


def _positive(text):
    import argparse

    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def _check(args):
    problems = []
    if args.ranks % args.ep:
        problems.append(f"--ranks {args.ranks} is not a multiple of --ep {args.ep}")
    if args.experts % args.ep:
        problems.append(f"--experts {args.experts} is not a multiple of --ep {args.ep}")
    if args.hidden % args.heads:
        problems.append(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    if args.heads % args.query_groups:
        problems.append(f"--heads {args.heads} is not a multiple of --query-groups {args.query_groups}")
    if args.topk > args.experts:
        problems.append(f"--topk {args.topk} is more than --experts {args.experts}")
    if problems:
        args.parser.error("; ".join(problems))


def _package_root():
    """The folder to put on a rank's PYTHONPATH so that this package imports by its name."""
    here = os.path.dirname(os.path.abspath(__file__))
    for _ in __package__.split("."):
        here = os.path.dirname(here)
    return here


def _read_events(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def run_pass(args, label, folder, extra_env, progress):
    """Run every rank of one pass; return ``{"steps": {...}, "ranks": [facts...], ...}``."""
    os.makedirs(folder, exist_ok=True)
    spec = dict(
        layers=args.layers, hidden=args.hidden, heads=args.heads, query_groups=args.query_groups,
        ffn=args.ffn, experts=args.experts, topk=args.topk, vocab=args.vocab, seq_len=args.seq_len,
        ranks=args.ranks, ep=args.ep, strict=not extra_env, store=os.path.join(folder, "store"),
        checkpoint=os.path.join(folder, "checkpoint"), events=folder,
    )
    spec_path = os.path.join(folder, "spec.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **extra_env)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [_package_root(), env.get("PYTHONPATH")]))
    module = f"{__package__}._demo_rank"
    processes = []
    for rank in range(args.ranks):
        log = open(os.path.join(folder, f"rank{rank}.log"), "w")
        processes.append(
            subprocess.Popen(
                [sys.executable, "-m", module, spec_path, str(rank)],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )
        )
        log.close()

    steps = {}

    def report_finished_steps():
        # A step is over once every rank recorded it, or one rank failed it.
        events = [_read_events(os.path.join(folder, f"rank{r}.jsonl")) for r in range(args.ranks)]
        while len(steps) < len(STEPS) and all(s["ok"] for s in steps.values()):
            name = STEPS[len(steps)]
            records = [e for rank_events in events for e in rank_events if e.get("step") == name]
            failures = [e for e in records if not e["ok"]]
            if not failures and len(records) < args.ranks:
                break
            steps[name] = _summarise(name, records, failures)
            progress(label, name, steps[name])

    deadline, failed_at = time.monotonic() + args.timeout, None
    while True:
        report_finished_steps()
        codes = [p.poll() for p in processes]
        if None not in codes:
            break
        if any(code not in (None, 0) for code in codes) or not all(s["ok"] for s in steps.values()):
            # A failed rank: the others may wait for it in a collective; give them a moment.
            failed_at = failed_at or time.monotonic()
            if time.monotonic() - failed_at > 15:
                break
        if time.monotonic() > deadline:
            break
        time.sleep(0.2)
    report_finished_steps()  # what the ranks wrote between the last look and their exit
    hung = [rank for rank, p in enumerate(processes) if p.poll() is None]
    for p in processes:
        # The whole session of the rank: megatron-core's checkpoint writer starts a helper
        # process that outlives a rank that ended abruptly.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()

    events = [_read_events(os.path.join(folder, f"rank{r}.jsonl")) for r in range(args.ranks)]
    ranks = [next((e for e in rank_events if e.get("done")), None) for rank_events in events]
    if len(steps) < len(STEPS) and not any(not s["ok"] for s in steps.values()):
        name = STEPS[len(steps)]
        reason = f"ranks {hung} still running after {args.timeout} s" if hung else "a rank ended early"
        steps[name] = dict(ok=False, error=f"stopped: {reason} (see rank*.log)", where="", seconds=None, size=None)
        progress(label, name, steps[name])
    for name in STEPS:
        steps.setdefault(name, dict(ok=None))  # not reached
    for rank, facts in enumerate(ranks):
        if facts is None:
            with open(os.path.join(folder, f"rank{rank}.log")) as f:
                ranks[rank] = {"log_tail": f.read()[-3000:]}
    return {"steps": steps, "ranks": ranks, "exit_codes": [p.returncode for p in processes]}


def _summarise(name, records, failures):
    if failures:
        first = failures[0]
        return dict(ok=False, error=first["error"], where=first["where"], seconds=first["seconds"],
                    size=None, traceback=first.get("traceback"))
    sizes = [e["size"] for e in records if "size" in e]
    return dict(ok=True, seconds=max(e["seconds"] for e in records), size=sizes[0] if sizes else None)


def _delivery(facts):
    """How the fixes reached this run: by the shim, by a fixed megatron-core, or not at all."""
    states = {s for s in facts.get("fixes", {}).values() if s != "not-applicable"}
    if "applied" in states:
        return "shim applied"
    if states == {"upstream-fixed"}:
        return "megatron-core already fixed (upstream-fixed)"
    if states == {"disabled"}:
        return "shim disabled"
    return ", ".join(sorted(states)) or "no fixes concern this megatron-core"


def _facts(result):
    """The facts of the first rank of a pass that recorded them ({} if none did)."""
    return next((r for r in result["ranks"] if r and "fixes" in r), {})


def _guard_text(guard):
    if guard is None:
        return "TE import guard: unknown (a rank did not finish)"
    text = f"TE import guard {guard['mode']}"
    return text + (f" ({guard['reason']})" if guard.get("reason") else "")


def summarise(args, results, folder):
    without, shim = results["without shim"], results["with shim"]
    ranks = [r for r in shim["ranks"] if r is not None]
    complete = all("cuda_initialized" in r for r in ranks)
    first = ranks[0] if ranks else {}
    tensors = sum(r.get("tensors", 0) for r in ranks)
    equal = sum(r.get("equal", 0) for r in ranks)
    cuda = [r.get("cuda_initialized") for r in ranks]
    drivers = sorted({lib for r in ranks for lib in r.get("driver_libraries", [])})
    checks = {
        "every step passed": all(shim["steps"][s]["ok"] for s in STEPS),
        "every tensor equal": tensors > 0 and tensors == equal,
        "logits equal": all(r.get("logits_equal") for r in ranks) and bool(ranks),
        "CUDA never initialised": complete and not any(cuda),
        "no driver library mapped": complete and not drivers,
    }
    baseline_failed = [s for s in STEPS if without["steps"][s]["ok"] is False]
    return {
        "passed": all(checks.values()),
        "checks": checks,
        "megatron_core": first.get("mcore"),
        "torch": first.get("torch"),
        "delivery": {label: _delivery(_facts(results[label])) for label, _ in PASSES},
        "te_guard": {label: _facts(results[label]).get("te_guard") for label, _ in PASSES},
        "fixes": first.get("fixes", {}),
        "features": first.get("features", {}),
        "model": {k: getattr(args, k) for k in ("layers", "hidden", "heads", "query_groups", "ffn",
                                                 "experts", "topk", "vocab", "seq_len")},
        "ranks": args.ranks,
        "expert_parallel": args.ep,
        "parameters": first.get("parameters"),
        "tensors_compared": tensors,
        "tensors_equal": equal,
        "cuda_initialized": any(cuda) if complete else None,
        "driver_libraries": drivers,
        "without_shim_failed_at": baseline_failed[0] if baseline_failed else None,
        "passes": results,
        "output_dir": folder if args.keep else None,
    }


def _seconds(value):
    return "" if value is None else f"{value:.1f} s"


def _size(value):
    if value is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024


def _cell(step, notes):
    if step["ok"] is None:
        return "not reached"
    if step["ok"]:
        return "ok"
    notes.append(step)
    return f"FAILED ({len(notes)})"


def print_table(summary):
    notes = []
    rows = [("step", "without shim", "with shim", "time", "size on disk")]
    for name in STEPS:
        without = summary["passes"]["without shim"]["steps"][name]
        shim = summary["passes"]["with shim"]["steps"][name]
        rows.append((name, _cell(without, notes), _cell(shim, notes), _seconds(shim.get("seconds")),
                     _size(shim.get("size"))))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    for number, step in enumerate(notes, 1):
        print(f"({number}) {step['error']}")
        if step.get("where"):
            print(f"    at {step['where']}")
    print()
    yes_no = {True: "yes", False: "no", None: "unknown (a rank did not finish)"}
    print(f"megatron-core {summary['megatron_core']}, torch {summary['torch']}; "
          f"{summary['ranks']} rank{'s' if summary['ranks'] != 1 else ''}, "
          f"expert parallelism {summary['expert_parallel']}")
    for label, _ in PASSES:
        print(f"{label}: {summary['delivery'][label]}; {_guard_text(summary['te_guard'][label])}")
    missing = [k for k, v in summary["features"].items() if not v]
    if missing:
        print(f"not in this megatron-core, left out of the model: {', '.join(missing)}")
    if summary["parameters"] is not None:
        print(f"parameters: {summary['parameters']:,}")
    print(f"tensors compared: {summary['tensors_compared']} (all ranks), equal: {summary['tensors_equal']}")
    print(f"CUDA initialised: {yes_no[summary['cuda_initialized']]}")
    print(f"driver libraries mapped: {', '.join(summary['driver_libraries']) or 'none'}")
    if summary["without_shim_failed_at"] is None:
        print("NOTE: without the shim every step passed as well: this megatron-core needs no shim "
              f"({summary['delivery']['without shim']}).")
    if summary["output_dir"]:
        print(f"kept: {summary['output_dir']}")
    failed = [name for name, ok in summary["checks"].items() if not ok]
    print("PASS" if summary["passed"] else f"FAIL: these did not hold: {', '.join(failed)}")


def run(args):
    _check(args)
    created = args.output_dir is None or not os.path.exists(args.output_dir)
    folder = os.path.abspath(args.output_dir or tempfile.mkdtemp(prefix="mcore-cpu-shim-demo-"))
    stream = sys.stderr if args.json else sys.stdout

    def progress(label, name, step):
        if step["ok"]:
            extra = ", ".join(filter(None, [_seconds(step["seconds"]), step["size"] and _size(step["size"])]))
            text = f"ok ({extra})"
        else:
            text = f"FAILED: {step['error']}" + (f" at {step['where']}" if step.get("where") else "")
        print(f"[{label}] {name}: {text}", file=stream, flush=True)

    results = {}
    try:
        for label, sub in PASSES:
            if os.path.exists(os.path.join(folder, sub)):
                shutil.rmtree(os.path.join(folder, sub))
            extra_env = WITHOUT_SHIM if label == "without shim" else {}
            results[label] = run_pass(args, label, os.path.join(folder, sub), extra_env, progress)
        summary = summarise(args, results, folder)
    finally:
        if not args.keep:
            for _, sub in PASSES:
                shutil.rmtree(os.path.join(folder, sub), ignore_errors=True)
            if created:
                shutil.rmtree(folder, ignore_errors=True)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print_table(summary)
    return 0 if summary["passed"] else 1

