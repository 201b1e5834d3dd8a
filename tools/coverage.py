"""Which fix state every megatron-core a user may run gets, decided from source alone.

python tools/coverage.py [--cache DIR] [--json FILE]

Lists every megatron-core version PyPI serves for Python 3.11 and 3.12 from 0.13.0rc0 on,
release candidates included and ``.dev`` nightlies older than 0.16.1 left out, downloads each
wheel (no dependencies) into the cache (default ``.coverage-wheels``, reused), reads the target
modules out of the wheel without installing or importing it, and runs the engine's own
decision (``_engine.classify_source``) on them; the upstream snapshots in
``../shared/upstream`` (when present; found as tools/matrix.py finds them) are read out of
their tarballs the same way. Prints one row per version (a fix's state over all its targets,
as ``status()`` gives it) and, below, the detail of every target that is not
``applied``/``upstream-fixed``/``not-applicable``. Exits 1 if any fix is ``unsupported``
(also where a module or function the fix expects is missing).
"""

import argparse
import json
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from matrix import UPSTREAM, snapshots  # noqa: E402  (where the upstream snapshots are)
from mcore_cpu_shim import _engine  # noqa: E402
from mcore_cpu_shim.fixes import FIXES  # noqa: E402

PYTHONS = ("3.11", "3.12")
OLDEST = Version("0.13.0rc0")  # 0.13.0 and its release candidates on
OLDEST_NIGHTLY = Version("0.16.1")
GOOD = (_engine.APPLIED, _engine.UPSTREAM_FIXED, _engine.NOT_APPLICABLE)


def pip(*args):
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(command, capture_output=True, text=True)


def served_versions():
    """Every megatron-core version PyPI serves for our Pythons from 0.13.0 on, oldest first."""
    served = set()
    for python in PYTHONS:
        result = pip("index", "versions", "megatron-core", "--pre", "--python-version", python)
        for line in result.stdout.splitlines():
            if line.startswith("Available versions:"):
                for text in line.split(":", 1)[1].split(","):
                    version = Version(text.strip())
                    if version < OLDEST or (version.is_devrelease and version < OLDEST_NIGHTLY):
                        continue
                    served.add(version)
    if not served:
        raise SystemExit("pip index versions megatron-core listed nothing (no index reachable?)")
    return [str(v) for v in sorted(served)]


def wheel(version, cache):
    """The wheel of ``version`` in the cache, downloaded for the first of our Pythons it has one."""
    def cached():
        return sorted(cache.glob(f"megatron_core-{version}-*.whl"))

    errors = []
    for python in PYTHONS:
        if not cached():
            result = pip("download", "--quiet", "--no-deps", "--only-binary=:all:",
                         "--python-version", python, "-d", str(cache), f"megatron-core=={version}")
            errors += [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    if cached():
        return cached()[0]
    raise SystemExit(f"could not download a wheel of megatron-core {version}: {errors}")


def module_path(module):
    return module.replace(".", "/") + ".py"


def wheel_reader(path):
    archive = zipfile.ZipFile(path)
    names = set(archive.namelist())

    def read(module):
        name = module_path(module)
        return archive.read(name).decode() if name in names else None

    return read


def tarball_reader(path):
    archive = tarfile.open(path)
    members = {m.name.removeprefix("./"): m for m in archive.getmembers() if m.isfile()}

    def read(module):
        member = members.get(module_path(module))
        return archive.extractfile(member).read().decode() if member else None

    return read


def sources(cache):
    for version in served_versions():
        yield version, wheel_reader(wheel(version, cache))
    for name, tarball in snapshots().items():
        yield name, tarball_reader(tarball)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--cache", type=Path, default=ROOT / ".coverage-wheels")
    parser.add_argument("--json", type=Path, help="also write the states as JSON here")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    if not UPSTREAM.is_dir():
        print(f"note: {UPSTREAM} is absent: the upstream snapshots are not checked")

    names = [fix.name for fix in FIXES]
    rows, problems, record = [], [], {}
    for label, read in sources(args.cache):
        states = _engine.classify_source(FIXES, read)
        record[label] = {fix: {t: list(s) for t, s in targets.items()} for fix, targets in states.items()}
        row = [label]
        for fix in names:
            targets = states[fix]
            row.append(_engine.combined_state({state for state, _ in targets.values()}))
            problems += [(label, target, state, detail)
                         for target, (state, detail) in targets.items() if state not in GOOD]
        rows.append(row)

    header = ["megatron-core"] + names
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for cells in [header, ["-" * w for w in widths]] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |")
    drifted = sum(
        1 for label in record for fix in record[label].values() for state, detail in fix.values()
        if state == _engine.APPLIED and detail.startswith(_engine.DRIFTED)
    )
    print(f"\n{len(rows)} trees; targets applied on drifted code (site checks): {drifted}")
    for label, target, state, detail in problems:
        print(f"{label}: {target}: {state}: {detail}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    print("no fix unsupported" if not problems else f"{len(problems)} target(s) not covered")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
