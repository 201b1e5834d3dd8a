"""te_checkpoint: a local-spec checkpoint loads into a model whose TE modules hold empty
``_extra_state``; non-empty extra state is still saved and loaded; norm replica ids.

The hidden leg has no Transformer Engine: stand-in modules implement get_extra_state /
set_extra_state as TE modules outside FP8 do (a zero-length uint8 tensor), and the sharded
state dicts, saves and loads are megatron-core's own. The visible leg builds the real TE model
(tests/gpu/te_leg.py) where Transformer Engine is importable.
"""

import io
import os
import sys

import pytest
from helpers import TESTS_DIR, init_gloo, run_python

HIDDEN = 16


def stand_in_te_norm(state=None):
    """A norm with extra state, like a TE 2.x LayerNorm: empty unless given ``state``."""
    import torch

    class TeLikeNorm(torch.nn.LayerNorm):
        def __init__(self):
            super().__init__(HIDDEN)
            self.state = state
            self.received = []

        def get_extra_state(self):
            return torch.empty(0, dtype=torch.uint8) if self.state is None else self.state

        def set_extra_state(self, value):
            self.received.append(value)

    return TeLikeNorm()


def holder(norm):
    import torch

    model = torch.nn.Module()
    model.norm = norm
    return model


def sharded(model):
    """megatron-core's sharded state dict of a non-Megatron module (as for TENorm)."""
    from megatron.core.transformer.utils import sharded_state_dict_default

    return sharded_state_dict_default(model.norm, "norm.")


def save(model, path):
    from megatron.core import dist_checkpointing

    path.mkdir()
    dist_checkpointing.save(sharded(model), str(path))
    return path


def randomised(norm, seed):
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in norm.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
    return norm


@pytest.mark.cuda_hidden
@pytest.mark.parametrize(
    "value, empty",
    [
        ("none", True),
        ("empty-uint8", True),
        ("empty-bytes", True),
        ("empty-buffer", True),
        ("saved-none", True),
        ("saved-empty-dict", True),
        ("uint8", False),
        ("saved-dict", False),
        ("bytes", False),
    ],
)
def test_is_empty_extra_state(value, empty):
    import torch
    from mcore_cpu_shim.te_checkpoint import is_empty_extra_state

    def saved(obj):
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer

    values = {
        "none": None,
        "empty-uint8": torch.empty(0, dtype=torch.uint8),
        "empty-bytes": b"",
        "empty-buffer": io.BytesIO(),
        "saved-none": saved(None),
        "saved-empty-dict": saved({}),
        "uint8": torch.tensor([1, 2], dtype=torch.uint8),
        "saved-dict": saved({"scale_fwd": torch.ones(2)}),
        "bytes": b"\x01",
    }
    assert is_empty_extra_state(values[value]) is empty


@pytest.mark.cuda_hidden
def test_local_checkpoint_loads_where_te_extra_state_is_empty(tmp_path, forbid_cuda):
    import torch
    from megatron.core import dist_checkpointing
    from mcore_cpu_shim import te_checkpoint

    init_gloo(tmp_path)
    local = holder(randomised(torch.nn.LayerNorm(HIDDEN), seed=1))  # the local norm: no extra state
    ckpt = save(local, tmp_path / "ckpt")
    te = holder(stand_in_te_norm())
    request = sharded(te)
    assert "norm._extra_state" in request

    # megatron-core alone requires the entry the local checkpoint cannot have.
    with pytest.raises(BaseException) as missing:  # torch's CheckpointException is one
        dist_checkpointing.load(sharded(te), str(ckpt))
    assert "Missing key in checkpoint state_dict: norm._extra_state" in str(missing.value)

    loaded = te_checkpoint.load(request, ckpt)
    assert set(loaded) == {"norm.weight", "norm.bias", "norm._extra_state"}
    assert loaded["norm._extra_state"].numel() == 0
    te.load_state_dict(loaded, strict=True)
    assert torch.equal(te.norm.weight, local.norm.weight)
    assert torch.equal(te.norm.bias, local.norm.bias)
    assert [v.numel() for v in te.norm.received] == [0]  # handed its own empty state back


@pytest.mark.cuda_hidden
def test_non_empty_extra_state_is_saved_and_loaded(tmp_path, forbid_cuda):
    import torch
    from mcore_cpu_shim import te_checkpoint
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    init_gloo(tmp_path)
    fp8_meta = torch.tensor([7, 1, 3], dtype=torch.uint8)
    ckpt = save(holder(stand_in_te_norm(state=fp8_meta)), tmp_path / "ckpt")
    stored = {e.key for e in load_sharded_metadata(str(ckpt)).values()}
    assert "norm._extra_state" in stored

    fresh = holder(stand_in_te_norm())  # a fresh TE model: empty until FP8 runs
    loaded = te_checkpoint.load(sharded(fresh), ckpt)
    assert torch.equal(loaded["norm._extra_state"], fp8_meta)
    fresh.load_state_dict(loaded, strict=True)
    assert torch.equal(fresh.norm.received[0], fp8_meta)


@pytest.mark.cuda_hidden
def test_missing_non_empty_extra_state_is_an_error(tmp_path, forbid_cuda):
    import torch
    from mcore_cpu_shim import te_checkpoint

    init_gloo(tmp_path)
    ckpt = save(holder(torch.nn.LayerNorm(HIDDEN)), tmp_path / "ckpt")
    te = holder(stand_in_te_norm(state=torch.tensor([5], dtype=torch.uint8)))
    with pytest.raises(te_checkpoint.MissingExtraStateError, match=r"norm\._extra_state/shard_"):
        te_checkpoint.load(sharded(te), ckpt)


@pytest.mark.cuda_hidden
def test_norm_replica_ids(tmp_path):
    from mcore_cpu_shim.te_checkpoint import misplaced_tp_replicas, tp_replica_id

    init_gloo(tmp_path)
    request = sharded(holder(stand_in_te_norm()))
    assert {v.replica_id for v in request.values()} == {(0, 0, 0)}
    assert misplaced_tp_replicas(request, tp_rank=0) == {}
    # What a TP rank 1 must not write: the id of the main replica.
    assert misplaced_tp_replicas(request, tp_rank=1) == {
        "norm.weight": (0, 0, 0),
        "norm.bias": (0, 0, 0),
        "norm._extra_state": (0, 0, 0),
    }
    assert tp_replica_id((0, 0, 3), tp_rank=2) == (0, 2, 3)
    with pytest.raises(ValueError, match="replica id"):
        tp_replica_id(0, tp_rank=1)


def te_importable():
    """(True, "") or (False, why): importing TE fails with many exception types on bad hosts."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as exc:  # ImportError, OSError, RuntimeError, ...
        return False, f"{type(exc).__name__}: {exc}"
    return True, ""


@pytest.mark.cuda_visible
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_te_model_loads_a_cpu_checkpoint(tmp_path, moe):
    """CPU (CUDA hidden, local spec) writes; the TE model on the GPU loads and matches."""
    ok, why = te_importable()
    if not ok:
        pytest.skip(f"Transformer Engine is not importable here: {why}")
    sys.path.insert(0, os.path.join(TESTS_DIR, "gpu"))
    import te_leg

    ckpt = tmp_path / "ckpt"
    written = run_python(
        f"""
        import te_leg
        te_leg.write({str(ckpt)!r}, moe={moe}, store={str(tmp_path / 'w')!r})
        """,
        CUDA_VISIBLE_DEVICES="",
        PYTHONPATH=os.pathsep.join(filter(None, [os.path.join(TESTS_DIR, "gpu"), os.environ.get("PYTHONPATH")])),
    )
    assert written.returncode == 0, written.stderr
    report = te_leg.load_and_compare(str(ckpt), moe=moe, store=str(tmp_path / "r"))
    assert report["missing_in_te"] == [] and report["differing"] == [], report
    assert report["load_state_dict_missing"] == [], report
    assert report["load_state_dict_unexpected"] == [], report
    assert report["compared"] > 0
    assert report["max_logit_diff"] < 1e-2, report
