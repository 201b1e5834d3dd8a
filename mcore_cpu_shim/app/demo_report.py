"""What ``mcore-cpu-shim demo`` says about its passes: the summary (``--json``) and the table.

A round trip passed when every step of the pass with the shim passed, every tensor is equal, the
logits agree (megatron-core only: equal; Megatron-Bridge: within the parity bar), CUDA was never
initialised and no driver library was mapped. The pass without the shim says what megatron-core
and Megatron-Bridge do on their own, and where they stop.
"""

from .demo_worker import STEPS
from .launch import size_text

PASSES = (("without shim", "without-shim"), ("with shim", "with-shim"))
MEGATRON_ONLY = "megatron-core only"
BRIDGE = "Megatron-Bridge"


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
    """The facts of a pass's first rank that recorded them, preferring one that imported
    Megatron-Bridge (its versions and fix states); {} if none did."""
    finished = [r for r in result["ranks"] if r and "fixes" in r]
    return next((r for r in finished if r.get("megatron_bridge")), finished[0] if finished else {})


def _guard_text(guard):
    if guard is None:
        return "TE import guard: unknown (a rank did not finish)"
    text = f"TE import guard {guard['mode']}"
    return text + (f" ({guard['reason']})" if guard.get("reason") else "")


def _summary(args, results, folder, round_trip, steps, tensors, equal, result_checks):
    """What both round trips' summaries hold; ``result_checks``: the round trip's own checks
    (tensors, logits), between "every step passed" and the CUDA checks."""
    without, shim = results["without shim"], results["with shim"]
    finished = [r for r in shim["ranks"] if r is not None]
    complete = bool(finished) and len(finished) == len(shim["ranks"]) and all("cuda_initialized" in r for r in finished)
    cuda = [r.get("cuda_initialized") for r in finished]
    drivers = sorted({lib for r in finished for lib in r.get("driver_libraries", [])})
    checks = {"every step passed": all(shim["steps"][s]["ok"] for s in steps), **result_checks,
              "CUDA never initialised": complete and not any(cuda), "no driver library mapped": complete and not drivers}
    baseline_failed = [s for s in steps if without["steps"][s]["ok"] is False]
    first = _facts(shim)
    return {
        "round_trip": round_trip,
        "step_names": list(steps),
        "passed": all(checks.values()),
        "checks": checks,
        "megatron_core": first.get("megatron_core"),
        "torch": first.get("torch"),
        "delivery": {label: _delivery(_facts(results[label])) for label, _ in PASSES},
        "te_guard": {label: _facts(results[label]).get("te_guard") for label, _ in PASSES},
        "fixes": first.get("fixes", {}),
        "ranks": args.ranks,
        "expert_parallel": args.ep,
        "tensors_compared": tensors,
        "tensors_equal": equal,
        "cuda_initialized": any(cuda) if complete else None,
        "driver_libraries": drivers,
        "without_shim_failed_at": baseline_failed[0] if baseline_failed else None,
        "passes": results,
        "output_dir": folder if args.keep else None,
    }


def summarise(args, results, folder):
    """The megatron-core-only round trip's summary."""
    ranks = results["with shim"]["ranks"]
    finished = [r for r in ranks if r is not None]
    tensors = sum(r.get("tensors", 0) for r in finished)
    equal = sum(r.get("equal", 0) for r in finished)
    own = {"every tensor equal": tensors > 0 and tensors == equal,
           "logits equal": bool(ranks) and all(r is not None and r.get("logits_equal") for r in ranks)}
    summary = _summary(args, results, folder, MEGATRON_ONLY, STEPS, tensors, equal, own)
    first = _facts(results["with shim"])
    summary.update(
        features=first.get("features", {}), parameters=first.get("parameters"),
        model={k: getattr(args, k) for k in ("layers", "hidden", "heads", "query_groups", "ffn", "experts", "topk",
                                             "vocab", "seq_len")})
    return summary


def summarise_bridge(args, results, folder):
    """The Megatron-Bridge round trip's summary."""
    from .demo_bridge import STEPS as BRIDGE_STEPS

    steps = results["with shim"]["steps"]
    written = steps[BRIDGE_STEPS[0]].get("facts", {})
    compared = steps[BRIDGE_STEPS[3]].get("facts", {})
    logits = steps[BRIDGE_STEPS[4]].get("facts") or None
    tensors, equal = compared.get("tensors", 0), compared.get("equal", 0)
    own = {"every tensor equal": tensors > 0 and tensors == equal and not compared.get("unexpected"),
           "logits within the bar": bool(logits) and logits["max_abs_diff"] <= logits["bar"]
           and logits["argmax_equal"] == logits["positions"],
           "exported folder's logits equal": bool(logits) and logits.get("export_logits_equal") is True}
    summary = _summary(args, results, folder, BRIDGE, BRIDGE_STEPS, tensors, equal, own)
    finished = [r for r in results["with shim"]["ranks"] if r is not None]
    summary.update(
        megatron_bridge=_facts(results["with shim"]).get("megatron_bridge"),
        transformers=next((r["transformers"] for r in finished if r.get("transformers")), None),
        model={"family": args.model, "architecture": written.get("architecture"), "dtype": written.get("dtype"),
               "config": written.get("config", {}), "seq_len": args.seq_len},
        parameters=written.get("parameters"), logits=logits)
    return summary


def seconds_text(value):
    return "" if value is None else f"{value:.1f} s"


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
        rows.append((name, _cell(without, notes), _cell(shim, notes), seconds_text(shim.get("seconds")),
                     size_text(shim.get("size"))))
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
        same = "equal" if logits.get("export_logits_equal") else "NOT equal"
        print(f"  the exported folder, loaded by transformers: logits {same} to the source's, bit for bit")


