"""The Megatron-Bridge round trip of ``mcore-cpu-shim demo``: one pass, and its workers.

A pass writes a tiny Hugging Face model (``hf_models.write``: ``transformers``, random
weights, no hub), converts it HF -> ``torch_dist`` -> HF with ``mcore-cpu-shim convert``'s own
code, compares every tensor of the result with the original exactly, and compares the CPU
logits of the HF model (``transformers``, float32, eager attention) with those of the megatron
model built from the converted checkpoint. Its workers run in three groups, each started and
followed by convert's machinery (``convert.start_ranks``, ``convert.supervise``) in a folder of
its own:

- ``write``: one process writes the HF model;
- ``import``: ``--ranks`` processes run convert's import (``_convert_rank.run_import``: Bridge's
  ``AutoBridge`` provider, ``save_megatron_model``) with expert parallelism ``--ep``;
- ``export``: one process runs convert's export (``_convert_rank.run_export``:
  ``load_megatron_model``, ``save_hf_pretrained``), then compares the tensors, then the logits.

Every worker is ``python -m mcore_cpu_shim._demo_bridge SPEC RANK``, which is
``_convert_rank.main`` with this module's ``run`` and ``GuardedPhases``: in the pass with the
shim (``strict`` in the spec) each phase runs under ``forbid_cuda()``, so a CUDA call that the
code catches and hides still fails it.

Nothing is imported from torch, transformers, megatron or Bridge at module level: the parent
imports this module.
"""

import os
import sys
import time

from . import _convert_rank
from ._convert_rank import PHASES as CONVERT_PHASES
from ._convert_rank import Phases, VerifyMismatch

STEPS = (
    "write HF model",
    "import (HF -> torch_dist)",
    "export (torch_dist -> HF)",
    "compare tensors",
    "CPU logits HF vs megatron",
)
# The phases each step is made of: the import and export steps are convert's phases (without
# its verify: the comparison with the written model is the demo's own step).
STEP_PHASES = {
    STEPS[0]: ("write HF model",),
    STEPS[1]: tuple(p for p in CONVERT_PHASES["import"] if p != "verify"),
    STEPS[2]: tuple(p for p in CONVERT_PHASES["export"] if p != "verify"),
    STEPS[3]: ("compare tensors",),
    STEPS[4]: ("CPU logits",),
}
# The worker groups of a pass, in order: (direction, its steps).
GROUPS = (("write", STEPS[:1]), ("import", STEPS[1:2]), ("export", STEPS[2:]))

# The parity bar of the logits: max |megatron - HF| <= PARITY x max |HF|, and the same argmax
# at every position.
PARITY = 1e-4
PARITY_TEXT = "1e-4"
BATCH = 2

# The environment of a group's workers, on top of the pass's. The export group runs the
# megatron forward: megatron-core compiles its fused activations (GPT-OSS's gated quick-GELU
# with per-token router weights, ``jit_fuser``) with torch.compile, and on the CPU TorchInductor
# asks ``torch.cuda.current_device()`` for its cache key (torch/_inductor/codecache.py,
# ``CacheBase.get_system``, which catches the failure): a CUDA call forbid_cuda() counts, which
# on a host with a driver maps it, and a C++ compiler the host may not have. With
# TORCHDYNAMO_DISABLE=1, torch.compile returns those functions as they are: the same code runs
# eagerly.
GROUP_ENV = {"export": {"TORCHDYNAMO_DISABLE": "1"}}

# Demo options -> config fields of the tiny HF model (only the options given are passed on).
CONFIG_FIELDS = {
    "layers": "num_hidden_layers",
    "hidden": "hidden_size",
    "heads": "num_attention_heads",
    "query_groups": "num_key_value_heads",
    "ffn": "intermediate_size",  # a MoE family's: its expert FFN (hf_models.EXPERT_FIELDS)
    "experts": None,  # hf_models.EXPERT_FIELDS
    "topk": "num_experts_per_tok",
    "vocab": "vocab_size",
}


# --- The parent: one pass ---


def overrides(args):
    """The config fields of the tiny model that the demo's size options change."""
    from .hf_models import EXPERT_FIELDS

    names = dict(CONFIG_FIELDS)
    if args.model in EXPERT_FIELDS:
        names["experts"], names["ffn"] = EXPERT_FIELDS[args.model]
    fields = {names[k]: getattr(args, k) for k in names if getattr(args, k) is not None}
    if args.hidden is not None or args.heads is not None:
        fields["head_dim"] = (args.hidden or 64) // (args.heads or 4)
    return fields


def _phase_step():
    return {phase: step for step, phases in STEP_PHASES.items() for phase in phases}


class _StepProgress:
    """convert.supervise's progress object: says a demo step is over once its last phase is."""

    def __init__(self, label, folder, ranks, progress):
        self.label, self.folder, self.ranks, self.progress = label, folder, ranks, progress
        self.shown = set()

    def running(self, name, seconds):
        pass

    def done(self, name, summary):
        step = _phase_step()[name]
        if summary["ok"] and name == STEP_PHASES[step][-1] and step not in self.shown:
            self.shown.add(step)
            self.progress(self.label, step, summarise_step(step, _events(self.folder, self.ranks)))


def _events(folder, ranks):
    from .demo import _read_events

    return [_read_events(os.path.join(folder, f"rank{r}.jsonl")) for r in range(ranks)]


def summarise_step(step, events):
    """A step whose phases every rank ended ok: time (the sum over its phases of the slowest
    rank's), size on disk and what its phases recorded (rank 0's)."""
    seconds, facts = 0.0, {}
    for phase in STEP_PHASES[step]:
        ended = [e for rank_events in events for e in rank_events if e.get("phase") == phase and e.get("ok")]
        seconds += max((e.get("seconds") or 0) for e in ended)
        first = next((e for e in events[0] if e.get("phase") == phase and e.get("ok")), {})
        facts.update({k: v for k, v in first.items() if k not in ("phase", "ok", "seconds", "t")})
    return dict(ok=True, seconds=seconds, size=facts.pop("size", None), facts=facts)


def group_spec(direction, args, folder, strict):
    paths = dict(hf=os.path.join(folder, "hf"), megatron=os.path.join(folder, "megatron"),
                 back=os.path.join(folder, "hf-back"))
    common = dict(timeout=args.timeout, strict=strict, verify=False, tp=1)
    if direction == "write":
        return dict(common, direction="write", family=args.model, hf=paths["hf"], overrides=overrides(args),
                    ranks=1, ep=1)
    if direction == "import":
        return dict(common, direction="import", hf=paths["hf"], out=paths["megatron"], dtype=None,
                    ranks=args.ranks, ep=args.ep)
    return dict(common, direction="export", megatron=paths["megatron"], hf_config=paths["hf"],
                out=paths["back"], ranks=1, ep=1, seq_len=args.seq_len, batch=BATCH)


def run_pass(args, label, folder, extra_env, progress):
    """Run the worker groups of one pass; returns ``{"steps", "ranks", "exit_codes"}`` as
    demo.run_pass does (``ranks``: the facts of every worker that recorded them)."""
    from . import convert

    os.makedirs(folder, exist_ok=True)
    deadline = time.monotonic() + args.timeout
    steps, ranks, codes = {}, [], []
    env = dict(os.environ, **extra_env)
    for direction, group_steps in GROUPS:
        if any(s["ok"] is False for s in steps.values()):
            break
        sub = os.path.join(folder, direction)
        os.makedirs(sub)
        spec = group_spec(direction, args, folder, strict=not extra_env)
        spec_path = os.path.join(sub, "spec.json")

        def command(rank, spec_path=spec_path):
            return [sys.executable, "-m", f"{__package__}._demo_bridge", spec_path, str(rank)]

        phases = tuple(p for step in group_steps for p in STEP_PHASES[step])
        processes = convert.start_ranks(spec, sub, command, env=dict(env, **GROUP_ENV.get(direction, {})))
        watcher = _StepProgress(label, sub, spec["ranks"], progress)
        outcome = convert.supervise(processes, phases, sub, watcher, deadline=deadline)
        events = _events(sub, spec["ranks"])
        failure = outcome["failure"]
        for step in group_steps:
            if step in watcher.shown:
                steps[step] = summarise_step(step, events)
                continue
            # The first step not over is the one the failure stopped (supervise reports one
            # for ranks that ended without finishing their phases too).
            steps[step] = _failed_step(failure or {"error": "the ranks ended without finishing it"}, deadline)
            progress(label, step, steps[step])
            break
        ranks += [next((e for e in rank_events if e.get("done")), None) for rank_events in events]
        codes += [p.returncode for p in processes]
    for step in STEPS:
        steps.setdefault(step, dict(ok=None))  # not reached
    return {"steps": steps, "ranks": ranks, "exit_codes": codes}


def _failed_step(failure, deadline):
    error = (failure.get("error") or "").strip().splitlines()
    text = error[0] if error else "failed"
    if failure.get("error") == "stopped before it finished" and time.monotonic() > deadline:
        text = "stopped: still running when the pass's --timeout ran out (see rank*.log with --keep)"
    facts = {k: v for k, v in failure.items()
             if k not in ("phase", "ok", "seconds", "t", "error", "where", "traceback", "input", "mismatch", "rank")}
    return dict(ok=False, error=text, where=failure.get("where") or "", seconds=failure.get("seconds"),
                size=None, traceback=failure.get("traceback"), rank=failure.get("rank"),
                phase=failure.get("phase"), facts=facts)


# --- The workers ---


def _chain(exc):
    seen = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        exc = exc.__cause__ or exc.__context__
    return seen


def where(exc):
    """Where ``exc`` happened, as convert says it (``path:line in function``), but in megatron
    (core or Bridge) where any exception of its chain was raised there (e.g. Bridge's failing
    import behind convert's ``cannot import Megatron-Bridge``), or where the text of a
    ``forbid_cuda()`` error (a call that was caught) shows a megatron frame."""
    import re

    for link in _chain(exc):
        found = _convert_rank.where(link)
        if found.startswith("megatron/"):
            return found
    # The stack of the first call in a forbid_cuda() error: its innermost megatron frame, else
    # its innermost frame.
    frames = re.findall(r'File "([^"]*)", line (\d+), in (\S+)', str(exc))
    inside = [f for f in frames if "/megatron/" in f[0]]
    if inside or frames:
        path, line, name = (inside or frames)[-1]
        for root in ("megatron/", "site-packages/"):
            if root in path:
                path = path[path.rfind(root) + (len(root) if root == "site-packages/" else 0):]
                break
        return f"{path}:{line} in {name}"
    return _convert_rank.where(exc)


class GuardedPhases(Phases):
    """convert's ``Phases``, with each phase under ``forbid_cuda()`` in a strict pass; a failure
    is placed in megatron where its chain shows it (``where``); the last record also says what
    the Transformer Engine import guard did and which transformers ran."""

    def __init__(self, events_path):
        import json

        super().__init__(events_path)
        # _convert_rank.main makes it from the events path; the spec is next to the events.
        with open(os.path.join(os.path.dirname(events_path), "spec.json")) as f:
            self.strict = json.load(f).get("strict", False)
        self.guard, self.failed = None, None

    def start(self, name):
        super().start(name)  # ends the current phase first (and with it its block)
        if self.strict:
            from .tripwire import forbid_cuda

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
        super().end(**facts)

    def fail(self, exc):
        self._close(exc)
        self.failed = exc
        super().fail(exc)

    def record(self, **event):
        if event.get("ok") is False and self.failed is not None and not event.get("mismatch"):
            event["where"] = where(self.failed)
        if event.get("done"):
            event.update(_process_facts())
        super().record(**event)


def _process_facts():
    facts = {}
    try:
        from . import _te_guard

        facts["te_guard"] = {k: v for k, v in _te_guard.state().items() if k in ("mode", "reason")}
    except Exception:  # noqa: BLE001
        pass
    if "transformers" in sys.modules:
        facts["transformers"] = getattr(sys.modules["transformers"], "__version__", None)
    return facts


def write_model(spec, phases):
    phases.start("write HF model")
    import json

    from . import hf_models
    from ._convert_rank import SafetensorsFolder, directory_size

    hf_models.write(spec["family"], spec["hf"], **spec["overrides"])
    weights = SafetensorsFolder(spec["hf"])
    with open(os.path.join(spec["hf"], "config.json")) as f:
        config = json.load(f)
    tensors = [weights.get(n) for n in weights.names()]
    phases.end(size=directory_size(spec["hf"]), hf_tensors=len(tensors),
               parameters=sum(t.numel() for t in tensors), dtype=str(tensors[0].dtype).replace("torch.", ""),
               architecture=(config.get("architectures") or ["?"])[0], config=_model_config(config))


def _model_config(config):
    """What the demo says about the model: the fields that make it GPT-OSS-like (or not)."""
    keys = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
            "intermediate_size", "num_local_experts", "num_experts_per_tok", "sliding_window",
            "vocab_size", "rope_scaling", "rope_parameters", "layer_types")
    return {k: config[k] for k in keys if config.get(k) is not None}


def compare_tensors(spec, phases):
    """Every tensor of the exported folder against the written one: same names, dtype, shape
    and values (convert's ``compare``)."""
    phases.start("compare tensors")
    from ._convert_rank import SafetensorsFolder, check_comparison, compare

    exported = SafetensorsFolder(spec["out"])
    facts = compare(((name, exported.get(name)) for name in exported.names()), SafetensorsFolder(spec["hf_config"]))
    check_comparison(facts)
    phases.end(**facts)


def tokens(vocab, batch, seq_len):
    """The fixed token ids both models see."""
    import torch

    generator = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (batch, seq_len), generator=generator)


def hf_logits(folder, ids):
    """The HF model's logits: ``transformers``, float32, eager attention, on the CPU."""
    import torch
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype = {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": torch.float32}
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", **dtype)
    model.eval()
    with torch.no_grad():
        return model(input_ids=ids).logits, model.config


def megatron_logits(spec, ids):
    """The logits of the megatron model built from the converted checkpoint by Bridge
    (``load_megatron_model``, the checkpoint's own run_config.yaml), in float32, on the CPU."""
    import torch
    from megatron.core.tensor_parallel import random

    bridge = _convert_rank.bridge_for(_convert_rank._auto_bridge(), spec["hf_config"])
    # Megatron's RNG tracker for inference: the local attention forks the tracker around its
    # dropout in every forward; the training tracker keeps CUDA generator states.
    random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    # The checkpoint says bf16 (GPT-OSS's provider forces it); built with bf16 off, Bridge makes
    # the parameters float32 (build_and_load_model) and the bf16 weights load exactly.
    model = _convert_rank.load_checkpoint(bridge, spec["megatron"], spec, bf16=False, fp16=False)[0]
    positions = torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids)
    model.eval()
    with torch.no_grad():
        logits = model(ids, positions, None)
    config = model.config
    return logits, {
        "params_dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "window_size": list(config.window_size) if getattr(config, "window_size", None) else None,
    }


def parity(expected, actual):
    """The comparison of two logits tensors ``[batch, seq, vocab]`` (``actual`` may have a
    padded vocabulary): max abs diff, scale, the bar, argmax agreement, first position off."""
    actual = actual[..., : expected.shape[-1]].float()
    if actual.shape != expected.shape:
        raise AssertionError(f"logits of shape {list(actual.shape)}, HF's are {list(expected.shape)}")
    diff = (actual - expected).abs()
    scale = expected.abs().max().item()
    bar = PARITY * scale
    off = (diff > bar).any(dim=(0, 2)).nonzero()
    same_argmax = (actual.argmax(-1) == expected.argmax(-1))
    return dict(
        max_abs_diff=diff.max().item(), scale=scale, bar=bar, parity=PARITY_TEXT,
        argmax_equal=int(same_argmax.sum().item()), positions=same_argmax.numel(),
        first_position_off=int(off[0].item()) if len(off) else None,
        tokens=list(expected.shape[:2]),
    )


def window_note(hf_config, megatron):
    """Where Bridge built another sliding window than the HF model has, say so (Megatron's
    ``window_size=(w, 0)`` lets a token see w before it and itself: HF's ``sliding_window`` is
    w + 1)."""
    window = getattr(hf_config, "sliding_window", None)
    built = megatron.get("window_size")
    if window and built and built[0] != window - 1:
        return (f"; Megatron-Bridge built window_size {tuple(built)} for the HF model's sliding_window "
                f"{window}, which is window_size ({window - 1}, 0)")
    return ""


def cpu_logits(spec, phases):
    phases.start("CPU logits")
    ids = tokens(_vocab(spec["hf_config"]), spec["batch"], spec["seq_len"])
    expected, hf_config = hf_logits(spec["hf_config"], ids)
    actual, megatron = megatron_logits(spec, ids)
    facts = dict(parity(expected, actual), megatron=megatron, dtype="float32",
                 sliding_window=getattr(hf_config, "sliding_window", None))
    problems = []
    if not facts["max_abs_diff"] <= facts["bar"]:  # NaN fails too
        problems.append(f"max abs diff {facts['max_abs_diff']:.2e} > {PARITY_TEXT} x scale {facts['scale']:.2e}"
                        f" = {facts['bar']:.2e}, from position {facts['first_position_off']} on")
    if facts["argmax_equal"] != facts["positions"]:
        problems.append(f"argmax equal at {facts['argmax_equal']}/{facts['positions']} positions")
    if problems:
        raise VerifyMismatch("logits differ: " + "; ".join(problems) + window_note(hf_config, megatron), facts)
    phases.end(**facts)


def _vocab(folder):
    import json

    with open(os.path.join(folder, "config.json")) as f:
        return json.load(f)["vocab_size"]


def run(spec, rank, phases):
    if spec["direction"] == "write":
        write_model(spec, phases)
    elif spec["direction"] == "import":
        _convert_rank.run_import(spec, rank, phases)
    else:
        _convert_rank.run_export(spec, rank, phases)
        compare_tensors(spec, phases)
        cpu_logits(spec, phases)


if __name__ == "__main__":
    _convert_rank.main(sys.argv[1], int(sys.argv[2]), run=run, phases_class=GuardedPhases)
