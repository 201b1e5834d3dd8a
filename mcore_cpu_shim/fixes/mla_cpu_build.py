"""mla_cpu_build: a multi-latent attention model is built and run on a host without CUDA or TE.

Two things stop every MLA model (DeepSeek-V2/V3, Kimi-K2, ...) on a CPU-only host, every
release 0.13.0rc0 ... 0.19.2 and main:

- ``MultiLatentAttention.__init__`` makes its rotary embedding itself, ``RotaryEmbedding(...)``
  for ``rope_type="rope"`` and ``YarnRotaryEmbedding(...)`` for ``rope_type="yarn"`` (the
  default, DeepSeek-V3's), and passes neither ``use_cpu_initialization``. Both constructors
  then make their frequencies on ``torch.cuda.current_device()`` whatever the config says
  (``GPTModel``, building the same classes for its own RoPE, passes
  ``config.use_cpu_initialization``): "Found no NVIDIA driver" while instantiating
  ``MLASelfAttention`` (``yarn_rotary_pos_embedding.py:76`` on 0.16.1).
- It builds its core attention with ``k_channels`` and ``v_channels`` (MLA's query/key head
  size, nope + rope part, differs from its value head size), which only Transformer Engine's
  ``TEDotProductAttention`` takes. megatron-core's own ``DotProductAttention``, the local spec's
  core attention, does not: ``TypeError: DotProductAttention.__init__() got an unexpected
  keyword argument 'k_channels'``. Where TE is unusable (no CUDA device) nothing else exists.
  Its computation works for any head sizes already (the score and context matmuls take them
  from the tensors); only the constructor's output size, ``hidden_size_per_partition``
  (``kv_channels`` x heads), assumes value heads of ``kv_channels``.
- 0.14.0 ... 0.18.2 only: the module sets its ``HAVE_TE`` to True whenever
  ``megatron.core.extensions.transformer_engine`` imports, which it also does without TE
  (it then builds its TE classes on a ``MagicMock``), and the constructor asks
  ``HAVE_TE and isinstance(self.linear_proj, TELinear)``: ``TypeError: isinstance() arg 2 must
  be a type`` without TE. (0.19 takes ``HAVE_TE`` from the extension module, which is right.)

Fix:

- both rotary calls pass ``use_cpu_initialization=self.config.use_cpu_initialization``, as
  ``GPTModel`` does. With the flag off (every run that initialises on the GPU) the calls are
  exactly upstream's. With it on, the frequencies and YaRN's cos/sin cache are made on the
  CPU, as ``GPTModel``'s are under that flag, and a model moved to the GPU computes its
  embedding there (``RotaryEmbedding``: upstream's move at the first forward; YaRN: on its
  tables' device, ``yarn_rope_device``);
- where the core attention spec is megatron-core's ``DotProductAttention`` and it takes no
  ``k_channels``, MLA builds a subclass of it (``MLADotProductAttention``, no parameters of
  its own, so the state dict is the same) that takes ``k_channels``/``v_channels``: the output
  size is ``v_channels`` per head and, where no ``softmax_scale`` is given, the default scale
  is ``1/sqrt(k_channels)`` (MLA always gives its own, with YaRN's mscale). Every operation of
  the forward is upstream's. TE's attention (a GPU run) is built as before;
- the constructor's ``HAVE_TE`` reads true only where ``TELinear`` is a class (with TE
  installed, as before).

So the values are unchanged: on a GPU with TE the spec is TE's and the rotary calls are
upstream's unless ``use_cpu_initialization`` is set, and then the embedding is computed on the
GPU as ``GPTModel``'s is. On the CPU the attention is upstream's local computation.

Form: the live constructor is rewritten at three expressions (``engine.rewrite``:
``RotaryEmbedding`` and ``YarnRotaryEmbedding`` -> ``cpu_initialised(<class>, self.config)``,
``submodules.core_attention`` -> ``core_attention(submodules.core_attention)``), and at
``HAVE_TE`` -> ``te_classes(HAVE_TE, TELinear)`` where it occurs (0.14 on), on known and
drifted code alike: the MLA constructor changes in almost every release (eight shapes from
0.13.0rc0 to main) and every other line stays upstream's. The site checks make sure each
expression occurs once, that the constructor passes no ``use_cpu_initialization`` yet, that
it passes ``k_channels``/``v_channels`` and that both rotary constructors take the flag. Code
that passes the flag and whose ``DotProductAttention`` takes ``k_channels`` (patch 0012) reads
fixed. Code that passes the flag while its attention does not is left alone and reported
unsupported; code whose attention takes ``k_channels`` but passes no flag gets the rewrite, whose
``core_attention`` then leaves the spec as it is. (The fixed reading does not look at ``HAVE_TE``:
patch 0012 is against 0.19.2, whose ``HAVE_TE`` is right; a back-port to 0.14 ... 0.18 would have
to fix that line too.)
"""

import functools

from ..engine import Check, Fix, Target, occurs, other_takes, rewrite

_MODULE = "megatron.core.transformer.multi_latent_attention"
_EMBEDDINGS = "megatron.core.models.common.embeddings"
_ATTENTION = "megatron.core.transformer.dot_product_attention"
FLAG = "use_cpu_initialization"
_CHANNELS = ("k_channels", "v_channels")


def cpu_initialised(embedding_class, config):
    """``embedding_class`` called with the config's ``use_cpu_initialization`` (upstream passes
    none, which means the current CUDA device)."""
    return functools.partial(embedding_class, use_cpu_initialization=config.use_cpu_initialization)


def _takes_channels(cls):
    import inspect

    return set(_CHANNELS) <= set(inspect.signature(cls.__init__).parameters)


@functools.lru_cache(maxsize=None)
def _mla_class(base):
    """``base`` (megatron-core's DotProductAttention) taking MLA's head sizes."""
    import math

    class MLADotProductAttention(base):
        """megatron-core's DotProductAttention for MLA heads: query/key heads of
        ``k_channels``, value heads of ``v_channels`` (mcore_cpu_shim.fixes.mla_cpu_build)."""

        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if k_channels is not None:
                self.hidden_size_per_attention_head = k_channels
                if kwargs.get("softmax_scale") is None:
                    self.softmax_scale = 1.0 / math.sqrt(k_channels)
                    if self.config.apply_query_key_layer_scaling:
                        self.softmax_scale /= max(1, self.layer_number)
            if v_channels is not None:
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    return MLADotProductAttention


def core_attention(spec):
    """MLA's core attention spec, with megatron-core's local DotProductAttention (where it takes
    no k_channels) swapped for ``MLADotProductAttention``; any other spec as it is."""
    import dataclasses
    import importlib

    local = importlib.import_module(_ATTENTION).DotProductAttention
    module = getattr(spec, "module", spec)
    if module is not local or _takes_channels(local):
        return spec
    if module is spec:
        return _mla_class(local)
    return dataclasses.replace(spec, module=_mla_class(local))


def te_classes(have_te, te_linear):
    """The constructor's ``HAVE_TE``: true only where ``TELinear`` is a real class."""
    return bool(have_te) and isinstance(te_linear, type)


def _fixed_upstream(code):
    tree = code.lookup(_ATTENTION, "DotProductAttention.__init__")
    return FLAG in code.text and tree is not None and set(_CHANNELS) <= set(code.parameters(tree))


_REPLACEMENTS = {
    "RotaryEmbedding": "_mcore_cpu_shim.cpu_initialised(RotaryEmbedding, self.config)",
    "YarnRotaryEmbedding": "_mcore_cpu_shim.cpu_initialised(YarnRotaryEmbedding, self.config)",
    "submodules.core_attention": "_mcore_cpu_shim.core_attention(submodules.core_attention)",
}
_TE_CHECK = {"HAVE_TE": "_mcore_cpu_shim.te_classes(HAVE_TE, TELinear)"}


def _REWRITE(original, module):
    from ..engine import normalised_source

    replacements = dict(_REPLACEMENTS)
    if "HAVE_TE" in normalised_source(original):
        replacements.update(_TE_CHECK)
    return rewrite(original, replacements, __name__)

FIX = Fix(
    name="mla_cpu_build",
    summary="multi-latent attention builds on the CPU: its rotary embedding honours "
    "use_cpu_initialization and the local core attention takes MLA's head sizes "
    "(DeepSeek-V2/V3-style models without CUDA or TE)",
    targets=(
        Target(
            module=_MODULE,
            qualname="MultiLatentAttention.__init__",
            known_buggy={
                "85cea48f9fe1ff90": "0.13.0rc0-0.13.1",
                "72642886d5b6a1b6": "0.14.0rc0-0.14.0rc1",
                "a098242d6b50d16f": "0.14.0rc2-0.14.0rc5",
                "e72c3f4109ce9acb": "0.14.0rc6-0.14.0rc7",
                "e98d0ba586290cb2": "0.14.0, 0.15.0rc0-0.15.0rc2",
                "1e979a67f26ff4c3": "0.15.0rc3-0.15.3",
                "8e60de9e87791f57": "0.16.0-0.17.1",
                "237f0d798a4893b1": "0.18.0-0.19.2, main d98e8a64, Bridge pin 2a75ac12",
            },
            bug=("RotaryEmbedding(",),
            fixed_by=(
                Check(
                    f"passes {FLAG} and DotProductAttention.__init__ takes k_channels, v_channels",
                    _fixed_upstream,
                ),
            ),
            replacement=_REWRITE,
            site=(
                occurs("= RotaryEmbedding("),
                occurs("= YarnRotaryEmbedding("),
                occurs("RotaryEmbedding", 2),
                occurs("submodules.core_attention"),
                occurs("k_channels="),
                occurs("v_channels="),
                occurs(FLAG, 0),
                Check(
                    "HAVE_TE, where named, only in HAVE_TE and isinstance(..., TELinear)",
                    lambda code: "HAVE_TE" not in code.text
                    or (code.text.count("HAVE_TE") == 1 and "isinstance(self.linear_proj, TELinear)" in code.text),
                ),
                other_takes(f"{_EMBEDDINGS}.rotary_pos_embedding", "RotaryEmbedding.__init__", FLAG),
                other_takes(f"{_EMBEDDINGS}.yarn_rotary_pos_embedding", "YarnRotaryEmbedding.__init__", FLAG),
            ),
            drift=_REWRITE,
        ),
    ),
)
