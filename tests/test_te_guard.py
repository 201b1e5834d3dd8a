"""The Transformer Engine import guard: on a process without usable CUDA an installed TE counts
as absent, whether it loads or not (a build that cannot load without a driver, a core without
its torch extension, a leftover folder, a complete install), so megatron-core imports and takes
its local paths; with CUDA usable the guard changes nothing.

The fake TE packages cover shapes a real install on these hosts cannot show (an OSError at
import, a leftover folder) and run in every leg; test_te_real.py runs against real TE installs
(the te leg, tools/te_leg.py)."""

import importlib
import importlib.util
import json
import sys
import warnings

import pytest
from helpers import MODE, run_python

pytestmark = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the guard is part of the shim, not of the patches")

NO_DRIVER = "libcuda.so.1: cannot open shared object file: No such file or directory"
CORE_ONLY = "Could not find shared object file for Transformer Engine torch lib."


def fake_te(root, kind):
    """A transformer_engine package under ``root`` that fails the way ``kind`` says."""
    package = root / "transformer_engine"
    package.mkdir(parents=True)
    if kind == "raises":  # a TE build linked against the driver
        (package / "__init__.py").write_text(f"raise OSError({NO_DRIVER!r})\n")
    elif kind == "nested":  # like real TE: the top level swallows ImportError from .pytorch
        (package / "__init__.py").write_text(
            "try:\n    from . import pytorch\nexcept ImportError:\n    pass\n__version__ = '2.9.0'\n"
        )
        (package / "pytorch").mkdir()
        (package / "pytorch" / "__init__.py").write_text(
            "raise RuntimeError('Found no NVIDIA driver on your system')\n"
        )
    elif kind == "extension":  # as nested, but the torch extension fails to dlopen
        (package / "__init__.py").write_text(
            "try:\n    from . import pytorch\nexcept ImportError:\n    pass\n__version__ = '2.9.0'\n"
        )
        (package / "pytorch").mkdir()
        (package / "pytorch" / "__init__.py").write_text(f"raise ImportError({NO_DRIVER!r})\n")
    elif kind == "missing-dependency":  # megatron-core falls back by itself: not ours to touch
        (package / "__init__.py").write_text("from transformer_engine_missing_dep import x\n")
    elif kind == "core-only":  # like real TE without its torch extension
        (package / "__init__.py").write_text(
            "try:\n    from . import pytorch\nexcept FileNotFoundError as e:\n"
            "    if 'Could not find shared object file' not in str(e):\n        raise\n"
            "__version__ = '2.9.0'\n"
        )
        (package / "pytorch").mkdir()
        (package / "pytorch" / "__init__.py").write_text(f"raise FileNotFoundError({CORE_ONLY!r})\n")
    elif kind == "complete":  # imports fine, as a complete install does once torch is loaded
        (package / "__init__.py").write_text("from . import pytorch\n__version__ = '2.9.0'\n")
        (package / "pytorch").mkdir()
        (package / "pytorch" / "__init__.py").write_text("import transformer_engine_torch\n")
        (root / "transformer_engine_torch.py").write_text("")
    elif kind == "works":
        (package / "__init__.py").write_text("__version__ = '2.9.0'\n")
    # "leftover": the folder alone, as a partly removed install leaves it
    return str(root)


def te_modules():
    """The TE modules this process holds (a None entry is Python's "absent" mark, no module)."""
    return sorted(m for m in sys.modules if m.split(".")[0] in ("transformer_engine", "transformer_engine_torch")
                  and sys.modules[m] is not None)


def te_marked_absent():
    """TE's top-level names carry Python's own "absent" mark: None in sys.modules."""
    return all(name in sys.modules and sys.modules[name] is None
               for name in ("transformer_engine", "transformer_engine_torch"))


def shim_warnings(caught):
    import mcore_cpu_shim

    return [str(w.message) for w in caught if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)]


ABSENT = "No module named 'transformer_engine': Transformer Engine counts as absent in this process"
# What the one warning says, per fake: the reason, with the real exception where TE fails.
REASONS = {
    "raises": f"Transformer Engine (version unknown) installed, not importable (transformer_engine: OSError: {NO_DRIVER}), CUDA not usable: treated as absent",
    "nested": "Transformer Engine (version unknown) installed, not importable (transformer_engine: RuntimeError: Found no NVIDIA driver on your system), CUDA not usable: treated as absent",
    "extension": f"Transformer Engine 2.9.0 installed, not importable (transformer_engine.pytorch: ImportError: {NO_DRIVER}), CUDA not usable: treated as absent",
    "core-only": f"Transformer Engine 2.9.0 installed, not importable (transformer_engine.pytorch: FileNotFoundError: {CORE_ONLY}), CUDA not usable: treated as absent",
    "missing-dependency": "Transformer Engine (version unknown) installed, not importable (transformer_engine: ModuleNotFoundError: No module named 'transformer_engine_missing_dep'), CUDA not usable: treated as absent",
    "complete": "Transformer Engine 2.9.0 installed and importable, CUDA not usable: treated as absent",
}
CAUSES = {"raises": OSError, "nested": RuntimeError, "extension": ImportError,
          "core-only": FileNotFoundError, "missing-dependency": ModuleNotFoundError,
          "complete": type(None), "leftover": type(None)}


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("kind", ["raises", "nested", "extension", "core-only", "missing-dependency", "complete", "leftover"])
def test_installed_te_counts_as_absent_without_cuda(tmp_path, monkeypatch, kind):
    """Whatever TE does at import, fail or work: absent, one warning naming the truth."""
    from mcore_cpu_shim import te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, kind))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ModuleNotFoundError) as first:
            import transformer_engine  # noqa: F401
        with pytest.raises(ModuleNotFoundError, match="'transformer_engine' is not a package"):
            import transformer_engine.pytorch  # noqa: F401
        with pytest.raises(ModuleNotFoundError):
            import transformer_engine_torch  # noqa: F401
    assert first.value.name == "transformer_engine"
    assert str(first.value).startswith(ABSENT)
    assert type(first.value.__cause__) is CAUSES[kind]
    assert te_modules() == [] and te_marked_absent()
    # find_spec agrees with import: where programs probe for TE, it is not there
    assert importlib.util.find_spec("transformer_engine") is None
    assert importlib.util.find_spec("transformer_engine_torch") is None
    [warning] = shim_warnings(caught)
    reason = te_guard.state()["reason"]
    if kind == "leftover":
        assert reason.startswith("Transformer Engine (version unknown) installed, not importable (")
        assert "holds no __init__.py (left over from a removed install)), CUDA not usable: treated as absent" in reason
    else:
        assert reason == REASONS[kind]
    assert warning.startswith(f"mcore_cpu_shim: {reason}. megatron-core takes its local code paths instead")
    assert ".." not in warning  # an exception text ending in "." is not followed by another
    assert te_guard.state()["te"]["importable"] is (kind == "complete")


@pytest.mark.cuda_hidden
def test_te_whose_torch_extension_fails_to_load_counts_as_absent(tmp_path, monkeypatch):
    """TE's own __init__ swallows the ImportError of its torch part, so ``import
    transformer_engine`` alone would work; the guard tries megatron-core's imports
    (``transformer_engine.pytorch`` too, whose plain ImportError ``tensor_parallel/random.py``
    does not catch) and names that error."""
    from mcore_cpu_shim import te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "extension"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModuleNotFoundError) as caught:
            from transformer_engine.pytorch import distributed  # noqa: F401
    assert type(caught.value.__cause__) is ImportError and NO_DRIVER in str(caught.value.__cause__)
    assert te_guard.state()["te"]["error"] == f"transformer_engine.pytorch: ImportError: {NO_DRIVER}"
    assert te_modules() == [] and te_marked_absent()


@pytest.mark.cuda_hidden
def test_block_mode_hides_a_working_te(tmp_path, monkeypatch):
    from mcore_cpu_shim import te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "works"))
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not te_guard.installed_guard()])
    te_guard.install("block")
    te_guard.install("block")  # idempotent
    assert sum(getattr(f, te_guard.GUARD_MARKER, False) for f in sys.meta_path) == 1
    with pytest.raises(ModuleNotFoundError, match="MCORE_CPU_SHIM_TE=block"):
        import transformer_engine  # noqa: F401
    assert te_guard.state() == {"mode": "block", "owner": f"mcore_cpu_shim {te_guard.__version__}",
                                 "reason": "MCORE_CPU_SHIM_TE=block", "te": None, "imported_before": []}
    assert importlib.util.find_spec("transformer_engine") is None  # tried by nobody, absent to all


@pytest.mark.cuda_hidden
def test_a_second_copy_leaves_the_guard_to_the_first(tmp_path, monkeypatch):
    import shutil

    import mcore_cpu_shim
    from test_engine import PACKAGE_DIR

    shutil.copytree(PACKAGE_DIR, tmp_path / "othershim", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.syspath_prepend(str(tmp_path))
    other = importlib.import_module("othershim")
    guards = [f for f in sys.meta_path if getattr(f, mcore_cpu_shim.te_guard.GUARD_MARKER, False)]
    assert len(guards) == 1
    assert other.te_guard.state()["owner"] == f"mcore_cpu_shim {mcore_cpu_shim.__version__}"


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("value", ["on", "blok"])
def test_bad_switch_value_raises_at_import(value):
    result = run_python("import mcore_cpu_shim", MCORE_CPU_SHIM_TE=value)
    assert result.returncode != 0
    assert f"ValueError: MCORE_CPU_SHIM_TE={value!r}: unknown value; valid values are auto, block, off" in result.stderr


MCORE_WITH_TE = """
    import json, sys, warnings
    warnings.simplefilter("always")
    with warnings.catch_warnings(record=True) as caught:
        import mcore_cpu_shim
        import megatron.core
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        spec = get_gpt_layer_local_spec()
        from megatron.core.tensor_parallel import random
    print(json.dumps({
        "spec": type(spec).__name__,
        "have_te": random.HAVE_TE,
        "te_modules": [m for m in sys.modules if m.split(".")[0] == "transformer_engine" and sys.modules[m] is not None],
        "warnings": [str(w.message) for w in caught
                     if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)],
    }))
"""

# What megatron-core dies of without the guard (REFERENCE.md §2).
UNGUARDED_ERRORS = {
    "raises": ("OSError: " + NO_DRIVER,),
    "leftover": ("PackageNotFoundError", "has no attribute '__version__'"),
}


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("kind", ["raises", "leftover"])
def test_megatron_imports_with_an_unloadable_te(tmp_path, kind):
    import os

    path = os.pathsep.join([fake_te(tmp_path, kind), os.environ.get("PYTHONPATH", "")])
    unguarded = run_python(MCORE_WITH_TE, PYTHONPATH=path, MCORE_CPU_SHIM_TE="off")
    assert unguarded.returncode != 0, unguarded.stdout
    assert any(error in unguarded.stderr for error in UNGUARDED_ERRORS[kind]), unguarded.stderr[-3000:]

    guarded = run_python(MCORE_WITH_TE, PYTHONPATH=path)
    assert guarded.returncode == 0, guarded.stderr[-3000:]
    report = json.loads(guarded.stdout.strip().splitlines()[-1])
    assert report["spec"] == "ModuleSpec" and report["have_te"] is False, report
    assert report["te_modules"] == [], report
    assert len(report["warnings"]) == 1, report


@pytest.mark.cuda_visible
def test_guard_stays_out_of_the_way_with_cuda(tmp_path, monkeypatch):
    """On a GPU node a broken TE must stay loud: the original error, nothing hidden."""
    from mcore_cpu_shim import te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "raises"))
    with pytest.raises(OSError, match="libcuda.so.1") as caught:
        import transformer_engine  # noqa: F401
    assert not isinstance(caught.value, ImportError)
    assert te_guard.state()["reason"] is None


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("kind", ["core-only", "complete"])
def test_megatron_core_agrees_that_te_is_absent(tmp_path, kind):
    """HAVE_TE in every megatron-core module, is_te_min_version, get_te_version, find_spec:
    all say "no TE", for a TE that fails in its PyTorch part and for one that imports."""
    import os

    code = MCORE_WITH_TE.replace(
        '    print(json.dumps({',
        '    import importlib.util\n'
        '    from megatron.core import utils\n'
        '    try:\n'
        '        te_min = utils.is_te_min_version("1.0")\n'
        '    except Exception as exc:  # 0.13-0.16 without TE: get_te_version() is None\n'
        '        te_min = type(exc).__name__\n'
        '    print(json.dumps({\n'
        '        "all_have_te": sorted({m.HAVE_TE for n, m in list(sys.modules.items()) if n.startswith("megatron.")'
        ' and isinstance(getattr(m, "HAVE_TE", None), bool)}),\n'
        '        "te_min": te_min, "te_version": str(utils.get_te_version()),\n'
        '        "find_spec": importlib.util.find_spec("transformer_engine") is not None,',
    )

    def view(*path):
        result = run_python(code, PYTHONPATH=os.pathsep.join([*path, os.environ.get("PYTHONPATH", "")]))
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(result.stdout.strip().splitlines()[-1])

    # Compared with no TE at all: 0.16's multi_latent_attention has HAVE_TE True even then (its
    # try block imports only megatron's own TE wrappers, which import without TE there).
    report, no_te = view(fake_te(tmp_path, kind)), view()
    for key in ("all_have_te", "te_min", "te_version", "find_spec", "te_modules", "have_te"):
        assert report[key] == no_te[key], (key, report, no_te)  # exactly as without TE
    assert report["find_spec"] is False and report["te_modules"] == []
    [warning] = report["warnings"]
    assert warning.startswith(f"mcore_cpu_shim: {REASONS[kind]}.")


@pytest.mark.cuda_hidden
def test_te_imported_before_the_shim_stays_and_the_warning_says_how_to_fix_it(tmp_path):
    import os

    code = """
        import json, sys, warnings
        import torch, transformer_engine
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import mcore_cpu_shim
        import transformer_engine.pytorch  # the guard stands aside: TE stays whole
        print(json.dumps({"state": mcore_cpu_shim.te_guard.state(),
                          "pytorch": "transformer_engine.pytorch" in sys.modules,
                          "warnings": [str(w.message) for w in caught
                                       if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)]}))
    """
    path = os.pathsep.join([fake_te(tmp_path, "complete"), os.environ.get("PYTHONPATH", "")])
    result = run_python(code, PYTHONPATH=path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["state"]["reason"] is None and report["pytorch"] is True
    assert report["state"]["imported_before"] == ["transformer_engine", "transformer_engine.pytorch", "transformer_engine_torch"]
    [warning] = report["warnings"]
    assert warning == (
        "mcore_cpu_shim: Transformer Engine 2.9.0 was imported before mcore_cpu_shim (transformer_engine, "
        "transformer_engine.pytorch, transformer_engine_torch), so the guard cannot make it absent although "
        "CUDA is not usable here: megatron-core will use it, and TE modules fail without CUDA. To fix, import "
        "mcore_cpu_shim before anything imports transformer_engine (as the program's first import), or start "
        "the program with `mcore-cpu-shim run -- ...`."
    )


PLUGIN = """
def load():
    global seen
    try:
        import transformer_engine  # noqa: F401
        seen = "imported"
    except ImportError as exc:
        seen = f"{type(exc).__name__}: {exc}"
"""


@pytest.mark.cuda_hidden
def test_te_imported_by_a_torch_plugin_while_torch_imports(tmp_path):
    """A ``torch.backends`` entry point (torch loads them at the end of ``import torch``) that
    imports TE: with the shim first, the guard decides then (torch.cuda can already answer)
    and megatron-core later agrees; without it first, TE was imported before the shim."""
    import os

    fake_te(tmp_path, "complete")
    (tmp_path / "te_plugin.py").write_text(PLUGIN)
    info = tmp_path / "te_plugin-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: te-plugin\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[torch.backends]\nte_plugin = te_plugin:load\n")
    code = """
        import json, sys, warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            if sys.argv[1] == "shim first":
                import mcore_cpu_shim
            import torch
            import mcore_cpu_shim
            have_te = None
            if sys.argv[1] == "shim first":  # (a fake TE imported first would not do for megatron)
                from megatron.core.tensor_parallel import random
                have_te = random.HAVE_TE
        print(json.dumps({"plugin": sys.modules["te_plugin"].seen, "have_te": have_te,
                          "state": mcore_cpu_shim.te_guard.state(),
                          "warnings": [str(w.message) for w in caught
                                       if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)]}))
    """
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])

    first = run_python(code.replace("sys.argv[1]", '"shim first"'), fresh=True, PYTHONPATH=path)
    assert first.returncode == 0, first.stderr[-3000:]
    report = json.loads(first.stdout.strip().splitlines()[-1])
    assert report["plugin"].startswith("ModuleNotFoundError: " + ABSENT), report
    assert report["have_te"] is False and report["state"]["reason"] == REASONS["complete"]
    assert len(report["warnings"]) == 1

    late = run_python(code.replace("sys.argv[1]", '"torch first"'), fresh=True, PYTHONPATH=path)
    report = json.loads(late.stdout.strip().splitlines()[-1]) if late.returncode == 0 else None
    assert report is not None and report["plugin"] == "imported", late.stderr[-3000:]
    [warning] = report["warnings"]
    assert "was imported before mcore_cpu_shim" in warning and report["state"]["reason"] is None


@pytest.mark.cuda_visible
def test_guard_lets_a_working_te_through_with_cuda(tmp_path, monkeypatch):
    """With CUDA usable TE is used as installed: the guard decides nothing, warns nothing."""
    from mcore_cpu_shim import te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "complete"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        import transformer_engine.pytorch  # noqa: F401
    assert "transformer_engine_torch" in sys.modules
    assert te_guard.state()["reason"] is None and shim_warnings(caught) == []
    assert importlib.util.find_spec("transformer_engine") is not None
