"""gdp_probe_device: importing megatron-core main does not ask a device that is not there.

megatron-core main (since mid 2026; no release has it yet) brings Gated Delta Product kernels
in ``ssm/ops/gdp``. Their ``common.check_shared_mem`` asks
``torch.cuda.get_device_properties(0)`` how much shared memory a block may use, to pick the
Triton autotune block sizes, and ``chunk_o.py`` calls it at import time
(``BKV_LIST = [64, 128] if check_shared_mem() else [32, 64]``). ``import megatron.core`` gets
there on every host (through the optimizer, Megatron-FSDP's adapter, the Mamba layer and the
dynamic inference context), whether or not the model has a single GDP layer. On a host without
CUDA the call raises and upstream catches it and answers ``False``; the conversion goes on,
but it has asked the driver on import (``forbid_cuda()`` fails there, and with a device
visible the probe initialises CUDA in every process that only imports megatron-core).

Fix: where ``torch.cuda.is_available()`` is false (it initialises nothing), the probe answers
``False`` without asking, which is what upstream's own ``except`` branch answers there; with
CUDA available the original runs (and its ``functools.cache`` stays in front of it). So the
answer, and the block sizes chosen from it, are unchanged on every host.

The replacement only wraps the original, so drifted code gets the same wrapper; the site
checks make sure the probe still asks ``get_device_properties`` once and still answers
``False`` when asking fails. megatron-core 0.13 … 0.19 have no such module: not-applicable.
"""

from ..engine import Fix, Target, cuda_attributes, occurs
from .common import cuda_or


def _check_shared_mem(original, module):
    # Without CUDA: upstream's answer when the device cannot be asked.
    return cuda_or(original, lambda *args, **kwargs: False)


FIX = Fix(
    name="gdp_probe_device",
    summary="megatron-core main's GDP shared-memory probe answers without a device where CUDA "
    "is unavailable (no CUDA call at import)",
    targets=(
        Target(
            module="megatron.core.ssm.ops.gdp.common",
            qualname="check_shared_mem",
            known_buggy={"ceb40913c61e7aa7": "main d98e8a64 (2026-08-22)"},
            bug=("torch.cuda.get_device_properties(",),
            absent_in="0.13.1-0.19.2 and the Megatron-Bridge pin 2a75ac12",
            replacement=_check_shared_mem,
            site=(
                occurs("torch.cuda.get_device_properties("),
                occurs("except Exception:\nreturn False"),
                cuda_attributes("get_device_properties"),
            ),
        ),
    ),
)
