"""Site-level matching on the megatron-core under test, read as source (no model builds).

Every target of every fix is mutated the ways upstream drifts (a statement before and after the
bug site, an unrelated local renamed, a new keyword argument) and must still be applied by its
site checks; a change at the bug site (its statement doubled) must leave it unsupported, and the
bug removed must read upstream-fixed. In the patched mode the same source has the patches in,
so every target must read fixed there. Whether the drift forms also *behave* like the
known-release replacements is what tools/matrix.py's drift mode checks: the whole suite with
every release's own code sent through the site checks.
"""

import ast
import copy

import pytest
from helpers import HAVE_BRIDGE, MODE, patched_here
from helpers import megatron_source as read

from mcore_cpu_shim import engine
from mcore_cpu_shim.fixes import BRIDGE_FIXES, FIXES

pytestmark = pytest.mark.cuda_hidden

# Megatron-Bridge's targets where its source is on the path (the matrix's bridge legs).
TARGETS = [(fix.name, target) for fix in FIXES + (BRIDGE_FIXES if HAVE_BRIDGE else ()) for target in fix.targets]
IDS = [target.name.split(":")[1] for _, target in TARGETS]


def patched(fix_name, target):
    """Whether this mode's tree has the patch at ``target`` (Megatron-Bridge's patches change
    only Bridge: a Bridge fix's target in megatron-training stays as it was)."""
    in_bridge = target.module.startswith("megatron.bridge")
    return patched_here(fix_name) and (MODE != "bridge-patched" or in_bridge)


def lookup(module, qualname):
    text = read(module)
    return None if text is None else engine.find_definition(ast.parse(text), qualname)[0]


def definition(target):
    text = read(target.module)
    if text is None:
        return None
    if target.qualname == engine.MODULE:
        return engine.top_level_imports(ast.parse(text))
    return engine.find_definition(ast.parse(text), target.qualname)[0]


def decide(target, tree, strict=False):
    state, detail, _ = engine.classify(target, tree, lookup, strict)
    return state, detail


def bug_statements(tree, target):
    """(parent body, index) of the smallest statements holding a bug snippet (for a snippet
    spanning statements: its line that names CUDA)."""
    found = []
    for bug in target.bug:
        cuda_lines = [line for line in bug.strip().splitlines() if "cuda" in line]
        for snippet in [bug.strip()] + cuda_lines[-1:]:
            holders = [
                (len(engine.normalise(stmt)), body, i)
                for node in ast.walk(tree)
                for field in ("body", "orelse", "finalbody")
                for body in [getattr(node, field, None)]
                if isinstance(body, list)
                for i, stmt in enumerate(body)
                if isinstance(stmt, ast.stmt) and snippet in engine.normalise(stmt)
            ]
            if holders:
                found.append(min(holders, key=lambda h: h[0])[1:])
                break
    return found


def statement(text):
    return ast.parse(text).body[0]


def start_of_body(tree):
    first = tree.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant)
    return 1 if docstring else 0


def renamable_local(tree, target):
    """A local variable that no bug snippet or site check mentions, or None."""
    mentioned = " ".join(target.bug) + " ".join(check.description for check in target.site)
    parameters = {a.arg for a in ast.walk(tree.args) if isinstance(a, ast.arg)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            if node.id not in parameters and node.id not in mentioned:
                return node.id
    return None


def drifted(tree, target):
    """The synthetic drifts away from the bug site: {name: mutated definition}."""
    mutations = {}
    before = copy.deepcopy(tree)
    before.body.insert(start_of_body(before), statement("_drift_before = None"))
    mutations["statement before"] = before
    after = copy.deepcopy(tree)
    for body, index in bug_statements(after, target)[:1]:
        body.insert(index + 1, statement("_drift_after = None"))
        mutations["statement after the bug"] = after
    if isinstance(tree, ast.Module):  # a module target: its top-level imports have no arguments
        return mutations
    option = copy.deepcopy(tree)
    option.args.kwonlyargs.append(ast.arg(arg="drift_option"))
    option.args.kw_defaults.append(ast.Constant(value=None))
    mutations["new keyword argument"] = option
    local = renamable_local(tree, target)
    if local is not None:
        renamed = copy.deepcopy(tree)
        for node in ast.walk(renamed):
            if isinstance(node, ast.Name) and node.id == local:
                node.id = f"{local}_drifted"
        mutations[f"local {local} renamed"] = renamed
    return mutations


def at_site(tree, target):
    """The bug expression changed: its last ``torch.cuda`` call made conditional
    (``call if _drift else call``), or, where the bug names no such call, its statement doubled."""
    changed = copy.deepcopy(tree)
    body, index = bug_statements(changed, target)[0]
    calls = [
        (node, field, value)
        for node in ast.walk(body[index])
        for field, value in ast.iter_fields(node)
        if isinstance(value, ast.Call) and ast.unparse(value.func).startswith("torch.cuda.")
    ]
    if not calls:
        body.insert(index + 1, copy.deepcopy(body[index]))
        return changed
    node, field, call = max(calls, key=lambda c: (c[2].lineno, c[2].col_offset))
    test = ast.Name(id="_drift", ctx=ast.Load())
    setattr(node, field, ast.IfExp(test=test, body=call, orelse=copy.deepcopy(call)))
    return changed


def without_bug(tree, target):
    """Every statement holding a bug snippet removed."""
    changed = copy.deepcopy(tree)
    while True:
        holders = bug_statements(changed, target)
        if not holders:
            return changed
        body, index = holders[0]
        del body[index]
        if not body:
            body.append(ast.Pass())


@pytest.mark.parametrize("fix_name, target", TARGETS, ids=IDS)
def test_synthetic_drift(fix_name, target):
    tree = definition(target)
    if tree is None:
        assert target.absent_in is not None or engine.INHERITED in target.known_buggy
        return
    state, detail = decide(target, tree)
    if patched(fix_name, target):
        # The patched tree: the bug is gone wherever the fix concerns this release.
        assert state in (engine.UPSTREAM_FIXED, engine.NOT_APPLICABLE), (state, detail)
        return
    if state != engine.APPLIED:
        # Fixed in this release already (e.g. YaRN's constructor from 0.15), or no such feature.
        assert state in (engine.UPSTREAM_FIXED, engine.NOT_APPLICABLE), (state, detail)
        for name, mutated in drifted(tree, target).items():
            assert decide(target, mutated)[0] == state, name
        return
    assert target.site, f"{target.name} has no site checks: drifted code would be unsupported"
    for name, mutated in drifted(tree, target).items():
        state, detail = decide(target, mutated)
        assert state == engine.APPLIED and detail.startswith(engine.DRIFTED), (name, detail)
        state, detail = decide(target, mutated, strict=True)
        assert state == engine.UNSUPPORTED and engine.ENV_STRICT in detail, (name, detail)
    if target.whole:  # a wrapper of the whole function: no bug site to change
        return
    state, detail = decide(target, at_site(tree, target))
    assert state == engine.UNSUPPORTED and "not as the fix expects" in detail, detail
    state, detail = decide(target, without_bug(tree, target))
    # Where the feature sat in the bug's statement, it went with it.
    assert state == engine.UPSTREAM_FIXED or (target.feature and state == engine.NOT_APPLICABLE)


@pytest.mark.parametrize("fix_name, target", TARGETS, ids=IDS)
def test_every_release_passes_its_own_site_checks(fix_name, target):
    """The checks describe the releases the fix was written against: each one passes them."""
    if patched(fix_name, target):
        pytest.skip(f"mode {MODE}: the release's own code is patched")
    tree = definition(target)
    if tree is None or not target.site:
        assert tree is None or engine.INHERITED in target.known_buggy
        return
    if decide(target, tree)[0] == engine.APPLIED:
        failed = [c.description for c in target.site if not c.holds(engine.Code(tree, lookup))]
        assert not failed


YARN_APPLY = next(t for _, t in TARGETS if t.qualname == "YarnRotaryEmbedding._apply")


@pytest.mark.parametrize(
    "body, expected",
    [
        ("return super()._apply(fn)", engine.APPLIED),
        ("self.forward.cache_clear()\nreturn super()._apply(fn)", engine.UPSTREAM_FIXED),
    ],
    ids=["override without memo clear", "override clearing the memo"],
)
def test_an_override_of_upstreams_own_counts_as_fixed_only_if_it_clears_the_memo(body, expected):
    source = "def _apply(self, fn, recurse=True):\n" + "".join(f"    {line}\n" for line in body.splitlines())
    state, detail = decide(YARN_APPLY, statement(source))
    assert state == expected, detail
    # The class inheriting nn.Module._apply: the override is added.
    assert decide(YARN_APPLY, None)[0] == engine.APPLIED


def test_strict_switch_values(monkeypatch):
    for value, strict in (("", False), ("0", False), ("1", True), (" 1 ", True)):
        monkeypatch.setenv(engine.ENV_STRICT, value)
        assert engine.strict_from_env() is strict
    monkeypatch.setenv(engine.ENV_STRICT, "yes")
    with pytest.raises(ValueError, match="MCORE_CPU_SHIM_STRICT='yes'"):
        engine.strict_from_env()
