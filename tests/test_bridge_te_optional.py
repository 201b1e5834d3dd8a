"""bridge_te_optional: Megatron-Bridge imports without a usable Transformer Engine, and its TE-only
PEFT adapters say clearly why they cannot be built."""

import pytest
from helpers import expected_state, needs_bridge, run_bridge, run_without_fix

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_te_optional"
IMPORT = """
import importlib.util, json
import torch
import mcore_cpu_shim
with mcore_cpu_shim.forbid_cuda() as touched:
    import megatron.bridge
    from megatron.bridge.peft import lora_layers
from helpers import import_every_target
import_every_target(mcore_cpu_shim)  # (peft.lora too: 0.3.1 imports TE there as well)
report = {"touched": touched, "te_found": importlib.util.find_spec("transformer_engine") is not None,
          "is_te_linear": isinstance(torch.nn.Linear(2, 2), lora_layers.te.Linear),
          "state": {n: f["state"] for n, f in mcore_cpu_shim.status().items()}}
for name, build in (("te.Linear", lambda: lora_layers.te.Linear(2, 2)),
                    ("TELinearAdapter", lambda: lora_layers.TELinearAdapter(torch.nn.Linear(2, 2), dim=2))):
    if name == "TELinearAdapter" and not hasattr(lora_layers, name):
        continue  # (Megatron-Bridge main has no such adapter)
    try:
        build()
    except ImportError as exc:
        report[name] = str(exc)
print(json.dumps(report))
"""


def test_bridge_imports_and_te_adapters_fail_clearly():
    report = run_bridge(IMPORT)
    assert report["touched"] == [] and not report["te_found"], report
    assert report["is_te_linear"] is False
    assert "Transformer Engine" in report.get("te.Linear", ""), report
    assert "Transformer Engine" in report.get("TELinearAdapter", "Transformer Engine"), report
    assert report["state"][FIX] == expected_state(FIX)


def test_without_the_fix_bridge_does_not_import():
    stderr = run_without_fix(FIX, "import mcore_cpu_shim\nimport megatron.bridge")
    assert "No module named 'transformer_engine'" in stderr, stderr[-2000:]
