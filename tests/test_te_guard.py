"""The Transformer Engine import guard: an installed TE that cannot load without a driver (or
a leftover TE folder) counts as absent, so megatron-core imports and falls back to its local
implementations; with CUDA usable the guard changes nothing.

The fake TE packages stand in for a real TE build, which cannot be installed on these hosts
(REFERENCE.md §2); what they raise is what real TE raises on a driverless host."""

import importlib
import importlib.util
import json
import sys
import warnings

import pytest
from helpers import MODE, run_python

pytestmark = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the guard is part of the shim, not of the patches")

NO_DRIVER = "libcuda.so.1: cannot open shared object file: No such file or directory"


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
    elif kind == "works":
        (package / "__init__.py").write_text("__version__ = '2.9.0'\n")
    # "leftover": the folder alone, as a partly removed install leaves it
    return str(root)


def te_modules():
    return sorted(m for m in sys.modules if m == "transformer_engine" or m.startswith("transformer_engine."))


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("kind", ["raises", "nested", "leftover"])
def test_unloadable_te_counts_as_absent(tmp_path, monkeypatch, kind):
    import mcore_cpu_shim

    monkeypatch.syspath_prepend(fake_te(tmp_path, kind))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(ModuleNotFoundError) as first:
            import transformer_engine  # noqa: F401
        with pytest.raises(ModuleNotFoundError) as again:
            import transformer_engine.pytorch  # noqa: F401
    assert first.value.name == "transformer_engine"
    assert "Transformer Engine counts as absent" in str(first.value)
    cause = {"raises": OSError, "nested": RuntimeError, "leftover": type(None)}[kind]
    assert type(first.value.__cause__) is cause
    assert again.value.__cause__ is first.value.__cause__
    assert te_modules() == []
    # find_spec only looks: it must not raise where programs probe for TE
    assert importlib.util.find_spec("transformer_engine") is not None
    [warning] = [w for w in caught if issubclass(w.category, mcore_cpu_shim.McoreCpuShimWarning)]
    assert "cannot be used on this host" in str(warning.message)
    assert "falls back to its local implementations" in str(warning.message)


@pytest.mark.cuda_hidden
def test_te_whose_torch_extension_fails_to_load_counts_as_absent(tmp_path, monkeypatch):
    """TE's own __init__ swallows the ImportError of its torch part; megatron-core's later
    ``from transformer_engine.pytorch... import`` would get that plain ImportError, which
    ``tensor_parallel/random.py`` (``except ModuleNotFoundError``) does not catch."""
    monkeypatch.syspath_prepend(fake_te(tmp_path, "extension"))
    import transformer_engine  # noqa: F401  (TE's own fallback: no torch part)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ModuleNotFoundError) as caught:
            from transformer_engine.pytorch import distributed  # noqa: F401
    assert type(caught.value.__cause__) is ImportError and NO_DRIVER in str(caught.value.__cause__)
    assert te_modules() == []
    with pytest.raises(ModuleNotFoundError):
        import transformer_engine  # noqa: F401,F811


@pytest.mark.cuda_hidden
def test_missing_dependency_of_te_passes_unchanged(tmp_path, monkeypatch):
    from mcore_cpu_shim import _te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "missing-dependency"))
    with pytest.raises(ModuleNotFoundError) as caught:
        import transformer_engine  # noqa: F401
    assert caught.value.name == "transformer_engine_missing_dep"
    assert _te_guard.state()["reason"] is None


@pytest.mark.cuda_hidden
def test_block_mode_hides_a_working_te(tmp_path, monkeypatch):
    from mcore_cpu_shim import _te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "works"))
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if f is not _te_guard.installed_guard()])
    _te_guard.install("block")
    _te_guard.install("block")  # idempotent
    assert sum(getattr(f, _te_guard.GUARD_MARKER, False) for f in sys.meta_path) == 1
    with pytest.raises(ModuleNotFoundError, match="MCORE_CPU_SHIM_TE=block"):
        import transformer_engine  # noqa: F401
    assert _te_guard.state() == {"mode": "block", "owner": f"mcore_cpu_shim {_te_guard.__version__}",
                                 "reason": "MCORE_CPU_SHIM_TE=block"}


@pytest.mark.cuda_hidden
def test_a_second_copy_leaves_the_guard_to_the_first(tmp_path, monkeypatch):
    import shutil

    import mcore_cpu_shim
    from test_engine import PACKAGE_DIR

    shutil.copytree(PACKAGE_DIR, tmp_path / "othershim", ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.syspath_prepend(str(tmp_path))
    other = importlib.import_module("othershim")
    guards = [f for f in sys.meta_path if getattr(f, mcore_cpu_shim._te_guard.GUARD_MARKER, False)]
    assert len(guards) == 1
    assert other._te_guard.state()["owner"] == f"mcore_cpu_shim {mcore_cpu_shim.__version__}"


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
        "te_modules": [m for m in sys.modules if m.split(".")[0] == "transformer_engine"],
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
    from mcore_cpu_shim import _te_guard

    monkeypatch.syspath_prepend(fake_te(tmp_path, "raises"))
    with pytest.raises(OSError, match="libcuda.so.1") as caught:
        import transformer_engine  # noqa: F401
    assert not isinstance(caught.value, ImportError)
    assert _te_guard.state()["reason"] is None
