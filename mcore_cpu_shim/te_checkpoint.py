"""Load a checkpoint written by the local (non-TE) model into the Transformer Engine model.

A CPU host builds the GPT model with the local layer spec (Transformer Engine modules cannot
be built without CUDA); training later builds the same model with the TE spec. With the
``local_moe_norm_keys`` fix every *tensor* of the local checkpoint is stored under the key the
TE model asks for. What the TE model asks for in addition are ``_extra_state`` objects of its
TE modules (FP8 metadata) that no local module has:

- TE norms (``TENorm`` gives ``te.pytorch.LayerNorm``/``RMSNorm``; in TE 2.x these are
  operation-based modules with an extra state), e.g. ``decoder.layers.pre_mlp_layernorm`` of a
  MoE layer and ``decoder.final_layernorm``;
- TE attention (``TEDotProductAttention``) where megatron-core saves its state dict as is
  (0.13 and 0.14 define no ``sharded_state_dict`` for it; 0.15 on save only a learnable
  softmax offset, no extra state).

Every one of them is empty in a model that has not run FP8 (TE 2.x: a zero-length uint8
tensor; TE 1.x: a serialised ``None``), and ``set_extra_state`` of an empty state does
nothing. megatron-core still requests them on load, and ``dist_checkpointing.load`` fails with
``Missing key in checkpoint state_dict: ..._extra_state/shard_...``.

``load(sharded_state_dict, checkpoint_dir)`` is ``dist_checkpointing.load`` except for exactly
those entries: an ``_extra_state`` object the checkpoint lacks *and* the model holds empty is
not requested, and the model's own (empty) value is returned in its place, so a strict
``model.load_state_dict(...)`` afterwards works and sets nothing. An ``_extra_state`` the
checkpoint has is loaded as before; one the checkpoint lacks while the model holds real FP8
metadata raises (that model expects state the checkpoint cannot give). Saving is untouched:
non-empty extra state is saved as before.

Norm replica ids: a TE norm is replicated across tensor-parallel ranks, so every rank but TP
rank 0 must save it as a replica (``replica_id[1] == tp rank``, the layout
``(PP, TP, DP)``). megatron-core 0.13 … 0.19 get that right on the GPT path
(``MegatronModule.sharded_state_dict`` hands its ``tp_group`` to ``sharded_state_dict_default``),
but the helpers that build those ids read the TP rank of ``tp_group`` only, as 0, when a
caller passes a ``dp_cp_group`` without it (``get_pg_rank(None)``):
``make_sharded_tensor_for_checkpoint`` from 0.15, ``make_sharded_tensors_for_checkpoint``
(extra state) from 0.16; ``sharded_state_dict_default`` always passes a ``dp_cp_group``.
``misplaced_tp_replicas`` names the entries whose ids do not match; ``tp_replica_id`` gives
the right one.

Nothing here imports Transformer Engine or torch at import time; the functions work on any
module that implements ``get_extra_state``/``set_extra_state``.
"""

import io
import logging

logger = logging.getLogger("mcore_cpu_shim")

EXTRA_STATE = "_extra_state"


def is_empty_extra_state(value) -> bool:
    """True when an ``_extra_state`` value carries no state: ``None``, a zero-length tensor
    (TE 2.x), empty bytes, or a buffer holding a serialised ``None`` or empty container (TE 1.x)."""
    import torch

    if value is None:
        return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 0
    if isinstance(value, (bytes, bytearray)):
        return len(value) == 0
    if isinstance(value, io.BytesIO):
        raw = value.getvalue()
        if not raw:
            return True
        try:
            decoded = torch.load(io.BytesIO(raw), weights_only=False)
        except Exception:  # not a torch serialisation: treat as state, never drop it
            return False
        return decoded is None or (isinstance(decoded, (dict, list, tuple)) and not decoded)
    if isinstance(value, (dict, list, tuple)):
        return not value
    return False


def _sharded_objects(sharded_state_dict, path=()):
    """(path, ShardedObject) for every ShardedObject in a (nested) sharded state dict."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    items = sharded_state_dict.items() if isinstance(sharded_state_dict, dict) else enumerate(
        sharded_state_dict
    )
    for name, value in items:
        if isinstance(value, ShardedObject):
            yield path + (name,), value
        elif isinstance(value, (dict, list)):
            yield from _sharded_objects(value, path + (name,))


def _pop(tree, path):
    for name in path[:-1]:
        tree = tree[name]
    return tree.pop(path[-1]) if isinstance(tree, dict) else tree[path[-1]]


def _put(tree, path, value):
    for name in path[:-1]:
        tree = tree.setdefault(name, {}) if isinstance(tree, dict) else tree[name]
    tree[path[-1]] = value


class MissingExtraStateError(RuntimeError):
    """The model holds FP8 metadata in an ``_extra_state`` the checkpoint does not have."""


def split_missing_extra_state(sharded_state_dict, stored_unique_keys):
    """Take out of ``sharded_state_dict`` (in place) the ``_extra_state`` objects that are not
    among ``stored_unique_keys`` (ShardedObject unique keys in the checkpoint) and that the
    model holds empty; return ``{path: value}`` for them. Raise MissingExtraStateError for a
    missing one that is not empty."""
    taken, refused = {}, []
    for path, entry in list(_sharded_objects(sharded_state_dict)):
        if not entry.key.endswith(EXTRA_STATE) or entry.unique_key in stored_unique_keys:
            continue
        if not is_empty_extra_state(entry.data):
            refused.append(entry.unique_key)
            continue
        _pop(sharded_state_dict, path)
        taken[path] = entry.data
    if refused:
        raise MissingExtraStateError(
            f"the checkpoint lacks {', '.join(refused)}, which this model holds with content "
            "(FP8 metadata): load it into a model that has not run FP8, or from a checkpoint "
            "that was saved with that state"
        )
    return taken


def load(sharded_state_dict, checkpoint_dir, **load_kwargs):
    """``dist_checkpointing.load`` for a TE model reading a local-spec checkpoint: empty
    ``_extra_state`` objects the checkpoint lacks are not required (see the module doc)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    stored = {
        entry.unique_key
        for entry in load_sharded_metadata(str(checkpoint_dir)).values()
        if isinstance(entry, ShardedObject)
    }
    taken = split_missing_extra_state(sharded_state_dict, stored)
    if taken:
        logger.info(
            "te_checkpoint: %d empty _extra_state entries not in %s, kept as the model has them",
            len(taken),
            checkpoint_dir,
        )
    loaded = dist_checkpointing.load(sharded_state_dict, str(checkpoint_dir), **load_kwargs)
    state = loaded[0] if isinstance(loaded, tuple) else loaded
    for path, value in taken.items():
        _put(state, path, value)
    return loaded


def tp_replica_id(replica_id, tp_rank):
    """The replica id of a tensor replicated across TP ranks, in megatron's (PP, TP, DP) form."""
    if not (isinstance(replica_id, tuple) and len(replica_id) == 3):
        raise ValueError(f"expected a (PP, TP, DP) replica id, got {replica_id!r}")
    return (replica_id[0], tp_rank, replica_id[2])


def misplaced_tp_replicas(sharded_state_dict, tp_rank, key_part="norm"):
    """{checkpoint key: replica id} for entries whose key contains ``key_part`` (norms by
    default; TP-replicated) and whose TP replica id is not ``tp_rank``. Empty when right."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    wrong = {}
    for value in _walk(sharded_state_dict):
        if isinstance(value, (ShardedTensor, ShardedObject)) and key_part in value.key:
            rid = value.replica_id
            if isinstance(rid, tuple) and len(rid) == 3 and rid[1] != tp_rank:
                wrong[value.key] = rid
    return wrong


def _walk(tree):
    values = tree.values() if isinstance(tree, dict) else tree
    for value in values:
        if isinstance(value, (dict, list)):
            yield from _walk(value)
        else:
            yield value
