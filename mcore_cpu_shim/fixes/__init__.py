"""One module per fix; each defines FIX. The order here is the order of patches/series."""

from . import (
    attention_buffers_device,
    dcp_collective_device,
    dcp_results_queue,
    gdp_probe_device,
    local_moe_norm_keys,
    moe_dispatcher_device,
    mla_cpu_build,
    moe_forward_device,
    rng_tracker_device,
    rope_device,
    router_buffers_device,
    softmax_offsets_device,
    swiglu_load_copy,
    yarn_rope_device,
)

FIXES = (
    dcp_collective_device.FIX,
    yarn_rope_device.FIX,
    softmax_offsets_device.FIX,
    moe_dispatcher_device.FIX,
    local_moe_norm_keys.FIX,
    attention_buffers_device.FIX,
    moe_forward_device.FIX,
    gdp_probe_device.FIX,
    rng_tracker_device.FIX,
    rope_device.FIX,
    router_buffers_device.FIX,
    mla_cpu_build.FIX,
    dcp_results_queue.FIX,
    swiglu_load_copy.FIX,
)

from . import (  # noqa: E402
    bridge_expert_names,
    bridge_local_experts,
    bridge_local_layers,
    bridge_modelopt_lazy,
    bridge_process_group,
    bridge_replicated_device,
    bridge_rng_state,
    bridge_save_copies,
    bridge_scatter_contiguous,
    bridge_te_optional,
    bridge_yarn_config,
)

# The Megatron-Bridge fix set, in the order of patches/bridge/series.
BRIDGE_FIXES = (
    bridge_te_optional.FIX,
    bridge_process_group.FIX,
    bridge_local_layers.FIX,
    bridge_rng_state.FIX,
    bridge_yarn_config.FIX,
    bridge_expert_names.FIX,
    bridge_local_experts.FIX,
    bridge_replicated_device.FIX,
    bridge_scatter_contiguous.FIX,
    bridge_save_copies.FIX,
    bridge_modelopt_lazy.FIX,
)
