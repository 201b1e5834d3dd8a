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
import sys
import tempfile

from . import passes
from .demo_report import PASSES, print_table, seconds_text, summarise, summarise_bridge
from .demo_worker import STEPS
from .hf_models import BRIDGE_FAMILIES, EXPERT_FIELDS
from .inputs import InputError, check_packages, positive
from .launch import size_text

# The pass without the shim: no fix and no Transformer Engine guard.
WITHOUT_SHIM = {"MCORE_CPU_SHIM_DISABLE": "all", "MCORE_CPU_SHIM_TE": "off"}


# The model size of the megatron-core-only round trip (the Bridge round trip's defaults are
# those of the tiny models of hf_models).
MEGATRON_DEFAULTS = dict(layers=2, hidden=64, heads=4, query_groups=2, ffn=128, experts=4, topk=2, vocab=256)
# hf_models' tiny models, for the checks of the options (they share these; GPT-OSS adds experts).
HF_DEFAULTS = dict(layers=2, hidden=64, heads=4, query_groups=2, ffn=None, experts=4, topk=2, vocab=256)


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
    size.add_argument("--layers", type=positive, help="transformer layers (default 2)")
    size.add_argument("--hidden", type=positive, help="hidden size (default 64)")
    size.add_argument("--heads", type=positive, help="attention heads (default 4)")
    size.add_argument("--query-groups", type=positive, help="key/value heads (default 2)")
    size.add_argument("--ffn", type=positive, help="expert FFN size (default 128; Bridge: intermediate_size)")
    size.add_argument("--experts", type=positive, help="MoE experts (default 4)")
    size.add_argument("--topk", type=positive, help="experts per token (default 2)")
    size.add_argument("--vocab", type=positive, help="vocabulary size (default 256)")
    size.add_argument("--seq-len", type=positive, default=32,
                      help="sequence length of the forward pass (default 32)")
    p.add_argument("--ranks", type=positive, default=2,
                   help="Gloo ranks (default 2; Bridge: of the import, the export and logits run on one)")
    p.add_argument("--ep", type=positive,
                   help="expert parallelism (default 2; Bridge: of the import, 1 for a dense model)")
    p.add_argument("--output-dir", help="where to write (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the checkpoints and rank logs")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the table")
    p.add_argument("--timeout", type=positive, default=600, help="seconds per pass (default 600)")
    p.set_defaults(func=run, parser=p)
    return p


def bridge_missing():
    """None where the Megatron-Bridge round trip can run (Bridge, transformers and the rest
    importable, looked up without importing them), else what to install, as convert says it."""
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


def megatron_pass(args, label, folder, extra_env, progress):
    """One pass of the megatron-core-only round trip: one group of ``--ranks`` ranks."""
    spec = dict(
        layers=args.layers, hidden=args.hidden, heads=args.heads, query_groups=args.query_groups,
        ffn=args.ffn, experts=args.experts, topk=args.topk, vocab=args.vocab, seq_len=args.seq_len,
        ranks=args.ranks, ep=args.ep, strict=not extra_env, timeout=args.timeout,
        checkpoint=os.path.join(folder, "checkpoint"),
    )
    group = passes.Group("ranks", "demo_worker", spec, STEPS, {step: (step,) for step in STEPS})
    return passes.run_pass([group], STEPS, label, folder, extra_env, progress, args.timeout)


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
                seconds_text(step["seconds"]), step["size"] and size_text(step["size"]),
                "tensors" in facts and f"{facts['equal']}/{facts['tensors']} tensors equal",
                "max_abs_diff" in facts and f"max abs diff {facts['max_abs_diff']:.1e}",
            ]))
            text = f"ok ({extra})"
        else:
            text = f"FAILED: {step['error']}" + (f" at {step['where']}" if step.get("where") else "")
        print(f"[{label}] {name}: {text}", file=stream, flush=True)

    if bridge:
        from . import demo_bridge

        one_pass = demo_bridge.run_pass
    else:
        one_pass = megatron_pass
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
