"""``mcore-cpu-shim doctor``: what this host and this megatron-core look like to the shim.

It imports what a conversion imports (torch, every module a fix targets, Transformer Engine),
then reports: torch and its build, whether CUDA is usable and whether those imports
initialised it, which CUDA driver and toolkit libraries they mapped into the process, the
megatron-core version (from megatron.core.package_info, so also for a source tree without
package metadata), Megatron-Bridge where it is installed (version, whether ``import
megatron.bridge`` works, with the real error if not), Transformer Engine (installed version, whether megatron-core's TE imports
work, whether it is usable, what the import guard decided), and each fix's state per target.

Exit status 1 when megatron-core or Megatron-Bridge has a CUDA assumption that no fix covers (a
fix ``unsupported``) or fails to import, or when CUDA is not usable and Transformer Engine is
neither absent nor treated as absent (the guard off, or TE imported before the guard) while
megatron-core would use it or die importing it; 0 otherwise.

Transformer Engine's status is ``absent`` (not installed), ``treated as absent`` (the guard,
``MCORE_CPU_SHIM_TE=auto``, on a process without usable CUDA: installed, tried, made absent),
``blocked`` (``MCORE_CPU_SHIM_TE=block``), ``usable`` (importable and CUDA usable) or
``unusable``. The doctor tries exactly megatron-core's imports: ``transformer_engine`` alone
imports even where its PyTorch part does not (TE's own ``__init__`` swallows that failure).
"""

import importlib
import importlib.util
import json
import os
import sys

from ..tripwire import CUDA_LIBRARIES, DRIVER_LIBRARIES, mapped_libraries


def add_parser(subparsers):
    parser = subparsers.add_parser(
        "doctor",
        help="report torch, CUDA, megatron-core, Megatron-Bridge, Transformer Engine and every fix's state",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.set_defaults(func=run_doctor)


def megatron_core_found():
    """Whether ``megatron.core`` can be imported here: an installed release, or a source tree
    on the path (a git checkout or submodule, as Megatron-Bridge has it), which has no package
    metadata. Looks without importing megatron.core itself (its parent package ``megatron``
    is imported, as any import of megatron.core would)."""
    if sys.modules.get("megatron.core") is not None:
        return True
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except Exception:  # no "megatron" package at all, or one that fails to import
        return False


def _megatron_bridge(engine, report):
    """Megatron-Bridge, if installed: its version and whether ``import megatron.bridge`` works
    here (the shim active, as in a conversion); a failing import is a problem."""
    from ..engine import bridge_version, module_file

    if module_file("megatron.bridge") is None:
        return {"version": None}
    bridge = {"version": bridge_version(), "path": os.path.dirname(module_file("megatron.bridge"))}
    try:
        importlib.import_module("megatron.bridge")
    except Exception as exc:
        bridge.update(importable=False, error=f"{type(exc).__name__}: {exc}")
        report["problems"].append(
            f"Megatron-Bridge {bridge['version']} is installed but does not import: {bridge['error']}. "
            f"On a CPU-only host it needs the pure-Python packages of `pip install 'mcore-cpu-shim[bridge]'`"
        )
    else:
        bridge["importable"] = True
    return bridge


def _import_targets(package, report):
    """Import every module a fix targets, as a conversion would; record the failures."""
    bridge = report.get("megatron_bridge", {}).get("importable")
    for fix in package.status().values():
        for target in fix["targets"]:
            module = target.split(":")[0]
            if module.startswith("megatron.bridge") and not bridge:
                continue  # not installed, or its own import failed (reported once, below)
            try:
                importlib.import_module(module)
            except ImportError:
                pass  # stays "pending": this release has no such module
            except Exception as exc:  # megatron-core itself fails to import
                report["problems"].append(f"importing {module} failed: {type(exc).__name__}: {exc}")


def _transformer_engine(te_guard, report):
    """Transformer Engine as megatron-core meets it here: installed (which distributions, which
    version), importable (``transformer_engine``, ``transformer_engine.pytorch`` and the torch
    extension ``transformer_engine_torch``, megatron-core's imports, tried in its order, with
    the real exception), and usable: importable and CUDA usable. Adds a problem where
    megatron-core would use TE (or die importing it) while CUDA is not usable."""
    from importlib.machinery import PathFinder

    distributions = te_guard.installed_distributions()
    installed = bool(distributions) or any(
        PathFinder.find_spec(name) is not None for name in te_guard.TOP_LEVEL
    )
    te = {"installed": installed, "distributions": distributions,
          "version": distributions.get("transformer-engine"), "importable": None, "error": None,
          "imports": {}, "usable": False, "treated_as_absent": False}
    guard = te_guard.state()
    if not installed:
        return dict(te, status="absent", reason="not installed", guard=guard)
    if guard["mode"] == "block" and not guard["imported_before"]:
        return dict(te, status="blocked", treated_as_absent=True, guard=guard,
                    reason=f"installed{_version(te)}, not tried: {guard['reason']}: treated as absent")
    if guard["mode"] == "auto" and not guard["imported_before"] and guard["reason"] is None:
        try:  # the guard decides at the first lookup (megatron-core's imports may have made it)
            import transformer_engine  # noqa: F401
        except Exception:  # absent (the guard decided), or CUDA usable: tried again below
            pass
        guard = te_guard.state()
    cuda = te_guard.cuda_usable()
    if guard["reason"] is not None and guard["te"] is not None:  # the guard tried it and decided
        te.update({k: guard["te"][k] for k in ("importable", "error", "imports")})
        te["version"] = guard["te"]["version"] or te["version"]
        te["treated_as_absent"] = True
        status = "treated as absent"
    else:  # no guard, a guard that stands aside, or usable CUDA: megatron-core gets what this gets
        te.update(te_guard.summarise_imports(te_guard.try_imports()))
        te["version"] = te_guard.installed_version() or te["version"]
        te["usable"] = te["importable"] and cuda
        status = "usable" if te["usable"] else "unusable"
    parts = [f"installed{_version(te)}"]
    parts.append("importable" if te["importable"] else f"not importable ({te['error']})")
    if te["usable"]:
        parts.append("usable (CUDA usable)")
    else:
        parts.append("not usable (no CUDA)" if not cuda else "not usable")
    if te["treated_as_absent"]:
        parts[-1] += ": treated as absent"
    reason = ", ".join(parts)
    if not cuda and not te["treated_as_absent"]:
        first_failure = next((e for e in te["imports"].values() if e != "ok"), "")
        if guard["imported_before"]:
            why = (f"it was imported before mcore_cpu_shim ({', '.join(guard['imported_before'][:3])}), "
                   f"so the import guard cannot make it absent; {te_guard.FIX_ADVICE}")
        else:
            why = f"the import guard is off ({te_guard.ENV_TE}={guard['mode']}); unset it or set it to auto"
        if te["importable"]:
            reason += ": megatron-core will use it"
            report["problems"].append(
                f"Transformer Engine{_version(te)} imports and megatron-core will use it (HAVE_TE, TE "
                f"norms, GEMMs, optimizers), but CUDA is not usable: its modules fail on the CPU. "
                f"Cause: {why}."
            )
        elif not first_failure.startswith("ModuleNotFoundError"):
            report["problems"].append(
                f"Transformer Engine{_version(te)} fails to import ({te['error']}), an error "
                f"megatron-core does not catch, and CUDA is not usable. Cause: {why}."
            )
    return dict(te, status=status, reason=reason, guard=guard)


def _version(te):
    return f" ({te['version']})" if te["version"] else " (version unknown)"


def collect():
    """The report as a dict (what ``--json`` prints)."""
    from .. import engine, te_guard

    package = importlib.import_module(engine.PACKAGE)

    report = {
        "shim": {"version": package.__version__, "package": engine.PACKAGE,
                 "path": os.path.dirname(package.__file__)},
        "python": sys.version.split()[0],
        "problems": [],
    }
    try:
        import torch
    except Exception as exc:
        report["torch"] = {"version": None, "error": f"{type(exc).__name__}: {exc}"}
        torch = None
    else:
        build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
        if getattr(torch.version, "hip", None):
            build = f"ROCm {torch.version.hip}"
        report["torch"] = {"version": torch.__version__, "build": build}

    installed = megatron_core_found()
    report["megatron_bridge"] = _megatron_bridge(engine, report) if installed and torch is not None else {"version": None}
    if installed and torch is not None:
        _import_targets(package, report)
    report["megatron_core"] = {"version": engine.mcore_version() if installed else None}
    if installed:
        core = sys.modules.get("megatron.core")
        report["megatron_core"]["path"] = os.path.dirname(core.__file__) if core else None
    report["transformer_engine"] = _transformer_engine(te_guard, report)

    # Read before this report asks torch about devices: what the imports above mapped.
    libraries = mapped_libraries()
    if libraries is not None:
        report["driver_libraries"] = [n for n in libraries if n.startswith(DRIVER_LIBRARIES)]
        report["cuda_libraries"] = [n for n in libraries if n.startswith(CUDA_LIBRARIES)]
    if torch is not None:
        report["cuda"] = {
            "initialised": torch.cuda.is_initialized(),
            "usable": torch.cuda.is_available(),
            "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES"),
        }

    report["fixes"] = package.status()
    for name, fix in report["fixes"].items():
        for target, state in fix["targets"].items():
            if state["state"] == engine.UNSUPPORTED:
                report["problems"].append(
                    f"{name}: {target} still assumes CUDA and no fix covers it ({state['detail']})"
                )
    return report


def _yes(value):
    return "yes" if value else "no"


def render(report):
    lines = [f"mcore-cpu-shim {report['shim']['version']} ({report['shim']['package']} at {report['shim']['path']})"]
    torch = report["torch"]
    rows = [("python", report["python"])]
    if torch["version"] is None:
        rows.append(("torch", f"not importable: {torch['error']}"))
    else:
        rows.append(("torch", f"{torch['version']} ({torch['build']} build)"))
    if "cuda" in report:
        cuda = report["cuda"]
        visible = cuda["CUDA_VISIBLE_DEVICES"]
        rows.append(("CUDA usable", _yes(cuda["usable"]) + ("" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})")))
        rows.append(("CUDA initialised", _yes(cuda["initialised"]) + " (after importing torch, megatron-core and TE)"))
    if "driver_libraries" in report:
        rows.append(("driver libraries", ", ".join(report["driver_libraries"]) or "none mapped"))
        rows.append(("CUDA libraries", ", ".join(report["cuda_libraries"]) or "none mapped"))
    mcore = report["megatron_core"]
    rows.append(("megatron-core", f"{mcore['version']} ({mcore.get('path')})" if mcore["version"] else "not installed"))
    bridge = report.get("megatron_bridge", {"version": None})
    if bridge["version"] is None:
        rows.append(("Megatron-Bridge", "not installed"))
    else:
        works = "imports" if bridge["importable"] else f"does not import: {bridge['error']}"
        rows.append(("Megatron-Bridge", f"{bridge['version']} ({bridge['path']}), {works}"))
    te = report["transformer_engine"]
    rows.append(("Transformer Engine", te["reason"]))
    guard = te["guard"]
    rows.append(("TE import guard", f"MCORE_CPU_SHIM_TE={guard['mode']}" + (f" ({guard['owner']})" if guard["owner"] else "")))
    width = max(len(name) for name, _ in rows)
    lines += [f"{name:<{width}}  {value}" for name, value in rows]
    lines.append("fixes:")
    for name, fix in report["fixes"].items():
        lines.append(f"  {name}: {fix['state']}")
        for target, state in fix["targets"].items():
            lines.append(f"    {state['state']:<15} {target}: {state['detail']}")
    if report["problems"]:
        lines.append("problems:")
        lines += [f"  {problem}" for problem in report["problems"]]
    else:
        lines.append("no problems found")
    return "\n".join(lines)


def run_doctor(args):
    if args.json:
        # Only the report on stdout: what the imports print or log there (Megatron-Bridge main
        # sets up logging to stdout) goes to stderr.
        import contextlib

        with contextlib.redirect_stdout(sys.stderr):
            report = collect()
        print(json.dumps(report, indent=2))
    else:
        report = collect()
        print(render(report))
    return 1 if report["problems"] else 0
