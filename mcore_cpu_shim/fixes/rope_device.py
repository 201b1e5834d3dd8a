"""rope_device: plain and multimodal rotary embeddings computed on the CPU where CUDA is absent.

``RotaryEmbedding`` keeps its frequencies ``inv_freq`` as a plain attribute (not a buffer: it
is not in the state dict and ``.to()``/``.cuda()`` do not move it). The constructor makes them
where ``use_cpu_initialization`` says (the CPU, or the current CUDA device), and the first
computation of the embedding moves them to the GPU:

    if self.inv_freq.device.type == 'cpu':
        # move `inv_freq` to GPU once at the first micro-batch forward pass
        self.inv_freq = self.inv_freq.to(device=torch.cuda.current_device())

in ``RotaryEmbedding.forward`` in 0.13.0rc0 ... 0.15.3 and in ``RotaryEmbedding.get_emb`` (which
``forward`` calls before the context-parallel split) from 0.16.0 on, through 0.19.2 and main
(one code each). So the forward pass of every plain-RoPE model built on the CPU dies on a host
without CUDA ("Found no NVIDIA driver on your system" at ``rotary_pos_embedding.py:162`` on
0.19.2, ``:164`` on 0.13 ... 0.15): ``GPTModel`` with ``position_embedding_type="rope"``, which
is what every plain-RoPE model is: Llama 2/3.x (with and without ``rope_scaling``), Mistral,
Mixtral, Qwen2/2.5, Qwen3 and Qwen3-MoE, Gemma/Gemma2/Gemma3 (Megatron-Bridge's Gemma3 rotary
embedding is a ``RotaryEmbedding`` subclass that calls ``forward`` of its own and of a local
one), GLM-4.5, Nemotron (Megatron-Bridge's providers for these set ``"rope"``); also
multi-latent attention with ``rope_type="rope"`` and the hybrid (Mamba), BERT and T5 models
with RoPE. YaRN models (GPT-OSS, DeepSeek-V3's default MLA) are ``yarn_rope_device``'s.
The rest of the computation follows the frequencies already: ``get_freqs_non_repeated`` makes
the positions on ``self.inv_freq.device``, ``get_cos_sin`` (flash decoding) calls it without
any move, and ``get_rotary_seq_len`` only counts (none of the three names CUDA, in any
release).

``MultimodalRotaryEmbedding`` (M-RoPE: ``position_embedding_type="mrope"``, Megatron-Bridge's
Qwen2.5-VL and GLM-4.5V language models) has no ``use_cpu_initialization`` at all: its
constructor makes ``inv_freq`` with ``torch.arange(..., device=torch.cuda.current_device())``,
every release 0.13.0rc0 ... 0.19.2 and main (two codes: ``cp_group`` arrived in 0.14.0rc3). So
such a model cannot even be built without CUDA. Its ``forward`` then follows the frequencies
(``position_ids.to(device=self.inv_freq.device, ...)``).

Where Megatron-Bridge converts a checkpoint (``import_ckpt``/``export_ckpt``, the shim's
``convert``, whose ``--verify`` compares tensors) it builds the model and maps weights but
runs no forward: there the plain-RoPE part is not needed, the M-RoPE constructor is (a
Qwen2.5-VL or GLM-4.5V model is built). The plain-RoPE part is on the forward path only: a CPU
check of the converted model's logits, generation, HF-vs-Megatron comparisons.

Fix, in both places only where ``torch.cuda.is_available()`` is false (it initialises
nothing): the frequencies stay where they are (``forward``/``get_emb``: the move becomes a
no-op, the embedding is computed on the frequencies' device, the CPU for a CPU-built model), and
M-RoPE's constructor makes them on the CPU. Where CUDA is available the expression is
``torch.cuda.current_device()`` exactly as before: the same move, the same devices, the same
operations in the same order, so GPU values stay bit-identical (on the CPU host, too, every
operation is upstream's, only on the device the frequencies are already on).

Why the host decides here and not the module (as in ``yarn_rope_device``, whose cos/sin cache
is a buffer that moves with the model): a ``RotaryEmbedding`` has no tensor of its own that
follows the model, and its ``forward`` receives none (only ``max_seq_len``). A rule "compute
where ``inv_freq`` is" would break GPU runs that move the model without ``Module._apply``:
FSDP2's ``fully_shard`` moves parameters and buffers tensor by tensor (``inv_freq`` is neither;
Megatron-LM leaves the ``.cuda()`` to it under ``use_cpu_initialization``), and
Megatron-Bridge's ``get_model`` calls ``.cuda()`` only without ``use_cpu_initialization``; there
upstream's first-forward move is what brings the frequencies to the GPU. Likewise M-RoPE
cannot honour ``use_cpu_initialization`` (its ``forward`` never moves the frequencies, so a
CPU-initialised model moved to the GPU would compute on the CPU). As in
``attention_buffers_device``, a CPU-placed model on a host *with* CUDA still gets its
frequencies moved to the GPU, as before: a CPU forward needs CUDA hidden
(``CUDA_VISIBLE_DEVICES=""``).

Form: every release (known or drifted code alike) gets its live function rewritten at the one
bug expression (``engine.rewrite``: ``torch.cuda.current_device()`` -> ``frequency_device(self)``
in ``forward``/``get_emb``, -> ``buffer_device()`` (``fixes.common``) in M-RoPE's
constructor), so every other line is upstream's (``forward``'s ``lru_cache`` is kept, with a memo of its own), tracebacks point into
megatron-core's file, and drifted code keeps what upstream changed around the spot. The site
checks make sure the expression occurs once, in the statement the rewrite expects, that
``torch.cuda`` is used for nothing else, and (plain RoPE) that ``get_freqs_non_repeated`` still
computes on the frequencies' device. Upstream code that asks ``torch.cuda.is_available()`` there
(as patch 0010 does) reads fixed.
"""


from ..engine import Check, Fix, Target, cuda_attributes, normalise, occurs, rewriting
from .common import buffer_device  # noqa: F401  (reached by the rewrite)

_MODULE = "megatron.core.models.common.embeddings.rotary_pos_embedding"
# How patch 0010 (and, we expect, upstream) fixes both spots: it asks before using CUDA.
NO_CUDA = "torch.cuda.is_available()"
BUG = "torch.cuda.current_device()"


def frequency_device(self):
    """Where ``forward``/``get_emb`` move the frequencies: the current CUDA device where CUDA
    is available (upstream), else where they are (the move is a no-op)."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else self.inv_freq.device


def _positions_follow_the_frequencies(code):
    tree = code.lookup(_MODULE, "RotaryEmbedding.get_freqs_non_repeated")
    if tree is None:
        return False
    text = normalise(tree)
    return "device=self.inv_freq.device" in text and "torch.cuda" not in text


_MOVE_REWRITE = rewriting(__name__, {BUG: "_mcore_cpu_shim.frequency_device(self)"})
_MOVE = (
    occurs("if self.inv_freq.device.type == 'cpu':\n"),
    occurs(f"self.inv_freq = self.inv_freq.to(device={BUG})\n"),
    occurs(BUG),
    cuda_attributes("current_device"),
    occurs("self.get_freqs_non_repeated(max_seq_len, offset)"),
    Check(
        "RotaryEmbedding.get_freqs_non_repeated makes the positions on self.inv_freq.device "
        "and names no torch.cuda",
        _positions_follow_the_frequencies,
    ),
)
# M-RoPE's constructor makes its frequencies on common.buffer_device(): the
# current CUDA device where CUDA is available (upstream), else the CPU.
_INIT_REWRITE = rewriting(__name__, {BUG: "_mcore_cpu_shim.buffer_device()"})

FIX = Fix(
    name="rope_device",
    summary="plain RoPE computed where its frequencies are and M-RoPE built on the CPU where "
    "CUDA is unavailable (CPU forward of Llama/Qwen/Mixtral..., CPU build of Qwen2.5-VL)",
    targets=(
        Target(
            module=_MODULE,
            qualname="RotaryEmbedding.forward",
            known_buggy={"23b8459a12c3d7ec": "0.13.0rc0-0.15.3"},
            bug=(BUG,),
            fixed_by=(NO_CUDA,),
            # From 0.16 forward only adds the CP split to get_emb, the next target.
            feature="self.inv_freq",
            replacement=_MOVE_REWRITE,
            site=_MOVE,
            drift=_MOVE_REWRITE,
        ),
        Target(
            module=_MODULE,
            qualname="RotaryEmbedding.get_emb",
            known_buggy={"b62029a25a3160d7": "0.16.0-0.19.2, main d98e8a64, Bridge pin 2a75ac12"},
            bug=(BUG,),
            fixed_by=(NO_CUDA,),
            absent_in="0.13.0rc0-0.15.3",
            replacement=_MOVE_REWRITE,
            site=_MOVE,
            drift=_MOVE_REWRITE,
        ),
        Target(
            module=_MODULE,
            qualname="MultimodalRotaryEmbedding.__init__",
            known_buggy={
                "462cecbb07ba04c7": "0.13.0rc0-0.14.0rc2",
                "88f195697c417826": "0.14.0rc3-0.19.2, main d98e8a64, Bridge pin 2a75ac12",
            },
            bug=(BUG,),
            fixed_by=(NO_CUDA,),
            replacement=_INIT_REWRITE,
            site=(
                occurs(f"torch.arange(0, dim, 2, dtype=torch.float32, device={BUG})"),
                occurs(BUG),
                cuda_attributes("current_device"),
            ),
            drift=_INIT_REWRITE,
        ),
    ),
)
