"""Benchmark (not a test): what ``import mcore_cpu_shim`` costs a process.

Every conversion process (and every rank, and every process ``mcore-cpu-shim run`` starts)
imports the package first, whether or not a fix ever applies, so the import must stay light:
target <= 15 ms cumulative. Measured as Python measures it, ``python -X importtime -c "import
mcore_cpu_shim"``: the cumulative column of the package's top line (its own modules and every
module it imports that the interpreter had not loaded at startup), in fresh interpreters,
side by side with ``import json`` as a reference a machine's speed moves the same way. The two
alternate (A B A B ...) so that drift on a shared machine hits both; the ratio is the number to
compare across machines, the absolute one is what the target is about.

    python benchmarks/bench_import.py                 # 30 interpreters per side
    python benchmarks/bench_import.py --runs 100 --tree

The package is imported from this tree (put first on PYTHONPATH); megatron-core need not be
installed (the import loads neither torch nor megatron). A first run of each side writes the
bytecode caches (``PYTHONDONTWRITEBYTECODE`` is dropped for the children), as an installed
package has them; it is not measured.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "mcore_cpu_shim"


def importtime(python, module, env):
    """``(cumulative microseconds of module's top line, the -X importtime lines)`` of one
    fresh interpreter importing ``module``."""
    result = subprocess.run(
        [python, "-X", "importtime", "-c", f"import {module}"],
        env=env, capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"import {module} failed:\n{result.stderr[-4000:]}")
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    for line in lines:
        _, cumulative, name = line.split("|")
        if name.rstrip() == f" {module}":  # the top line: not indented, not the header
            return int(cumulative), lines
    raise SystemExit(f"no -X importtime line for {module}:\n{result.stderr[-4000:]}")


def subtree(lines, module):
    """The -X importtime lines of ``module``'s import: its own line and those above it that
    it imported (printed before it, indented)."""
    end = next(i for i, line in enumerate(lines) if line.split("|")[2].rstrip() == f" {module}")
    start = end
    while start > 0 and lines[start - 1].split("|")[2].startswith("   "):
        start -= 1
    return lines[start : end + 1]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30, help="fresh interpreters per side (default 30)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    parser.add_argument("--reference", default="json", help="the reference import (default json)")
    parser.add_argument("--tree", action="store_true",
                        help="also print the package's import tree in its median run")
    args = parser.parse_args(argv)

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    sides = (PACKAGE, args.reference)
    for module in sides:  # warm-up: bytecode caches written, files in the page cache
        importtime(args.python, module, env)

    runs = {module: [] for module in sides}
    for rep in range(args.runs):
        for module in sides if rep % 2 == 0 else sides[::-1]:
            runs[module].append(importtime(args.python, module, env))

    def ms(values):
        return {"median": statistics.median(values) / 1000, "min": min(values) / 1000}

    shim = ms([us for us, _ in runs[PACKAGE]])
    reference = ms([us for us, _ in runs[args.reference]])
    version = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"],
                             capture_output=True, text=True).stdout.strip()
    report = {
        "python": f"{version} ({args.python})",
        "runs": args.runs,
        "import_ms": {PACKAGE: shim, args.reference: reference},
        "ratio": {"median": shim["median"] / reference["median"], "min": shim["min"] / reference["min"]},
        "target_ms": 15,
    }
    print(f"python {report['python']}, {args.runs} fresh interpreters per side, alternating")
    print(f"import {PACKAGE}: median {shim['median']:.2f} ms, min {shim['min']:.2f} ms "
          f"(cumulative, -X importtime; target <= 15 ms)")
    print(f"import {args.reference} (reference): median {reference['median']:.2f} ms, "
          f"min {reference['min']:.2f} ms")
    print(f"ratio {PACKAGE}/{args.reference}: median {report['ratio']['median']:.2f}, "
          f"min {report['ratio']['min']:.2f}")
    if args.tree:
        ordered = sorted(runs[PACKAGE], key=lambda run: run[0])
        print("the package's import tree in its median run (microseconds):")
        for line in subtree(ordered[len(ordered) // 2][1], PACKAGE):
            print("  " + line.removeprefix("import time:"))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
