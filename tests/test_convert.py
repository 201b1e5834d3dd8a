"""``mcore-cpu-shim convert``: Hugging Face <-> Megatron torch_dist with Megatron-Bridge on the CPU.

Bad input exits 2 with a message that names the problem and the fix, checked before any worker
starts (fast, no Megatron-Bridge needed). The rank machinery is tested with stand-in workers
that record phases like the real ones: a rank that fails or dies stops the others at once and
is the one reported, and a Gloo collective gives up after the timeout. The comparison behind
``--verify`` is tested on its own. The end-to-end round trips (tiny models from
``mcore_cpu_shim.app.hf_models``) need Megatron-Bridge and skip without it.
"""

import importlib.util
import json
import os
import sys
import time

import pytest
from helpers import MODE, assert_same_as, convert_process, once_per_python, round_trip

pytestmark = [
    pytest.mark.cuda_hidden,
    once_per_python(),
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the command line is part of the shim"),
]


def _bridge_missing():
    try:
        return importlib.util.find_spec("megatron.bridge") is None
    except (ImportError, ValueError):
        return True


needs_bridge = pytest.mark.skipif(
    _bridge_missing(),
    reason="Megatron-Bridge is not installed here (pip install --no-deps megatron-bridge "
    "&& pip install 'mcore-cpu-shim[bridge]')",
)


def convert(*args, capsys):
    """``mcore-cpu-shim convert ARGS`` in this process: (exit status, stdout, stderr)."""
    from mcore_cpu_shim.app import cli

    try:
        code = cli.main(["convert", *map(str, args)])
    except SystemExit as exc:  # argparse
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


# --- Stand-in model folders, written without torch or transformers ---


def write_safetensors(path, tensors):
    """A safetensors file of float32 tensors ``{name: [values]}`` (shape: one dimension)."""
    header, data, offset = {}, b"", 0
    for name, values in tensors.items():
        raw = b"".join(int(v).to_bytes(4, "little") for v in values)
        header[name] = {"dtype": "F32", "shape": [len(values)], "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    head = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little") + head + data)


def fake_hf(folder, architectures=("LlamaForCausalLM",)):
    """A folder that passes the command's own checks: config.json and one safetensors file."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump({"architectures": list(architectures), "model_type": "llama"}, f)
    write_safetensors(os.path.join(folder, "model.safetensors"), {"w": [1, 2, 3, 4], "b": [5, 6]})
    return folder


def fake_megatron(folder):
    os.makedirs(os.path.join(folder, "iter_0000000"))
    open(os.path.join(folder, "iter_0000000", "run_config.yaml"), "w").close()
    return folder


# --- Bad input: exit 2, the problem and the fix named, before any worker starts ---


def test_missing_source_folder(tmp_path, capsys):
    code, out, err = convert("import", "--hf", tmp_path / "nope", "--out", tmp_path / "out", capsys=capsys)
    assert code == 2, err
    assert "--hf" in err and "no such folder" in err and "config.json" in err
    assert not (tmp_path / "out").exists()


def test_source_without_config_json(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    os.remove(hf / "config.json")
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert "has no config.json" in err and "not a Hugging Face model folder" in err


def test_config_without_architectures(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    (hf / "config.json").write_text('{"model_type": "llama"}')
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert 'names no "architectures"' in err and "LlamaForCausalLM" in err


@pytest.mark.parametrize("quantization, architecture, said", [
    ({"quant_method": "awq", "bits": 4}, "LlamaForCausalLM", "quant_method 'awq' is not a layout this conversion reads"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "LlamaForCausalLM", "quant_method 'bitsandbytes'"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "DeepseekV3ForCausalLM",
     "FP8 as fmt 'e5m2' with weight_block_size [128, 128] is not a layout this conversion reads"),
    ({"quant_method": "mxfp4"}, "LlamaForCausalLM", "MXFP4 weights convert for GPT-OSS (GptOssForCausalLM)"),
])
def test_a_quantization_it_cannot_read_exactly_is_refused_first(tmp_path, capsys, quantization, architecture, said):
    hf = fake_hf(tmp_path / "hf", architectures=(architecture,))
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps(dict(config, quantization_config=quantization)))
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2, err
    assert said in err and "dequantize it first" in err, err
    assert not (tmp_path / "out").exists()


def test_source_without_safetensors(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    os.remove(hf / "model.safetensors")
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert "has no *.safetensors weights" in err

    (hf / "pytorch_model.bin").write_bytes(b"\0")  # the old format: say how to convert it
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert "pytorch_model.bin" in err and "safe_serialization=True" in err


def test_truncated_safetensors(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    shard = hf / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-5])  # an interrupted download
    code, out, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert f"{shard} is corrupt (truncated)" in err and "download it again" in err
    assert "Traceback" not in out + err

    shard.write_bytes(b"\x10\x00")  # not even a header
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2 and f"{shard} is corrupt" in err


def test_index_naming_a_missing_shard(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    index = {"weight_map": {"w": "model.safetensors", "x": "model-00002-of-00002.safetensors"}}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert "model-00002-of-00002.safetensors" in err and "not there" in err


def test_non_empty_out_needs_overwrite(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    code, _, err = convert("import", "--hf", hf, "--out", out, capsys=capsys)
    assert code == 2
    assert "exists and is not empty" in err and "--overwrite" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_overwrite_never_touches_the_source(tmp_path, capsys):
    hf = fake_hf(tmp_path / "models" / "hf")
    before = sorted(os.listdir(hf))
    cases = [
        (hf, "is the --hf folder"),
        (tmp_path / "models", "contains the --hf folder"),  # replacing it would delete the source
        (tmp_path, "contains the --hf folder"),
    ]
    (hf / "sub").mkdir()
    (hf / "sub" / "x").write_text("part of the source")
    cases.append((hf / "sub", "is inside the --hf folder"))
    for out, message in cases:
        code, _, err = convert("import", "--hf", hf, "--out", out, "--overwrite", capsys=capsys)
        assert code == 2, out
        assert message in err and "give another --out" in err, err
    assert sorted(os.listdir(hf)) == sorted(before + ["sub"])
    assert (hf / "sub" / "x").read_text() == "part of the source"


def test_export_refuses_a_folder_that_is_no_checkpoint(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    (tmp_path / "empty").mkdir()
    code, _, err = convert("export", "--megatron", tmp_path / "empty", "--hf-config", hf,
                           "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert "not a Megatron-Bridge checkpoint" in err and "run_config.yaml" in err

    megatron = fake_megatron(tmp_path / "ckpt")
    code, _, err = convert("export", "--megatron", megatron, "--hf-config", tmp_path / "none",
                           "--out", tmp_path / "out", capsys=capsys)
    assert code == 2 and "--hf-config" in err and "no such folder" in err
    code, _, err = convert("export", "--megatron", megatron, "--hf-config", hf, "--out", megatron,
                           "--overwrite", capsys=capsys)
    assert code == 2 and "is the --megatron folder" in err


def test_parallelism_that_does_not_divide(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", "--ranks", 3, "--ep", 2, capsys=capsys)
    assert code == 2 and "--ranks 3 is not a multiple of --tp 1 x --ep 2" in err
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", "--ranks", 0, capsys=capsys)
    assert code == 2 and "must be 1 or more" in err
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", "--ranks", 3, "--tp", 2, capsys=capsys)
    assert code == 2 and "--ranks 3 is not a multiple of --tp 2 x --ep 1" in err
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", "--ranks", 6, "--tp", 2, "--pp", 2,
                           capsys=capsys)
    assert code == 2 and "--ranks 6 is not a multiple of --tp 2 x --pp 2 x --ep 1" in err


def test_virtual_stages_that_do_not_fit(tmp_path, capsys):
    hf = fake_hf(tmp_path / "hf")
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", "--vpp", 2, capsys=capsys)
    assert code == 2 and "--vpp 2 needs --pp > 1" in err
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(dict(config, num_hidden_layers=6)))
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", "--pp", 2, "--vpp", 2, capsys=capsys)
    assert code == 2 and "config.json has 6 layers, not a multiple of --pp 2 x --vpp 2 = 4" in err
    assert "with --pp 2, --vpp 1 or 3 would fit" in err
    assert not (tmp_path / "out").exists()


def test_megatron_bridge_not_installed(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "megatron.bridge", None)  # find_spec: not installed
    hf = fake_hf(tmp_path / "hf")
    code, _, err = convert("import", "--hf", hf, "--out", tmp_path / "out", capsys=capsys)
    assert code == 2
    assert "Megatron-Bridge is not installed" in err
    assert "pip install --no-deps megatron-bridge" in err and "pip install 'mcore-cpu-shim[bridge]'" in err
    assert not (tmp_path / "out").exists()


def test_registered_with_both_directions(capsys):
    code, out, _ = convert("--help", capsys=capsys)
    assert code == 0 and "import" in out and "export" in out
    code, _, err = convert(capsys=capsys)
    assert code == 2 and "DIRECTION" in err


# --- The ranks: failures, deaths, timeouts, progress (stand-in workers) ---

FAKE_RANK = """
import json, os, sys, time
from mcore_cpu_shim.app import convert_worker, launch, worker

spec_path, rank, plan = sys.argv[1], int(os.environ["RANK"]), json.loads(sys.argv[2])
with open(spec_path) as f:
    spec = json.load(f)
phases = worker.Phases(os.path.join(spec["events"], f"rank{rank}.jsonl"))


def every_rank_in(name):  # a rank fails once all are in the phase, as in a collective
    for _ in range(1200):
        every = launch.rank_events(spec["events"], spec["ranks"])
        if all(any(e.get("phase") == name and e.get("started") for e in events) for events in every):
            return
        time.sleep(0.05)


ok = False
try:
    for name in convert_worker.phases_of(spec):
        phases.start(name)
        action = plan.get(f"{rank}:{name}")
        if action in ("raise", "die"):
            every_rank_in(name)
        if action == "raise":
            raise RuntimeError(f"boom on rank {rank}")
        if action == "input":
            raise worker.InputProblem("this model is not convertible")
        if action == "die":
            os.kill(os.getpid(), 9)
        if action == "hang":
            time.sleep(600)
        if action == "gloo":  # a collective whose peer never joins it
            import torch
            worker.init_gloo(spec, rank)
            if rank == 0:
                torch.distributed.all_reduce(torch.ones(1))
            else:
                time.sleep(600)
    phases.end(size=1024)
    ok = True
except BaseException as exc:
    phases.fail(exc)
phases.record(done=True, ok=ok, torch="x", cuda_initialized=False)
os._exit(0 if ok else 1)
"""


def run_fake(tmp_path, plan, ranks=2, timeout=300, verify=False):
    """Run stand-in ranks through the command's own launcher and supervisor."""
    from mcore_cpu_shim.app import convert as command

    script = tmp_path / "fake_rank.py"
    script.write_text(FAKE_RANK)
    folder = tmp_path / "work"
    folder.mkdir()
    spec = dict(direction="import", verify=verify, ranks=ranks, tp=1, ep=1, timeout=timeout, out=str(tmp_path / "o"))
    spec_path = str(folder / "spec.json")

    class Stream:
        text = ""

        def write(self, s):
            Stream.text += s

        def flush(self):
            pass

        def isatty(self):
            return False

    start = time.monotonic()
    outcome = command.execute(spec, str(folder), stream=Stream(),
                              command=[sys.executable, str(script), spec_path, json.dumps(plan)])
    return outcome, Stream.text, time.monotonic() - start, str(folder)


def test_a_failing_rank_stops_the_others_and_is_reported(tmp_path, capsys):
    from mcore_cpu_shim.app import launch

    # Rank 1 fails copying weights; rank 0 waits for it forever (as in a collective).
    outcome, progress, seconds, folder = run_fake(tmp_path, {"1:copy weights": "raise", "0:copy weights": "hang"})
    assert seconds < 60, "the waiting rank was not stopped"
    failure = outcome["failure"]
    assert (failure["rank"], failure["phase"], failure["error"]) == (1, "copy weights", "RuntimeError: boom on rank 1")
    assert "fake_rank.py" in failure["where"]
    assert "  load HF: ok (" in progress and "  build model: ok (" in progress
    assert "  copy weights: FAILED" in progress and "save" not in progress

    assert launch.report_failure("mcore-cpu-shim convert import", failure, folder) == 1
    err = capsys.readouterr().err
    assert "rank 1 failed in 'copy weights': RuntimeError: boom on rank 1" in err
    assert f"rank logs kept in {folder}" in err


def test_a_rank_that_dies_is_named_with_its_signal(tmp_path, capsys):
    outcome, progress, seconds, _ = run_fake(tmp_path, {"1:build model": "die", "0:build model": "hang"})
    assert seconds < 60
    failure = outcome["failure"]
    assert failure["rank"] == 1 and failure["phase"] == "build model"
    assert "killed by SIGKILL" in failure["error"]


def test_a_gloo_collective_gives_up_after_the_timeout(tmp_path):
    # Rank 1 joins the group, then never the all-reduce: rank 0 must fail after --timeout
    # seconds (not megatron's or torch's 30 minutes), and the parent then stops rank 1.
    outcome, _, seconds, _ = run_fake(tmp_path, {"0:load HF": "gloo", "1:load HF": "gloo"}, timeout=5)
    failure = outcome["failure"]
    assert failure["rank"] == 0 and failure["phase"] == "load HF", failure
    assert "timed out" in failure["error"].lower() or "timeout" in failure["error"].lower(), failure["error"]
    assert seconds < 90


def test_progress_and_facts_of_a_run_that_passes(tmp_path):
    outcome, progress, _, _ = run_fake(tmp_path, {}, verify=True)
    assert outcome["failure"] is None
    lines = [line for line in progress.splitlines() if line]
    assert [line.split(":")[0].strip() for line in lines] == ["load HF", "build model", "copy weights", "save", "verify"]
    assert all(": ok (" in line for line in lines)
    assert "1.0 KB" in lines[-1]  # the facts a phase recorded (size) are shown
    assert outcome["facts"]["cuda_initialized"] is False


@needs_bridge
@pytest.mark.parametrize("signum", ["SIGINT", "SIGTERM"])
def test_ctrl_c_or_sigterm_ends_every_rank_and_keeps_out(tmp_path, signum):
    """Ctrl-C (SIGINT) or SIGTERM to ``convert`` while its ranks work: torch's agent and every
    rank are gone within seconds, the exit status is 130, and ``--out`` is as it was."""
    import signal
    import subprocess

    import psutil
    from mcore_cpu_shim.app import hf_models

    hf = hf_models.write("llama", tmp_path / "hf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("the old --out")
    command = [sys.executable, "-m", "mcore_cpu_shim", "convert", "import", "--hf", str(hf), "--out", str(out),
               "--overwrite", "--ranks", "2"]
    process = subprocess.Popen(command, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    children = []
    for _ in range(600):  # the agent and its two ranks
        children = psutil.Process(process.pid).children(recursive=True)
        if len(children) >= 3 or process.poll() is not None:
            break
        time.sleep(0.1)
    assert len(children) >= 3, process.communicate()
    time.sleep(1)
    sent = time.monotonic()
    process.send_signal(getattr(signal, signum))
    _, err = process.communicate(timeout=60)
    assert time.monotonic() - sent < 30
    assert process.returncode == 130, err
    assert "interrupted; every rank stopped" in err and "left as it was" in err
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, [p.cmdline() for p in alive]
    assert sorted(os.listdir(out)) == ["keep.txt"] and (out / "keep.txt").read_text() == "the old --out"
    assert sorted(os.listdir(tmp_path)) == ["hf", "out"]  # nothing moved aside is left over


def test_an_input_problem_in_a_rank_exits_2(tmp_path, capsys):
    from mcore_cpu_shim.app import launch

    outcome, _, _, folder = run_fake(tmp_path, {"0:load HF": "input", "1:load HF": "input"})
    assert outcome["failure"]["input"] is True
    assert launch.report_failure("mcore-cpu-shim convert import", outcome["failure"], folder) == 2
    assert "error: this model is not convertible" in capsys.readouterr().err


# --- The comparison behind --verify ---


def test_compare_counts_every_tensor(tmp_path):
    torch = pytest.importorskip("torch")
    safetensors_torch = pytest.importorskip("safetensors.torch")
    from mcore_cpu_shim.app.convert_worker import check_comparison, compare
    from mcore_cpu_shim.app.quantized import SafetensorsFolder
    from mcore_cpu_shim.app.worker import VerifyMismatch

    a, b, c = torch.randn(3, 2).bfloat16(), torch.randn(4).bfloat16(), torch.randn(2).bfloat16()
    safetensors_torch.save_file({"a": a, "b": b}, str(tmp_path / "model-1.safetensors"))
    safetensors_torch.save_file({"c": c}, str(tmp_path / "model-2.safetensors"))
    reference = SafetensorsFolder(str(tmp_path))

    facts = compare([("a", a.clone()), ("b", b.clone()), ("c", c.clone())], reference)
    assert facts == {"tensors": 3, "equal": 3, "differing": [], "missing": [], "unexpected": [], "how": {}}
    check_comparison(facts)

    changed = b.clone()
    changed[0] += 1
    facts = compare([("a", a.clone()), ("b", changed), ("d", c.clone())], reference)
    how = facts.pop("how")
    assert facts == {"tensors": 3, "equal": 1, "differing": ["b"], "missing": ["c"], "unexpected": ["d"]}
    assert list(how) == ["b"] and how["b"] == (changed.double() - b.double()).abs().max().item() > 0.9
    with pytest.raises(VerifyMismatch, match=r"1/3 tensors equal: 1 differ \(e.g. b\); 1 missing.*; b: max abs diff \d\.\d{3}e[+-]\d\d$"):
        check_comparison(dict(facts, how=how))

    # A conversion to another dtype: compared with the source cast to it, still exactly.
    facts = compare([(n, t.float()) for n, t in (("a", a), ("b", b), ("c", c))], reference, dtype=torch.float32)
    assert facts["equal"] == 3
    cast = compare([("a", a.float())], reference)  # no silent casting
    assert cast["differing"] == ["a"] and cast["how"] == {"a": "dtype float32, the reference's bfloat16"}


# --- End to end, with Megatron-Bridge ---


@needs_bridge
def test_round_trip_every_tensor_equal(tmp_path):
    """Llama on one rank; GPT-OSS's one-rank import and export are test_bridge_quantized.py's
    (as published, MXFP4), its multi-rank ones test_gpt_oss_two_ranks_expert_parallel below
    and test_bridge_replicated_device.py's TP 2 x PP 2."""
    hf, count, imported = round_trip(tmp_path, "llama")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    for phase in ("load HF", "build model", "copy weights", "save"):
        assert f"  {phase}: ok (" in imported.stdout
    assert f"  verify: ok (" in imported.stdout and f"{count}/{count} tensors equal" in imported.stdout
    assert "CUDA initialised: no" in imported.stdout
    assert os.path.isdir(tmp_path / "megatron" / "iter_0000000")

    exported = convert_process("export", "--megatron", tmp_path / "megatron", "--hf-config", hf,
                               "--out", tmp_path / "back", "--verify")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert f"{count}/{count} tensors equal" in exported.stdout
    assert os.path.exists(tmp_path / "back" / "config.json")
    assert assert_same_as(hf, tmp_path / "back") == count
    assert not [n for n in os.listdir(tmp_path) if ".replaced-" in n]


@needs_bridge
def test_gpt_oss_two_ranks_expert_parallel(tmp_path):
    hf, count, imported = round_trip(tmp_path, "gpt-oss", "--ranks", 2, "--ep", 2)
    text = imported.stdout + imported.stderr
    assert imported.returncode == 0, text
    assert "2 ranks, TP 1, EP 2" in imported.stdout and f"{count}/{count} tensors equal" in imported.stdout
    exported = convert_process("export", "--megatron", tmp_path / "megatron", "--hf-config", hf,
                               "--out", tmp_path / "back", "--verify")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert assert_same_as(hf, tmp_path / "back") == count


@needs_bridge
def test_virtual_pipeline_stages_import_and_reshard_exactly(tmp_path):
    """Llama with four layers at PP 2 x VPP 2 (two ranks, two model chunks each, interleaved):
    verified on import, exported on one rank (no pipeline), every tensor the source's."""
    from mcore_cpu_shim.app import hf_models

    hf = hf_models.write("llama", tmp_path / "hf", num_hidden_layers=4)
    count = len(hf_models.tensors(hf))
    imported = convert_process("import", "--hf", hf, "--out", tmp_path / "megatron", "--pp", 2, "--vpp", 2, "--verify")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert "2 ranks, TP 1, PP 2 x VPP 2, EP 1" in imported.stdout and f"{count}/{count} tensors equal" in imported.stdout
    run_config = (tmp_path / "megatron" / "iter_0000000" / "run_config.yaml").read_text()
    assert "virtual_pipeline_model_parallel_size: 2" in run_config  # the model was built in four chunks
    exported = convert_process("export", "--megatron", tmp_path / "megatron", "--hf-config", hf,
                               "--out", tmp_path / "back", "--verify")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert assert_same_as(hf, tmp_path / "back") == count


@needs_bridge
def test_unsupported_architecture(tmp_path):
    pytest.importorskip("transformers")
    from mcore_cpu_shim.app import hf_models

    hf = hf_models.write("llama", tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["architectures"] = ["FooForCausalLM"]
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")

    result = convert_process("import", "--hf", hf, "--out", out, "--overwrite")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Megatron-Bridge cannot convert architectures ['FooForCausalLM']" in result.stderr
    assert "LlamaForCausalLM" in result.stderr  # what it does convert
    assert "Traceback" not in result.stderr
    assert os.listdir(out) == ["keep.txt"]  # a failed --overwrite puts the old --out back
