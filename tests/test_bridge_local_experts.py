"""bridge_local_experts: a bridge that maps only TE's grouped experts maps SequentialMLP's too.

The conversion itself is test_demo.py::test_bridge_family[deepseek-v3] (Bridge 0.3.1 maps
DeepSeek's experts only in the grouped form); these check the registry on OLMoE's bridge, which
lists only the grouped form on 0.3.1 and on main.
"""

import pytest
from helpers import expected_state, needs_bridge, run_bridge, run_without_fix

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_local_experts"
LOOKUP = """
import json
import mcore_cpu_shim
from megatron.bridge.models.olmoe.olmoe_bridge import OlMoEBridge

def hf(mapping):
    return None if mapping is None else mapping.hf_param

registry = OlMoEBridge().mapping_registry()
local = "decoder.layers.1.mlp.experts.local_experts.2.linear_fc%s.weight"
grouped = "decoder.layers.1.mlp.experts.linear_fc%s.weight2"
for n in (1, 2):
    assert registry.megatron_to_hf_lookup(local % n) is not None, "no mapping for " + local % n
print(json.dumps({
    "local": [hf(registry.megatron_to_hf_lookup(local % n)) for n in (1, 2)],
    "local_kinds": [type(registry.megatron_to_hf_lookup(local % n)).__name__ for n in (1, 2)],
    "grouped": [hf(registry.megatron_to_hf_lookup(grouped % n)) for n in (1, 2)],
    "names": [m.megatron_param for m in registry.mappings],
    "state": mcore_cpu_shim.status()["bridge_local_experts"]["state"],
}))
"""
EXPERT = "model.layers.1.mlp.experts.2."


def test_local_experts_map_to_the_same_hf_tensors():
    report = run_bridge(LOOKUP)
    fc1 = {"gate": EXPERT + "gate_proj.weight", "up": EXPERT + "up_proj.weight"}
    assert report["grouped"] == [fc1, EXPERT + "down_proj.weight"], report
    assert report["local"] == report["grouped"], report
    assert report["local_kinds"] == ["GatedMLPMapping", "AutoMapping"]
    assert len(report["names"]) == len(set(report["names"])), "a mapping listed twice"
    assert report["state"] == expected_state(FIX)


def test_twins_follow_the_bridge_and_are_not_doubled():
    """The twins come after the bridge's own mappings; a registry that lists both forms (Qwen3-MoE)
    gets nothing; a mapping kind the fix does not know is left alone."""
    report = run_bridge("""
import json
import mcore_cpu_shim
from megatron.bridge.models.conversion.mapping_registry import MegatronMappingRegistry
from megatron.bridge.models.conversion.param_mapping import AutoMapping, DirectMapping
from megatron.bridge.models.qwen.qwen3_moe_bridge import Qwen3MoEBridge

plain = MegatronMappingRegistry(
    AutoMapping("decoder.layers.*.mlp.experts.linear_fc2.weight*", "model.layers.*.mlp.experts.*.down_proj.weight"),
    DirectMapping("mtp.layers.*.mlp.experts.linear_fc2.weight*", "mtp.*.experts.*.down.weight"),
    AutoMapping("output_layer.weight", "lm_head.weight"),
)
print(json.dumps({"plain": [m.megatron_param for m in plain.mappings],
                  "qwen3_moe": [m.megatron_param for m in Qwen3MoEBridge().mapping_registry().mappings]}))
""")
    assert report["plain"] == [
        "decoder.layers.*.mlp.experts.linear_fc2.weight*",
        "mtp.layers.*.mlp.experts.linear_fc2.weight*",
        "output_layer.weight",
        "decoder.layers.*.mlp.experts.local_experts.*.linear_fc2.weight",
    ], report
    qwen = report["qwen3_moe"]
    assert len(qwen) == len(set(qwen)) and sum("local_experts" in name for name in qwen) == 2, qwen


def test_without_the_fix_local_experts_have_no_mapping():
    stderr = run_without_fix(FIX, LOOKUP)
    assert "no mapping for decoder.layers.1.mlp.experts.local_experts.2.linear_fc1.weight" in stderr, stderr[-2000:]
