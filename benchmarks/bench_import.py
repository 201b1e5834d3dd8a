"""Benchmark (not a test): what ``import mcore_cpu_shim`` costs a process, as a ratio to
``import torch``.

Every conversion process (and every rank, and every process ``mcore-cpu-shim run`` starts)
imports the package first, whether or not a fix ever applies, and then torch: the package's
import must stay a small part of that, target <= 5 % of ``import torch``. Measured as Python
measures it, ``python -X importtime``, in one fresh interpreter per run that imports the package
and then torch (the order of a conversion): the cumulative column of each top line. What both
need (e.g. ``dataclasses``) is counted against the package, which comes first. The ratio is the
number to compare across machines.

    python benchmarks/bench_import.py                 # 20 interpreters
    python benchmarks/bench_import.py --runs 50 --tree

The package is imported from this tree (put first on PYTHONPATH); torch must be importable by
the interpreter (megatron-core need not be: the import loads neither torch nor megatron). A
first run writes the bytecode caches (``PYTHONDONTWRITEBYTECODE`` is dropped for the children),
as an installed package has them; it is not measured.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "mcore_cpu_shim"
TARGET = 0.05


def importtime(python, modules, env):
    """``({module: cumulative microseconds of its top line}, the -X importtime lines)`` of one
    fresh interpreter importing ``modules`` in order."""
    result = subprocess.run(
        [python, "-X", "importtime", "-c", "; ".join(f"import {m}" for m in modules)],
        env=env, capture_output=True, text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"import {', '.join(modules)} failed:\n{result.stderr[-4000:]}")
    lines = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    top = {f" {m}": m for m in modules}  # a top line: the name after one space, not indented
    found = {}
    for line in lines:
        _, cumulative, name = line.split("|")
        if name.rstrip() in top:
            found[top[name.rstrip()]] = int(cumulative)
    missing = [m for m in modules if m not in found]
    if missing:
        raise SystemExit(f"no -X importtime line for {missing}:\n{result.stderr[-4000:]}")
    return found, lines


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
    parser.add_argument("--runs", type=int, default=20, help="fresh interpreters (default 20)")
    parser.add_argument("--python", default=sys.executable, help="the interpreter (default: this one)")
    parser.add_argument("--after", default="torch", help="what the process imports next (default torch)")
    parser.add_argument("--tree", action="store_true",
                        help="also print the package's import tree in its median run")
    args = parser.parse_args(argv)

    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH", "")]))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    modules = (PACKAGE, args.after)
    importtime(args.python, modules, env)  # warm-up: bytecode caches written, files in the page cache
    runs = [importtime(args.python, modules, env) for _ in range(args.runs)]

    def ms(module):
        values = [found[module] for found, _ in runs]
        return {"median": statistics.median(values) / 1000, "min": min(values) / 1000}

    shim, after = ms(PACKAGE), ms(args.after)
    ratios = [found[PACKAGE] / found[args.after] for found, _ in runs]
    version = subprocess.run([args.python, "-c", "import sys; print(sys.version.split()[0])"],
                             capture_output=True, text=True).stdout.strip()
    report = {
        "python": f"{version} ({args.python})",
        "runs": args.runs,
        "import_ms": {PACKAGE: shim, args.after: after},
        "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "target_ratio": TARGET,
    }
    print(f"python {report['python']}, {args.runs} fresh interpreters, each: import {PACKAGE}; import {args.after}")
    print(f"import {PACKAGE}: median {shim['median']:.2f} ms, min {shim['min']:.2f} ms (cumulative, -X importtime)")
    print(f"import {args.after}: median {after['median']:.1f} ms, min {after['min']:.1f} ms")
    r = report["ratio"]
    print(f"ratio {PACKAGE}/{args.after} per process: median {100 * r['median']:.2f} %, "
          f"min {100 * r['min']:.2f} %, max {100 * r['max']:.2f} % (target <= {100 * TARGET:.0f} %)")
    if args.tree:
        ordered = sorted(runs, key=lambda run: run[0][PACKAGE])
        print("the package's import tree in its median run (microseconds):")
        for line in subtree(ordered[len(ordered) // 2][1], PACKAGE):
            print("  " + line.removeprefix("import time:"))
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
