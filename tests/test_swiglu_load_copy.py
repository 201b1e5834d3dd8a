"""swiglu_load_copy: a torch_dist load of a SwiGLU model returns each ``linear_fc1`` weight as
the parameter it was read into (no concatenated copy), and every tensor comes back exactly;
halves read anywhere else are still concatenated."""

import pytest
from helpers import MODE, init_gloo, run_without_fix, tensors, tiny_gpt

FIX = "swiglu_load_copy"
GATED = dict(gated_linear_unit=True)


def load(tmp_path):
    """A gated tiny GPT saved as torch_dist, and loaded into a fresh one whose parameters are
    NaN: ``(saved tensors, the fresh model, what dist_checkpointing.load returned)``."""
    import torch
    from megatron.core import dist_checkpointing

    init_gloo(str(tmp_path))
    saved = tiny_gpt(seed=1, **GATED)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    dist_checkpointing.save(saved.sharded_state_dict(), str(checkpoint))
    fresh = tiny_gpt(seed=2, **GATED)
    with torch.no_grad():
        for parameter in fresh.parameters():
            parameter.fill_(float("nan"))
    return tensors(saved), fresh, dist_checkpointing.load(fresh.sharded_state_dict(), str(checkpoint))


def check_load(tmp_path):
    import torch

    expected, fresh, loaded = load(tmp_path)
    parameters = dict(fresh.named_parameters())
    fc1 = [name for name in loaded if name.endswith("mlp.linear_fc1.weight")]
    assert len(fc1) == 2, sorted(loaded)  # one per layer
    for name in fc1:
        assert loaded[name].data_ptr() == parameters[name].data_ptr(), f"{name} was loaded into a copy"
        assert torch.equal(loaded[name], expected[name]), name
    fresh.load_state_dict(loaded)
    actual = tensors(fresh)
    assert actual.keys() == expected.keys()
    assert [k for k in expected if not torch.equal(expected[k], actual[k])] == []


@pytest.mark.cuda_hidden
def test_fc1_is_loaded_into_the_parameter(tmp_path, forbid_cuda):
    check_load(tmp_path)
    assert forbid_cuda == []


@pytest.mark.cuda_visible
def test_fc1_is_loaded_into_the_parameter_on_a_gpu_host(tmp_path):
    """The same with a GPU visible: the model is built on the CPU and loads there."""
    check_load(tmp_path)


@pytest.mark.cuda_hidden
def test_halves_read_elsewhere_are_concatenated():
    """A load whose halves are not the parameter's own memory (its own buffers) gets the
    concatenation, and the parameter is left alone."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    weight = torch.nn.Parameter(torch.zeros(6, 4))
    factory = apply_swiglu_sharded_factory(ShardedTensor.from_rank_offsets("fc1", weight, (0, 0, 1)), ())
    halves = [torch.full((3, 4), 1.0), torch.full((3, 4), 2.0)]
    merged = factory.merge_fn(halves)
    assert torch.equal(merged, torch.cat(halves)) and merged.data_ptr() != weight.data_ptr()
    assert torch.equal(weight, torch.zeros(6, 4))
    in_place = factory.merge_fn(list(torch.chunk(weight, 2)))
    assert torch.equal(in_place, weight) and in_place.data_ptr() == weight.data_ptr()
    assert not in_place.requires_grad


@pytest.mark.cuda_hidden
def test_without_the_fix_fc1_is_a_copy(tmp_path):
    if MODE != "shim":
        pytest.skip(f"mode {MODE}: megatron-core is patched, there is no unfixed code to run")
    stderr = run_without_fix(FIX, f"""
import pathlib
import mcore_cpu_shim
from test_swiglu_load_copy import check_load
check_load(pathlib.Path({str(tmp_path)!r}))
""")
    assert "was loaded into a copy" in stderr, stderr[-3000:]
