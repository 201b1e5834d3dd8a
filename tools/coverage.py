"""Which fix state every megatron-core and Megatron-Bridge a user may run gets, from source alone.

python tools/coverage.py [--cache DIR] [--json FILE]

Lists every megatron-core version PyPI serves for Python 3.11 and 3.12 from 0.13.0rc0 on,
release candidates included and ``.dev`` nightlies older than 0.16.1 left out, and every
Megatron-Bridge version it serves for them (pre-releases included), downloads each wheel (no
dependencies) into the cache (default ``.coverage-wheels``, reused), reads the target modules
out of the wheel without installing or importing it, and runs the engine's own decision
(``engine.classify_source``) on them: ``FIXES`` on megatron-core, ``BRIDGE_FIXES`` on
Megatron-Bridge. The upstream snapshots in ``../shared/upstream`` (when present) are read out of
their tarballs the same way: the megatron-core ones as tools/matrix.py finds them, and the
Megatron-Bridge main one that its ``bridge_overlay`` takes (``src/megatron/bridge/...`` inside).
Prints one table per project, one row per version (a fix's state over all its targets, as
``status()`` gives it) and, below each, the detail of every target that is not
``applied``/``upstream-fixed``/``not-applicable``. Exits 1 if any fix of either set is
``unsupported`` (also where a module or function the fix expects is missing). ``--json``
writes ``{project: {version: {fix: {target: [state, detail]}}}}``.
"""

import argparse
import json
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

from matrix import UPSTREAM, snapshots  # noqa: E402  (where the upstream snapshots are)
from mcore_cpu_shim import engine  # noqa: E402
from mcore_cpu_shim.fixes import BRIDGE_FIXES, FIXES  # noqa: E402

PYTHONS = ("3.11", "3.12")
GOOD = (engine.APPLIED, engine.UPSTREAM_FIXED, engine.NOT_APPLICABLE)


def bridge_snapshots():
    """{name: tarball} of Megatron-Bridge main in ../shared/upstream: the newest
    megatron-bridge-main-<hash>.tar.xz, the one ``matrix.bridge_overlay("main")`` extracts."""
    tarballs = sorted(UPSTREAM.glob("megatron-bridge-main-*.tar.xz"))
    return {t.name.removeprefix("megatron-bridge-").removesuffix(".tar.xz"): t for t in tarballs[-1:]}


@dataclass(frozen=True)
class Project:
    """One project whose fix set is decided: its PyPI name, fixes, which served versions count,
    and where its snapshots are (and the folder their ``megatron/`` lies in)."""

    name: str
    fixes: tuple
    snapshots: Callable[[], dict]
    snapshot_root: str = ""
    oldest: Optional[Version] = None  # versions before it are left out (None: none are)
    oldest_nightly: Optional[Version] = None  # ``.dev`` versions before it are left out

    @property
    def wheel_name(self):
        return self.name.replace("-", "_")

    def counts(self, version):
        if self.oldest is not None and version < self.oldest:
            return False
        return not (version.is_devrelease and self.oldest_nightly is not None and version < self.oldest_nightly)


PROJECTS = (
    Project("megatron-core", FIXES, snapshots, oldest=Version("0.13.0rc0"),  # 0.13.0 and its rcs on
            oldest_nightly=Version("0.16.1")),
    # 0.3.0 on: the 0.1/0.2 pre-releases lack the modules the fix set targets
    Project("megatron-bridge", BRIDGE_FIXES, bridge_snapshots, snapshot_root="src/", oldest=Version("0.3.0")),
)


def pip(*args):
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(command, capture_output=True, text=True)


def served_versions(project):
    """Every version of ``project`` PyPI serves for our Pythons that counts, oldest first."""
    served = set()
    for python in PYTHONS:
        result = pip("index", "versions", project.name, "--pre", "--python-version", python)
        for line in result.stdout.splitlines():
            if line.startswith("Available versions:"):
                versions = (Version(text.strip()) for text in line.split(":", 1)[1].split(","))
                served.update(version for version in versions if project.counts(version))
    if not served:
        raise SystemExit(f"pip index versions {project.name} listed nothing (no index reachable?)")
    return [str(v) for v in sorted(served)]


def wheel(project, version, cache):
    """The wheel of ``project`` ``version`` in the cache, downloaded for the first of our
    Pythons it has one."""
    def cached():
        return sorted(cache.glob(f"{project.wheel_name}-{version}-*.whl"))

    errors = []
    for python in PYTHONS:
        if not cached():
            result = pip("download", "--quiet", "--no-deps", "--only-binary=:all:",
                         "--python-version", python, "-d", str(cache), f"{project.name}=={version}")
            errors += [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    if cached():
        return cached()[0]
    raise SystemExit(f"could not download a wheel of {project.name} {version}: {errors}")


def module_path(module):
    return module.replace(".", "/") + ".py"


def wheel_reader(path):
    archive = zipfile.ZipFile(path)
    names = set(archive.namelist())

    def read(module):
        name = module_path(module)
        return archive.read(name).decode() if name in names else None

    return read


def tarball_reader(path, root=""):
    """``read(module)`` for a tarball whose ``megatron/`` lies in the folder ``root``."""
    archive = tarfile.open(path)
    members = {m.name.removeprefix("./"): m for m in archive.getmembers() if m.isfile()}

    def read(module):
        member = members.get(root + module_path(module))
        return archive.extractfile(member).read().decode() if member else None

    return read


def sources(project, cache):
    for version in served_versions(project):
        yield version, wheel_reader(wheel(project, version, cache))
    for name, tarball in project.snapshots().items():
        yield name, tarball_reader(tarball, project.snapshot_root)


def table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    for cells in [header, ["-" * w for w in widths]] + rows:
        print("| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |")


def decide(project, cache):
    """Print ``project``'s table and details; returns ({version: states}, the targets not covered)."""
    names = [fix.name for fix in project.fixes]
    rows, problems, record = [], [], {}
    for label, read in sources(project, cache):
        states = engine.classify_source(project.fixes, read)
        record[label] = {fix: {t: list(s) for t, s in targets.items()} for fix, targets in states.items()}
        row = [label]
        for fix in names:
            targets = states[fix]
            row.append(engine.combined_state({state for state, _ in targets.values()}))
            problems += [(label, target, state, detail)
                         for target, (state, detail) in targets.items() if state not in GOOD]
        rows.append(row)

    print()
    table([project.name] + names, rows)
    drifted = sum(
        1 for label in record for fix in record[label].values() for state, detail in fix.values()
        if state == engine.APPLIED and detail.startswith(engine.DRIFTED)
    )
    print(f"\n{project.name}: {len(rows)} trees; targets applied on drifted code (site checks): {drifted}")
    for label, target, state, detail in problems:
        print(f"{project.name} {label}: {target}: {state}: {detail}")
    return record, problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--cache", type=Path, default=ROOT / ".coverage-wheels")
    parser.add_argument("--json", type=Path, help="also write the states as JSON here")
    args = parser.parse_args()
    args.cache.mkdir(parents=True, exist_ok=True)
    if not UPSTREAM.is_dir():
        print(f"note: {UPSTREAM} is absent: the upstream snapshots are not checked")

    record, problems = {}, []
    for project in PROJECTS:
        record[project.name], missed = decide(project, args.cache)
        problems += missed
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    print("\nno fix unsupported" if not problems else f"\n{len(problems)} target(s) not covered")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
