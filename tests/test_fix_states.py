"""Each megatron-core fix's state in this mode, target by target, once its target modules are
imported: one parametrized test instead of a copy in every fix's test file.

In the patched mode every target reads ``disabled``; with the shim (the shim and drift modes)
each reads ``expected_state`` (applied, or upstream-fixed where this tree's source shows the
fix in), except where a release has no such code: ``RELEASE_SPECIFIC`` lists those, each with
why, as read from the releases (independent of the engine's own decision, which
test_engine.py compares with ``tools/coverage.py``'s)."""

import pytest
from helpers import MCORE_VERSION, MODE, expected_state, import_every_target

NA = "not-applicable"


def _rope_forward(v):  # 0.13-0.15 compute the frequencies in forward, 0.16 on in get_emb
    return v < (0, 16)


# fix -> {target's qualname: function of the release (major, minor) -> the state where the
# release has no such code, else None (expected_state)}
RELEASE_SPECIFIC = {
    "dcp_collective_device": {
        # 0.13 has no failure-flag broadcast in the async finalize
        "save_state_dict_async_finalize": lambda v: NA if v < (0, 14) else None,
    },
    "attention_buffers_device": {
        # the sliding-window mask came with 0.15
        "get_sliding_window_causal_mask": lambda v: NA if v < (0, 15) else None,
    },
    "softmax_offsets_device": {
        # 0.13/0.14 have no offsets; 0.15 allocates them without naming a device
        "DotProductAttention.__init__": lambda v: NA if v < (0, 16) else None,
    },
    "local_moe_norm_keys": {
        # from 0.17 on the keys map in get_gpt_layer_local_submodules, which
        # get_gpt_layer_local_spec only wraps; before, get_gpt_layer_local_submodules is not there
        "get_gpt_layer_local_spec": lambda v: NA if v >= (0, 17) else None,
        "get_gpt_layer_local_submodules": lambda v: NA if v < (0, 17) else None,
    },
    "rope_device": {
        "RotaryEmbedding.forward": lambda v: None if _rope_forward(v) else NA,
        "RotaryEmbedding.get_emb": lambda v: NA if _rope_forward(v) else None,
    },
    "yarn_rope_device": {
        # 0.15 on build the constructor's tensors without CUDA themselves
        "YarnRotaryEmbedding.__init__": lambda v: None if v < (0, 15) else "upstream-fixed",
        "YarnRotaryEmbedding.forward": lambda v: None if _rope_forward(v) else NA,
        "YarnRotaryEmbedding.get_emb": lambda v: NA if _rope_forward(v) else None,
    },
    "dcp_results_queue": {
        # 0.13/0.14 run a sync save in a forked process (no execute_sync); strategies.base is
        # gone in 0.19; TorchDistSaveShardedStrategy has its own save from 0.17 on, when the
        # getter lost its underscore
        "AsyncSaveShardedStrategy.save": lambda v: None if (0, 15) <= v < (0, 19) else NA,
        "TorchDistSaveShardedStrategy.save": lambda v: NA if v < (0, 17) else None,
        "_get_write_results_queue": lambda v: NA if v >= (0, 17) else None,
        "get_write_results_queue": lambda v: NA if v < (0, 17) else None,
    },
}
FIXES = (
    "dcp_collective_device",
    "yarn_rope_device",
    "softmax_offsets_device",
    "moe_dispatcher_device",
    "local_moe_norm_keys",
    "attention_buffers_device",
    "moe_forward_device",
    "rope_device",
    "router_buffers_device",
    "mla_cpu_build",
    "dcp_results_queue",
    "swiglu_load_copy",
)


def expected_target_state(fix, target):
    if MODE == "patched":
        return expected_state(fix, target)  # disabled, whatever the release has
    rule = RELEASE_SPECIFIC.get(fix, {}).get(target.split(":")[1])
    state = rule(MCORE_VERSION) if rule else None
    return state or expected_state(fix, target)


@pytest.mark.cuda_hidden
@pytest.mark.parametrize("fix", FIXES)
def test_fix_state_matches_mode(fix):
    import mcore_cpu_shim

    import_every_target(mcore_cpu_shim, fix)
    status = mcore_cpu_shim.status()[fix]
    states = {target: s["state"] for target, s in status["targets"].items()}
    assert states == {target: expected_target_state(fix, target) for target in states}, status
    every_na = all(state == NA for state in states.values())
    assert status["state"] == (NA if every_na and MODE != "patched" else expected_state(fix)), status
