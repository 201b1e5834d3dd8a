"""Vendoring: the package copied into another package's tree works under that name, and two
copies in one process never wrap the same target twice."""

import json
import os
import shutil

import pytest
from helpers import MODE, run_python, upstream_fixed
from test_engine import PACKAGE_DIR, PRELOAD

pytestmark = [
    pytest.mark.cuda_hidden,
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: vendoring is about the shim itself"),
]


def vendor(tmp_path, fixes_kept=None):
    """Copy the package to tmp_path/bridge/_vendor/mcore_cpu_shim, as a downstream bridge would.

    ``fixes_kept``: keep only the first N fixes, as an older copy that lacks the newer ones.
    """
    vendored = tmp_path / "bridge" / "_vendor" / "mcore_cpu_shim"
    shutil.copytree(PACKAGE_DIR, vendored, ignore=shutil.ignore_patterns("__pycache__"))
    for package in (tmp_path / "bridge", tmp_path / "bridge" / "_vendor"):
        (package / "__init__.py").write_text("")
    if fixes_kept is not None:
        registry = vendored / "fixes" / "__init__.py"
        # (an older copy had no Megatron-Bridge fixes either)
        registry.write_text(registry.read_text() + f"\nFIXES = FIXES[:{fixes_kept}]\nBRIDGE_FIXES = ()\n")
    return os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])


def test_vendored_copy_fixes_a_save(tmp_path):
    result = run_python(
        f"""
        import json, pathlib
        import bridge._vendor.mcore_cpu_shim as shim
        from helpers import init_gloo, save_and_reload, tiny_gpt, tensors, assert_same_tensors
        init_gloo({str(tmp_path)!r})
        model = tiny_gpt(seed=1)
        expected = tensors(model)
        fresh = save_and_reload(model, tiny_gpt(seed=2), pathlib.Path({str(tmp_path / "ckpt")!r}))
        assert_same_tensors(expected, tensors(fresh))
        import importlib, inspect, sys
        fix = shim.status()["dcp_collective_device"]
        owners = {{}}  # the package in the marker of every target that carries one
        for target in fix["targets"]:
            module, qualname = target.split(":")
            owner = importlib.import_module(module)
            *path, name = qualname.split(".")
            for part in path:
                owner = getattr(owner, part)
            raw = inspect.getattr_static(owner, name)
            marker = getattr(getattr(raw, "__func__", raw), "__mcore_cpu_shim__", None)
            if marker:
                owners[target] = marker["package"]
        fix = shim.status()["dcp_collective_device"]
        print(json.dumps({{"state": fix["state"], "owners": owners, "top_level": "mcore_cpu_shim" in sys.modules,
                          "applied": sorted(t for t, s in fix["targets"].items() if s["state"] == "applied")}}))
        """,
        PYTHONPATH=vendor(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["state"] == "applied" and report["top_level"] is False, report
    # Every target the vendored copy applied carries its marker, under the vendored name.
    assert report["applied"] and sorted(report["owners"]) == report["applied"], report
    assert set(report["owners"].values()) == {"bridge._vendor.mcore_cpu_shim"}, report
    if not upstream_fixed(PRELOAD):  # (megatron-core fixed it itself on PR 6270's branch)
        assert PRELOAD in report["owners"], report


def test_older_copy_first_then_newer_copy_adds_only_what_is_missing(tmp_path):
    import mcore_cpu_shim

    names = mcore_cpu_shim.fix_names()
    result = run_python(
        """
        import importlib, json
        import bridge._vendor.mcore_cpu_shim as old
        import mcore_cpu_shim as new
        from helpers import import_every_target
        import_every_target(new)
        print(json.dumps({"old": old.status(), "new": new.status()}))
        """,
        PYTHONPATH=vendor(tmp_path, fixes_kept=1),
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(report["old"]) == [names[0]]
    for name in names:
        for target, state in report["new"][name]["targets"].items():
            if state["state"] != "applied":
                continue
            if name == names[0]:  # the older copy got there first and owns it
                assert state["detail"] == f"applied by another copy: bridge._vendor.mcore_cpu_shim {mcore_cpu_shim.__version__}"
                assert report["old"][name]["targets"][target]["state"] == "applied"
            else:  # the older copy lacks this fix: the newer one applies it itself
                assert not state["detail"].startswith("applied by another copy"), (name, target, state)
