"""bridge_yarn_config: a Bridge checkpoint of a YaRN model keeps its YaRN settings, and the
provider rebuilt from it (what export and any reload use) has them back."""

import pytest
from helpers import bridge_checkpoint, expected_state, needs_bridge, run_bridge

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_yarn_config"
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
    report = run_bridge(RELOAD, bridge_checkpoint("gpt-oss", tmp_path / "megatron"))
    assert report["yarn"] == {"yarn_rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 4096,
                              "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0}
    assert report["state"] == expected_state(FIX)
