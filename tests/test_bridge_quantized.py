"""Checkpoints in the quantized layouts vendors publish convert exactly, on both
Megatron-Bridge legs: a GPT-OSS in MXFP4 (expert weights as ``*_blocks``/``*_scales``,
``quant_method: mxfp4``; ``hf_models.write_mxfp4``) and a DeepSeek-V3 in FP8 (linear weights
float8 e4m3 with a ``*_scale_inv`` per block, ``quant_method: fp8``; ``hf_models.write_fp8``,
with 32 x 32 blocks so that the tiny matrices have several, and partial ones at the edges).

The reference of every comparison is the dequantized model: the blocks decoded by this
project's own reading (``app/quantized.py``); for MXFP4, Bridge dequantizes on import with its
own code, so ``--verify`` compares two independent decodings; an FP8 source is dequantized by
convert itself (no Bridge reads the scales for every model), shard by shard, into a folder next
to ``--out`` that is removed afterwards. The export written back with the quantized folder as
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


def test_fp8_reference_decoding_by_hand():
    torch = pytest.importorskip("torch")
    from mcore_cpu_shim.app.quantized import dequantize_fp8

    weight = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]).to(torch.float8_e4m3fn)
    scale_inv = torch.tensor([[2.0, 3.0], [5.0, 7.0]])  # 2 x 2 blocks over 3 x 3: partial edges
    values = dequantize_fp8(weight, scale_inv, (2, 2), torch.float32)
    assert values.tolist() == [[2.0, 4.0, 9.0], [8.0, 10.0, 18.0], [35.0, 40.0, 63.0]]


@pytest.fixture(scope="module")
def fp8(tmp_path_factory):
    from mcore_cpu_shim.app import hf_models

    root = tmp_path_factory.mktemp("fp8")
    folder = hf_models.write_fp8(root / "deepseek-fp8", root / "reference", block=(32, 32))
    return folder, str(root / "reference")


def test_fp8_layout_is_the_published_one(fp8):
    from mcore_cpu_shim.app import hf_models

    folder, reference = fp8
    stored = hf_models.tensors(folder)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"  # 40 x 64: a partial row block
    assert str(stored[name].dtype) == "torch.float8_e4m3fn" and list(stored[name].shape) == [40, 64]
    assert list(stored[f"{name}_scale_inv"].shape) == [2, 2] and str(stored[f"{name}_scale_inv"].dtype) == "torch.float32"
    for plain in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.1.mlp.gate.weight",
                  "model.layers.0.input_layernorm.weight"):
        assert plain in stored and f"{plain}_scale_inv" not in stored and str(stored[plain].dtype) == "torch.bfloat16"


@pytest.mark.parametrize("layout", ["mxfp4", "fp8"])
def test_import_verify_export_and_logits(layout, request, tmp_path):
    import torch
    from mcore_cpu_shim.app import hf_models
    from mcore_cpu_shim.app.demo_bridge import hf_logits, tokens

    folder, reference = request.getfixturevalue(layout)
    count = len(hf_models.tensors(reference))
    imported = convert_process("import", "--hf", folder, "--out", tmp_path / "megatron", "--verify")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    assert f"{count}/{count} tensors equal" in imported.stdout  # the dequantized model, exactly
    if layout == "fp8":
        assert "  dequantize: ok (" in imported.stdout
    assert not [n for n in os.listdir(tmp_path) if ".dequantized-" in n]  # the copy is gone

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
