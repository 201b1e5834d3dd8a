"""bridge_scatter_contiguous: every TP rank gets its own shard of a Hugging Face weight, exactly,
over a real two-rank Gloo group, through Bridge's own row- and column-parallel mappings.

The conversion at TP 2 (import, verify, export, every tensor equal to the source) is
test_bridge_replicated_device.py::test_tp2_round_trip_is_exact; this isolates the scatter.
"""

import json

import pytest
from helpers import MODE, expected_state, init_gloo, leave_group, needs_bridge, run_ranks

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_scatter_contiguous"


def scatter_rank(rank, world_size, workdir):
    """One rank: load a 6x8 weight through RowParallelMapping (split along dim 1: views that
    are not contiguous) and ColumnParallelMapping (dim 0); print whether each shard is this
    rank's chunk of the weight."""
    import mcore_cpu_shim
    import torch

    init_gloo(workdir, rank=rank, world_size=world_size, tensor_parallel=2)
    from megatron.bridge.models.conversion.param_mapping import ColumnParallelMapping, RowParallelMapping

    weight = torch.arange(6 * 8, dtype=torch.bfloat16).reshape(6, 8)
    equal = {}
    for kind, dim in ((RowParallelMapping, 1), (ColumnParallelMapping, 0)):
        want = torch.chunk(weight, world_size, dim=dim)[rank]
        local = torch.nn.Linear(want.shape[1], want.shape[0], bias=False, dtype=torch.bfloat16)
        mapping = kind("decoder.layers.0.self_attention.linear_proj.weight", "model.layers.0.self_attn.o_proj.weight")
        shard = mapping.hf_to_megatron(weight.clone(), local)
        equal[kind.__name__] = torch.equal(shard, want)
    print(json.dumps({"equal": equal, "state": mcore_cpu_shim.status()[FIX]["state"]}))
    leave_group()


def scatter(tmp_path):
    results = run_ranks("test_bridge_scatter_contiguous:scatter_rank", 2, str(tmp_path))
    for code, output in results:
        assert code == 0, output[-4000:]
    # (the output has stderr too: the JSON line is the last that starts like one)
    return [json.loads([line for line in output.splitlines() if line.startswith('{"equal"')][-1])
            for _, output in results]


def test_each_rank_gets_its_shard(tmp_path):
    for report in scatter(tmp_path):
        assert report == {"equal": {"RowParallelMapping": True, "ColumnParallelMapping": True},
                          "state": expected_state(FIX)}


def test_without_the_fix_row_parallel_shards_are_wrong(tmp_path, monkeypatch):
    if MODE != "shim":
        pytest.skip(f"mode {MODE}: Bridge is patched, there is no unfixed code to run")
    if expected_state(FIX) != "applied":
        pytest.skip("this Megatron-Bridge makes the shards contiguous itself (0.4.0 and later)")
    monkeypatch.setenv("MCORE_CPU_SHIM_DISABLE", FIX)
    reports = scatter(tmp_path)
    # Each rank's row shard is read as if its view were contiguous: wrong after its first row,
    # on rank 0 (the source) as on rank 1; the column shards are contiguous and right.
    assert [r["equal"] for r in reports] == [{"RowParallelMapping": False, "ColumnParallelMapping": True}] * 2, reports
