"""bridge_replicated_device: a weight every TP rank holds whole (a layer norm, a bias, a router)
reaches each rank of a real two-rank Gloo group without CUDA, as TP rank 0 read it; and a
``--tp 2 --pp 2`` conversion (import, verify, export, import at another layout) gives back
every tensor of the source exactly.
"""

import json
import os

import pytest
from helpers import MODE, NO_CUDA, assert_same_as, convert_process, expected_state, init_gloo, leave_group, \
    needs_bridge, round_trip, run_ranks

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_replicated_device"
shim_only = pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the command line is part of the shim")


def broadcast_rank(rank, world_size, workdir):
    """One rank: load a layer norm's weight through ReplicatedMapping (rank 1 is handed other
    values, which the broadcast from TP rank 0 must replace); print whether it is rank 0's."""
    import mcore_cpu_shim
    import torch

    init_gloo(workdir, rank=rank, world_size=world_size, tensor_parallel=2)
    from megatron.bridge.models.conversion.param_mapping import ReplicatedMapping

    weight = torch.linspace(-1, 1, 8, dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(8, dtype=torch.bfloat16)
    mapping = ReplicatedMapping("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                                "model.layers.0.input_layernorm.weight")
    given = weight.clone() if rank == 0 else torch.zeros_like(weight)
    loaded = mapping.hf_to_megatron(given, norm)
    print(json.dumps({"equal": torch.equal(loaded, weight), "device": str(loaded.device),
                      "state": mcore_cpu_shim.status()[FIX]["state"]}))
    leave_group()


def test_every_rank_gets_rank_zeros_weight_on_the_cpu(tmp_path):
    results = run_ranks("test_bridge_replicated_device:broadcast_rank", 2, str(tmp_path))
    for code, output in results:
        assert code == 0, output[-4000:]
        report = json.loads([line for line in output.splitlines() if line.startswith('{"equal"')][-1])
        assert report == {"equal": True, "device": "cpu", "state": expected_state(FIX)}


def test_without_the_fix_the_broadcast_asks_for_cuda(tmp_path, monkeypatch):
    if MODE != "shim":
        pytest.skip(f"mode {MODE}: Bridge is patched, there is no unfixed code to run")
    monkeypatch.setenv("MCORE_CPU_SHIM_DISABLE", FIX)
    results = run_ranks("test_bridge_replicated_device:broadcast_rank", 2, str(tmp_path))
    assert any(code != 0 for code, _ in results), results
    assert any(any(words in output for words in NO_CUDA) for _, output in results), results[0][1][-4000:]


@shim_only
def test_tp2_pp2_import_reshards_exactly(tmp_path):
    """GPT-OSS at TP 2 x PP 2 (4 ranks): layer norms, biases, the router and sinks replicated,
    attention split by row and column, one layer per stage, the experts whole (expert TP 1).
    Exported on one rank and imported again at PP 2 x EP 2, every tensor is the source's."""
    hf, count, imported = round_trip(tmp_path, "gpt-oss", "--tp", 2, "--pp", 2)
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert "4 ranks, TP 2, PP 2, EP 1" in imported.stdout and f"{count}/{count} tensors equal" in imported.stdout
    assert "CUDA initialised: no" in imported.stdout
    exported = convert_process("export", "--megatron", tmp_path / "megatron", "--hf-config", hf,
                               "--out", tmp_path / "back", "--verify")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    assert assert_same_as(hf, tmp_path / "back") == count
    again = convert_process("import", "--hf", tmp_path / "back", "--out", tmp_path / "again", "--pp", 2, "--ep", 2,
                            "--verify")
    assert again.returncode == 0, again.stdout + again.stderr
    assert "4 ranks, TP 1, PP 2, EP 2" in again.stdout and f"{count}/{count} tensors equal" in again.stdout


@shim_only
def test_without_the_fix_a_tp2_import_stops_copying_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("MCORE_CPU_SHIM_DISABLE", FIX)
    _, _, imported = round_trip(tmp_path, "llama", "--tp", 2)
    text = imported.stdout + imported.stderr
    assert imported.returncode != 0, text
    assert "copy weights" in text and any(words in text for words in NO_CUDA), text[-4000:]
    assert not os.path.isdir(tmp_path / "megatron" / "iter_0000000")
