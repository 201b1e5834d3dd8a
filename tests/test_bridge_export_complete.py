"""An export never drops or invents a tensor (app/hf_layout.py): the tensors a Hugging Face
folder must hold come from the architecture its config.json describes (transformers on the meta
device), not from the names in the ``--hf-config`` folder's files; ``convert export`` fails,
naming the tensor, and keeps nothing, where the written folder differs from it.

The Megatron-Bridge legs run this file (both Bridge releases: transformers 4 with Bridge 0.3.1,
transformers 5 with Bridge main, whose load-time weight conversions the reference reverts)."""

import json
import os
import shutil

import pytest
from helpers import MODE, convert_process, hf_model, needs_bridge

pytestmark = [
    pytest.mark.cuda_hidden,
    needs_bridge(),
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the command line is part of the shim"),
]

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3-moe", "gpt-oss", "deepseek-v3", "mixtral")


def copy_without(source, folder, drop=(), add=None, reshape=None):
    """A copy of the HF folder ``source`` whose safetensors (and shard index) lack the tensors
    ``drop``, hold the extra tensors ``add`` and have ``reshape``'s tensors in another shape."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, folder)
    for name in sorted(n for n in os.listdir(folder) if n.endswith(".safetensors")):
        path = os.path.join(folder, name)
        tensors = {k: v for k, v in load_file(path).items() if k not in drop}
        for key in reshape or ():
            if key in tensors:
                tensors[key] = torch.zeros(tensors[key].shape[0] + 1, *tensors[key].shape[1:], dtype=tensors[key].dtype)
        tensors.update(add or {})
        add = None  # only into the first file
        save_file(tensors, path, metadata={"format": "pt"})
    index = os.path.join(folder, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            content = json.load(f)
        content["weight_map"] = {k: v for k, v in content["weight_map"].items() if k not in drop}
        with open(index, "w") as f:
            json.dump(content, f)
    return str(folder)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tiny_family_holds_its_architecture(family):
    from mcore_cpu_shim.app import hf_layout

    folder = hf_model(family)
    required, optional = expected = hf_layout.expected_tensors(folder)
    facts = hf_layout.check_complete(folder, expected)
    assert facts["expected"] == len(required) == facts["written"] > 0
    assert not optional  # none of them ties its embeddings


def test_tied_embeddings_may_leave_the_output_embedding_out(tmp_path):
    from mcore_cpu_shim.app import hf_layout, hf_models

    folder = hf_models.write("qwen2", tmp_path / "tied", tie_word_embeddings=True)
    required, optional = hf_layout.expected_tensors(folder)
    assert list(optional) == ["lm_head.weight"] and "lm_head.weight" not in hf_layout.written_tensors(folder)
    assert hf_layout.check_complete(folder, (required, optional))["expected"] == len(required)


def test_a_missing_an_extra_and_a_misshaped_tensor_are_named(tmp_path):
    import torch
    from mcore_cpu_shim.app import hf_layout
    from mcore_cpu_shim.app.worker import VerifyMismatch

    source = hf_model("llama")
    for case, options, named in [
        ("missing", dict(drop=["model.norm.weight"]), "1 missing (e.g. model.norm.weight)"),
        ("extra", dict(add={"model.layers.9.mlp.up_proj.weight": torch.zeros(2)}),
         "1 not in the architecture (e.g. model.layers.9.mlp.up_proj.weight)"),
        ("misshaped", dict(reshape=["model.embed_tokens.weight"]), "1 of another shape (e.g. model.embed_tokens.weight"),
    ]:
        folder = copy_without(source, tmp_path / case, **options)
        with pytest.raises(VerifyMismatch) as raised:
            hf_layout.check_complete(folder, hf_layout.expected_tensors(source))
        assert named in str(raised.value), str(raised.value)


# Real in what changes code paths, small in layers: a 151,936-word vocabulary (Qwen2's),
# head_dim 32 where hidden / heads is 16, 2 KV heads for 4 query heads, tied embeddings (no
# lm_head.weight in the files, as Qwen2.5-0.5B and Llama-3.2-1B), several shards with an index.
REAL_SHAPES = dict(vocab_size=151936, head_dim=32, num_key_value_heads=2, tie_word_embeddings=True)


def real_shapes(root):
    """A float16 Qwen2 of REAL_SHAPES, sharded; imported with ``--dtype bfloat16 --verify``
    (the comparison with the source cast to bfloat16); and that source cast to bfloat16, the
    reference of the export. (One import for both exports below: a module fixture would be
    made again in every forked test.)"""
    from safetensors.torch import save_file

    from mcore_cpu_shim.app import hf_models

    source = hf_models.write("qwen2", root / "hf", dtype="float16", shard_size="8MB", **REAL_SHAPES)
    shards = [n for n in os.listdir(source) if n.endswith(".safetensors")]
    assert len(shards) > 1 and os.path.exists(os.path.join(source, "model.safetensors.index.json")), shards
    imported = convert_process("import", "--hf", source, "--out", root / "megatron", "--dtype", "bfloat16", "--verify")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    reference = root / "reference"
    shutil.copytree(source, reference, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    save_file({k: v.bfloat16() for k, v in hf_models.tensors(source).items()}, str(reference / "model.safetensors"))
    config = json.loads((reference / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps(dict(config, torch_dtype="bfloat16", dtype="bfloat16")))
    return source, str(root / "megatron"), str(reference), imported.stdout


def test_the_architecture_decides_what_an_export_writes(tmp_path):
    """Bridge's save_hf_pretrained(strict=False) skips every tensor the --hf-config folder's
    files do not name: with a folder whose files lack the final norm, the export used to
    report success without it (transformers then loaded it with a freshly initialised norm).
    The export now writes what the architecture holds, in a staged sharding; it equals the
    source cast to bfloat16, and transformers gives that model's logits. And a --hf-config
    whose config.json describes another model than the checkpoint (one layer more): the export
    yields no tensor for that layer, and fails naming them; nothing is kept."""
    import torch
    from mcore_cpu_shim.app import hf_models
    from mcore_cpu_shim.app.demo_bridge import hf_logits, tokens

    source, megatron, reference, imported = real_shapes(tmp_path)
    count = len(hf_models.tensors(source))
    assert f"{count}/{count} tensors equal" in imported  # --dtype bfloat16: the source cast, exactly
    config_folder = copy_without(source, tmp_path / "config", drop=["model.norm.weight"])
    out = tmp_path / "back"
    exported = convert_process("export", "--megatron", megatron, "--hf-config", config_folder, "--out", out, "--verify")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    expected, written = hf_models.tensors(reference), hf_models.tensors(out)
    tied = written.pop("lm_head.weight", None)  # the architecture allows it; the files have none
    assert tied is None or torch.equal(tied, written["model.embed_tokens.weight"])
    assert expected.keys() == written.keys()
    differing = [k for k in expected if expected[k].dtype != written[k].dtype or not torch.equal(expected[k], written[k])]
    assert not differing, differing
    ids = tokens(REAL_SHAPES["vocab_size"], 2, 16)
    assert torch.equal(hf_logits(str(out), ids)[0], hf_logits(reference, ids)[0])

    config_folder = tmp_path / "longer"
    shutil.copytree(source, config_folder)
    config = json.loads((config_folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config["num_hidden_layers"] = layers + 1
    if config.get("layer_types"):  # transformers checks that there is one per layer
        config["layer_types"].append(config["layer_types"][-1])
    (config_folder / "config.json").write_text(json.dumps(config))
    out = tmp_path / "short"
    exported = convert_process("export", "--megatron", megatron, "--hf-config", config_folder, "--out", out)
    assert exported.returncode == 1, exported.stdout + exported.stderr
    assert "missing (e.g. model.layers.%d." % layers in exported.stderr, exported.stderr
    assert "  save HF: FAILED" in exported.stdout
    assert not out.exists()


def test_a_source_that_is_not_the_model_its_config_describes_is_refused(tmp_path):
    """Before any work: a source tensor missing, or in another shape than config.json says,
    is an input problem named with the fix (exit 2), and nothing is written."""
    import torch
    from mcore_cpu_shim.app import hf_layout
    from mcore_cpu_shim.app.quantized import source_tensors
    from mcore_cpu_shim.app.worker import InputProblem

    source = hf_model("llama")
    hf_layout.check_source(source_tensors(source), hf_layout.expected_tensors(source), source)  # whole: passes
    short = copy_without(source, tmp_path / "short", drop=["model.layers.1.mlp.down_proj.weight"])
    with pytest.raises(InputProblem, match=r"1 missing \(e.g. model.layers.1.mlp.down_proj.weight\)"):
        hf_layout.check_source(source_tensors(short), hf_layout.expected_tensors(short), short)
    extra = copy_without(source, tmp_path / "extra", add={"model.layers.2.mtp.weight": torch.zeros(2)})
    hf_layout.check_source(source_tensors(extra), hf_layout.expected_tensors(extra), extra)  # beyond: the converter's

    wrong = copy_without(source, tmp_path / "wrong", reshape=["model.norm.weight"])
    out = tmp_path / "out"
    result = convert_process("import", "--hf", wrong, "--out", out)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "model.norm.weight [65] (config.json: [64])" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def dtype_of_this_leg():
    """One of the two dtypes per Bridge leg (an import and an export each, ~40 s of a leg's CI
    time): float32 with Bridge 0.3.1 (transformers 4), float16 with Bridge main (transformers 5,
    which names the dtype ``dtype``, not ``torch_dtype``)."""
    from mcore_cpu_shim import engine

    return "float32" if engine.bridge_version().startswith("0.3.") else "float16"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_float32_or_float16_source_comes_back_in_its_dtype(dtype, tmp_path):
    """The checkpoint keeps the source's dtype where --dtype does not say another (the import's
    verify compares with the source as it is), and the export gives it back exactly."""
    import torch
    from mcore_cpu_shim.app import hf_models

    here = dtype_of_this_leg()
    if dtype != here:
        pytest.skip(f"{dtype}: runs in the other Bridge leg of the matrix (this one: {here})")

    source = hf_models.write("llama", tmp_path / "hf", dtype=dtype)
    imported = convert_process("import", "--hf", source, "--out", tmp_path / "megatron", "--verify")
    assert imported.returncode == 0, imported.stdout + imported.stderr
    exported = convert_process("export", "--megatron", tmp_path / "megatron", "--hf-config", source,
                               "--out", tmp_path / "back")
    assert exported.returncode == 0, exported.stdout + exported.stderr
    expected, written = hf_models.tensors(source), hf_models.tensors(tmp_path / "back")
    assert {str(t.dtype) for t in written.values()} == {f"torch.{dtype}"}
    assert expected.keys() == written.keys() and all(torch.equal(expected[k], written[k]) for k in expected)
