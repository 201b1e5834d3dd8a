"""One module per fix; each defines FIX. The order here is the order of patches/series."""

from . import (
    dcp_collective_device,
    local_moe_norm_keys,
    moe_dispatcher_device,
    softmax_offsets_device,
    yarn_rope_device,
)

FIXES = (
    dcp_collective_device.FIX,
    yarn_rope_device.FIX,
    softmax_offsets_device.FIX,
    moe_dispatcher_device.FIX,
    local_moe_norm_keys.FIX,
)
