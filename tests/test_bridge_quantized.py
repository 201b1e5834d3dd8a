"""A GPT-OSS in the MXFP4 layout its checkpoints are published in (expert weights as
``*_blocks``/``*_scales``, ``quant_method: mxfp4``; written locally by
``hf_models.write_mxfp4``) converts exactly, on both Megatron-Bridge legs.

The reference of every comparison is the dequantized model: the blocks decoded by this
project's own MXFP4 reading (``app/quantized.py``), independent of Bridge's. Import
``--verify`` compares with it; the export written back with the MXFP4 folder as
``--hf-config`` holds every dequantized tensor (none dropped for a name the folder's files do
not have), no ``quantization_config``, and transformers gives the reference's logits."""

import json
import os

import pytest
from helpers import MODE, convert_process, needs_bridge

pytestmark = [
    pytest.mark.cuda_hidden,
    needs_bridge(),
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the command line is part of the shim"),
]


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    from mcore_cpu_shim.app import hf_models

    root = tmp_path_factory.mktemp("mxfp4")
    folder = hf_models.write_mxfp4(root / "gpt-oss-mxfp4", root / "reference")
    return folder, str(root / "reference")


def test_the_layout_is_the_published_one(mxfp4):
    from mcore_cpu_shim.app import hf_models

    folder, reference = mxfp4
    stored = hf_models.tensors(folder)
    blocks, scales = stored["model.layers.0.mlp.experts.gate_up_proj_blocks"], stored["model.layers.0.mlp.experts.gate_up_proj_scales"]
    expected = hf_models.tensors(reference)["model.layers.0.mlp.experts.gate_up_proj"]  # [experts, hidden, 2 x ffn]
    experts, hidden, out = expected.shape
    assert (list(blocks.shape), str(blocks.dtype)) == ([experts, out, hidden // 32, 16], "torch.uint8")
    assert (list(scales.shape), str(scales.dtype)) == ([experts, out, hidden // 32], "torch.uint8")
    assert "model.layers.0.mlp.experts.gate_up_proj" not in stored
    assert json.loads(open(os.path.join(folder, "config.json")).read())["quantization_config"]["quant_method"] == "mxfp4"


def test_the_reference_decoding_by_hand():
    torch = pytest.importorskip("torch")
    from mcore_cpu_shim.app.quantized import dequantize_mxfp4

    # One block: bytes 0x21 (low nibble 1 = +0.5, high nibble 2 = +1.0), then 0xF8
    # (low 8 = -0.0, high 15 = -6.0), the rest zero; scale 129 = 2^2.
    block = torch.zeros(1, 1, 16, dtype=torch.uint8)
    block[0, 0, 0], block[0, 0, 1] = 0x21, 0xF8
    values = dequantize_mxfp4(block, torch.tensor([[129]], dtype=torch.uint8), torch.float32)
    assert values.shape == (1, 32)
    assert values[0, :4].tolist() == [2.0, 4.0, -0.0, -24.0] and not values[0, 4:].any()


def test_import_verify_export_and_logits(mxfp4, tmp_path):
    import torch
    from mcore_cpu_shim.app import hf_models
    from mcore_cpu_shim.app.demo_bridge import hf_logits, tokens

    folder, reference = mxfp4
    count = len(hf_models.tensors(reference))
    imported = convert_process("import", "--hf", folder, "--out", tmp_path / "megatron", "--verify")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert f"{count}/{count} tensors equal" in imported.stdout  # Bridge's decoding = ours, exactly

    exported = convert_process("export", "--megatron", tmp_path / "megatron", "--hf-config", folder,
                               "--out", tmp_path / "back", "--verify")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    expected, written = hf_models.tensors(reference), hf_models.tensors(tmp_path / "back")
    assert expected.keys() == written.keys()
    differing = [k for k in expected if expected[k].dtype != written[k].dtype or not torch.equal(expected[k], written[k])]
    assert not differing, differing
    assert "quantization_config" not in json.loads((tmp_path / "back" / "config.json").read_text())

    ids = tokens(256, 2, 16)
    assert torch.equal(hf_logits(str(tmp_path / "back"), ids)[0], hf_logits(reference, ids)[0])
