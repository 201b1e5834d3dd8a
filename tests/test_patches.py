"""patches/: one upstreamable patch per fix, in fix order, each readable on its own.

``patches/series`` holds megatron-core's (against 0.19.2, or main for code no release has),
``patches/bridge/series`` Megatron-Bridge's (against main 067f987d) for the Bridge fixes main
still needs; the Bridge fixes main has upstream get no patch, a comment in that series says so.
"""

import os
import re
import subprocess
import tarfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.cuda_hidden

ROOT = Path(__file__).resolve().parent.parent
PATCHES = ROOT / "patches"
BRIDGE_PATCHES = PATCHES / "bridge"
BRIDGE_MAIN = "067f987df03b8355b03192d88d70f1709fedf51a"
BRIDGE_SNAPSHOT = ROOT.parent / "shared" / "upstream" / f"megatron-bridge-main-{BRIDGE_MAIN[:8]}.tar.xz"
# The Bridge fixes that Megatron-Bridge main has upstream: no patch for them.
BRIDGE_FIXED_ON_MAIN = ("bridge_yarn_config", "bridge_expert_names", "bridge_scatter_contiguous")

# What each series' patches must say and touch: (Base line, source root, unit test root).
CORE = (r"megatron-core (0\.19\.2 |main [0-9a-f]{40} )", "megatron/core/", "tests/unit_tests/")
BRIDGE = (rf"Megatron-Bridge main {BRIDGE_MAIN}$", "src/megatron/bridge/", "tests/unit_tests/")


def series(folder=PATCHES):
    lines = (folder / "series").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def patch_name(number, fix):
    return f"{number:04d}-{fix.replace('_', '-')}.patch"


def test_one_patch_per_fix_in_fix_order():
    from mcore_cpu_shim.fixes import FIXES

    expected = [patch_name(i, fix.name) for i, fix in enumerate(FIXES, 1)]
    assert series() == expected
    assert sorted(p.name for p in PATCHES.glob("*.patch")) == sorted(expected)


def test_one_bridge_patch_per_fix_main_still_needs():
    from mcore_cpu_shim.fixes import BRIDGE_FIXES

    names = [fix.name for fix in BRIDGE_FIXES]
    assert set(BRIDGE_FIXED_ON_MAIN) <= set(names)
    needed = [name for name in names if name not in BRIDGE_FIXED_ON_MAIN]
    expected = [patch_name(i, name) for i, name in enumerate(needed, 1)]
    assert series(BRIDGE_PATCHES) == expected
    assert sorted(p.name for p in BRIDGE_PATCHES.glob("*.patch")) == sorted(expected)
    comments = [line for line in (BRIDGE_PATCHES / "series").read_text().splitlines() if line.startswith("#")]
    for name in BRIDGE_FIXED_ON_MAIN:
        assert any(name in line and "upstream" in line for line in comments), f"series says nothing of {name}"


def check_format(path, base, source_root, test_root):
    text = path.read_text()
    head, _, body = text.partition("\n---\n")
    name = path.name
    assert head.startswith("From 0000000000000000000000000000000000000000 "), name
    assert re.search(r"^Subject: \[PATCH\] .+", head, re.M), f"{name}: no Subject"
    for field in ("Description:", "Origin:", "Forwarded:", "Last-Update:"):
        assert re.search(rf"^{field}", head, re.M), f"{name}: no {field}"
    assert re.search(rf"^Base: {base}", head, re.M), f"{name}: no Base"
    paths = re.findall(r"^diff --git a/(\S+) b/(\S+)$", body, re.M)
    assert paths, f"{name}: no diff"
    for a, b in paths:
        assert a == b and a.startswith((source_root, test_root)), f"{name}: touches {a}"
    assert any(a.startswith(source_root) for a, _ in paths), f"{name}: changes nothing under {source_root}"
    assert any(a.startswith(test_root) for a, _ in paths), f"{name}: adds or extends no unit test"


@pytest.mark.parametrize("patch", series())
def test_patch_is_format_patch_with_a_dep3_header(patch):
    # Against the newest release, or against main for code no release has.
    check_format(PATCHES / patch, *CORE)


@pytest.mark.parametrize("patch", series(BRIDGE_PATCHES))
def test_bridge_patch_is_format_patch_with_a_dep3_header(patch):
    check_format(BRIDGE_PATCHES / patch, *BRIDGE)


@pytest.fixture
def bridge_main(tmp_path):
    """A fresh copy of Megatron-Bridge main from ../shared/upstream (skips where there is none)."""
    if not BRIDGE_SNAPSHOT.is_file():
        pytest.skip(f"needs ../shared/upstream/{BRIDGE_SNAPSHOT.name} (the Megatron-Bridge main snapshot)")
    tree = tmp_path / "bridge-main"
    with tarfile.open(BRIDGE_SNAPSHOT) as archive:
        archive.extractall(tree, filter="data")
    return tree


def test_bridge_series_applies_to_bridge_main(bridge_main):
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(bridge_main.parent))
    for patch in series(BRIDGE_PATCHES):
        for args in (["--check"], []):  # each one on the tree the ones before it made
            result = subprocess.run(
                ["git", "apply", *args, str(BRIDGE_PATCHES / patch)],
                cwd=bridge_main, env=env, capture_output=True, text=True,
            )
            assert result.returncode == 0, f"{patch}: {result.stderr}"


def test_bridge_series_leaves_out_what_main_has(bridge_main):
    """The Bridge fixes without a patch are the ones the shim finds fixed on main (every target
    upstream-fixed or not applicable), read from the snapshot's source."""
    from mcore_cpu_shim import engine
    from mcore_cpu_shim.fixes import BRIDGE_FIXES

    def read(module):
        path = bridge_main / "src" / Path(*module.split(".")).with_suffix(".py")
        return path.read_text() if path.is_file() else None

    decided = engine.classify_source(BRIDGE_FIXES, read)
    fixed = {fix for fix, targets in decided.items()
             if all(state in (engine.UPSTREAM_FIXED, engine.NOT_APPLICABLE) for state, _ in targets.values())}
    assert fixed == set(BRIDGE_FIXED_ON_MAIN), decided
