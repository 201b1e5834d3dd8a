"""A real Transformer Engine install on a host without usable CUDA (the ``te`` leg).

``tools/te_leg.py`` (``tox -e te``) installs TE three ways in turn (core only; complete 2.20.2;
complete 2.12.0, the torch extensions from ../shared/wheels) next to torch 2.14.1 and
megatron-core 0.19.2 and runs this file with CUDA hidden. Without TE installed every test
here skips (the normal matrix legs); the fake-TE tests in test_te_guard.py cover the shapes a
real install cannot (OSError at import, leftover folders).

What must hold, whichever install: TE counts as absent to megatron-core (every HAVE_TE False,
``is_te_min_version`` False, no TE norm in the local spec, no ``te_general_gemm``, no TE
FusedAdam, ``find_spec`` None), one warning with the true reason, ``doctor`` says so and exits
0 (and 1 with the guard off), the demo passes, and a checkpoint has exactly the keys of the
same save with TE blocked.
"""

import importlib.metadata
import json
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import MODE, run_python, run_ranks
from test_cli import cli
from test_demo import assert_demo_passed, failures, run_demo


def installed_te():
    """``{distribution: version}`` of the TE distributions installed here (never imports TE)."""
    found = {}
    for name in ("transformer-engine", "transformer-engine-cu12", "transformer-engine-cu13",
                 "transformer-engine-torch"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


TE = installed_te()
VERSION = TE.get("transformer-engine")
COMPLETE = "transformer-engine-torch" in TE  # else the core only: no torch extension

pytestmark = [
    pytest.mark.skipif(not TE, reason="Transformer Engine is not installed (the te leg installs it: tools/te_leg.py)"),
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the guard is part of the shim, not of the patches"),
]

# Without the torch extension, transformer_engine imports and transformer_engine.pytorch fails.
CORE_ONLY_ERROR = "transformer_engine.pytorch: FileNotFoundError: Could not find shared object file for Transformer Engine torch lib"


def assert_reason(reason):
    """The guard's reason for this install."""
    if COMPLETE:
        assert reason == f"Transformer Engine {VERSION} installed and importable, CUDA not usable: treated as absent"
    else:
        assert reason.startswith(f"Transformer Engine {VERSION} installed, not importable ({CORE_ONLY_ERROR}"), reason
        assert reason.endswith("), CUDA not usable: treated as absent"), reason


def last_json(result):
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


MEGATRON_VIEW = """
    import importlib.util, json, sys, tempfile, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import mcore_cpu_shim
        import megatron.core
        from megatron.core import optimizer, utils
        from megatron.core.models.gpt import gpt_layer_specs
        from megatron.core.transformer.moe import moe_utils
        from helpers import init_gloo, tiny_gpt
        init_gloo(tempfile.mkdtemp())
        model = tiny_gpt(1)
    te_names = ("transformer_engine", "transformer_engine_torch")
    print(json.dumps({
        "have_te": {name: module.HAVE_TE for name, module in list(sys.modules.items())
                    if name.startswith("megatron.") and isinstance(getattr(module, "HAVE_TE", None), bool)},
        "te_min_version": utils.is_te_min_version("1.0.0"),
        "te_version": str(utils.get_te_version()),
        "te_general_gemm": repr(getattr(moe_utils, "te_general_gemm", "<unbound>")),
        "adam": f"{optimizer.Adam.__module__}.{optimizer.Adam.__qualname__}",
        "te_classes": sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()
                              if "transformer_engine" in type(m).__module__}),
        "final_norm": type(model.decoder.final_layernorm).__name__,
        "find_spec": [importlib.util.find_spec(name) is not None for name in te_names],
        "te_modules": [m for m in sys.modules if m.split(".")[0] in te_names and sys.modules[m] is not None],
        "state": mcore_cpu_shim.te_guard.state(),
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)],
    }))
"""


@pytest.mark.cuda_hidden
def test_megatron_core_sees_no_te():
    view = last_json(run_python(MEGATRON_VIEW))

    assert view["have_te"] and not any(view["have_te"].values()), view["have_te"]
    assert view["te_min_version"] is False and view["te_version"] == "0.0.0"
    assert view["te_general_gemm"] == "None"
    assert not view["adam"].startswith("transformer_engine"), view["adam"]
    assert view["te_classes"] == [] and view["final_norm"] != "TENorm", view
    assert view["find_spec"] == [False, False]
    assert view["te_modules"] == []
    [warning] = view["warnings"]
    assert_reason(view["state"]["reason"])
    assert warning.startswith(f"mcore_cpu_shim: {view['state']['reason']}. megatron-core takes its local code paths")
    assert ".." not in warning
    assert view["state"]["te"]["importable"] is COMPLETE and view["state"]["te"]["version"] == VERSION


@pytest.mark.cuda_hidden
def test_te_before_torch_is_decided_after_torch():
    """TE's core raises OSError (libnccl.so.2) when imported before torch: the guard imports
    torch first, so the reason is about this install, not about the import order."""
    code = """
        import json, sys, warnings
        warnings.simplefilter("ignore")
        import mcore_cpu_shim
        try:
            import transformer_engine
        except ModuleNotFoundError as exc:
            error = str(exc)
        print(json.dumps({"error": error, "torch": "torch" in sys.modules,
                          "reason": mcore_cpu_shim.te_guard.state()["reason"]}))
    """
    result = last_json(run_python(code, fresh=True))
    assert result["torch"] is True
    assert_reason(result["reason"])
    assert "libnccl" not in result["reason"]
    assert result["error"].startswith("No module named 'transformer_engine': Transformer Engine counts as absent")


@pytest.mark.cuda_hidden
def test_te_imported_before_the_shim_is_left_alone_with_a_warning():
    code = """
        import json, warnings
        try:
            import transformer_engine.pytorch
        except Exception:
            import transformer_engine  # core only: the package imports, its PyTorch part not
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mcore_cpu_shim
        print(json.dumps({"state": mcore_cpu_shim.te_guard.state(),
                          "warnings": [str(w.message) for w in caught
                                       if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)]}))
    """
    result = last_json(run_python(code))
    assert result["state"]["reason"] is None and "transformer_engine" in result["state"]["imported_before"]
    [warning] = result["warnings"]
    assert warning.startswith(f"mcore_cpu_shim: Transformer Engine {VERSION} was imported before mcore_cpu_shim")
    assert "import mcore_cpu_shim before anything imports transformer_engine" in warning
    assert "`mcore-cpu-shim run -- ...`" in warning


@pytest.mark.cuda_hidden
def test_doctor_tells_the_truth():
    # The three reports at once (each a fresh interpreter importing every target, ~10 s).
    with ThreadPoolExecutor(3) as pool:
        runs = [pool.submit(cli, *args, **env) for args, env in [
            (("doctor", "--json"), {}), (("doctor",), {}), (("doctor", "--json"), {"MCORE_CPU_SHIM_TE": "off"})]]
        result, text, unguarded = (run.result() for run in runs)
    assert result.returncode == 0, (result.stdout[-3000:], result.stderr[-3000:])
    report = json.loads(result.stdout)
    te = report["transformer_engine"]
    assert te["installed"] is True and te["version"] == VERSION and te["distributions"] == TE
    assert te["importable"] is COMPLETE and te["usable"] is False and te["treated_as_absent"] is True
    assert te["status"] == "treated as absent"
    if COMPLETE:
        assert te["reason"] == f"installed ({VERSION}), importable, not usable (no CUDA): treated as absent"
        assert te["imports"] == {name: "ok" for name in ("transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch")}
    else:
        assert te["reason"].startswith(f"installed ({VERSION}), not importable ({CORE_ONLY_ERROR}")
        assert te["imports"]["transformer_engine"] == "ok"
    assert report["problems"] == []
    assert report["cuda"]["usable"] is False and report["cuda"]["initialised"] is False

    assert text.returncode == 0
    assert f"Transformer Engine  {te['reason']}\n" in text.stdout  # the text says what the JSON says

    assert unguarded.returncode == 1, unguarded.stderr[-3000:]
    report = json.loads(unguarded.stdout)
    te = report["transformer_engine"]
    assert te["guard"]["mode"] == "off" and te["treated_as_absent"] is False and te["usable"] is False
    if COMPLETE:
        assert te["status"] == "unusable" and te["importable"] is True
        assert any(p.startswith(f"Transformer Engine ({VERSION}) imports and megatron-core will use it")
                   for p in report["problems"]), report["problems"]
    else:
        # megatron-core dies at import (tensor_parallel/random.py catches only ModuleNotFoundError)
        assert any(p.startswith(f"Transformer Engine ({VERSION}) fails to import ({CORE_ONLY_ERROR}")
                   for p in report["problems"]), report["problems"]
        assert any(p.startswith("importing megatron.core") and "FileNotFoundError" in p
                   for p in report["problems"]), report["problems"]


@pytest.mark.cuda_hidden
def test_demo_passes():
    result, summary = run_demo()

    assert_demo_passed(result, summary)
    assert summary["te_guard"]["without shim"] == {"mode": "off", "reason": None}
    assert summary["te_guard"]["with shim"]["mode"] == "auto"
    assert_reason(summary["te_guard"]["with shim"]["reason"])
    # Without the shim megatron-core fails at the first step; with the core only, at importing TE.
    assert summary["without_shim_failed_at"] == "build model"
    first = summary["passes"]["without shim"]["steps"]["build model"]
    if not COMPLETE:
        assert first["error"].startswith("FileNotFoundError: Could not find shared object file"), failures(summary, "without shim")
        assert first["where"].startswith("megatron/core/") and "<module>" in first["where"], first


def save_keys(rank, world_size, folder):
    """One rank: build the GPT-OSS-like model (MoE, YaRN, softmax offsets), save it as
    torch_dist, reload it into a fresh model; print the checkpoint's keys."""
    import mcore_cpu_shim  # noqa: F401  (the fixes and the TE guard, as the environment says)
    from pathlib import Path

    from helpers import assert_same_tensors, gpt_oss_like, init_gloo, save_and_reload, tensors
    from torch.distributed.checkpoint import FileSystemReader

    init_gloo(folder, rank, world_size)
    model = gpt_oss_like(seed=1)
    fresh = save_and_reload(model, gpt_oss_like(seed=2), Path(folder) / "checkpoint")
    assert_same_tensors(tensors(model), tensors(fresh))
    keys = sorted(FileSystemReader(str(Path(folder) / "checkpoint")).read_metadata().state_dict_metadata)
    print("KEYS " + json.dumps(keys))


def checkpoint_keys(folder):
    folder.mkdir()
    [(code, output)] = run_ranks("test_te_real:save_keys", 1, str(folder))
    assert code == 0, output[-4000:]
    [line] = [line for line in output.splitlines() if line.startswith("KEYS ")]
    return json.loads(line[len("KEYS "):])


@pytest.mark.cuda_hidden
def test_checkpoint_has_the_keys_of_a_save_without_te(tmp_path, monkeypatch):
    with_te = checkpoint_keys(tmp_path / "auto")
    monkeypatch.setenv("MCORE_CPU_SHIM_TE", "block")  # TE absent without even trying it
    without_te = checkpoint_keys(tmp_path / "block")

    assert with_te == without_te
    # With the guard off a complete TE adds the TENorm's decoder.final_layernorm._extra_state.
    assert not [key for key in with_te if key.startswith("decoder.final_layernorm._extra_state")], with_te
    assert "decoder.final_layernorm.weight" in with_te
