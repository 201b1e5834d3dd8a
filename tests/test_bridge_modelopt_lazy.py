"""bridge_modelopt_lazy: a conversion through Megatron-Bridge's save and load does not import
NVIDIA ModelOpt, and gives back the source's tensors exactly; where a model or a state dict has
ModelOpt state, the real ModelOpt still saves and restores it (real ModelOpt, a quantized
``nn.Linear``: ModelOpt's Megatron plugin cannot save a converted Megatron model without CUDA).

Bridge main imports ModelOpt in its own ``__init__``: there ModelOpt is loaded before any fix
runs, and the tests check only that everything still works (the source says which Bridge it is).
"""

import pytest
from helpers import expected_state, hf_model, megatron_source, needs_bridge, run_bridge

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_modelopt_lazy"
LOADED = "import sys\nloaded = lambda: 'modelopt' in sys.modules\n"

# convert's import (its save), then its export (load_megatron_model, save_hf_pretrained)
SAVE = LOADED + """
import json
import mcore_cpu_shim
from megatron.bridge import AutoBridge
hf, megatron = sys.argv[1:3]
at_start = loaded()
bridge = AutoBridge.from_hf_pretrained(hf)
provider = bridge.to_megatron_provider(load_weights=True)
provider.finalize()
model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
bridge.save_megatron_model(model, megatron, low_memory_save=True)
print(json.dumps({"at start": at_start, "after": loaded()}))
"""
EXPORT = LOADED + """
import json
import mcore_cpu_shim, torch
from megatron.bridge import AutoBridge
from mcore_cpu_shim.app import hf_models
hf, megatron, out = sys.argv[1:4]
at_start = loaded()
AutoBridge.from_hf_pretrained(hf).export_ckpt(megatron, out)
after = loaded()
source, back = hf_models.tensors(hf), hf_models.tensors(out)
print(json.dumps({"state": mcore_cpu_shim.status()["%s"]["state"], "at start": at_start, "after": after, "source": sorted(source), "back": sorted(back),
                  "differ": sorted(k for k in source if k not in back or not torch.equal(source[k], back[k]))}))
""" % FIX

# Bridge's checkpointing module's ModelOpt functions, called as its save and load call them.
STATE = LOADED + """
import json
import torch
import mcore_cpu_shim
import megatron.bridge.training.checkpointing as checkpointing
path, step = sys.argv[1:3]
at_start = loaded()
plain, state_dict = [torch.nn.Sequential(torch.nn.Linear(4, 4))], {}
checkpointing.save_modelopt_state(plain, state_dict)
checkpointing.save_sharded_modelopt_state(plain, path + ".unused", ("torch_dist", 1))
checkpointing.restore_modelopt_state(plain, {"checkpoint_version": 3.0})
facts = {"at start": at_start, "after plain calls": loaded(), "plain state": sorted(state_dict)}
if step == "save":
    import modelopt.torch.quantization as mtq
    quantized = [mtq.quantize(torch.nn.Sequential(torch.nn.Linear(4, 4)), mtq.INT8_DEFAULT_CFG, forward_loop=None)]
    checkpointing.save_modelopt_state(quantized, state_dict)
    torch.save(state_dict, path)
    facts["saved"] = sorted(state_dict)
else:
    state_dict = torch.load(path, weights_only=False)
    facts["after reading"] = loaded()
    fresh = [torch.nn.Sequential(torch.nn.Linear(4, 4))]
    checkpointing.restore_modelopt_state(fresh, state_dict)
    import modelopt.torch.opt as mto
    facts["restored"] = mto.ModeloptStateManager.is_converted(fresh[0])
    facts["layer"] = type(fresh[0][0]).__name__
print(json.dumps(facts))
"""


def bridge_imports_modelopt():
    """Whether this Bridge's ``__init__`` imports ModelOpt itself (main does, first thing)."""
    return "import modelopt" in megatron_source("megatron.bridge")


def test_a_conversion_imports_no_modelopt_and_is_exact(tmp_path):
    hf, megatron = hf_model("llama"), str(tmp_path / "megatron")
    saved = run_bridge(SAVE, hf, megatron)
    exported = run_bridge(EXPORT, hf, megatron, str(tmp_path / "hf"))
    assert exported["state"] == expected_state(FIX)  # the load imports both target modules
    assert exported["source"] and exported["back"] == exported["source"] and exported["differ"] == []
    for facts in (saved, exported):
        assert facts["at start"] is bridge_imports_modelopt()
        if not bridge_imports_modelopt():
            assert facts["after"] is False, facts


def test_modelopt_state_is_still_saved_and_restored(tmp_path):
    path = str(tmp_path / "state.pt")
    saved, restored = run_bridge(STATE, path, "save"), run_bridge(STATE, path, "load")
    assert saved["plain state"] == [] and saved["saved"] == ["modelopt_state"]
    # the quantized layer comes back quantized, from the state dict alone
    assert (restored["restored"], restored["layer"]) == (True, "QuantLinear"), restored
    for facts in (saved, restored):
        assert facts["at start"] is bridge_imports_modelopt()
    if not bridge_imports_modelopt():
        # the calls that have nothing to do import nothing; the restore of real state imports
        # ModelOpt itself
        assert (saved["after plain calls"], restored["after plain calls"], restored["after reading"]) == (False,) * 3
