"""``mcore-cpu-shim demo``: a CPU-only conversion round trip, without and with the shim.

With Megatron-Bridge installed: a tiny GPT-OSS-like Hugging Face model (``hf_models``:
``transformers``, random weights, no hub) is written, converted HF -> ``torch_dist`` -> HF by
``mcore-cpu-shim convert``'s own code (Bridge's ``AutoBridge``, ``--ranks`` Gloo ranks with
expert parallelism ``--ep`` for the import), every tensor of the result is compared with the
original exactly, and the CPU logits of the HF model (``transformers``, float32, eager
attention) are compared with those of the megatron model built from the converted checkpoint
(float32). Without it, the demo says how to install it and runs the megatron-core-only round
trip: a GPT-OSS-like model (local spec, YaRN RoPE, learnable softmax offsets, alltoall MoE)
built with ``use_cpu_initialization=True`` by N ranks in a Gloo group (expert parallelism E),
saved with ``dist_checkpointing``, reloaded into a freshly built model, compared tensor by
tensor, and run forward (original and reloaded, logits compared).

Either round trip runs twice: once without the shim (every fix disabled and the Transformer
Engine import guard off: ``MCORE_CPU_SHIM_DISABLE=all``, ``MCORE_CPU_SHIM_TE=off``, so what
megatron-core and Megatron-Bridge do on their own, including dying at import on a Transformer
Engine that cannot load) and once with the shim as this environment configures it. Each rank
or worker is a fresh interpreter with CUDA hidden (``CUDA_VISIBLE_DEVICES=""``), so the demo is
safe on a GPU host too; in the second pass every step runs under ``forbid_cuda()``.

Exit status: 0 if every step of the shim pass passed, every tensor is equal, the logits are
equal (megatron-core only) or within the parity bar (Bridge: same argmax at every position and
max abs diff <= 1e-4 x max abs HF logit), CUDA was never initialised and no driver library was
mapped; 1 otherwise; 2 for bad options. Nothing here imports torch: the ranks do.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from ._demo_rank import STEPS
from .hf_models import BRIDGE_FAMILIES, EXPERT_FIELDS

PASSES = (("without shim", "without-shim"), ("with shim", "with-shim"))
# The pass without the shim: no fix and no Transformer Engine guard.
WITHOUT_SHIM = {"MCORE_CPU_SHIM_DISABLE": "all", "MCORE_CPU_SHIM_TE": "off"}


# The model size of the megatron-core-only round trip (the Bridge round trip's defaults are
# those of the tiny models of hf_models).
MEGATRON_DEFAULTS = dict(layers=2, hidden=64, heads=4, query_groups=2, ffn=128, experts=4, topk=2, vocab=256)
# hf_models' tiny models, for the checks of the options (they share these; GPT-OSS adds experts).
HF_DEFAULTS = dict(layers=2, hidden=64, heads=4, query_groups=2, ffn=None, experts=4, topk=2, vocab=256)
MEGATRON_ONLY = "megatron-core only"
BRIDGE = "Megatron-Bridge"


def add_parser(subparsers):
    p = subparsers.add_parser(
        "demo",
        help="convert a tiny GPT-OSS-like model on the CPU (HF -> torch_dist -> HF with Megatron-Bridge, "
        "else a megatron-core round trip), without and with the shim",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    p.add_argument("--model", choices=BRIDGE_FAMILIES, default="gpt-oss",
                   help="the Hugging Face model of the Megatron-Bridge round trip (default gpt-oss)")
    p.add_argument("--megatron-only", action="store_true",
                   help="run the megatron-core-only round trip even where Megatron-Bridge is installed")
    size = p.add_argument_group(
        "model size", "Defaults: the megatron-core round trip's as shown; the Bridge round trip's are "
        "the tiny model's of mcore_cpu_shim.hf_models (only the options given change it)")
    size.add_argument("--layers", type=_positive, help="transformer layers (default 2)")
    size.add_argument("--hidden", type=_positive, help="hidden size (default 64)")
    size.add_argument("--heads", type=_positive, help="attention heads (default 4)")
    size.add_argument("--query-groups", type=_positive, help="key/value heads (default 2)")
    size.add_argument("--ffn", type=_positive, help="expert FFN size (default 128; Bridge: intermediate_size)")
    size.add_argument("--experts", type=_positive, help="MoE experts (default 4)")
    size.add_argument("--topk", type=_positive, help="experts per token (default 2)")
    size.add_argument("--vocab", type=_positive, help="vocabulary size (default 256)")
    size.add_argument("--seq-len", type=_positive, default=32,
                      help="sequence length of the forward pass (default 32)")
    p.add_argument("--ranks", type=_positive, default=2,
                   help="Gloo ranks (default 2; Bridge: of the import, the export and logits run on one)")
    p.add_argument("--ep", type=_positive,
                   help="expert parallelism (default 2; Bridge: of the import, 1 for a dense model)")
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


def bridge_missing():
    """None where the Megatron-Bridge round trip can run (Bridge, transformers and the rest
    importable, looked up without importing them), else what to install, as convert says it."""
    from .convert import InputError, check_packages

    try:
        check_packages()
    except InputError as exc:
        return str(exc)
    return None


def _resolve(args, bridge):
    """Fill in the defaults of the round trip that runs, and check the options (exit 2)."""
    if args.megatron_only and args.model != "gpt-oss":
        args.parser.error(f"--model {args.model} converts through Megatron-Bridge: leave out --megatron-only")
    dense = bridge and args.model not in EXPERT_FIELDS
    if args.ep is None:
        args.ep = 1 if dense else 2
    if dense:
        given = [f"--{k}" for k in ("experts", "topk") if getattr(args, k) is not None]
        if args.ep > 1:
            given.append(f"--ep {args.ep}")
        if given:
            args.parser.error(f"{' and '.join(given)}: {args.model} has no experts")
    if not bridge:
        for key, value in MEGATRON_DEFAULTS.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
    # The values the checks see: the Bridge model's defaults where an option was not given.
    values = {k: getattr(args, k) if getattr(args, k) is not None else HF_DEFAULTS[k] for k in HF_DEFAULTS}
    values.update(ranks=args.ranks, ep=args.ep)
    _check(args.parser, values, experts=not dense)


def _check(parser, values, experts=True):
    """Exit 2 (``parser.error``) for option values that do not fit together; ``values``: the
    effective ones, by option name; ``experts``: whether the model has any."""
    from types import SimpleNamespace

    args = SimpleNamespace(**values)
    problems = []
    if args.ranks % args.ep:
        problems.append(f"--ranks {args.ranks} is not a multiple of --ep {args.ep}")
    if experts and args.experts % args.ep:
        problems.append(f"--experts {args.experts} is not a multiple of --ep {args.ep}")
    if args.hidden % args.heads:
        problems.append(f"--hidden {args.hidden} is not a multiple of --heads {args.heads}")
    elif args.hidden // args.heads % 2:
        problems.append(f"--hidden {args.hidden} / --heads {args.heads} = {args.hidden // args.heads} channels "
                        "per head, an odd number: rotary embeddings turn pairs of channels")
    if args.heads % args.query_groups:
        problems.append(f"--heads {args.heads} is not a multiple of --query-groups {args.query_groups}")
    if experts and args.topk > args.experts:
        problems.append(f"--topk {args.topk} is more than --experts {args.experts}")
    if problems:
        parser.error("; ".join(problems))


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
    # The whole session of each rank: megatron-core's checkpoint writer starts a helper
    # process that outlives a rank that ended abruptly.
    from .convert import stop  # (convert imports this module: here, not at the top)

    stop(processes)

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
    """The megatron-core-only round trip's summary."""
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
        "round_trip": MEGATRON_ONLY,
        "step_names": list(STEPS),
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


def summarise_bridge(args, results, folder):
    """The Megatron-Bridge round trip's summary."""
    from ._demo_bridge import STEPS as BRIDGE_STEPS

    without, shim = results["without shim"], results["with shim"]
    steps = shim["steps"]
    workers = shim["ranks"]
    complete = bool(workers) and all(r is not None and "cuda_initialized" in r for r in workers)
    finished = [r for r in workers if r is not None]
    cuda = [r.get("cuda_initialized") for r in finished]
    drivers = sorted({lib for r in finished for lib in r.get("driver_libraries", [])})
    # The facts of a worker that imported Megatron-Bridge (versions, fix states).
    first = next((r for r in finished if r.get("megatron_bridge")), finished[0] if finished else {})
    written = steps[BRIDGE_STEPS[0]].get("facts", {})
    compared = steps[BRIDGE_STEPS[3]].get("facts", {})
    logits = steps[BRIDGE_STEPS[4]].get("facts") or None
    tensors, equal = compared.get("tensors", 0), compared.get("equal", 0)
    checks = {
        "every step passed": all(steps[s]["ok"] for s in BRIDGE_STEPS),
        "every tensor equal": tensors > 0 and tensors == equal and not compared.get("unexpected"),
        "logits within the bar": bool(logits) and logits["max_abs_diff"] <= logits["bar"]
        and logits["argmax_equal"] == logits["positions"],
        "CUDA never initialised": complete and not any(cuda),
        "no driver library mapped": complete and not drivers,
    }
    baseline_failed = [s for s in BRIDGE_STEPS if without["steps"][s]["ok"] is False]
    return {
        "round_trip": BRIDGE,
        "step_names": list(BRIDGE_STEPS),
        "passed": all(checks.values()),
        "checks": checks,
        "megatron_core": first.get("megatron_core"),
        "megatron_bridge": first.get("megatron_bridge"),
        "torch": first.get("torch"),
        "transformers": next((r["transformers"] for r in finished if r.get("transformers")), None),
        "delivery": {label: _delivery(_bridge_facts(results[label])) for label, _ in PASSES},
        "te_guard": {label: _bridge_facts(results[label]).get("te_guard") for label, _ in PASSES},
        "fixes": first.get("fixes", {}),
        "model": {"family": args.model, "architecture": written.get("architecture"),
                  "dtype": written.get("dtype"), "config": written.get("config", {}), "seq_len": args.seq_len},
        "ranks": args.ranks,
        "expert_parallel": args.ep,
        "parameters": written.get("parameters"),
        "tensors_compared": tensors,
        "tensors_equal": equal,
        "logits": logits,
        "cuda_initialized": any(cuda) if complete else None,
        "driver_libraries": drivers,
        "without_shim_failed_at": baseline_failed[0] if baseline_failed else None,
        "passes": results,
        "output_dir": folder if args.keep else None,
    }


def _bridge_facts(result):
    """The facts of the first worker of a Bridge pass that imported megatron (fix states)."""
    finished = [r for r in result["ranks"] if r and "fixes" in r]
    return next((r for r in finished if r.get("megatron_bridge")), finished[0] if finished else {})


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
    for name in summary["step_names"]:
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
    if summary["round_trip"] == BRIDGE:
        _print_bridge_facts(summary)
    else:
        _print_megatron_facts(summary)
    yes_no = {True: "yes", False: "no", None: "unknown (a rank did not finish)"}
    print(f"CUDA initialised: {yes_no[summary['cuda_initialized']]}")
    print(f"driver libraries mapped: {', '.join(summary['driver_libraries']) or 'none'}")
    if summary["without_shim_failed_at"] is None:
        print("NOTE: without the shim every step passed as well: this megatron-core needs no shim "
              f"({summary['delivery']['without shim']}).")
    if summary["output_dir"]:
        print(f"kept: {summary['output_dir']}")
    failed = [name for name, ok in summary["checks"].items() if not ok]
    print("PASS" if summary["passed"] else f"FAIL: these did not hold: {', '.join(failed)}")


def _print_passes(summary):
    for label, _ in PASSES:
        print(f"{label}: {summary['delivery'][label]}; {_guard_text(summary['te_guard'][label])}")


def _print_megatron_facts(summary):
    print(f"megatron-core {summary['megatron_core']}, torch {summary['torch']}; "
          f"{summary['ranks']} rank{'s' if summary['ranks'] != 1 else ''}, "
          f"expert parallelism {summary['expert_parallel']}")
    _print_passes(summary)
    missing = [k for k, v in summary["features"].items() if not v]
    if missing:
        print(f"not in this megatron-core, left out of the model: {', '.join(missing)}")
    if summary.get("bridge_missing"):
        print("Megatron-Bridge: not installed, so this is the megatron-core-only round trip (see the top)")
    if summary["parameters"] is not None:
        print(f"parameters: {summary['parameters']:,}")
    print(f"tensors compared: {summary['tensors_compared']} (all ranks), equal: {summary['tensors_equal']}")


def _model_text(model):
    """``GptOssForCausalLM: YaRN RoPE, attention sinks, ...``: what the written model has."""
    config = model["config"]
    parts = [f"{config.get('num_hidden_layers')} layers", f"hidden {config.get('hidden_size')}",
             f"{config.get('num_attention_heads')} heads / {config.get('num_key_value_heads')} KV"]
    if model["family"] == "gpt-oss":
        # transformers 5 writes "rope_parameters", 4.x "rope_scaling"
        rope = (config.get("rope_parameters") or config.get("rope_scaling") or {}).get("rope_type")
        parts += [f"{rope.replace('yarn', 'YaRN')} RoPE" if rope else "RoPE", "attention sinks",
                  f"sliding window {config.get('sliding_window')} on every other layer",
                  f"{config.get('num_local_experts')} experts top-{config.get('num_experts_per_tok')}"]
    return f"{model['architecture']} ({', '.join(parts)})"


def _print_bridge_facts(summary):
    versions = [f"{name} {summary[key]}" for name, key in (
        ("megatron-core", "megatron_core"), ("Megatron-Bridge", "megatron_bridge"), ("torch", "torch"),
        ("transformers", "transformers")) if summary.get(key)]
    ranks = summary["ranks"]
    print(f"{', '.join(versions) or 'versions unknown (no worker finished)'}; "
          f"import on {ranks} rank{'s' if ranks != 1 else ''}, "
          f"expert parallelism {summary['expert_parallel']}; export and logits on 1 rank")
    _print_passes(summary)
    model = summary["model"]
    if model.get("architecture"):
        print(f"model: {_model_text(model)}, {model['dtype']}, {summary['parameters']:,} parameters")
    print(f"tensors compared: {summary['tensors_compared']} (HF -> torch_dist -> HF, names, dtypes and "
          f"values), equal: {summary['tensors_equal']}")
    logits = summary["logits"]
    if logits:
        batch, length = logits["tokens"]
        window = logits.get("sliding_window")
        inside = f", all within the {window}-token sliding window" if window and length <= window else ""
        within = "<=" if logits["max_abs_diff"] <= logits["bar"] else ">"
        print(f"logits, HF (transformers, eager attention) vs megatron, float32 on the CPU, {batch} x {length} "
              f"tokens{inside}:")
        print(f"  max abs diff {logits['max_abs_diff']:.1e} {within} {logits['parity']} x scale "
              f"{logits['scale']:.1e} (max abs HF logit) = {logits['bar']:.1e}; "
              f"argmax equal at {logits['argmax_equal']}/{logits['positions']} positions")


def run(args):
    missing = None if args.megatron_only else bridge_missing()
    bridge = not args.megatron_only and missing is None
    if missing and args.model != "gpt-oss":
        args.parser.error(f"--model {args.model} converts through Megatron-Bridge. {missing}")
    _resolve(args, bridge)
    created = args.output_dir is None or not os.path.exists(args.output_dir)
    folder = os.path.abspath(args.output_dir or tempfile.mkdtemp(prefix="mcore-cpu-shim-demo-"))
    stream = sys.stderr if args.json else sys.stdout
    if missing:
        print(f"mcore-cpu-shim demo: {missing}", file=stream)
        print("mcore-cpu-shim demo: running the megatron-core-only round trip instead (no Hugging Face "
              "model)", file=stream, flush=True)

    def progress(label, name, step):
        if step["ok"]:
            facts = step.get("facts", {})  # the Bridge round trip's steps: what they found
            extra = ", ".join(filter(None, [
                _seconds(step["seconds"]), step["size"] and _size(step["size"]),
                "tensors" in facts and f"{facts['equal']}/{facts['tensors']} tensors equal",
                "max_abs_diff" in facts and f"max abs diff {facts['max_abs_diff']:.1e}",
            ]))
            text = f"ok ({extra})"
        else:
            text = f"FAILED: {step['error']}" + (f" at {step['where']}" if step.get("where") else "")
        print(f"[{label}] {name}: {text}", file=stream, flush=True)

    if bridge:
        from . import _demo_bridge

        one_pass = _demo_bridge.run_pass
    else:
        one_pass = run_pass
    results = {}
    try:
        for label, sub in PASSES:
            if os.path.exists(os.path.join(folder, sub)):
                shutil.rmtree(os.path.join(folder, sub))
            extra_env = WITHOUT_SHIM if label == "without shim" else {}
            results[label] = one_pass(args, label, os.path.join(folder, sub), extra_env, progress)
        summary = (summarise_bridge if bridge else summarise)(args, results, folder)
        summary["bridge_missing"] = missing
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
