"""The real Transformer Engine leg (``tox -e te``): TE installed three ways, each tested.

python tools/te_leg.py [PYTEST_ARGS]

Runs in the tox ``te`` environment (Python 3.12, torch 2.14.1 CUDA build; these hosts have no
driver). For each install, in turn, into this interpreter's environment:
  core only        transformer-engine + transformer-engine-cu13 2.20.2 (no torch extension)
  complete 2.20.2  the same + ../shared/wheels/transformer_engine_torch-2.20.2-*.whl
  complete 2.12.0  transformer-engine + -cu13 2.12.0 + the 2.12.0 extension wheel
it removes the previous TE, installs the new one with ``--no-deps`` (TE's pure-Python
dependencies are installed once, with torch pinned to the installed version, so pip never
replaces torch), and runs tests/test_te_real.py with CUDA hidden on megatron-core 0.19.2
(tools/matrix.py's overlay), then ``doctor --json`` for the summary line. At the end TE is
uninstalled again: plain ``tox`` runs this leg last in the py312 environment, whose release
legs must find no TE on the next run.

PyPI serves the torch extension only as an sdist that compiles for 15-25 minutes here, so the
prebuilt wheels in ../shared/wheels stand in for it; where that folder or a wheel is missing
the whole leg is skipped with a message (exit 0). Exit status 1 if any install's tests failed.
"""

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from matrix import leg_counts, one_environment_at_a_time, overlay, tree_env  # noqa: E402  (the matrix's megatron-core trees)

WHEELS = ROOT.parent / "shared" / "wheels"
MCORE = "0.19.2"
RESULTS = ROOT / ".matrix"
# TE's runtime dependencies (transformer_engine_torch's metadata) other than torch and TE.
TE_DEPENDENCIES = ["einops", "onnx", "onnxscript", "packaging", "pydantic", "nvdlfw-inspect",
                   "nvidia-cudnn-frontend>=1.29.0"]
INSTALLS = (("core only 2.20.2", "2.20.2", False), ("complete 2.20.2", "2.20.2", True),
            ("complete 2.12.0", "2.12.0", True))


def extension_wheel(version):
    found = sorted(WHEELS.glob(f"transformer_engine_torch-{version}-*.whl"))
    return found[0] if found else None


def pip(*args):
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def installed():
    """The TE distributions installed here, as the guard and doctor see them."""
    from mcore_cpu_shim import te_guard

    return te_guard.installed_distributions()


def install(version, complete, pin):
    present = list(installed())
    if present:
        pip("uninstall", "--quiet", "--yes", *present)
    packages = [f"transformer-engine=={version}", f"transformer-engine-cu13=={version}"]
    if complete:
        packages.append(str(extension_wheel(version)))
    pip("install", "--quiet", "--no-deps", "-c", pin, *packages)
    importlib.invalidate_caches()
    return installed()


def remove_empty_package():
    """pip leaves ``transformer_engine/common/include`` behind as empty folders, which Python
    imports as a namespace package: the guard would then see a TE that is "installed, not
    importable" in every later run of this environment. Remove it when it holds no file."""
    paths = sysconfig.get_paths()
    for folder in {Path(paths["purelib"]), Path(paths["platlib"])}:
        package = folder / "transformer_engine"
        if package.is_dir() and not any(p.is_file() for p in package.rglob("*")):
            shutil.rmtree(package)


def doctor(env):
    result = subprocess.run([sys.executable, "-m", "mcore_cpu_shim", "doctor", "--json"],
                            env=env, capture_output=True, text=True, cwd=ROOT)
    try:
        te = json.loads(result.stdout)["transformer_engine"]
    except (json.JSONDecodeError, KeyError):
        return result.returncode, f"no report: {result.stderr.strip().splitlines()[-1:]}"
    return result.returncode, te["reason"]


def main(pytest_args):
    wanted = {version for _, version, complete in INSTALLS if complete}
    missing = sorted(v for v in wanted if extension_wheel(v) is None)
    if missing:
        where = WHEELS if WHEELS.is_dir() else f"{WHEELS} (absent)"
        print(f"te leg skipped: no transformer_engine_torch wheel for {', '.join(missing)} in {where}; "
              f"PyPI has that package only as an sdist that compiles for 15-25 minutes "
              f"(see ../shared/wheels/README.md)")
        return 0
    tree = overlay(MCORE)
    RESULTS.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as folder:
        pin = os.path.join(folder, "pin.txt")
        with open(pin, "w") as f:
            f.write(f"torch=={importlib.metadata.version('torch')}\n")
        pip("install", "--quiet", "-c", pin, *TE_DEPENDENCIES)
        env = tree_env(tree, CUDA_VISIBLE_DEVICES="")
        try:
            summary, failed = run_installs(pin, env, pytest_args)
        finally:
            leftover = list(installed())
            if leftover:
                pip("uninstall", "--quiet", "--yes", *leftover)
            remove_empty_package()
    print("\nte leg summary (megatron-core " + MCORE + ", CUDA hidden):")
    print("\n".join(summary))
    print("te leg: " + (f"FAILED: {', '.join(failed)}" if failed else "all installs passed"))
    return 1 if failed else 0


def run_installs(pin, env, pytest_args):
    """Each install in turn: its tests and doctor's line; (summary lines, failed labels)."""
    summary, failed = [], []
    for label, version, complete in INSTALLS:
        print(f"\n===== Transformer Engine {label} (megatron-core {MCORE}, torch "
              f"{importlib.metadata.version('torch')}, CUDA hidden) =====", flush=True)
        distributions = install(version, complete, pin)
        if distributions.get("transformer-engine") != version or complete != ("transformer-engine-torch" in distributions):
            raise SystemExit(f"te leg: installing {label} gave {distributions}")
        junit = RESULTS / f"te-{label.replace(' ', '-')}.xml"
        junit.unlink(missing_ok=True)
        command = [sys.executable, "-m", "pytest", "-n", os.environ.get("MATRIX_WORKERS", "2"),
                   "-m", "cuda_hidden", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   "tests/test_te_real.py", *pytest_args]
        code = subprocess.run(command, env=env, cwd=ROOT).returncode
        counts = leg_counts(junit)
        doctor_code, doctor_line = doctor(env)
        if code != 0:
            failed.append(label)
        summary.append(f"{label}: {', '.join(f'{k} {v}' for k, v in distributions.items())}\n"
                       f"    tests (passed/skipped/failed): {counts}{'' if code == 0 else ' FAILED'}\n"
                       f"    doctor (exit {doctor_code}): Transformer Engine  {doctor_line}")
    return summary, failed


if __name__ == "__main__":
    with one_environment_at_a_time("te leg"):
        sys.exit(main(sys.argv[1:]))
