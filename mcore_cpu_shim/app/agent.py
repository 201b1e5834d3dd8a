"""The process torch's elastic agent runs in, for ``launch``: ``python -m <package>.app.agent
FOLDER RANKS COMMAND...``.

``launch_agent`` is what torchrun runs (``torch.distributed.launcher.api``): here one node, a
c10d rendezvous on 127.0.0.1 (a free port of its own), no restarts, every rank's stderr in
``FOLDER/rank<N>.log``. It starts the ranks, sets their ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``, and once one fails or dies it stops the others (SIGTERM,
SIGKILL after ``SHUTDOWN`` seconds) and says which failed first. What became of each rank goes
to ``FOLDER/agent.json`` for the parent (``launch.Ranks.result``). A SIGTERM (the parent's stop)
or the parent's end stops the agent and its ranks the same way.

Nothing is imported from torch at module level (``launch`` imports ``SHUTDOWN``).
"""

import json
import os
import signal
import sys

from .worker import end_with_parent

SHUTDOWN = 5  # seconds the agent gives a stopped rank before it kills it


def agent_main(folder, count, command):
    """Run ``command`` as ``count`` ranks under torch's elastic agent (``launch_agent``, what
    torchrun runs: a c10d rendezvous on loopback, one node, no restarts; when a rank fails or
    dies it stops the others), each rank's output in ``rank<N>.log``; write what became of each
    rank to ``agent.json`` (``Ranks.result``). Ends, and ends the ranks, when the parent is gone
    or sends SIGTERM."""
    import uuid

    from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs, SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, launch_agent

    class RankLogs(LogsSpecs):
        """Rank N's stderr in ``rank<N>.log`` (``worker.main`` puts its stdout there too)."""

        @property
        def root_log_dir(self):
            return folder

        def reify(self, envs):
            logs = {local: os.path.join(folder, f"rank{env['RANK']}.log") for local, env in envs.items()}
            errors = {local: f"{log[:-4]}.error.json" for local, log in logs.items()}  # torch's, if written
            return LogsDest(stdouts=dict.fromkeys(logs, ""), stderrs=logs, error_files=errors)  # "": the agent's

    # The parent gone: SIGTERM, so that the agent's own handler stops the ranks.
    end_with_parent(1.0, end=lambda: os.kill(os.getpid(), signal.SIGTERM))
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=count, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1", max_restarts=0, monitor_interval=0.1,
        shutdown_timeout=SHUTDOWN, logs_specs=RankLogs(),
    )
    result = {"codes": [0] * count, "first": None, "stopped": None}
    try:
        launch_agent(config, command[0], list(command[1:]))
    except ChildFailedError as exc:
        for rank, failure in exc.failures.items():
            result["codes"][rank] = failure.exitcode
        result["first"] = exc.get_first_failure()[0]
    except SignalException as exc:
        result.update(codes=[None] * count, stopped=exc.sigval.name)
    with open(os.path.join(folder, "agent.json.tmp"), "w") as f:
        json.dump(result, f)
    os.replace(os.path.join(folder, "agent.json.tmp"), os.path.join(folder, "agent.json"))
    return 0 if result["first"] is None and result["stopped"] is None else 1


if __name__ == "__main__":
    sys.exit(agent_main(sys.argv[1], int(sys.argv[2]), sys.argv[3:]))
