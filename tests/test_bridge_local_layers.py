"""bridge_local_layers: without a usable Transformer Engine a Bridge provider builds local layers
with the TE-only fusions off, and the checkpoint still describes the TE model a GPU builds."""

import pytest
from helpers import bridge_checkpoint, expected_state, hf_model, needs_bridge, run_bridge, run_without_fix

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_local_layers"
FINALIZE = """
import json, sys
import mcore_cpu_shim
with mcore_cpu_shim.forbid_cuda() as touched:
    from megatron.bridge import AutoBridge
    provider = AutoBridge.from_hf_pretrained(sys.argv[1]).to_megatron_provider(load_weights=False)
    flags = ("persist_layer_norm", "apply_rope_fusion", "moe_grouped_gemm", "moe_permute_fusion")
    before = {f: getattr(provider, f) for f in flags}
    provider.finalize()
    spec = provider.transformer_layer_spec(provider)
qkv = spec.submodules.self_attention.submodules.linear_qkv
from helpers import import_every_target
import_every_target(mcore_cpu_shim)  # the fix's other targets: settled, as in a conversion
print(json.dumps({"touched": touched, "before": before, "after": {f: getattr(provider, f) for f in flags},
                  "qkv": getattr(qkv, "__name__", str(qkv)), "state": mcore_cpu_shim.status()["%s"]["state"]}))
""" % FIX

# The GPU side, faked: CUDA "available" and a (stand-in) transformer_engine importable, decided
# after the imports (nothing CUDA runs). The provider rebuilt from the checkpoint must keep the
# fusions and ask for the TE layer spec, as a GPU conversion's checkpoint would.
GPU_SIDE = """
import importlib, json, sys
import torch
import mcore_cpu_shim
from megatron.bridge.models import gpt_provider
from megatron.bridge.training.model_load_save import load_model_config
torch.cuda.is_available = lambda: True
sys.path.insert(0, sys.argv[2])  # a transformer_engine to find from now on
importlib.invalidate_caches()
asked = []
gpt_provider.get_gpt_layer_with_transformer_engine_spec = lambda *a, **k: asked.append(k) or "TE spec"
provider, _ = load_model_config(sys.argv[1])
flags = {f: getattr(provider, f) for f in ("persist_layer_norm", "apply_rope_fusion")}
print(json.dumps({"spec": provider.transformer_layer_spec(provider), "flags": flags, "asked": len(asked)}))
"""



@pytest.mark.parametrize("family, switched", [("llama", ("persist_layer_norm", "apply_rope_fusion")),
                                              ("gpt-oss", ("moe_grouped_gemm", "moe_permute_fusion"))])
def test_cpu_provider_builds_local_layers(family, switched):
    report = run_bridge(FINALIZE, hf_model(family))
    assert report["touched"] == [], report
    assert all(report["before"][flag] for flag in switched), report  # the bridge's GPU settings
    assert not any(report["after"].values()), report
    assert report["qkv"] == "ColumnParallelLinear", report  # megatron-core's own, not TE's
    assert report["state"] == expected_state(FIX)


# DeepSeek-V3's bridge also sets two flags that need CUDA itself (not TE): the shared expert on a
# CUDA side stream, and the weight-gradient accumulation of APEX's/TE's CUDA extension.
CUDA_ONLY = ("moe_shared_expert_overlap", "gradient_accumulation_fusion")
CUDA_ONLY_FINALIZE = """
import json, sys
import mcore_cpu_shim
with mcore_cpu_shim.forbid_cuda() as touched:
    from megatron.bridge import AutoBridge
    from megatron.bridge.training.utils.config_utils import _ConfigContainerBase
    provider = AutoBridge.from_hf_pretrained(sys.argv[1]).to_megatron_provider(load_weights=False)
    flags = %r
    before = {f: getattr(provider, f) for f in flags}
    provider.finalize()
    after = {f: getattr(provider, f) for f in flags}
    written = _ConfigContainerBase._convert_value_to_dict(provider)
print(json.dumps({"touched": touched, "before": before, "after": after,
                  "written": {f: written[f] for f in flags}}))
""" % (CUDA_ONLY,)


def test_cuda_only_flags_off_where_cuda_is_unavailable():
    """DeepSeek-V3: built with both flags off on this host; run_config.yaml keeps them on."""
    report = run_bridge(CUDA_ONLY_FINALIZE, hf_model("deepseek-v3"))
    on, off = dict.fromkeys(CUDA_ONLY, True), dict.fromkeys(CUDA_ONLY, False)
    assert report == {"touched": [], "before": on, "after": off, "written": on}


def test_checkpoint_rebuilds_the_te_model_on_a_gpu(tmp_path):
    checkpoint = bridge_checkpoint("llama", tmp_path / "megatron")
    fake_te = tmp_path / "te"
    (fake_te / "transformer_engine").mkdir(parents=True)
    (fake_te / "transformer_engine" / "__init__.py").write_text("")
    report = run_bridge(GPU_SIDE, checkpoint, str(fake_te), MCORE_CPU_SHIM_TE="off")
    assert report == {"spec": "TE spec", "flags": {"persist_layer_norm": True, "apply_rope_fusion": True},
                      "asked": 1}


def test_without_the_fix_finalize_rejects_the_fusions():
    stderr = run_without_fix(FIX, FINALIZE.replace("sys.argv[1]", repr(hf_model("llama"))))
    assert "apply_rope_fusion is not available" in stderr or "persist_layer_norm" in stderr, stderr[-2000:]
