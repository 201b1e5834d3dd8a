"""bridge_rng_state: the RNG part of a Bridge checkpoint is collected without CUDA."""

import pytest
from helpers import expected_state, needs_bridge, run_bridge, run_without_fix

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_rng_state"
COLLECT = """
import json, sys, tempfile
import mcore_cpu_shim
from helpers import init_gloo
from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.bridge.training.checkpointing import get_rng_state
init_gloo(tempfile.mkdtemp())
tensor_parallel.model_parallel_cuda_manual_seed(1)
with mcore_cpu_shim.forbid_cuda() as touched:
    state = get_rng_state(False, "torch_dist", pg_collection=ProcessGroupCollection.use_mpu_process_groups())
(entry,) = state.data
print(json.dumps({"touched": touched, "cuda": entry["cuda_rng_state"] is None,
                  "keys": sorted(entry), "trackers": sorted(entry["rng_tracker_states"]),
                  "state": mcore_cpu_shim.status()["%s"]["state"]}))
""" % FIX


def test_rng_state_without_cuda():
    report = run_bridge(COLLECT)
    assert report["touched"] == [] and report["cuda"] is True, report
    assert {"random_rng_state", "np_rng_state", "torch_rng_state", "rng_tracker_states"} <= set(report["keys"])
    assert len(report["trackers"]) == 3
    assert report["state"] == expected_state(FIX)


def test_without_the_fix_collecting_needs_cuda():
    stderr = run_without_fix(FIX, COLLECT.replace("with mcore_cpu_shim.forbid_cuda() as touched:", "if True:\n    touched = []"))
    assert "get_rng_state" in stderr or "NVIDIA driver" in stderr or "not compiled with CUDA" in stderr, stderr[-2000:]
