"""bridge_yarn_config: a Bridge checkpoint of a YaRN model keeps its YaRN settings, and the
provider rebuilt from it (what export and any reload use) has them back."""

import os

import pytest
from helpers import expected_state, hf_model, needs_bridge, run_bridge

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_yarn_config"
IMPORT = """
import sys
import mcore_cpu_shim
from megatron.bridge import AutoBridge
AutoBridge.import_ckpt(sys.argv[1], sys.argv[2])
print("{}")
"""
RELOAD = """
import json, sys
import mcore_cpu_shim
from megatron.bridge.training.model_load_save import load_model_config
provider, _ = load_model_config(sys.argv[1])
names = ("yarn_rotary_scaling_factor", "yarn_original_max_position_embeddings", "yarn_beta_fast", "yarn_beta_slow")
print(json.dumps({"yarn": {n: getattr(provider, n, "missing") for n in names},
                  "state": mcore_cpu_shim.status()["%s"]["state"]}))
""" % FIX


def test_yarn_settings_survive_the_checkpoint(tmp_path):
    run_bridge(IMPORT, hf_model("gpt-oss"), str(tmp_path / "megatron"))
    (iteration,) = [d for d in os.listdir(tmp_path / "megatron") if d.startswith("iter_")]
    report = run_bridge(RELOAD, str(tmp_path / "megatron" / iteration))
    assert report["yarn"] == {"yarn_rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
                              "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
    assert report["state"] == expected_state(FIX)
