"""bridge_process_group: a Bridge provider that sets up its own process group (no group exists
yet, as in ``AutoBridge.import_ckpt``) uses Gloo and sets no CUDA device on a CPU-only host."""

import pytest
from helpers import expected_state, hf_model, needs_bridge, run_bridge, run_without_fix

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_process_group"
PROVIDE = """
import json, sys
import torch
import mcore_cpu_shim
with mcore_cpu_shim.forbid_cuda() as touched:
    from megatron.bridge import AutoBridge
    provider = AutoBridge.from_hf_pretrained(sys.argv[1]).to_megatron_provider(load_weights=False)
    provider.finalize()
    model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
    backend = torch.distributed.get_backend()
print(json.dumps({"backend": backend, "touched": touched, "state": mcore_cpu_shim.status()["%s"]["state"]}))
""" % FIX


def test_provider_starts_a_gloo_group_without_cuda():
    report = run_bridge(PROVIDE, hf_model("llama"))
    assert report == {"backend": "gloo", "touched": [], "state": expected_state(FIX)}


def test_without_the_fix_the_provider_asks_for_a_device():
    # (the device is asked for before any port is opened)
    stderr = run_without_fix(FIX, PROVIDE.replace("sys.argv[1]", repr(hf_model("llama"))))
    assert "set_device" in stderr or "NVIDIA driver" in stderr or "nccl" in stderr.lower(), stderr[-2000:]
