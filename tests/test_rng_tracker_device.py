"""rng_tracker_device: megatron's model-parallel RNG set-up and forks on a host without CUDA.

What a converter that lets megatron (or Megatron-Bridge's provider) set up model parallelism
does: ``model_parallel_cuda_manual_seed`` on a real Gloo group, then code forking the tracked
states, with the tracker's own errors intact; no CUDA touched.
"""

import pytest
from helpers import expected_state, init_gloo, run_without_fix

pytestmark = pytest.mark.cuda_hidden

FIX = "rng_tracker_device"
SEED = """
import torch
from helpers import init_gloo
from megatron.core import tensor_parallel
init_gloo({folder!r})
tensor_parallel.model_parallel_cuda_manual_seed(1234)
"""


def test_seeding_and_forking_work_without_cuda(tmp_path, forbid_cuda):
    import torch
    from megatron.core import tensor_parallel

    init_gloo(str(tmp_path))
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    names = set(tracker.get_states())
    assert {"model-parallel-rng", "expert-parallel-rng"} <= names and len(names) == 3, names

    cpu_state = torch.get_rng_state()
    with tracker.fork():
        inside = torch.rand(4)  # CPU draws come from the CPU generator, as outside a fork
    torch.set_rng_state(cpu_state)
    assert torch.equal(inside, torch.rand(4))

    with pytest.raises(Exception, match="seed 1234 already exists"):
        tracker.add("another-name", 1234)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("model-parallel-rng", 99)
    with pytest.raises(Exception, match="not added"):
        with tracker.fork("no-such-state"):
            pass
    assert forbid_cuda == []


def test_state():
    import megatron.core.tensor_parallel.random  # noqa: F401
    import mcore_cpu_shim

    assert mcore_cpu_shim.status()[FIX]["state"] == expected_state(FIX)


def test_without_the_fix_seeding_needs_cuda(tmp_path):
    stderr = run_without_fix(FIX, SEED.format(folder=str(tmp_path)))
    assert "get_rng_state" in stderr or "NVIDIA driver" in stderr or "not compiled with CUDA" in stderr, stderr[-2000:]
