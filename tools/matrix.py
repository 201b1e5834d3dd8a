"""The megatron-core version matrix, run by tox (one virtualenv per Python, see tox.ini).

python tools/matrix.py test [--drift VERSION]... VERSION... [-- PYTEST_ARGS]
    For each release: install it without dependencies into .mcore/<version> (reused when
    present) and run the test suite in every delivery mode it supports:
      shim          unmodified megatron-core + the shim
      patched       megatron-core with patches/series applied, shim switched off
                    (MCORE_CPU_SHIM_DISABLE=all, MCORE_CPU_SHIM_TE=off)
      patched+shim  the same patched tree with the shim active: it must stand down, so
                    only tests/test_engine.py runs there (it checks every fix's state)
      drift         (releases named by --drift) the shim mode with the release's known
                    fingerprints ignored, so every fix goes through its site checks and its
                    drift form: the whole suite proves the drift forms behave like the
                    known-release replacements
    The patched modes run where every patch applies (.mcore/<version>-patched, which also
    holds the megatron unit tests the patches add; those run in the patched mode too).
    VERSION may also be ``snapshots``: every unreleased megatron-core tree in
    ../shared/upstream (megatron-core-<name>.tar.xz, extracted to .mcore/<name>), in shim
    mode only (the patches are made against releases); skipped with a message where that
    folder is absent (a clone without the project's shared data).
    VERSION may also be a Megatron-Bridge leg: ``bridge-0.3.1`` (Megatron-Bridge 0.3.1 from PyPI,
    installed without dependencies into .mcore/bridge-0.3.1, on megatron-core 0.16.1) or
    ``bridge-main`` (Megatron-Bridge main from ../shared/upstream on the megatron-core commit it
    pins; skipped with a message where that folder is absent). Their modes: shim, and for
    Bridge main ``bridge-patched`` (patches/bridge/series applied to a copy of Bridge, the
    Bridge fixes switched off, megatron-core's from the shim; the Bridge unit tests the patches
    add run there too). They run the Bridge tests (tests/test_bridge_*.py and the drift checks
    over every target; in shim mode also the convert command, the demo and the engine state).
    The tests that do not depend on the release (helpers.once_per_python) run in the first
    shim leg of the list (and in the Bridge legs) only.
    Each mode runs two pytest sessions (CUDA legs; the cuda_visible one only where a fresh
    interpreter sees a CUDA device, else it is recorded as not run), each with MATRIX_WORKERS processes
    (pytest-xdist; default: the cores, at most 4).
    Fix states, patch results, mode results and per-leg counts go to .matrix/<version>.json.
    Exits non-zero if any run failed.
python tools/matrix.py report
    Print the tables (fix states, patches, modes) from every .matrix/*.json.
python tools/matrix.py patch VERSION
    Only build .mcore/<version>-patched (the release's wheel + patches/series) and say, per
    patch, whether it applies.
"""

import contextlib
import fcntl
import functools
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
OVERLAYS = ROOT / ".mcore"
RESULTS = ROOT / ".matrix"
UPSTREAM = ROOT.parent / "shared" / "upstream"
MODES = ("shim", "patched", "patched+shim", "drift")
# Environment of a mode beyond MCORE_CPU_SHIM_MODE.
MODE_ENV = {
    "patched": {"MCORE_CPU_SHIM_DISABLE": "all", "MCORE_CPU_SHIM_TE": "off"},
    "drift": {"_MCORE_CPU_SHIM_DRIFT_ONLY": "1"},
}
# Test processes per pytest session (pytest-xdist); most of a test's time is a child
# interpreter importing torch and megatron, so this scales with the cores.
NOT_HERE = "not applicable (no such file)"
NO_TESTS_COLLECTED = 5  # pytest's exit code, e.g. a leg with no tests in patched+shim
WORKERS = ["-n", os.environ.get("MATRIX_WORKERS", str(min(4, os.cpu_count() or 1)))]


@contextlib.contextmanager
def one_environment_at_a_time(what):
    """Hold the machine's cores for ``what`` (a tox environment's tests). ``tox -p all`` (the
    README's test command) sets up every environment at once, so the later environments'
    installs (downloading and unpacking py312's CUDA torch, the bridge extra) go on beside the
    first one's tests; the tests themselves take every core (pytest-xdist), so the environments run
    them one after another, in the order their installs finish."""
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / ".cores.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{what}: waiting while another tox environment runs its tests", flush=True)
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def series(folder=PATCHES):
    lines = (folder / "series").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


# Megatron-Bridge legs: (Megatron-Bridge, the megatron-core it runs on).
BRIDGE_LEGS = {"bridge-0.3.1": ("0.3.1", "0.16.1"), "bridge-main": ("main", "bridge-pin-2a75ac12")}
BRIDGE_PATCHES = PATCHES / "bridge"
BRIDGE_MODES = ("shim", "bridge-patched")
BRIDGE_TESTS = ["tests/test_bridge_*.py", "tests/test_convert.py", "tests/test_demo.py", "tests/test_drift.py",
                "tests/test_engine.py::test_every_fix_reaches_its_expected_state", "tests/test_family_mixtral.py"]
# convert under torchrun (two nodes on this host): the launcher does not depend on the Bridge
# release (each Bridge's TP conversion is test_bridge_replicated_device's), so the first leg only.
TORCHRUN_TESTS = ["tests/test_convert_torchrun.py"]
# The family table's rows: test_demo.py's Bridge conversions, and Mixtral's (no Bridge converts it).
FAMILY_CASES = {"test_bridge_family[": None, "test_mixtral_converts_with_megatron_core": "mixtral"}


def bridge_series():
    """patches/bridge/series as the report names them (bridge/<patch>)."""
    return [f"bridge/{p}" for p in series(BRIDGE_PATCHES)] if (BRIDGE_PATCHES / "series").is_file() else []


def bridge_fix_names():
    sys.path.insert(0, str(ROOT))
    from mcore_cpu_shim.fixes import BRIDGE_FIXES  # (the registry only: activates nothing)

    return ",".join(fix.name for fix in BRIDGE_FIXES)


def bridge_overlay(version):
    """The folder to put on PYTHONPATH for Megatron-Bridge ``version`` (None: no snapshot)."""
    if version != "main":
        target = OVERLAYS / f"bridge-{version}"
        if not (target / f"megatron_bridge-{version}.dist-info").is_dir():
            shutil.rmtree(target, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                            str(target), f"megatron-bridge=={version}"], check=True)
        return target
    tarballs = sorted(UPSTREAM.glob("megatron-bridge-main-*.tar.xz"))
    if not tarballs:
        return None
    target = OVERLAYS / tarballs[-1].name.removeprefix("megatron-").removesuffix(".tar.xz")
    if not (target / "src" / "megatron" / "bridge" / "__init__.py").is_file():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tarfile.open(tarballs[-1]) as archive:
            archive.extractall(target, filter="data")
    return target / "src"


def bridge_patched_overlay(plain):
    """A copy of the Bridge repository tree (``plain`` is its src/) with patches/bridge/series
    applied in order: (its src/, {patch: applies | needs rebase})."""
    tree = plain.parent.with_name(plain.parent.name + "-patched")
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(plain.parent, tree, ignore=shutil.ignore_patterns("__pycache__"))
    results = {}
    for patch in series(BRIDGE_PATCHES):
        applied = git_apply(tree, patch, BRIDGE_PATCHES).returncode == 0
        results[f"bridge/{patch}"] = "applies" if applied else "needs rebase"
    return tree / "src", results


def snapshots():
    """{name: tarball} of the unreleased megatron-core trees in ../shared/upstream."""
    return {
        tarball.name.removeprefix("megatron-core-").removesuffix(".tar.xz"): tarball
        for tarball in sorted(UPSTREAM.glob("megatron-core-*.tar.xz"))
    }


def snapshot_overlay(name, tarball):
    target = OVERLAYS / name
    if not (target / "megatron" / "core" / "package_info.py").is_file():
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        with tarfile.open(tarball) as archive:
            archive.extractall(target, filter="data")
    return target


def is_release(label):
    return label[:1].isdigit()


def overlay(version):
    target = OVERLAYS / version
    if not (target / f"megatron_core-{version}.dist-info").is_dir():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(target), f"megatron-core=={version}"],
            check=True,
        )
    return target


def git_apply(tree, patch, folder=PATCHES):
    """git apply inside ``tree`` as a plain folder (never the repository around it). It applies
    the whole patch or, if any hunk fails, nothing."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tree.parent))
    args = ["git", "apply", str(folder / patch)]
    return subprocess.run(args, cwd=tree, env=env, capture_output=True, text=True)


def changed_files(patch):
    """The megatron-core files a patch changes (not the ones it creates)."""
    files, current = [], None
    for line in (PATCHES / patch).read_text().splitlines():
        if line.startswith("diff --git a/"):
            current = line.split()[2][2:]
            if current.startswith("megatron/"):
                files.append(current)
        elif line.startswith("new file mode") and current in files:
            files.remove(current)
    return files


def patched_overlay(version, plain):
    """A copy of the release with every patch applied in order; per patch: applies, needs
    rebase, or not applicable (it changes only files this release does not have, as a patch
    for code that exists on megatron-core main only)."""
    tree = OVERLAYS / f"{version}-patched"
    shutil.rmtree(tree, ignore_errors=True)
    shutil.copytree(plain, tree, ignore=shutil.ignore_patterns("__pycache__"))
    results = {}
    for patch in series():
        if not any((tree / path).is_file() for path in changed_files(patch)):
            results[patch] = NOT_HERE
            continue
        results[patch] = "applies" if git_apply(tree, patch).returncode == 0 else "needs rebase"
    return tree, results


def leg_counts(junit):
    """'passed/skipped/failed' from a pytest junit XML file ('no result' if pytest wrote none)."""
    if not junit.is_file():
        return "no result"
    suite = ElementTree.parse(junit).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    total, skipped = int(suite.get("tests")), int(suite.get("skipped"))
    failed = int(suite.get("failures")) + int(suite.get("errors"))
    return f"{total - skipped - failed}/{skipped}/{failed}"


NO_DEVICE = "not run (no CUDA device)"


@functools.lru_cache(maxsize=None)
def devices():
    """How many CUDA devices a fresh interpreter sees here (0 where the probe fails)."""
    probe = [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"]
    result = subprocess.run(probe, capture_output=True, text=True)
    words = result.stdout.split()
    return int(words[-1]) if result.returncode == 0 and words else 0


# The shim's switches (and the tests' mode): a run sets its own, none come in from outside.
SWITCHES = ("MCORE_CPU_SHIM_DISABLE", "MCORE_CPU_SHIM_TE", "MCORE_CPU_SHIM_STRICT",
            "MCORE_CPU_SHIM_MODE", "_MCORE_CPU_SHIM_DRIFT_ONLY")


def tree_env(*trees, **settings):
    """This environment for a test run on megatron-core ``trees`` (with a Megatron-Bridge tree
    first, in a Bridge leg): no outside shim switches, the trees on PYTHONPATH, then
    ``settings``."""
    env = {name: value for name, value in os.environ.items() if name not in SWITCHES}
    # An unreleased tree's package_info appends the hash of the git repository around it: the
    # trees here sit inside this project's clone, whose hash is not theirs.
    env.update(PYTHONPATH=os.pathsep.join(map(str, trees)), GIT_CEILING_DIRECTORIES=str(OVERLAYS), **settings)
    return env


def run_mode(version, mode, trees, pytest_args, once=False):
    """One delivery mode on ``trees`` (the megatron-core tree, with a Bridge tree before it in
    a Bridge leg): both CUDA legs; returns (passed, fix states, per-leg counts). ``once``: this
    run also has the release-independent tests (helpers.once_per_python)."""
    tree = trees[0]
    env = tree_env(*trees, MCORE_CPU_SHIM_MODE="shim" if mode == "drift" else mode,
                   MCORE_CPU_SHIM_ONCE_PER_PYTHON="1" if once else "0", **MODE_ENV.get(mode, {}))
    if mode == "bridge-patched":
        env["MCORE_CPU_SHIM_DISABLE"] = bridge_fix_names()  # Bridge's come from the patches
    if version in BRIDGE_LEGS:
        paths = sorted(str(p.relative_to(ROOT)) for p in ROOT.glob(BRIDGE_TESTS[0]))
        if mode == "shim":  # (the command line and the demo are the shim's: shim mode only)
            paths += BRIDGE_TESTS[1:] + (TORCHRUN_TESTS if version == next(iter(BRIDGE_LEGS)) else [])
        else:  # what the patches must do alike: the Bridge tests, and every target reading fixed
            paths += ["tests/test_drift.py"]
    elif mode == "patched+shim":
        # The shim must stand down on patched code (every fix upstream-fixed, nothing replaced),
        # so the behaviour there is the patched mode's; the engine tests check the stand-down.
        paths = ["tests/test_engine.py"]
    elif mode == "drift":
        # What the drift forms must do alike: every fix's own tests, the engine's, and the
        # end-to-end runs (forward, multi-rank save, demo); the rest does not depend on them.
        fix_tests = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").glob("test_*_device.py"))
        paths = fix_tests + ["tests/test_local_moe_norm_keys.py", "tests/test_mla_cpu_build.py",
                             "tests/test_fix_states.py", "tests/test_engine.py", "tests/test_cpu_forward.py", "tests/test_multirank.py",
                             "tests/test_demo.py"]
    else:
        paths = ["tests"]
    unit_tests = tree.parent / "tests" / "unit_tests" if mode == "bridge-patched" else tree / "tests" / "unit_tests"
    if mode in ("patched", "bridge-patched") and unit_tests.is_dir():
        paths.append(str(unit_tests))  # the tests the patches add upstream
    states_file = RESULTS / f"{version}-{mode}-states.json"
    states_file.unlink(missing_ok=True)
    codes, legs = [], {}
    for leg in ("cuda_hidden", "cuda_visible"):
        leg_env = dict(env, CUDA_VISIBLE_DEVICES="") if leg == "cuda_hidden" else env
        if leg == "cuda_hidden":
            leg_env["MCORE_CPU_SHIM_STATES_FILE"] = str(states_file)  # tests/conftest.py writes it
        # The unit tests that patches add carry no markers: they run in the hidden leg.
        leg_paths = paths if leg == "cuda_hidden" else paths[:-1] if str(unit_tests) in paths else paths
        if leg == "cuda_visible" and not devices():
            # Every test of the leg would skip for this one reason: say it without a session
            # (one pytest session costs about 20 s of startup here, over 25 sessions per run).
            print(f"\n----- mode {mode}, {leg}: not run, this host has no CUDA device -----", flush=True)
            legs[leg] = NO_DEVICE
            continue
        marker = f"{leg} or not cuda_visible" if leg == "cuda_hidden" else leg
        junit = RESULTS / f"{version}-{mode}-{leg}.xml"
        junit.unlink(missing_ok=True)
        print(f"\n----- mode {mode}, {leg}: pytest {' '.join(leg_paths)} -----", flush=True)
        command = [sys.executable, "-m", "pytest", *WORKERS, "-m", marker, f"--junitxml={junit}",
                   *leg_paths, *pytest_args]
        code = subprocess.run(command, env=leg_env, cwd=ROOT).returncode
        codes.append(0 if code == NO_TESTS_COLLECTED else code)
        legs[leg] = leg_counts(junit)
    states = json.loads(states_file.read_text()) if states_file.is_file() else {}
    if not states:
        print(f"no fix states recorded in {states_file}", flush=True)
    states_file.unlink(missing_ok=True)  # they go into .matrix/<version>.json with the rest
    return bool(states) and not any(codes), states, legs


def test(versions, pytest_args, drift=()):
    failed = []
    RESULTS.mkdir(exist_ok=True)
    if "snapshots" in versions:
        found = snapshots()
        if not found:
            print(f"\nno upstream snapshots: {UPSTREAM} is absent or empty; their legs are skipped")
        at = versions.index("snapshots")
        versions = versions[:at] + list(found) + versions[at + 1:]
    for version in versions:
        if version in BRIDGE_LEGS:
            failed += bridge_leg(version, pytest_args)
            continue
        print(f"\n===== megatron-core {version} (Python {sys.version.split()[0]}) =====", flush=True)
        if is_release(version):
            plain = overlay(version)
            patched, patches = patched_overlay(version, plain)
        else:
            plain, patched, patches = snapshot_overlay(version, snapshots()[version]), None, {}
        record = {"mcore": version, "patches": patches, "modes": {}, "states": {}, "legs": {}}
        for mode in MODES:
            if mode == "drift" and version not in drift:
                continue
            if mode in ("patched", "patched+shim") and patched is None:
                record["modes"][mode] = "not run (unreleased tree: shim only)"
                continue
            if mode in ("patched", "patched+shim") and "needs rebase" in patches.values():
                record["modes"][mode] = "not run (a patch needs rebase)"
                continue
            tree = patched if mode in ("patched", "patched+shim") else plain
            once = mode == "shim" and version == versions[0]  # the first leg of this Python
            ok, states, legs = run_mode(version, mode, [tree], pytest_args, once)
            record["modes"][mode] = "passed" if ok else "FAILED"
            record["states"][mode] = states
            record["legs"][mode] = legs
            if not ok:
                failed.append(f"{version} {mode}")
        (RESULTS / f"{version}.json").write_text(json.dumps(record, indent=1))
    print(f"\nmatrix on Python {sys.version.split()[0]}: "
          + (f"FAILED: {', '.join(failed)}" if failed else "all runs passed"))
    return 1 if failed else 0


def bridge_leg(leg, pytest_args):
    """One Megatron-Bridge leg in its modes; .matrix/<leg>.json; returns the failed runs."""
    version, mcore = BRIDGE_LEGS[leg]
    print(f"\n===== Megatron-Bridge {version} on megatron-core {mcore} (Python {sys.version.split()[0]}) =====",
          flush=True)
    plain = bridge_overlay(version)
    core = overlay(mcore) if is_release(mcore) else snapshots().get(mcore)
    if plain is None or core is None:
        print(f"no upstream snapshots: {UPSTREAM} is absent or incomplete; the {leg} leg is skipped")
        return []
    core = core if is_release(mcore) else snapshot_overlay(mcore, core)
    patched, patches = bridge_patched_overlay(plain) if version == "main" else (None, {})
    record = {"mcore": leg, "patches": patches, "modes": {}, "states": {}, "legs": {}}
    failed = []
    for mode in BRIDGE_MODES:
        if mode == "bridge-patched" and (patched is None or "needs rebase" in patches.values()):
            why = "patches/bridge are made against Bridge main" if patched is None else "a patch needs rebase"
            record["modes"][mode] = f"not run ({why})"
            continue
        trees = [patched if mode == "bridge-patched" else plain, core]
        ok, states, legs = run_mode(leg, mode, trees, pytest_args, once=True)
        record["modes"][mode], record["states"][mode], record["legs"][mode] = ("passed" if ok else "FAILED"), states, legs
        if not ok:
            failed.append(f"{leg} {mode}")
    (RESULTS / f"{leg}.json").write_text(json.dumps(record, indent=1))
    return failed


def table(title, header, rows):
    widths = [max(len(str(row[i])) for row in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    print(f"\n{title}")
    print(line(header))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))


def report():
    runs = [json.loads(p.read_text()) for p in RESULTS.glob("*.json")]
    if not runs:
        print(f"no results in {RESULTS}")
        return 1
    # Releases oldest first, then the unreleased trees by name.
    runs.sort(key=lambda r: (0, tuple(int(x) for x in r["mcore"].split(".")), "")
              if is_release(r["mcore"]) else (1, (), r["mcore"]))
    releases = [r["mcore"] for r in runs]
    fixes = sorted({fix for r in runs for fix in r["states"].get("shim", {})})
    table("Fix state per megatron-core release (mode shim: unmodified megatron-core + shim):",
          ["fix"] + releases,
          [[fix] + [r["states"].get("shim", {}).get(fix, "-") for r in runs] for fix in fixes])
    table("Patches (git apply, in series order, each on top of the ones that applied):",
          ["patch"] + releases,
          [[p] + [r["patches"].get(p, "-") for r in runs] for p in series() + bridge_series()])
    table("Test runs per delivery mode:", ["mode"] + releases,
          [[m] + [r["modes"].get(m, "-") for r in runs] for m in MODES + BRIDGE_MODES[1:]])
    legs = [(m, leg) for m in MODES + BRIDGE_MODES[1:] for leg in ("cuda_hidden", "cuda_visible")]
    table("Tests per mode and CUDA leg (passed/skipped/failed; skipped = cannot run on this host or mode):",
          ["mode", "leg"] + releases,
          [[m, leg] + [r.get("legs", {}).get(m, {}).get(leg, "-") for r in runs] for m, leg in legs])
    families = family_cells([r["mcore"] for r in runs if r["mcore"] in BRIDGE_LEGS])
    if families:
        names = sorted({name for name, _ in families})
        bridge_legs = sorted({leg for _, leg in families})
        table("Model families (mode shim; through Megatron-Bridge: tests/test_demo.py::test_bridge_family; "
              "Mixtral with megatron-core directly: tests/test_family_mixtral.py):",
              ["family"] + bridge_legs, [[n] + [families.get((n, leg), "-") for leg in bridge_legs] for n in names])
    return 0


def family_cells(bridge_legs):
    """{(family, Bridge leg): what its family case (FAMILY_CASES) recorded, or why it did not run}."""
    cells = {}
    for leg in bridge_legs:
        junit = RESULTS / f"{leg}-shim-cuda_hidden.xml"
        if not junit.is_file():
            continue
        for case in ElementTree.parse(junit).getroot().iter("testcase"):
            name = case.get("name", "")
            prefix = next((p for p in FAMILY_CASES if name.startswith(p)), None)
            if prefix is None:
                continue
            family = FAMILY_CASES[prefix] or name[len(prefix):-1]
            recorded = case.find("properties/property[@name='family']")
            skipped = case.find("skipped")
            if recorded is not None:
                cells[(family, leg)] = recorded.get("value")
            elif skipped is not None:
                cells[(family, leg)] = f"skipped: {skipped.get('message', '')}"
            else:
                cells[(family, leg)] = "failed"
    return cells


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "report":
        sys.exit(report())
    if command == "patch":
        tree, results = patched_overlay(rest[0], overlay(rest[0]))
        for patch, result in results.items():
            print(f"{patch}: {result}")
        print(tree)
        sys.exit(0 if "needs rebase" not in results.values() else 1)
    split = rest.index("--") if "--" in rest else len(rest)
    versions, drift = [], []
    words = iter(rest[:split])
    for word in words:
        if word == "--drift":
            drift.append(next(words))
        else:
            versions.append(word)
    with one_environment_at_a_time(f"matrix {' '.join(versions)}"):
        sys.exit(test(versions, rest[split + 1:], drift))
