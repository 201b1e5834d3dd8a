"""router_buffers_device: a MoE router with expert bias is built on the CPU where CUDA is absent.

``TopKRouter.__init__`` registers its bookkeeping buffers with
``device=torch.cuda.current_device()``:

- with ``moe_router_enable_expert_bias`` (aux-loss-free routing: DeepSeek-V3, Kimi-K2,
  GLM-4.5, Qwen3-Next, and Megatron-Bridge's providers for them): ``local_tokens_per_expert``
  and the persistent ``expert_bias`` (it is in the checkpoint: HF's
  ``e_score_correction_bias``);
- with a global aux loss (``moe_router_load_balancing_type`` containing ``global_aux_loss``):
  ``global_tokens_per_expert`` and ``ga_steps``;
- 0.19 adds quantile balancing: the persistent ``qb_beta``, ``qb_beta_accum`` and the int64
  ``qb_beta_count``.

Up to 0.15.0rc2 these buffers were made on the CPU (no device given); from 0.15.0rc3 on, every release
through 0.19.2 and main names the current CUDA device. So on a host without CUDA no model
with expert bias can even be built, e.g. for a checkpoint conversion ("Found no NVIDIA
driver" while instantiating ``TopKRouter``), even with ``use_cpu_initialization=True``. The
router weight itself is made on the CPU and moved by ``gating`` (``moe_forward_device``).

Fix, only where ``torch.cuda.is_available()`` is false: the buffers are made on the CPU. With
CUDA available the expression is ``torch.cuda.current_device()`` exactly as before, so a GPU
run makes the same zeros on the same device. Values cannot differ anyway: every buffer starts
as zeros, and the persistent ones are overwritten by the checkpoint.

Form: the live constructor is rewritten at the bug expression (``engine.rewrite``:
``torch.cuda.current_device()`` -> ``buffer_device()``), on known and drifted code alike, so
every other line is upstream's and tracebacks point into megatron-core's file. The site checks
make sure every use of the expression is a ``device=`` argument and that ``torch.cuda`` is used
for nothing else. Code that asks ``torch.cuda.is_available()`` there (as patch 0011 does) reads
fixed; 0.13.0rc0 ... 0.15.0rc2, which name no device, read upstream-fixed.
"""


from ..engine import Check, Fix, Target, cuda_attributes, rewriting
# The current CUDA device where CUDA is available (upstream), else the CPU: the same answer as
# for the attention buffers, one definition.
from .common import buffer_device  # noqa: F401  (reached by the rewrite)

_MODULE = "megatron.core.transformer.moe.router"
# How patch 0011 (and, we expect, upstream) fixes it: it asks before using CUDA.
NO_CUDA = "torch.cuda.is_available()"
BUG = "torch.cuda.current_device()"


_REWRITE = rewriting(__name__, {BUG: "_mcore_cpu_shim.buffer_device()"})

FIX = Fix(
    name="router_buffers_device",
    summary="MoE router buffers (expert bias, global aux loss, quantile balancing) made on the "
    "CPU where CUDA is unavailable (CPU build of DeepSeek-V3-style models)",
    targets=(
        Target(
            module=_MODULE,
            qualname="TopKRouter.__init__",
            known_buggy={
                "8465af832fe0bea3": "0.15.0rc3-0.15.3",
                "4c2cc3af6784cd4e": "0.16.0-0.16.1",
                "790e30acf162f1df": "0.17.0rc0-0.18.2",
                "37395258815e5e7e": "0.19.0-0.19.2, main d98e8a64, Bridge pin 2a75ac12",
            },
            bug=(BUG,),
            fixed_by=(NO_CUDA,),
            replacement=_REWRITE,
            site=(
                # 4 uses in 0.15-0.18, 7 with 0.19's quantile balancing
                Check(
                    f"every {BUG} is a device= argument",
                    lambda code: 0 < code.text.count(BUG) == code.text.count(f"device={BUG}"),
                ),
                cuda_attributes("current_device"),
            ),
            drift=_REWRITE,
        ),
    ),
)
