"""patches/: one upstreamable patch per fix, in fix order, each readable on its own."""

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda_hidden

PATCHES = Path(__file__).resolve().parent.parent / "patches"


def series():
    lines = (PATCHES / "series").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_one_patch_per_fix_in_fix_order():
    import mcore_cpu_shim

    expected = [f"{i:04d}-{name.replace('_', '-')}.patch" for i, name in enumerate(mcore_cpu_shim.fix_names(), 1)]
    assert series() == expected
    assert sorted(p.name for p in PATCHES.glob("*.patch")) == sorted(expected)


@pytest.mark.parametrize("patch", series())
def test_patch_is_format_patch_with_a_dep3_header(patch):
    text = (PATCHES / patch).read_text()
    head, _, body = text.partition("\n---\n")
    assert head.startswith("From 0000000000000000000000000000000000000000 ")
    assert re.search(r"^Subject: \[PATCH\] .+", head, re.M)
    for field in ("Description:", "Origin:", "Forwarded:", "Last-Update:"):
        assert re.search(rf"^{field}", head, re.M), f"{patch}: no {field}"
    # Against the newest release, or against main for code no release has.
    assert re.search(r"^Base: megatron-core (0\.19\.2 |main [0-9a-f]{40} )", head, re.M), f"{patch}: no Base"
    assert re.search(r"^diff --git a/megatron/core/\S+ b/megatron/core/", body, re.M)
    assert re.search(r"^diff --git a/tests/unit_tests/\S+ b/tests/unit_tests/", body, re.M), (
        f"{patch}: adds or extends no megatron unit test"
    )
