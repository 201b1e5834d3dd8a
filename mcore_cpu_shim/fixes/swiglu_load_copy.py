"""swiglu_load_copy: loading a SwiGLU ``linear_fc1`` keeps no second copy of it.

A gated MLP (SwiGLU: Llama, Qwen, Mistral, DeepSeek's dense layers, the local experts of
SequentialMLP) stores its ``linear_fc1`` weight as two checkpoint tensors, the gate and the up
half: ``apply_swiglu_sharded_factory`` (``megatron/core/transformer/mlp.py``, every release
0.13 … 0.19 and main) splits the parameter with ``torch.chunk`` at save and at load. At load
the two chunks are views of the parameter, so ``dist_checkpointing.load`` (torch_dist) reads
both halves straight into the parameter's memory; then the factory's merge function joins them
with ``torch.cat`` (``cat_with_oom_fallback`` from 0.18 on) into a *new* tensor of the whole
weight, and the loaded state dict holds those copies for every layer at once, until
``load_state_dict`` copies each back into the parameter that already holds the same bytes.
Nothing of it needs CUDA, but on a CPU host converting a big model it is what sets the peak:
0.46 x the model's bytes on top of the model at TinyLlama's shapes (2 x intermediate x hidden
per layer), in Megatron-Bridge's ``load_megatron_model``, so in ``convert``'s verify and in
every export.

Fix: the factory's merge function first asks whether the two loaded halves *are* the
parameter's two halves in place (both contiguous, the gate starting where the parameter starts
and the up half right after it, together exactly its shape, same dtype and device). Then the
concatenation is the parameter itself, byte for byte, and the merge returns the parameter
(detached, as the no-grad ``torch.cat`` would be) instead of a copy; ``load_state_dict``'s copy
of a tensor onto itself is then a no-op (``copy_`` returns at once for the same memory). Any
other load (a strategy that reads into buffers of its own, FSDP's flattened pieces, an
optimizer's state) gets upstream's merge unchanged. The values are the same in every case: the
memory holds exactly what ``torch.cat`` would have written.

Form: the factory function is wrapped whole (its result's ``merge_fn`` is wrapped), so
drifted code gets the same wrapper; the site check makes sure the function still builds one
factory. ``moe/experts.py`` takes the function from ``mlp`` by name when it is imported, so
SequentialMLP's experts get the wrapped one when this package is imported before megatron-core
(as documented); where both were imported first, its experts keep upstream's copies.
"""

from ..engine import Fix, Target, occurs

FACTORY = "return ShardedTensorFactory("
# How patch 0014 (and, we expect, upstream) does it.
FIXED = "swiglu_halves_in_place("


def halves_in_place(whole, halves) -> bool:
    """Whether ``halves`` (what the merge gets) are the two contiguous halves of ``whole``
    along dim 0, in its own memory, so that ``torch.cat(halves)`` equals ``whole`` byte for
    byte. Plain tensors only (a DTensor or another subclass gets upstream's merge)."""
    import torch

    if not isinstance(halves, (list, tuple)) or len(halves) != 2:
        return False
    first, second = halves
    plain = (torch.Tensor, torch.nn.Parameter)
    if any(type(t) not in plain for t in (whole, first, second)) or whole.ndim == 0 or not whole.numel():
        return False
    if any(t.dtype != whole.dtype or t.device != whole.device or not t.is_contiguous() for t in (whole, first, second)):
        return False
    if first.shape[1:] != whole.shape[1:] or second.shape[1:] != whole.shape[1:]:
        return False
    if first.shape[0] + second.shape[0] != whole.shape[0]:
        return False
    return (first.data_ptr() == whole.data_ptr()
            and second.data_ptr() == whole.data_ptr() + first.numel() * whole.element_size())


def _keep_in_place(merge, whole):
    def merge_fn(sub_state_dict, *args, **kwargs):
        if halves_in_place(whole, sub_state_dict):
            return whole.detach()
        return merge(sub_state_dict, *args, **kwargs)

    return merge_fn


def _factory(original, module):
    def apply_swiglu_sharded_factory(original_sh_ten, *args, **kwargs):
        factory = original(original_sh_ten, *args, **kwargs)
        factory.merge_fn = _keep_in_place(factory.merge_fn, factory.data)
        return factory

    return apply_swiglu_sharded_factory


FIX = Fix(
    name="swiglu_load_copy",
    summary="a SwiGLU linear_fc1 loaded into its parameter is not concatenated into a second "
    "copy (torch_dist load)",
    targets=(
        Target(
            module="megatron.core.transformer.mlp",
            qualname="apply_swiglu_sharded_factory",
            known_buggy={"1b1e8fe75f829bb7": "0.13.1", "751f3a9e3626741f": "0.14.0-0.15.3",
                         "f85c7686e9aec837": "0.16.1-0.17.1", "c2fd356bfc1d88cd": "0.18.2",
                         "6a0fc2574a12a40b": "0.19.2, main d98e8a64 and the Megatron-Bridge pin 2a75ac12"},
            bug=("def apply_swiglu_sharded_factory(",),
            fixed_by=(FIXED,),
            replacement=_factory,
            whole=True,
            site=(occurs(FACTORY),),
        ),
    ),
)
