"""softmax_offsets_device: attention softmax offsets honour ``use_cpu_initialization``.

megatron-core 0.16 and later build the per-head softmax offset of the local
``DotProductAttention`` on ``torch.cuda.current_device()``, whatever the config says:

- ``softmax_type="off-by-one"``: a zero tensor kept as a plain attribute, so it is neither in
  the state dict (correct: it is a constant) nor moved by ``.to()``/``.cuda()`` (wrong);
- ``softmax_type="learnable"``: a Parameter, initialised with ``config.init_method``.

On a host without CUDA, constructing either one fails, even with ``use_cpu_initialization``.

Fix: under ``use_cpu_initialization`` the offset is created on the CPU; otherwise on the
current CUDA device, as before. The off-by-one offset becomes a non-persistent buffer: the
module's ``.to()``/``.cuda()`` move it, and the state dict stays without it (same checkpoint
schema). As a buffer it also follows dtype casts of the module (``.bfloat16()``,
``Float16Module``); zeros stay exact zeros, and the softmax concatenates it with the scores
under type promotion. The learnable offset stays a Parameter of ``params_dtype`` and shape
``[num_attention_heads_per_partition]`` under the same key, initialised by the same one call
of ``config.init_method`` (so it draws from the RNG exactly as before, on the device it lives on).

How, without copying the long constructor: the original ``__init__`` reads ``softmax_type``
only in its last statement, the branch that creates the offset (``vanilla`` sets
``self.softmax_offset = None`` and touches no CUDA). So the original runs unchanged on a
shallow copy of the config that says ``vanilla``; the module then gets the caller's config
back and its offset is built here. The copy is referenced nowhere else: the original (and
``MegatronModule.__init__`` in 0.16 … 0.19) keeps the config only as ``self.config`` and reads
plain values from it. ``vanilla`` and unknown types (which raise, as before) go straight to
the original.

megatron-core 0.13 and 0.14 have no softmax offsets. 0.15 has them, but allocates both
without naming a device (always on the CPU, the learnable one left uninitialised): there is no
CUDA placement to fix, so the fix is ``not-applicable`` on 0.13 … 0.15.
On code that differs from every known release (drift), the same wrapper runs: it passes every
argument but ``config`` on as it came, so new parameters reach the original. The site checks
make sure the original still takes ``config`` first, reads ``softmax_type`` only in the one
if/elif chain that makes the offset (the ``vanilla`` branch setting it to ``None``, the other
two on ``torch.cuda.current_device()``), as its last statement, and defines
``num_attention_heads_per_partition``, the offset's length.

Transformer Engine's attention (``TEDotProductAttention``) only passes ``softmax_type`` on to
Transformer Engine, which creates its own offset; TE modules cannot be built without CUDA.
"""

import ast
import copy

from ..engine import Check, Fix, Target, occurs


def _dot_product_attention_init(original, module):
    import torch

    def __init__(self, config, *args, **kwargs):
        softmax_type = config.softmax_type
        if softmax_type not in ("off-by-one", "learnable"):
            original(self, config, *args, **kwargs)
            return

        # Everything but the offset, by the original code; it sets self.softmax_offset = None.
        vanilla = copy.copy(config)
        vanilla.softmax_type = "vanilla"
        original(self, vanilla, *args, **kwargs)
        self.config = config
        del self.softmax_offset

        if config.use_cpu_initialization:
            device = torch.device("cpu")
        else:
            device = torch.cuda.current_device()
        heads = self.num_attention_heads_per_partition
        if softmax_type == "off-by-one":
            zeros = torch.zeros(heads, device=device, dtype=config.params_dtype)
            self.register_buffer("softmax_offset", zeros, persistent=False)
        else:
            offset = torch.empty(heads, device=device, dtype=config.params_dtype)
            self.register_parameter("softmax_offset", torch.nn.Parameter(offset))
            if config.perform_initialization:
                self.softmax_offset = config.init_method(self.softmax_offset)

    return __init__


FIX = Fix(
    name="softmax_offsets_device",
    summary="attention softmax offsets on the CPU under use_cpu_initialization; off-by-one is a buffer",
    targets=(
        Target(
            module="megatron.core.transformer.dot_product_attention",
            qualname="DotProductAttention.__init__",
            known_buggy={"814d02a7435eaa93": "0.16.1-0.19.2"},
            bug=("device=torch.cuda.current_device()",),
            # Offsets allocated on a named device: 0.16 on. 0.13/0.14 have no offsets, 0.15
            # allocates them without a device (nothing to place).
            feature="(self.num_attention_heads_per_partition, device=",
            replacement=_dot_product_attention_init,
            site=(
                Check("takes config first", lambda code: code.parameters()[1:2] == ("config",)),
                occurs("softmax_type", 3),
                occurs("torch.cuda.current_device()", 2),
                occurs("device=torch.cuda.current_device(), dtype=self.config.params_dtype)", 2),
                occurs("if self.config.softmax_type == 'vanilla':\nself.softmax_offset = None\n"),
                occurs("elif self.config.softmax_type == 'off-by-one':\n"),
                occurs("elif self.config.softmax_type == 'learnable':\n"),
                occurs("self.num_attention_heads_per_partition = "),
                Check(
                    "the offset's if/elif chain is the last statement",
                    lambda code: ast.unparse(code.tree.body[-1]).startswith(
                        "if self.config.softmax_type == 'vanilla':"
                    ),
                ),
            ),
        ),
    ),
)
