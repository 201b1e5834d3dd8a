"""``python -m mcore_cpu_shim demo``: the whole CPU-only round trip, as a user runs it.

With Megatron-Bridge on the path the demo converts a tiny GPT-OSS-like Hugging Face model
HF -> torch_dist -> HF (without and with the shim): every tensor must come back equal and the
CPU logits of the HF model and of the megatron model built from the checkpoint must agree
within the parity bar. Without Bridge it says how to install it and runs the megatron-core-only
round trip, whose run (also with ``--megatron-only`` where Bridge is installed) must say that
every step passed with the shim, every tensor and the logits are equal, CUDA was never
initialised and no driver library was mapped, and where unfixed megatron-core stops.
"""

import json
import re
import subprocess
import sys

import pytest
from helpers import HAVE_BRIDGE, MODE, megatron_source, needs_bridge, upstream_fixed_here

STEPS = ["build model", "save torch_dist", "build fresh + load", "compare tensors", "forward compare"]
BRIDGE_STEPS = ["write HF model", "import (HF -> torch_dist)", "export (torch_dist -> HF)", "compare tensors",
                "CPU logits HF vs megatron"]
# The fixes of the CUDA spots met while building the model (YaRN tables, softmax offsets, the
# dispatcher's stream).
BUILD_FIXES = {"yarn_rope_device", "softmax_offsets_device", "moe_dispatcher_device"}
INSTALL = "pip install --no-deps megatron-bridge && pip install 'mcore-cpu-shim[bridge]'"
# Where Bridge still writes this, it builds GPT-OSS with a 128-token window whatever the HF
# config says (Megatron-Bridge 0.3.1, gpt_oss_bridge.py:94; main reads sliding_window).
FIXED_WINDOW = "provider.window_size = (128, 0)"


def demo(*options, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "mcore_cpu_shim", "demo", *options],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_demo(*options):
    result = demo("--json", *options)
    try:
        summary = json.loads(result.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"the demo printed no JSON (exit {result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}")
    return result, summary


def ok_flags(summary, label, steps=STEPS):
    return [summary["passes"][label]["steps"][step]["ok"] for step in steps]


def failures(summary, label):
    return {
        step: f"{s['error']} at {s.get('where')}"
        for step, s in summary["passes"][label]["steps"].items()
        if s["ok"] is False
    }


def assert_demo_passed(result, summary):
    steps = summary["step_names"]
    assert ok_flags(summary, "with shim", steps) == [True] * len(steps), failures(summary, "with shim")
    assert result.returncode == 0, result.stderr[-6000:]
    assert summary["passed"], summary["checks"]
    assert summary["tensors_compared"] > 0
    assert summary["tensors_equal"] == summary["tensors_compared"]
    assert summary["parameters"] > 0
    assert summary["cuda_initialized"] is False
    assert summary["driver_libraries"] == []
    # One progress line per step and pass, on stderr next to the JSON on stdout.
    assert f"[with shim] {steps[-1]}: ok" in result.stderr


@pytest.mark.cuda_hidden
def test_demo_round_trip_without_cuda():
    # Where Bridge is installed the demo converts through it (the tests below); the
    # megatron-core-only round trip is its fallback and --megatron-only.
    result, summary = run_demo(*(["--megatron-only"] if HAVE_BRIDGE else []))

    assert summary["round_trip"] == "megatron-core only"
    assert summary["step_names"] == STEPS
    assert_demo_passed(result, summary)
    if not HAVE_BRIDGE:
        # It says why it does not convert a Hugging Face model, and how to change that.
        assert "Megatron-Bridge is not installed" in result.stderr and INSTALL in result.stderr
        assert "running the megatron-core-only round trip instead" in result.stderr
        assert INSTALL in summary["bridge_missing"]
    else:
        assert summary["bridge_missing"] is None
    without = summary["passes"]["without shim"]["steps"]
    if MODE == "shim":
        assert summary["delivery"] == {"without shim": "shim disabled", "with shim": "shim applied"}
        failed_at = summary["without_shim_failed_at"]
        if BUILD_FIXES <= upstream_fixed_here():
            # megatron-core fixed the spots of the build itself (PR 6270's branch): without the
            # shim the model builds, and a later step meets a spot only the shim fixes.
            assert failed_at in STEPS[1:], failures(summary, "without shim")
        else:
            # Unfixed megatron-core cannot even build the model on a CPU-only host.
            assert failed_at == "build model", failures(summary, "without shim")
        # The demo says where, in megatron-core's own code, and skips the rest.
        assert without[failed_at]["where"].startswith("megatron/core/"), without[failed_at]
        at = STEPS.index(failed_at)
        assert ok_flags(summary, "without shim") == [True] * at + [False] + [None] * (len(STEPS) - at - 1)
    elif MODE == "bridge-patched":
        # Bridge patched, megatron-core's fixes from the shim: without the shim megatron-core
        # stops on its own CUDA spots as in shim mode.
        assert summary["without_shim_failed_at"] in STEPS, failures(summary, "without shim")
    else:
        # Patched megatron-core: both passes run the same fixed code (the shim is disabled in
        # "patched" and stands down in "patched+shim"), so both pass, and the demo says so.
        expected = "shim disabled" if MODE == "patched" else "megatron-core already fixed (upstream-fixed)"
        assert summary["delivery"]["with shim"] == expected
        assert summary["without_shim_failed_at"] is None, failures(summary, "without shim")
        assert ok_flags(summary, "without shim") == [True] * len(STEPS)


LOGITS = re.compile(
    r"max abs diff (\S+) (<=|>) 1e-4 x scale (\S+) \(max abs HF logit\) = (\S+); "
    r"argmax equal at (\d+)/(\d+) positions"
)


def table_rows(stdout):
    """{step: (without shim, with shim)} of the printed table."""
    rows = {}
    for line in stdout.splitlines():
        for step in BRIDGE_STEPS:
            if line.startswith(step + "  "):
                rows[step] = tuple(re.split(r"\s{2,}", line[len(step):].strip())[:2])
    return rows


@needs_bridge()
@pytest.mark.cuda_hidden
@pytest.mark.skipif(MODE not in ("shim", "bridge-patched"), reason=f"mode {MODE}: no Megatron-Bridge leg")
def test_bridge_demo_converts_a_tiny_gpt_oss_exactly():
    """The default run, as a user sees it: the table, every tensor equal, the logits within the
    bar, no CUDA; without the shim it stops where Bridge or megatron-core assumes CUDA."""
    result = demo()
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-6000:]
    assert out.rstrip().splitlines()[-1] == "PASS"

    rows = table_rows(out)
    assert list(rows) == BRIDGE_STEPS, out
    assert all(rows[step][1] == "ok" for step in BRIDGE_STEPS), out
    for step in BRIDGE_STEPS:
        assert f"[with shim] {step}: ok (" in out
    # Without the shim: it writes the model, then fails at a CUDA/TE assumption in megatron
    # (Bridge's unconditional Transformer Engine import in shim mode), shown with where.
    without = [rows[step][0] for step in BRIDGE_STEPS]
    assert without[0] == "ok", out
    failed = next(i for i, cell in enumerate(without) if cell != "ok")
    assert without[failed] == "FAILED (1)" and set(without[failed + 1:]) <= {"not reached"}, out
    note = out[out.index("\n(1) "):].splitlines()
    assert note[2].startswith("    at megatron/"), out
    if MODE == "shim":
        assert "transformer_engine" in note[1], out
        assert "shim disabled; TE import guard off" in out and "with shim: shim applied" in out

    assert "model: GptOssForCausalLM (2 layers" in out and "YaRN RoPE, attention sinks" in out
    compared = re.search(r"tensors compared: (\d+) \(HF -> torch_dist -> HF, names, dtypes and values\), "
                         r"equal: (\d+)", out)
    assert compared and compared[1] == compared[2] and int(compared[1]) > 30, out
    logits = LOGITS.search(out)
    assert logits, out
    diff, within, scale, bar, same, positions = logits.groups()
    assert within == "<=" and float(diff) <= float(bar) and float(bar) == pytest.approx(1e-4 * float(scale), rel=0.1)
    assert same == positions == "64"  # 2 x 32 tokens
    # The export as a user loads it (issue 25 item 5): transformers, from its own config.json.
    assert "the exported folder, loaded by transformers: logits equal to the source's, bit for bit" in out, out
    assert "CUDA initialised: no" in out and "driver libraries mapped: none" in out


def shim_pass(family, tmp_path, seq_len=32):
    """The demo's pass with the shim (``demo_bridge.run_pass``: the default run without its
    pass without the shim) on one rank, every step under forbid_cuda(); its result, once every
    rank's last record said it kept off CUDA."""
    from types import SimpleNamespace

    from mcore_cpu_shim.app import demo_bridge

    sizes = dict.fromkeys(demo_bridge.CONFIG_FIELDS)
    args = SimpleNamespace(model=family, ranks=1, ep=1, seq_len=seq_len, timeout=600, **sizes)
    result = demo_bridge.run_pass(args, "with shim", str(tmp_path), {}, lambda *line: None)
    assert result["ranks"] and all(rank is not None and rank["cuda_initialized"] is False
                                   and rank["driver_libraries"] == [] for rank in result["ranks"]), result["ranks"]
    return result


@needs_bridge()
@pytest.mark.cuda_hidden
@pytest.mark.skipif(MODE not in ("shim", "bridge-patched"), reason=f"mode {MODE}: no Megatron-Bridge leg")
def test_bridge_demo_past_the_sliding_window(tmp_path):
    """64 tokens, twice the tiny model's sliding window (32): the window layers now mask. Bridge
    main converts the window (``sliding_window - 1``) and the logits agree; Bridge 0.3.1 builds
    every GPT-OSS with window_size (128, 0), and the logits step fails and says so (the tensors
    are equal: the conversion of the weights is right, the model built from them is not). The
    demo's pass with the shim only: the default run above shows the pass without it."""
    steps = shim_pass("gpt-oss", tmp_path, seq_len=64)["steps"]
    before = {name: s for name, s in steps.items() if name != "CPU logits HF vs megatron"}
    assert all(s["ok"] for s in before.values()), {name: (s.get("error"), s.get("where")) for name, s in before.items()}
    assert steps["write HF model"]["facts"]["parameters"] > 0
    compared = steps["compare tensors"]["facts"]
    assert compared["tensors"] == compared["equal"] > 0
    step = steps["CPU logits HF vs megatron"]
    logits = step["facts"]
    assert logits["tokens"] == [2, 64]
    assert logits["export_logits_equal"] is True  # transformers on the export: the source's model
    if FIXED_WINDOW not in megatron_source("megatron.bridge.models.gpt_oss.gpt_oss_bridge"):
        assert step["ok"] is True, (step.get("error"), step.get("where"))
        assert logits["max_abs_diff"] <= logits["bar"]
        assert logits["megatron"]["window_size"] == [31, 0]
    else:
        assert step["ok"] is False
        assert not logits["max_abs_diff"] <= logits["bar"]
        assert "from position 32 on" in step["error"], step["error"]
        assert "built window_size (128, 0) for the HF model's sliding_window 32" in step["error"]
        assert logits["first_position_off"] == 32  # the first token whose window excludes one


# The family matrix (docs/support.md "Model families"): every family Bridge converts
# (hf_models.BRIDGE_FAMILIES) but the default run's GPT-OSS, converted on one rank; what its HF
# model is, and how many tensors it has (Mixtral: tests/test_family_mixtral.py).
FAMILIES = {
    "llama": ("LlamaForCausalLM", 21),
    "qwen2": ("Qwen2ForCausalLM", 27),
    "qwen3": ("Qwen3ForCausalLM", 25),
    "qwen3-moe": ("Qwen3MoeForCausalLM", 45),
    "deepseek-v3": ("DeepseekV3ForCausalLM", 41),
}


@needs_bridge()
@pytest.mark.cuda_hidden
# (bridge-patched: the patched Bridge's conversions are test_bridge_roundtrip's; a family per
# mode would cost CI six more minutes)
@pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the family matrix runs in the Bridge legs' shim mode")
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bridge_family(family, tmp_path, record_property):
    """Each family converts exactly and its CPU logits agree with HF's: plain RoPE (rope_device)
    with q/k/v biases (Qwen2) and q/k norms (Qwen3), a MoE without shared experts (Qwen3-MoE),
    and MLA with YaRN, expert bias and a shared expert (DeepSeek-V3: mla_cpu_build,
    router_buffers_device, bridge_local_layers' CUDA-only flags, and on Bridge 0.3.1
    bridge_local_experts). The demo's pass with the shim
    (every step under forbid_cuda()), on one rank; the default demo run above is the one with
    expert parallelism and the pass without the shim."""
    result = shim_pass(family, tmp_path)
    steps = result["steps"]
    assert [s["ok"] for s in steps.values()] == [True] * len(steps), {
        name: (s.get("error"), s.get("where")) for name, s in steps.items() if not s["ok"]}
    assert result["exit_codes"] == [0, 0, 0]
    architecture, tensors = FAMILIES[family]
    assert steps["write HF model"]["facts"]["architecture"] == architecture
    compared = steps["compare tensors"]["facts"]
    assert (compared["tensors"], compared["equal"]) == (tensors, tensors)
    logits = steps["CPU logits HF vs megatron"]["facts"]
    assert logits["max_abs_diff"] <= logits["bar"]
    assert logits["argmax_equal"] == logits["positions"] == 64
    # transformers loads the exported folder (its own config.json) into the source's model: the
    # same logits, bit for bit (issue 25 item 5).
    assert logits["export_logits_equal"] is True
    # For the matrix report's family table (tools/matrix.py family_cells).
    record_property("family", f"{tensors}/{tensors} tensors equal, logits max abs diff "
                              f"{logits['max_abs_diff']:.1e} (scale {logits['scale']:.1e})")


@pytest.mark.cuda_hidden
def test_parity_of_logits():
    torch = pytest.importorskip("torch")
    from mcore_cpu_shim.app.demo_bridge import parity

    expected = torch.randn(2, 8, 10)
    padded = torch.cat([expected, torch.zeros(2, 8, 6)], dim=-1)  # megatron pads the vocabulary
    facts = parity(expected, padded)
    assert facts["max_abs_diff"] == 0 and facts["argmax_equal"] == facts["positions"] == 16
    assert facts["bar"] == pytest.approx(1e-4 * expected.abs().max().item())
    assert facts["first_position_off"] is None

    changed = padded.clone()
    changed[1, 5, 3] += 10 * facts["bar"]  # over the bar, from position 5 on
    facts = parity(expected, changed)
    assert facts["max_abs_diff"] > facts["bar"] and facts["first_position_off"] == 5


@pytest.mark.cuda_hidden
def test_without_bridge_it_says_how_to_install_it(monkeypatch):
    from mcore_cpu_shim.app import demo as command

    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # find_spec: not installed
    message = command.bridge_missing()
    assert "Megatron-Bridge is not installed" in message and INSTALL in message


@pytest.mark.cuda_hidden
def test_bad_options_exit_2():
    for options, message in [
        (["--ranks", "3", "--ep", "2"], "--ranks 3 is not a multiple of --ep 2"),
        (["--hidden", "60"], "an odd number: rotary embeddings turn pairs of channels"),
        (["--megatron-only", "--model", "llama"], "leave out --megatron-only"),
    ]:
        result = demo(*options, timeout=60)
        assert result.returncode == 2, options
        assert message in result.stderr, result.stderr
    if HAVE_BRIDGE:
        result = demo("--model", "llama", "--ep", "2", timeout=60)
        assert result.returncode == 2 and "--ep 2: llama has no experts" in result.stderr
    else:
        result = demo("--model", "llama", timeout=60)
        assert result.returncode == 2 and INSTALL in result.stderr


@pytest.mark.cuda_visible
def test_demo_on_a_gpu_host_stays_off_the_gpu():
    """On a host with a GPU the demo's ranks still hide it: the same result as without one."""
    result, summary = run_demo()

    assert_demo_passed(result, summary)


@pytest.mark.cuda_hidden
def test_cli_starts_without_torch():
    code = "import sys, mcore_cpu_shim.app.cli; assert 'torch' not in sys.modules, 'torch imported'"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
