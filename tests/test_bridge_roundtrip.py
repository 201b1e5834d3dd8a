"""The conversion users run: Hugging Face -> torch_dist -> Hugging Face through Megatron-Bridge's
public API, on this CPU-only host with CUDA hidden, nothing worked around in the calling code.

Both ways Bridge offers: ``AutoBridge.import_ckpt`` / ``export_ckpt``, and the provider path
(``to_megatron_provider`` -> ``provide_distributed_model`` -> ``save_megatron_model``, with the
provider setting up its own process group). Each step runs in its own interpreter (as a user's
conversion does: import and export are two runs) under ``forbid_cuda()``; every HF tensor must
come back bit for bit. Tiny models from ``mcore_cpu_shim.app.hf_models``: a Llama (plain RoPE, dense)
and a GPT-OSS (YaRN, learnable softmax offsets, 4 experts top-2, alltoall dispatcher).
"""

import json
import os

import pytest
from helpers import MODE, free_port, hf_model, needs_bridge, run_bridge, run_python

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FAMILIES = {"llama": 21, "gpt-oss": 37}

IMPORT = """
import json, sys
import mcore_cpu_shim
with mcore_cpu_shim.forbid_cuda() as touched:
    from megatron.bridge import AutoBridge
    hf, out, path = sys.argv[1:4]
    if path == "import_ckpt":
        AutoBridge.import_ckpt(hf, out)
    else:
        bridge = AutoBridge.from_hf_pretrained(hf)
        provider = bridge.to_megatron_provider(load_weights=True)
        provider.finalize()
        model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
        bridge.save_megatron_model(model, out)
print(json.dumps({"touched": touched}))
"""

EXPORT = """
import json, sys
import mcore_cpu_shim
with mcore_cpu_shim.forbid_cuda() as touched:
    from megatron.bridge import AutoBridge
    hf, megatron, out = sys.argv[1:4]
    AutoBridge.from_hf_pretrained(hf).export_ckpt(megatron, out)
import torch
from mcore_cpu_shim.app import hf_models
source, back = hf_models.tensors(hf), hf_models.tensors(out)
equal = [name for name in source if name in back and torch.equal(source[name], back[name])]
print(json.dumps({"touched": touched, "source": len(source), "back": len(back), "equal": len(equal),
                  "differ": sorted(set(source) - set(equal)), "extra": sorted(set(back) - set(source))}))
"""


def run_config(checkpoint):
    import yaml

    (iteration,) = [d for d in os.listdir(checkpoint) if d.startswith("iter_")]
    with open(os.path.join(checkpoint, iteration, "run_config.yaml")) as config:
        return yaml.safe_load(config)["model"]


@pytest.mark.parametrize("path", ["import_ckpt", "provider"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_round_trip_is_exact_and_touches_no_cuda(family, path, tmp_path):
    if path == "provider" and MODE == "shim":
        # In shim mode test_demo.py's runs take this path (convert's import: the provider,
        # provide_distributed_model, save_megatron_model) for every family, with logits.
        pytest.skip("shim mode: the provider path is test_demo.py::test_bridge_family's (CI time)")
    hf = hf_model(family)
    megatron, back = str(tmp_path / "megatron"), str(tmp_path / "hf")
    imported = run_bridge(IMPORT, hf, megatron, path)
    assert imported["touched"] == []
    exported = run_bridge(EXPORT, hf, megatron, back)
    assert exported["touched"] == []
    assert exported["source"] == FAMILIES[family]
    assert (exported["equal"], exported["differ"], exported["extra"]) == (FAMILIES[family], [], [])

    # What a GPU user loads later: the model as Bridge configures it with TE on a GPU, none of
    # the CPU run's substitutions (those are the shim's; patched Bridge records the same).
    model = run_config(megatron)
    assert model["transformer_layer_spec"]["_target_"].endswith("gpt_provider.default_layer_spec")
    if family == "llama":
        assert (model["persist_layer_norm"], model["apply_rope_fusion"]) == (True, True)
    else:
        assert (model["moe_grouped_gemm"], model["moe_permute_fusion"]) == (True, True)
        assert model["position_embedding_type"] == "yarn"
        assert (model["yarn_rotary_scaling_factor"], model["yarn_original_max_position_embeddings"]) == (32.0, 4096)


@pytest.mark.skipif(MODE != "shim", reason="shows the unfixed failure: shim mode only")
def test_without_the_bridge_fixes_the_import_fails(tmp_path):
    """The Bridge fixes are what makes the conversion run: with them off, Bridge stops at its
    first CUDA/TE assumption (the megatron-core fixes stay on)."""
    from mcore_cpu_shim.fixes import BRIDGE_FIXES

    off = ",".join(fix.name for fix in BRIDGE_FIXES)
    result = run_python(IMPORT, args=(hf_model("llama"), str(tmp_path / "m"), "import_ckpt"),
                        MCORE_CPU_SHIM_DISABLE=off, MASTER_PORT=free_port())
    assert result.returncode != 0
    assert "transformer_engine" in result.stderr
