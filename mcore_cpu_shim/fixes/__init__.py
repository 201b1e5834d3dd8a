"""One module per fix; each defines FIX. The order here is the order of patches/series."""

from . import dcp_collective_device

FIXES = (dcp_collective_device.FIX,)
