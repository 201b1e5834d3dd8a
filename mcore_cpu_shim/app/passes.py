"""One pass of ``mcore-cpu-shim demo``: groups of ranks run by the launcher, their phases shown
as the demo's steps.

Both round trips are passes. The megatron-core one is one group of ``--ranks`` ranks
(``demo_worker``), a phase per step; the Megatron-Bridge one is three groups in a row (write the
HF model, convert's import, convert's export plus the comparisons: ``demo_bridge``), where the
import and export steps are made of convert's phases. Each group is started and followed by
``launch`` in a folder of its own, as ``convert`` runs its ranks: the same rank environment, event
format, supervisor and failure report. A step is over once every rank ended its last phase, or
the failure the supervisor reports stopped it; a failed group ends the pass.
"""

import os
import time
from dataclasses import dataclass, field

from . import launch


@dataclass
class Group:
    """One group of ranks: ``python -m <package>.app.<worker>`` on ``spec``, which runs the
    phases of ``steps`` (``step_phases``: step -> its phases), with ``env`` on top of the pass's
    environment."""

    name: str
    worker: str
    spec: dict
    steps: tuple
    step_phases: dict
    env: dict = field(default_factory=dict)


def summarise_step(phases, events):
    """A step whose ``phases`` every rank ended ok: its time (the sum over its phases of the
    slowest rank's), size on disk and what its phases recorded (rank 0's)."""
    seconds, facts = 0.0, {}
    for phase in phases:
        ended = [e for rank_events in events for e in rank_events if e.get("phase") == phase and e.get("ok")]
        seconds += max((e.get("seconds") or 0) for e in ended)
        first = next((e for e in events[0] if e.get("phase") == phase and e.get("ok")), {})
        facts.update({k: v for k, v in first.items() if k not in ("phase", "ok", "seconds", "t")})
    return dict(ok=True, seconds=seconds, size=facts.pop("size", None), facts=facts)


def failed_step(failure, deadline):
    """The step a failure (``launch.supervise``'s) stopped, as the demo shows it."""
    error = (failure.get("error") or "").strip().splitlines()
    text = error[0] if error else "failed"
    if failure.get("error") == "stopped before it finished" and time.monotonic() > deadline:
        text = "stopped: still running when the pass's --timeout ran out (see rank*.log with --keep)"
    facts = {k: v for k, v in failure.items()
             if k not in ("phase", "ok", "seconds", "t", "error", "where", "traceback", "input", "mismatch", "rank")}
    return dict(ok=False, error=text, where=failure.get("where") or "", seconds=failure.get("seconds"),
                size=None, traceback=failure.get("traceback"), rank=failure.get("rank"),
                phase=failure.get("phase"), facts=facts)


class StepProgress:
    """The supervisor's progress object: says a step is over once its last phase is."""

    def __init__(self, label, folder, group, progress):
        self.label, self.folder, self.group, self.progress = label, folder, group, progress
        self.owner = {phase: step for step, phases in group.step_phases.items() for phase in phases}
        self.shown = set()

    def running(self, name, seconds):
        pass

    def done(self, name, summary):
        step = self.owner[name]
        phases = self.group.step_phases[step]
        if summary["ok"] and name == phases[-1] and step not in self.shown:
            self.shown.add(step)
            events = launch.rank_events(self.folder, self.group.spec["ranks"])
            self.progress(self.label, step, summarise_step(phases, events))


def run_pass(groups, all_steps, label, folder, extra_env, progress, timeout):
    """Run ``groups`` in turn in ``folder``, the pass's environment ``extra_env`` on top of
    this process's; ``progress(label, step, summary)`` as each step ends. Returns
    ``{"steps": {step: summary}, "ranks": [last record of every rank, None where a rank wrote
    none], "exit_codes": [...]}``; steps not reached have ``ok`` None."""
    os.makedirs(folder, exist_ok=True)
    deadline = time.monotonic() + timeout
    steps, ranks, codes = {}, [], []
    for group in groups:
        if any(s["ok"] is False for s in steps.values()):
            break
        sub = os.path.join(folder, group.name)
        os.makedirs(sub)
        env = dict(os.environ, **extra_env, **group.env)
        started = launch.start_ranks(group.spec, sub, group.worker, env=env)
        watcher = StepProgress(label, sub, group, progress)
        phases = tuple(p for step in group.steps for p in group.step_phases[step])
        outcome = launch.supervise(started, phases, watcher, deadline=deadline)
        for step in group.steps:
            if step in watcher.shown:
                steps[step] = summarise_step(group.step_phases[step], outcome["events"])
                continue
            # The first step not over is the one the failure stopped (the supervisor reports
            # one for ranks that ended without finishing their phases too).
            steps[step] = failed_step(outcome["failure"] or {"error": "the ranks ended without finishing it"},
                                      deadline)
            progress(label, step, steps[step])
            break
        ranks += outcome["ranks"]
        codes += outcome["codes"]
    for step in all_steps:
        steps.setdefault(step, dict(ok=None))  # not reached
    return {"steps": steps, "ranks": ranks, "exit_codes": codes}
