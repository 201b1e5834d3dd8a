"""yarn_rope_device: YaRN rotary tables are built and rebuilt where the module lives.

``YarnRotaryEmbedding`` computes its rotary embedding from two frequency tensors,
``inv_freq_extra`` and ``inv_freq_inter``, which are plain attributes (not buffers), and caches
the result twice: in the non-persistent buffers ``cos_cached``/``sin_cached``, and in an
``lru_cache`` on ``forward``. In every release from 0.13 to 0.19 that computation starts with

    if self.inv_freq_extra.device.type == 'cpu':
        self.inv_freq_extra = self.inv_freq_extra.to(device=torch.cuda.current_device())

(the same for ``inv_freq_inter``), in ``forward`` up to 0.15 and in ``get_emb`` from 0.16 on.
The constructor builds the first cos/sin cache through that path, so
``use_cpu_initialization=True`` still needs CUDA: on a host without it, no model with YaRN can
be built. And the ``forward`` memo is never forgotten when the module moves: after ``.to()``,
``.cuda()`` or a dtype change an identical call returns the tensor made before.

Fix:

- the embedding is computed on the device the module's cos/sin cache lives on (before the
  first cache exists, where the constructor made the frequencies: the CPU with
  ``use_cpu_initialization=True``, the current CUDA device otherwise), and the frequencies
  are moved there once, as before. A CPU-built module stays on the CPU; after ``.cuda()`` the
  next (re)build runs on that GPU; a module built on a GPU and left there moves nothing. On
  the meta device the frequencies are used as meta copies but kept where they were: a meta
  tensor has no values to bring back.
- ``YarnRotaryEmbedding`` gets an ``_apply`` override (it inherits ``nn.Module._apply``) that
  forgets the ``forward`` memo once the inherited one has run, so the next call computes again
  on the module's current device.

The frequencies keep their float32: ``.to(dtype)`` converts the cos/sin buffers, as upstream,
but the embedding is computed in float32, also as upstream. Every operation of the upstream
body runs in the same order on the same dtypes, so values are unchanged bit for bit.

In 0.13 and 0.14 the constructor passes its arguments to ``RotaryEmbedding.__init__`` by
position, and ``use_cpu_initialization`` lands in the base class's ``rope_scaling`` slot
(``cp_group`` in ``rope_scaling_factor``): the base class initialises on
``torch.cuda.current_device()`` whatever the flag says, then fails scaling by ``None`` (a
``TypeError`` on any host). 0.15 passes them by keyword. Fix: with
``use_cpu_initialization=True`` the 0.13/0.14 constructor runs the same steps, passing the base
class's arguments by keyword as 0.15 does; with the default the upstream constructor runs
untouched. (megatron-core's own MLA layers never pass the flag in any release, so they still
build YaRN on the current CUDA device; that caller is not changed here.)

The four known bodies differ only in what the fix does not touch, and each is handled
explicitly (see ``_VARIANTS``): 0.13 has no ``packed_seq`` argument; 0.14 adds it; 0.15 adds
``correction_range_round_to_int`` and takes the scale from ``_yarn_get_concentration_factor``;
0.16 moves the computation into ``get_emb`` (``forward`` adds the context-parallel split) and
builds the ramp mask directly on the device.

On code that differs from every known release but still has the bug (drift, e.g. the
0.15.0 release candidates, whose constructor builds the frequencies under
``with torch.device(device):``), a rewritten copy of an older body would drop what upstream
changed, so the live functions are rewritten at the bug expressions instead:

- ``forward``/``get_emb``: each ``torch.cuda.current_device()`` in the two frequency moves
  becomes ``table_device(self)``; the site checks make sure those are its only two uses and
  that the rest of the computation follows the frequencies' device (``torch.arange(...,
  device=self.inv_freq_extra.device``). Unlike the known-release form, a module whose tables
  live on the meta device gets its frequencies moved there too.
- ``__init__``: the positional ``super().__init__(...)`` call becomes ``init_base(...)``, which
  passes the same arguments by keyword under ``use_cpu_initialization=True`` and by position
  (upstream, untouched) otherwise; checked: the call reads exactly as in 0.13/0.14 and the base
  class's constructor takes those names.
- ``_apply``: an override of upstream's own counts as fixed only if it clears a memo
  (``.cache_clear()``); otherwise it is wrapped the same way as the inherited one.
"""

import functools

from ..engine import (
    INHERITED,
    Fix,
    Target,
    cuda_attributes,
    fingerprint,
    normalised_source,
    occurs,
    other_takes,
    rewriting,
    takes,
)

_MODULE = "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding"
_CLASS = "YarnRotaryEmbedding"

# fingerprint -> how that body computes the embedding:
#   packed_seq:    forward takes ``packed_seq`` and skips the CP split for packed sequences
#   round_to_int:  _yarn_find_correction_range takes self.correction_range_round_to_int
#   concentration: the scale comes from _yarn_get_concentration_factor, else from two
#                  _yarn_get_mscale calls
#   mask_device:   _yarn_linear_ramp_mask builds the mask on the device, else on the CPU and
#                  the mask is moved
_FORWARD_0_13 = "6cdcfaac2ff403bd"
_FORWARD_0_14 = "fd1dd1558faa2a82"
_FORWARD_0_15 = "99cb903accc73b44"
_GET_EMB_0_16 = "62658c976ee79dcb"
_INIT_0_13 = "f9a67a0d8ed9419b"  # also 0.14
_VARIANTS = {
    _FORWARD_0_13: dict(
        packed_seq=False, round_to_int=False, concentration=False, mask_device=False
    ),
    _FORWARD_0_14: dict(
        packed_seq=True, round_to_int=False, concentration=False, mask_device=False
    ),
    _FORWARD_0_15: dict(packed_seq=True, round_to_int=True, concentration=True, mask_device=False),
    _GET_EMB_0_16: dict(round_to_int=True, concentration=True, mask_device=True),
}


def _variant(original):
    return _VARIANTS[fingerprint(normalised_source(original))]


def table_device(self):
    """Where the module's rotary tables live: its cos cache once built, else its frequencies.
    (Also where a drifted ``forward``/``get_emb`` moves the frequencies.)"""
    cached = getattr(self, "cos_cached", None)
    if cached is not None:
        return cached.device
    return self.inv_freq_extra.device


def _frequencies_on(self, device):
    """``inv_freq_extra`` and ``inv_freq_inter`` on ``device``, moved there for good unless it
    is the meta device."""
    extra, inter = self.inv_freq_extra, self.inv_freq_inter
    if extra.device != device:
        extra = extra.to(device=device)
    if inter.device != device:
        inter = inter.to(device=device)
    if device.type != "meta":
        self.inv_freq_extra, self.inv_freq_inter = extra, inter
    return extra, inter


def _embedding(self, module, max_seq_len, offset, round_to_int, concentration, mask_device):
    """The upstream computation of (emb, mscale), on the module's table device."""
    import torch

    assert not self.rotary_interleaved, "Yarn RoPE does not support interleaved rotary embeddings"

    device = table_device(self)
    inv_freq_extra, inv_freq_inter = _frequencies_on(self, device)

    range_args = (
        self.beta_fast,
        self.beta_slow,
        self.dim,
        self.rotary_base,
        self.original_max_position_embeddings,
    )
    if round_to_int:
        range_args += (self.correction_range_round_to_int,)
    low, high = module._yarn_find_correction_range(*range_args)
    if mask_device:
        ramp = module._yarn_linear_ramp_mask(low, high, self.dim // 2, device=device)
        inv_freq_mask = 1.0 - ramp.to(dtype=torch.float32)
    else:
        ramp = module._yarn_linear_ramp_mask(low, high, self.dim // 2)
        inv_freq_mask = 1.0 - ramp.to(device=device, dtype=torch.float32)
    inv_freq = inv_freq_inter * (1 - inv_freq_mask) + inv_freq_extra * inv_freq_mask

    seq = torch.arange(max_seq_len, device=device, dtype=inv_freq_extra.dtype) + offset
    freqs = torch.outer(seq, inv_freq)

    if concentration:
        _mscale = module._yarn_get_concentration_factor(
            self.scaling_factor, self.mscale, self.mscale_all_dim
        )
    else:
        _mscale = float(
            module._yarn_get_mscale(self.scaling_factor, self.mscale)
            / module._yarn_get_mscale(self.scaling_factor, self.mscale_all_dim)
        )

    emb = torch.cat((freqs, freqs), dim=-1)
    # [seq_length, 1, 1, dim]
    emb = emb[:, None, None, :]
    return emb, _mscale


# The base class's parameters, in the order 0.13/0.14 pass them by position.
_BASE_ARGUMENTS = (
    "kv_channels",
    "rotary_percent",
    "rotary_interleaved",
    "seq_len_interpolation_factor",
    "rotary_base",
    "use_cpu_initialization",
    "cp_group",
)
_POSITIONAL_BASE_CALL = f"super().__init__({', '.join(_BASE_ARGUMENTS)})"


def init_base(base, *arguments):
    """A drifted constructor's base-class call: by keyword with CPU initialisation (the
    arguments reach the parameters they are named after), by position otherwise (upstream)."""
    named = dict(zip(_BASE_ARGUMENTS, arguments))
    if named["use_cpu_initialization"]:
        base.__init__(**named)
    else:
        base.__init__(*arguments)


def _init(original, module):
    """__init__ of 0.13 and 0.14, with the base class's arguments passed by keyword."""
    import torch

    yarn = getattr(module, _CLASS)

    def __init__(
        self,
        kv_channels,
        rotary_percent=1.0,
        rotary_interleaved=False,
        seq_len_interpolation_factor=None,
        rotary_base=10000.0,
        use_cpu_initialization=False,
        scaling_factor=1.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=0.0,
        cp_group=None,
    ):
        if not use_cpu_initialization:
            # The upstream constructor, untouched: everything on the current CUDA device.
            original(
                self,
                kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                use_cpu_initialization=use_cpu_initialization,
                scaling_factor=scaling_factor,
                original_max_position_embeddings=original_max_position_embeddings,
                beta_fast=beta_fast,
                beta_slow=beta_slow,
                mscale=mscale,
                mscale_all_dim=mscale_all_dim,
                cp_group=cp_group,
            )
            return

        self.dim = kv_channels
        self.rotary_base = rotary_base
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast = beta_fast
        self.beta_slow = beta_slow
        self.mscale = mscale
        self.mscale_all_dim = mscale_all_dim

        device = "cpu"
        self.inv_freq_extra = 1.0 / (
            self.rotary_base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        )
        self.inv_freq_inter = 1.0 / (
            self.scaling_factor
            * self.rotary_base
            ** (torch.arange(0, self.dim, 2, dtype=torch.float32, device=device) / self.dim)
        )
        # By keyword: use_cpu_initialization and cp_group reach the base class (upstream, by
        # position, they landed in rope_scaling and rope_scaling_factor).
        super(yarn, self).__init__(
            kv_channels=kv_channels,
            rotary_percent=rotary_percent,
            rotary_interleaved=rotary_interleaved,
            seq_len_interpolation_factor=seq_len_interpolation_factor,
            rotary_base=rotary_base,
            use_cpu_initialization=use_cpu_initialization,
            cp_group=cp_group,
        )

        self._set_cos_sin_cache(
            self.original_max_position_embeddings, offset=0, dtype=torch.get_default_dtype()
        )

    return __init__


def _forward(original, module):
    """forward of 0.13-0.15: the whole computation, then the context-parallel split."""
    variant = dict(_variant(original))
    takes_packed_seq = variant.pop("packed_seq")

    def split_for_cp(self, emb, packed_seq):
        if self.cp_group is not None and self.cp_group.size() > 1 and not packed_seq:
            # This rank's part of the sequence.
            emb = module.get_pos_emb_on_this_cp_rank(emb, 0, self.cp_group)
        return emb

    if takes_packed_seq:

        def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False):
            emb, _mscale = _embedding(self, module, max_seq_len, offset, **variant)
            return split_for_cp(self, emb, packed_seq), _mscale

    else:

        def forward(self, max_seq_len: int, offset: int = 0):
            emb, _mscale = _embedding(self, module, max_seq_len, offset, **variant)
            return split_for_cp(self, emb, False), _mscale

    # Memoised like the original (same maxsize); _apply below forgets it when the module moves.
    return functools.lru_cache(**original.cache_parameters())(forward)


def _get_emb(original, module):
    """get_emb of 0.16 and later: the computation without the context-parallel split."""
    variant = _variant(original)

    def get_emb(self, max_seq_len: int, offset: int = 0):
        return _embedding(self, module, max_seq_len, offset, **variant)

    return get_emb


def _apply_override(original, module):
    """An override of the inherited nn.Module._apply that forgets the forward memo."""
    yarn = getattr(module, _CLASS)

    def _apply(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        finally:
            # The memo is an lru_cache on the class's forward function, keyed by instance: it can
            # only be cleared as a whole, so this forgets the entries of every YaRN instance in
            # the process, not just of the module that moved. They are recomputed on their next
            # call, with the same values. It is also cleared when the inherited
            # _apply fails half-way, as some buffers may have moved already.
            for klass in type(self).__mro__:
                if issubclass(klass, yarn):
                    clear = getattr(vars(klass).get("forward"), "cache_clear", None)
                    if clear is not None:
                        clear()

    return _apply


_MOVES = (
    occurs("self.inv_freq_extra = self.inv_freq_extra.to(device=torch.cuda.current_device())\n"),
    occurs("self.inv_freq_inter = self.inv_freq_inter.to(device=torch.cuda.current_device())\n"),
    occurs("torch.cuda.current_device()", 2),
    occurs("torch.arange(max_seq_len, device=self.inv_freq_extra.device"),
    cuda_attributes("current_device"),
)
_MOVES_REWRITE = rewriting(
    __name__, {"torch.cuda.current_device()": "_mcore_cpu_shim.table_device(self)"}
)

FIX = Fix(
    name="yarn_rope_device",
    summary="YaRN RoPE tables built on the module's device (CPU with use_cpu_initialization), "
    "forward memo forgotten when the module moves",
    targets=(
        Target(
            module=_MODULE,
            qualname=f"{_CLASS}.__init__",
            known_buggy={_INIT_0_13: "0.13.1-0.14.0"},
            # The base class's arguments by position (0.15 passes them by keyword).
            bug=("rotary_base, use_cpu_initialization, cp_group)",),
            replacement=_init,
            site=(
                occurs(_POSITIONAL_BASE_CALL),
                takes(*_BASE_ARGUMENTS),
                other_takes(
                    "megatron.core.models.common.embeddings.rotary_pos_embedding",
                    "RotaryEmbedding.__init__",
                    *_BASE_ARGUMENTS,
                ),
            ),
            drift=rewriting(
                __name__,
                {_POSITIONAL_BASE_CALL: f"_mcore_cpu_shim.init_base(super(), {', '.join(_BASE_ARGUMENTS)})"},
            ),
        ),
        Target(
            module=_MODULE,
            qualname=f"{_CLASS}.forward",
            known_buggy={_FORWARD_0_13: "0.13.1", _FORWARD_0_14: "0.14.0", _FORWARD_0_15: "0.15.3"},
            bug=("torch.cuda.current_device()",),
            # From 0.16 forward only adds the CP split to get_emb, the next target.
            feature="self.inv_freq_extra",
            replacement=_forward,
            site=_MOVES,
            drift=_MOVES_REWRITE,
        ),
        Target(
            module=_MODULE,
            qualname=f"{_CLASS}.get_emb",
            known_buggy={_GET_EMB_0_16: "0.16.1-0.19.2"},
            bug=("torch.cuda.current_device()",),
            absent_in="0.13.1-0.15.3",
            replacement=_get_emb,
            site=_MOVES,
            drift=_MOVES_REWRITE,
        ),
        Target(
            module=_MODULE,
            qualname=f"{_CLASS}._apply",
            known_buggy={INHERITED: "0.13.1-0.19.2"},
            # An override of upstream's own: fixed if it forgets a memo, else wrapped.
            bug=("def _apply(",),
            fixed_by=(".cache_clear()",),
            replacement=_apply_override,
            site=(takes("fn"),),
        ),
    ),
)
