"""One module per fix; each defines FIX. The order here is the order of patches/series."""

from . import (
    attention_buffers_device,
    dcp_collective_device,
    gdp_probe_device,
    local_moe_norm_keys,
    moe_dispatcher_device,
    moe_forward_device,
    softmax_offsets_device,
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
)
