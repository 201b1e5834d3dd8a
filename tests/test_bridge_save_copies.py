"""bridge_save_copies: Bridge's low-memory save copies only the tensors that are views of part
of a storage (the SwiGLU halves), runs no periodic garbage collection, and writes the same
checkpoint as the unfixed save; the export of it gives back the source's tensors exactly.

The model has 20 layers, so that the unfixed save's periodic collections (every 20 factories,
every 50 tensors) happen at all; its tensors are tiny, so the test is about counts, not time
(the time is benchmarks/bench_convert.py's).
"""

import os

import pytest
from helpers import MODE, expected_state, needs_bridge, run_bridge, run_python
from test_bridge_roundtrip import EXPORT

pytestmark = [pytest.mark.cuda_hidden, needs_bridge()]

FIX = "bridge_save_copies"
LAYERS = 20

SAVE = """
import gc, json, sys
import mcore_cpu_shim, torch
from megatron.bridge import AutoBridge
hf, out = sys.argv[1:3]
bridge = AutoBridge.from_hf_pretrained(hf)
provider = bridge.to_megatron_provider(load_weights=True)
provider.finalize()
model = provider.provide_distributed_model(wrap_with_ddp=False, use_cpu_initialization=True)
counts = {"whole copies": 0, "view copies": 0, "collections": 0}
clone, collect = torch.Tensor.clone, gc.collect

def counted_clone(self, *args, **kwargs):
    whole = (self.is_contiguous() and self.storage_offset() == 0
             and self.untyped_storage().nbytes() == self.numel() * self.element_size())
    counts["whole copies" if whole else "view copies"] += 1
    return clone(self, *args, **kwargs)

def counted_collect(*args):
    counts["collections"] += 1
    return collect(*args)

torch.Tensor.clone, gc.collect = counted_clone, counted_collect
try:
    bridge.save_megatron_model(model, out, low_memory_save=True)
finally:
    torch.Tensor.clone, gc.collect = clone, collect
print(json.dumps(dict(counts, state=mcore_cpu_shim.status()["%s"]["state"])))
""" % FIX


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hf") / "llama")
    result = run_python("import sys; from mcore_cpu_shim.app import hf_models; "
                        f"hf_models.write('llama', sys.argv[1], num_hidden_layers={LAYERS})", args=(folder,))
    assert result.returncode == 0, result.stderr[-4000:]
    return folder


def checkpoint_files(path):
    """{relative path: bytes} of every tensor file a torch_dist save wrote under ``path``."""
    found = {}
    for root, _, files in os.walk(path):
        for name in files:
            if name.endswith(".distcp"):
                with open(os.path.join(root, name), "rb") as f:
                    found[os.path.relpath(os.path.join(root, name), path)] = f.read()
    return found


@pytest.fixture(scope="module")
def fixed_save(deep_llama, tmp_path_factory):
    """The save with the fix (or patched Bridge): ``(its checkpoint folder, its counts)``."""
    out = str(tmp_path_factory.mktemp("fixed") / "megatron")
    return out, run_bridge(SAVE, deep_llama, out)


def test_save_keeps_what_owns_its_storage_and_exports_exactly(deep_llama, fixed_save, tmp_path):
    out, counts = fixed_save
    assert counts["state"] == expected_state(FIX)
    # The SwiGLU halves (two views per layer) are still copied, nothing else; the two final
    # collections stay.
    assert (counts["whole copies"], counts["view copies"], counts["collections"]) == (0, 2 * LAYERS, 2), counts
    exported = run_bridge(EXPORT, deep_llama, out, str(tmp_path / "hf"))
    assert exported["touched"] == [] and exported["source"] == 3 + 9 * LAYERS
    assert (exported["equal"], exported["differ"], exported["extra"]) == (exported["source"], [], [])


@pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: Bridge is patched, there is no unfixed code to run")
def test_the_unfixed_save_copies_and_collects_and_writes_the_same_bytes(deep_llama, fixed_save, tmp_path, monkeypatch):
    fixed, unfixed = fixed_save[0], str(tmp_path / "unfixed")
    monkeypatch.setenv("MCORE_CPU_SHIM_DISABLE", FIX)
    counts = run_bridge(SAVE, deep_llama, unfixed)
    assert counts["state"] == "disabled"
    # Every tensor that is not a SwiGLU half is copied whole; one collection after 20
    # factories, two after 50 and 100 of the other tensors, the two final ones.
    assert counts["view copies"] == 2 * LAYERS and counts["whole copies"] >= 5 * LAYERS, counts
    assert counts["collections"] == 5, counts
    written, expected = checkpoint_files(fixed), checkpoint_files(unfixed)
    assert sorted(written) == sorted(expected) and written
    assert [name for name in expected if written[name] != expected[name]] == []
