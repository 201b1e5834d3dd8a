"""bridge_expert_names: exporting a local (SequentialMLP) expert reads its number from the name."""

import pytest
from helpers import expected_state, needs_bridge, run_bridge, run_without_fix, upstream_fixed

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_expert_names"
TARGET = "megatron.bridge.models.conversion.param_mapping:MegatronParamMapping.gather_from_ep_ranks"
GATHER = """
import json, tempfile, types
import torch
import mcore_cpu_shim
from helpers import init_gloo
from megatron.bridge.models.conversion.param_mapping import DirectMapping
init_gloo(tempfile.mkdtemp())
hf = "model.layers.0.mlp.experts.3.down_proj.weight"
mapping = DirectMapping("decoder.layers.0.mlp.experts.local_experts.3.linear_fc2.weight", hf)
module = types.SimpleNamespace(config=types.SimpleNamespace(num_moe_experts=4))
weight = torch.randn(2, 2)
with mcore_cpu_shim.forbid_cuda() as touched:
    out = mapping.gather_from_ep_ranks(weight, module, hf)
print(json.dumps({"touched": touched, "names": sorted(out), "same": all(torch.equal(v, weight) for v in out.values()),
                  "state": mcore_cpu_shim.status()["%s"]["state"]}))
""" % FIX


def test_local_expert_names_export():
    report = run_bridge(GATHER)
    assert report["names"] == ["model.layers.0.mlp.experts.3.down_proj.weight"] and report["same"], report
    assert report["touched"] == [] and report["state"] == expected_state(FIX)


@pytest.mark.skipif(upstream_fixed(TARGET), reason="this Megatron-Bridge reads SequentialMLP names itself")
def test_without_the_fix_the_export_fails():
    stderr = run_without_fix(FIX, GATHER)
    assert "invalid literal for int()" in stderr, stderr[-2000:]
