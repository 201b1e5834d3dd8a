"""forbid_cuda() itself: torch.cuda.Stream/Event stay the same classes inside the block (code
imported there uses them as types) while constructing one trips, and everything is put back
exactly when the last block closes. The last test imports, inside the block, every megatron-core
module a conversion imports."""

import json

import pytest
from helpers import MODE, run_python

pytestmark = pytest.mark.cuda_hidden

CLASSES = ("Stream", "Event")


def tripwire():
    """The tripwire as the session has it, without activating the shim in patched mode."""
    import mcore_cpu_shim_pytest

    return mcore_cpu_shim_pytest.tripwire()


def own_dicts():
    """Each guarded class's own __dict__, as (key, value) pairs in order."""
    import torch

    return {name: list(vars(getattr(torch.cuda, name)).items()) for name in CLASSES}


def test_classes_stay_themselves_and_work_as_types_inside():
    import torch

    before = {name: getattr(torch.cuda, name) for name in CLASSES}
    with tripwire().forbid_cuda() as touched:
        for name, cls in before.items():
            assert getattr(torch.cuda, name) is cls
            assert getattr(torch.cuda.streams, name) is cls
            optional = getattr(torch.cuda, name) | None  # a class body annotation on newer mcore
            assert optional.__args__ == (cls, type(None))
            assert not isinstance(object(), getattr(torch.cuda, name))
            sub = type(f"My{name}", (getattr(torch.cuda, name),), {})
            assert issubclass(sub, cls) and sub.__mro__[1] is cls
    assert touched == []


@pytest.mark.parametrize("name", CLASSES)
def test_constructing_trips_and_the_block_reports_it(name):
    import torch

    tw = tripwire()
    cls = getattr(torch.cuda, name)
    with pytest.raises(tw.CudaTouchedError, match=rf"1 CUDA call\(s\) .*first: torch\.cuda\.{name}\(\) at"):
        with tw.forbid_cuda() as touched:
            with pytest.raises(tw.CudaTouchedError, match=rf"torch\.cuda\.{name}\(\) called inside"):
                cls()
            assert len(touched) == 1
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("call", ["get_rng_state()", "set_rng_state(torch.zeros(8, dtype=torch.uint8))", "memory_allocated()"])
def test_calls_that_reach_lazy_init_by_their_own_name_trip(call):
    """torch/cuda/random.py and memory.py call the ``_lazy_init`` they imported themselves:
    replacing ``torch.cuda._lazy_init`` alone would let these through."""
    import torch

    tw = tripwire()
    name = call.split("(")[0]
    with pytest.raises(tw.CudaTouchedError, match=rf"first: torch\.cuda\.{name}\(\) at"):
        with tw.forbid_cuda():
            with pytest.raises(tw.CudaTouchedError):
                eval(f"torch.cuda.{call}")
    assert not torch.cuda.is_initialized()


def test_subclass_defined_before_or_inside_trips_in_every_open_block():
    import torch

    tw = tripwire()
    before = type("EarlyStream", (torch.cuda.Stream,), {})
    outer = tw.forbid_cuda()
    outer_touched = outer.__enter__()
    with pytest.raises(tw.CudaTouchedError, match="3 CUDA call"):
        with tw.forbid_cuda() as touched:

            class InsideEvent(torch.cuda.Event):
                def __new__(cls, *args, **kwargs):
                    return super().__new__(cls, *args, **kwargs)

            for cls in (before, InsideEvent):
                with pytest.raises(tw.CudaTouchedError):
                    cls()
            with pytest.raises(tw.CudaTouchedError):
                torch.cuda.ExternalStream(0)
    called = [entry.split("()")[0] for entry in touched]
    assert called == ["torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.ExternalStream"]
    # The outer block is still open: construction still trips, and it saw every call too.
    with pytest.raises(tw.CudaTouchedError):
        torch.cuda.Stream()
    assert len(outer_touched) == 4
    with pytest.raises(tw.CudaTouchedError, match="4 CUDA call"):
        outer.__exit__(None, None, None)


def test_class_dicts_are_restored_exactly_after_overlapping_blocks():
    import torch

    tw = tripwire()
    before = own_dicts()
    assert all("__new__" in dict(before[name]) for name in CLASSES)  # the entry to put back
    first = tw.forbid_cuda()
    first.__enter__()
    second = tw.forbid_cuda()
    second.__enter__()
    assert own_dicts() != before
    first.__exit__(None, None, None)  # not nested: the first one closes first
    with pytest.raises(tw.CudaTouchedError):
        torch.cuda.Event()
    with pytest.raises(tw.CudaTouchedError):
        second.__exit__(None, None, None)
    after = own_dicts()
    assert after == before  # same keys in the same order
    for name in CLASSES:  # and the very same objects (the original staticmethod, not a copy)
        assert all(a is b for (_, a), (_, b) in zip(after[name], before[name]))
    # Construction is back to torch's own behaviour (this host cannot make a stream).
    with pytest.raises(Exception) as error:
        torch.cuda.Stream()
    assert not isinstance(error.value, tw.CudaTouchedError)


def test_a_class_without_its_own_new_gets_none_back(monkeypatch):
    import torch

    tw = tripwire()
    plain = type("Event", (), {"__module__": "torch.cuda"})
    monkeypatch.setattr(torch.cuda, "Event", plain)
    before = list(vars(plain))
    with pytest.raises(tw.CudaTouchedError):
        with tw.forbid_cuda():
            assert "__new__" in vars(plain)
            plain()
    assert list(vars(plain)) == before
    assert type(plain()) is plain


# A child interpreter (megatron-core not imported yet) imports, inside forbid_cuda(), what a
# conversion imports. In shim mode the shim is active first, as in a conversion; in patched
# mode megatron-core is patched and the shim stays off.
CONVERSION_MODULES = (
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.transformer_config",
    "megatron.core.transformer.module",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.moe_layer",
    "megatron.core.transformer.moe.experts",
    "megatron.core.tensor_parallel",
    "megatron.core.models.common.embeddings.yarn_rotary_pos_embedding",
    "megatron.core.transformer.dot_product_attention",
    "megatron.core.optimizer",
)
IMPORT_INSIDE = """
import importlib, importlib.machinery, json, sys
if {shim}:
    import mcore_cpu_shim
import mcore_cpu_shim_pytest
import torch


def exists(name):
    # importlib.util.find_spec would import the parent packages: look for the files instead.
    path = None
    for depth in range(1, name.count(".") + 2):
        spec = importlib.machinery.PathFinder.find_spec(".".join(name.split(".")[:depth]), path)
        if spec is None:
            return False
        path = spec.submodule_search_locations
    return True


present = [name for name in {modules!r} if exists(name)]
assert not any(name.split(".")[0] == "megatron" for name in sys.modules), "megatron-core already imported"
with mcore_cpu_shim_pytest.tripwire().forbid_cuda() as touched:
    for name in present:
        importlib.import_module(name)
print(json.dumps(dict(present=present, touched=touched, initialized=torch.cuda.is_initialized(),
                      imported=[name for name in {modules!r} if name in sys.modules])))
"""


def test_conversion_imports_inside_the_block_touch_no_cuda():
    code = IMPORT_INSIDE.format(shim=MODE != "patched", modules=CONVERSION_MODULES)
    result = run_python(code)
    assert result.returncode == 0, result.stderr[-5000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["touched"] == []
    assert report["initialized"] is False
    assert report["imported"] == report["present"]
    # Only modules that a release lacks may be skipped, and the core of a conversion is in all.
    assert set(CONVERSION_MODULES[:10]) <= set(report["present"]), report["present"]
