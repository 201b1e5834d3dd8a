"""The fix engine on real megatron-core: laziness, idempotence, import order, opt-out,
unfamiliar code, and a second copy of the package in the same process."""

import importlib.util
import json
import os
import shutil

import pytest
from helpers import (
    HAVE_BRIDGE,
    MODE,
    bridge_fix,
    expected_state,
    import_every_target,
    megatron_source,
    needs_unfixed,
    run_python,
)

pytestmark = pytest.mark.cuda_hidden

SHIM_ONLY = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: exercises the shim on unmodified megatron-core")
FS_ASYNC = "megatron.core.dist_checkpointing.strategies.filesystem_async"
PRELOAD = f"{FS_ASYNC}:FileSystemWriterAsync.preload_tensors"
WHICH_PRELOAD = (
    f"from {FS_ASYNC} import FileSystemWriterAsync as W; "
    'preload = W.__dict__["preload_tensors"].__func__'
)
PACKAGE_DIR = os.path.dirname(importlib.util.find_spec("mcore_cpu_shim").origin)
# The tests below that replace, edit or compare preload_tensors need its CUDA assumption there.
NEEDS_PRELOAD_BUG = needs_unfixed(PRELOAD)


def run_json(code, fresh=False, **env):
    """Run ``code`` (which prints one JSON line last) in a child interpreter; parse that line."""
    result = run_python(code, fresh=fresh, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_import_loads_neither_torch_nor_megatron():
    loaded = run_json(
        fresh=True,
        code="""
        import json, sys
        import mcore_cpu_shim
        print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "megatron"))))
        """
    )
    assert loaded == []


@SHIM_ONLY
@NEEDS_PRELOAD_BUG
def test_importing_and_applying_twice_patches_once():
    import mcore_cpu_shim
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    patched = FileSystemWriterAsync.__dict__["preload_tensors"].__func__
    importlib.reload(mcore_cpu_shim)
    mcore_cpu_shim.apply()
    again = FileSystemWriterAsync.__dict__["preload_tensors"].__func__
    assert again is patched
    assert patched.__mcore_cpu_shim__["fix"] == "dcp_collective_device"
    assert not hasattr(patched.__wrapped__, "__mcore_cpu_shim__"), "wrapped twice"


@SHIM_ONLY
@NEEDS_PRELOAD_BUG
def test_import_after_megatron_patches_loaded_modules_and_their_imported_names():
    report = run_json(
        f"""
        import json, sys
        import megatron.core.dist_checkpointing.strategies.torch
        import megatron.core.dist_checkpointing.strategies.state_dict_saver as saver
        original = saver.save_state_dict_async_finalize
        import mcore_cpu_shim
        {WHICH_PRELOAD}
        holders = [m for m in list(sys.modules.values())
                   if getattr(m, "__dict__", {{}}).get("save_state_dict_async_finalize") is original]
        print(json.dumps({{
            "status": mcore_cpu_shim.status()["dcp_collective_device"],
            "preload_marked": hasattr(preload, "__mcore_cpu_shim__"),
            "stale_holders": [m.__name__ for m in holders],
        }}))
        """
    )
    assert report["status"]["state"] == "applied", report
    assert report["preload_marked"]
    # 0.13 leaves the finalize untouched (not-applicable); elsewhere no module keeps the old one.
    if report["status"]["targets"][
        "megatron.core.dist_checkpointing.strategies.state_dict_saver:save_state_dict_async_finalize"
    ]["state"] == "applied":
        assert report["stale_holders"] == []


@pytest.mark.parametrize(
    "value, disabled",
    [
        ("", set()),
        ("dcp_collective_device", {"dcp_collective_device"}),
        ("dcp-collective-device, yarn_rope_device", {"dcp_collective_device", "yarn_rope_device"}),
        (" all , ", "every fix"),
    ],
)
def test_disable_switch_spellings(value, disabled):
    import mcore_cpu_shim
    from mcore_cpu_shim.engine import parse_disabled

    names = mcore_cpu_shim.fix_names()
    expected = set(names) if disabled == "every fix" else disabled
    assert parse_disabled(value, names) == expected


def test_disable_switch_leaves_the_target_untouched():
    report = run_json(
        f"""
        import json
        import mcore_cpu_shim
        {WHICH_PRELOAD}
        print(json.dumps({{"state": mcore_cpu_shim.status()["dcp_collective_device"]["state"],
                          "marked": hasattr(preload, "__mcore_cpu_shim__")}}))
        """,
        MCORE_CPU_SHIM_DISABLE="dcp-collective-device",
    )
    assert report == {"state": "disabled", "marked": False}


@pytest.mark.parametrize("value", ["dcp_colective_device", "dcp_collective_device,yarn"])
def test_disable_switch_rejects_unknown_names(value):
    result = run_python("import mcore_cpu_shim", MCORE_CPU_SHIM_DISABLE=value)
    assert result.returncode != 0
    assert "ValueError" in result.stderr
    assert "unknown fix name" in result.stderr and "valid names are dcp_collective_device" in result.stderr


def _megatron_copy(tmp_path, edit):
    """A copy of the installed megatron package with filesystem_async.py edited by ``edit``."""
    source = os.path.dirname(os.path.dirname(importlib.util.find_spec("megatron.core").origin))
    shutil.copytree(source, tmp_path / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    path = tmp_path / "megatron" / "core" / "dist_checkpointing" / "strategies" / "filesystem_async.py"
    text = path.read_text()
    edited = edit(text)
    assert edited != text
    path.write_text(edited)
    return os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])


CHECK_PRELOAD = f"""
    import json, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import mcore_cpu_shim
        {WHICH_PRELOAD}
    print(json.dumps({{
        "target": mcore_cpu_shim.status()["dcp_collective_device"]["targets"]["{PRELOAD}"],
        "marked": hasattr(preload, "__mcore_cpu_shim__"),
        "warnings": [str(w.message) for w in caught
                     if isinstance(w.message, mcore_cpu_shim.McoreCpuShimWarning)],
    }}))
"""


# Drift away from the bug site: a statement after ``result = []``.
DRIFT_AWAY = ("        result = []\n", "        result = []\n        result.clear()\n")
# Drift at the bug site: the synchronize call doubled.
DRIFT_AT_SITE = (
    "            torch.cuda.synchronize()\n",
    "            torch.cuda.synchronize()\n            torch.cuda.synchronize()\n",
)


def _edited(tmp_path, edit):
    return _megatron_copy(tmp_path, lambda t: t.replace(*edit, 1))


@SHIM_ONLY
@NEEDS_PRELOAD_BUG
def test_drift_away_from_the_bug_site_is_rewritten_there(tmp_path):
    from mcore_cpu_shim.engine import DRIFTED

    report = run_json(
        CHECK_PRELOAD.replace(
            "print(json.dumps({",
            """import torch
    from mcore_cpu_shim import forbid_cuda
    cpu = torch.arange(4.0)
    with forbid_cuda():
        [(_, _, (_, [(_, out)]))] = preload([("f", "k", (b"", [("item", cpu)]))], True)
    print(json.dumps({"same": out is cpu, "file": preload.__code__.co_filename,""",
        ),
        PYTHONPATH=_edited(tmp_path, DRIFT_AWAY),
    )
    assert report["target"]["state"] == "applied", report
    assert report["target"]["detail"].startswith(DRIFTED) and "rewritten at the bug site" in report["target"]["detail"]
    assert report["marked"] and report["warnings"] == []
    # No CUDA call for CPU tensors, the same tensor back, and upstream's own file in tracebacks.
    assert report["same"]
    assert report["file"].endswith("dist_checkpointing/strategies/filesystem_async.py")


@SHIM_ONLY
@NEEDS_PRELOAD_BUG
@pytest.mark.parametrize(
    "edit, strict", [(DRIFT_AT_SITE, "0"), (DRIFT_AWAY, "1")], ids=["change at the bug site", "strict mode"]
)
def test_unfamiliar_code_is_left_alone_with_one_warning(tmp_path, edit, strict):
    report = run_json(CHECK_PRELOAD, PYTHONPATH=_edited(tmp_path, edit), MCORE_CPU_SHIM_STRICT=strict)
    assert report["target"]["state"] == "unsupported", report
    assert not report["marked"]
    # (In strict mode, on unreleased megatron-core, other fixes warn about their drift too.)
    [warning] = [w for w in report["warnings"] if "'dcp_collective_device'" in w]
    from mcore_cpu_shim.engine import mcore_version

    assert f"megatron-core {mcore_version()}" in warning
    assert "Please report it at" in warning and "still assumes CUDA" in warning
    if strict == "1":
        assert "MCORE_CPU_SHIM_STRICT=1 applies fixes to known code only" in warning
    else:
        assert "not as the fix expects: 'torch.cuda.synchronize()' once" in warning


def test_strict_switch_rejects_bad_values():
    result = run_python("import mcore_cpu_shim", MCORE_CPU_SHIM_STRICT="yes")
    assert result.returncode != 0
    assert "ValueError: MCORE_CPU_SHIM_STRICT='yes'" in result.stderr


@SHIM_ONLY
@NEEDS_PRELOAD_BUG
def test_code_without_the_bug_counts_as_upstream_fixed(tmp_path):
    path = _megatron_copy(
        tmp_path,
        lambda t: t.replace("        if non_blocking:\n            torch.cuda.synchronize()\n", "", 1),
    )
    report = run_json(CHECK_PRELOAD, PYTHONPATH=path)
    assert report["target"]["state"] == "upstream-fixed", report
    assert not report["marked"] and report["warnings"] == []


@SHIM_ONLY
@NEEDS_PRELOAD_BUG
def test_second_copy_of_the_package_stands_down(tmp_path):
    shutil.copytree(PACKAGE_DIR, tmp_path / "othershim", ignore=shutil.ignore_patterns("__pycache__"))
    report = run_json(
        f"""
        import json
        import mcore_cpu_shim, othershim
        {WHICH_PRELOAD}
        print(json.dumps({{
            "first": mcore_cpu_shim.status()["dcp_collective_device"]["targets"]["{PRELOAD}"],
            "second": othershim.status()["dcp_collective_device"]["targets"]["{PRELOAD}"],
            "owner": preload.__mcore_cpu_shim__["package"],
            "double": hasattr(preload.__wrapped__, "__mcore_cpu_shim__"),
        }}))
        """,
        PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]),
    )
    assert report["first"]["state"] == report["second"]["state"] == "applied", report
    assert report["owner"] == "mcore_cpu_shim" and not report["double"]
    assert report["second"]["detail"].startswith("applied by another copy: mcore_cpu_shim ")


def test_every_fix_reaches_its_expected_state():
    import mcore_cpu_shim
    from mcore_cpu_shim import engine
    from mcore_cpu_shim.fixes import BRIDGE_FIXES, FIXES

    import_every_target(mcore_cpu_shim)
    status = mcore_cpu_shim.status()
    for name, fix in status.items():
        if bridge_fix(name) and not HAVE_BRIDGE:
            # (a megatron-training target may be there: some megatron-core wheels ship it)
            bridge = {t: s for t, s in fix["targets"].items() if t.startswith("megatron.bridge")}
            assert {s["detail"] for s in bridge.values()} == {"Megatron-Bridge is not installed"}, fix
            continue
        assert fix["state"] in {expected_state(name), "not-applicable"}, (name, fix)
    if MODE == "shim":
        # The live decision is the one tools/coverage.py makes from source alone.
        fixes = FIXES + (BRIDGE_FIXES if HAVE_BRIDGE else ())
        static = engine.classify_source(fixes, megatron_source)
        live = {name: {t: s["state"] for t, s in status[name]["targets"].items()} for name in static}
        assert live == {name: {t: s for t, (s, _) in targets.items()} for name, targets in static.items()}
