"""The megatron-core version matrix, run by tox (one virtualenv per Python, see tox.ini).

python tools/matrix.py test VERSION... [-- PYTEST_ARGS]
    for each release: install it without dependencies into .mcore/<version> (reused when
    present), record the shim's fix states into .matrix/<version>.json, run pytest with the
    release on PYTHONPATH. Exits non-zero if any release failed.
python tools/matrix.py report
    print one table of fix states from every .matrix/*.json (rows: fixes, columns: releases).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OVERLAYS = ROOT / ".mcore"
STATES = ROOT / ".matrix"

RECORD = """
import importlib, json, sys
import mcore_cpu_shim
from mcore_cpu_shim._engine import mcore_version
for fix in mcore_cpu_shim.status().values():
    for target in fix["targets"]:
        try:
            importlib.import_module(target.split(":")[0])
        except ImportError:
            pass  # stays "pending": this release has no such module
print(json.dumps({"mcore": mcore_version(), "status": mcore_cpu_shim.status()}, indent=1))
"""


def overlay(version: str) -> Path:
    target = OVERLAYS / version
    if not (target / f"megatron_core-{version}.dist-info").is_dir():
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
             str(target), f"megatron-core=={version}"],
            check=True,
        )
    return target


def test(versions, pytest_args) -> int:
    failed = []
    for version in versions:
        env = dict(os.environ, PYTHONPATH=str(overlay(version)))
        print(f"\n===== megatron-core {version} (Python {sys.version.split()[0]}) =====", flush=True)
        states = subprocess.run([sys.executable, "-c", RECORD], env=env, capture_output=True, text=True)
        if states.returncode != 0:
            print(states.stderr)
            failed.append(f"{version} (fix states)")
        else:
            STATES.mkdir(exist_ok=True)
            (STATES / f"{version}.json").write_text(states.stdout)
        if subprocess.run([sys.executable, "-m", "pytest", *pytest_args], env=env, cwd=ROOT).returncode:
            failed.append(version)
    print(f"\nmatrix on Python {sys.version.split()[0]}: {len(versions) - len(failed)} of "
          f"{len(versions)} releases green" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


def report() -> int:
    runs = [json.loads(p.read_text()) for p in sorted(STATES.glob("*.json"))]
    if not runs:
        print(f"no fix states recorded in {STATES}")
        return 1
    runs.sort(key=lambda r: tuple(int(x) for x in r["mcore"].split(".")[:3]))
    fixes = list(runs[0]["status"])
    header = ["fix \\ megatron-core"] + [r["mcore"] for r in runs]
    rows = [[fix] + [r["status"].get(fix, {}).get("state", "-") for r in runs] for fix in fixes]
    widths = [max(len(row[i]) for row in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    print("\nFix state per megatron-core release (shim on unmodified megatron-core):")
    print(line(header))
    print(line(["-" * w for w in widths]))
    for row in rows:
        print(line(row))
    return 0


if __name__ == "__main__":
    command, *rest = sys.argv[1:]
    if command == "report":
        sys.exit(report())
    versions, pytest_args = rest, []
    if "--" in rest:
        split = rest.index("--")
        versions, pytest_args = rest[:split], rest[split + 1:]
    sys.exit(test(versions, pytest_args))
