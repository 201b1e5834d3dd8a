"""Real megatron-core building blocks for the tests: Gloo groups, tiny models, round trips."""

import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import importlib
import importlib.util

import preloaded


def load_mcore_tree():
    """The package's one way to find megatron-core's tree and version, loaded from its file:
    importing the package would activate the shim (in patched mode, and in children that test
    a vendored copy, it must stay off)."""
    origin = importlib.util.find_spec("mcore_cpu_shim").origin
    path = os.path.join(os.path.dirname(origin), "engine", "tree.py")
    spec = importlib.util.spec_from_file_location("_tests_mcore_tree", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


mcore_tree = load_mcore_tree()
mcore_version = mcore_tree.mcore_version
MODE = os.environ.get("MCORE_CPU_SHIM_MODE", "shim")
MCORE_VERSION = tuple(int(p) for p in mcore_version().split(".")[:2])
# What CUDA's absence says (torch.cuda._lazy_init): no driver, a CPU-only torch, a driver with
# every device hidden.
NO_CUDA = ("NVIDIA driver", "not compiled with CUDA", "No CUDA GPUs are available")
# Megatron-Bridge on the path (tools/matrix.py's bridge legs put it there; the release legs
# have none, and every Bridge test skips there).
HAVE_BRIDGE = mcore_tree.module_file("megatron.bridge") is not None


def megatron_source(module):
    """The source of a megatron-core module in the tree on the path, read without importing
    megatron.core (None if the tree has no such module)."""
    path = mcore_tree.module_file(module)
    if path is None:
        return None
    with open(path) as source:
        return source.read()


def import_every_target(package, *fixes):
    """Import every module a fix of ``package`` (the shim, or a vendored copy) targets, as a
    conversion would (only those of ``fixes``, where named: a release's wheel may hold modules
    that cost seconds to import, e.g. megatron.training's config container, a Bridge fix's
    target). A module this megatron-core's tree does not have is left out: status() then reads
    its targets as this tree lacking them; any other import failure is raised."""
    for name, fix in package.status().items():
        if fixes and name not in fixes:
            continue
        for target in fix["targets"]:
            module = target.split(":")[0]
            if mcore_tree.module_file(module) is not None:
                importlib.import_module(module)


def bridge_fix(name):
    """Whether ``name`` is one of the Megatron-Bridge fixes."""
    from mcore_cpu_shim.fixes import BRIDGE_FIXES

    return name in {fix.name for fix in BRIDGE_FIXES}


def patched_here(fix):
    """Whether this mode has the patch of ``fix`` in the tree (and the fix itself off):
    megatron-core's patches in ``patched`` and ``patched+shim``, Megatron-Bridge's in
    ``bridge-patched`` (the matrix's Bridge main leg; the megatron-core fixes come from the
    shim there)."""
    if MODE == "bridge-patched":
        return bridge_fix(fix)
    return MODE in ("patched", "patched+shim") and not bridge_fix(fix)


def expected_state(fix=None, target=None):
    """The state every fix that concerns this tree must report in this mode (with ``target``,
    "module:qualname": that target of the fix). Where the shim is in charge of a fix, a fix (or
    target) that this tree's own source shows fixed (an upstream branch with the fix in) reads
    upstream-fixed, decided from source as tools/coverage.py does."""
    if fix is not None and not patched_here(fix) and MODE in ("shim", "bridge-patched"):
        fixed = upstream_fixed(target) if target is not None else fix in upstream_fixed_here()
        return "upstream-fixed" if fixed else "applied"
    if MODE == "bridge-patched":
        return "disabled"
    return {"shim": "applied", "patched+shim": "upstream-fixed", "patched": "disabled"}[MODE]


@functools.lru_cache(maxsize=None)
def _decided_from_source():
    """{fix: {target: (state, detail)}} for this tree, as tools/coverage.py decides it."""
    from mcore_cpu_shim import engine
    from mcore_cpu_shim.fixes import BRIDGE_FIXES, FIXES

    return engine.classify_source(FIXES + (BRIDGE_FIXES if HAVE_BRIDGE else ()), megatron_source)


def upstream_fixed_here():
    """The fixes whose every target this tree's source shows fixed or not concerned."""
    from mcore_cpu_shim import engine

    return {
        name
        for name, targets in _decided_from_source().items()
        if engine.combined_state({state for state, _ in targets.values()}) == engine.UPSTREAM_FIXED
    }


def upstream_fixed(*targets):
    """Whether this tree's source shows every one of ``targets`` ("module:qualname") fixed by
    megatron-core itself (upstream-fixed), in shim mode. A test whose premise is the CUDA
    assumption at those targets (unfixed code fails, the shim replaced them, the original runs
    next to the replacement) skips there: ``needs_unfixed(*targets)``."""
    if MODE not in ("shim", "bridge-patched"):
        return False  # patched modes have their own skips; nothing is decided from source there
    states = {t: s for decided in _decided_from_source().values() for t, (s, _) in decided.items()}
    # (a target of a project this leg does not have, e.g. Megatron-Bridge's: not fixed by it)
    return all(states.get(target) == "upstream-fixed" for target in targets)


def needs_unfixed(*targets):
    """Skip mark for a test whose premise is the CUDA assumption at ``targets``: it skips where
    megatron-core fixed every one of them itself (``upstream_fixed``)."""
    import pytest

    reason = f"megatron-core fixed {' and '.join(targets)} itself (upstream-fixed)"
    return pytest.mark.skipif(upstream_fixed(*targets), reason=reason)


# tools/matrix.py runs the release-independent tests in the first leg of each Python only
# ("1" there, "0" in the other legs); a plain pytest run has them.
ONCE_PER_PYTHON = os.environ.get("MCORE_CPU_SHIM_ONCE_PER_PYTHON", "1") == "1"


def once_per_python():
    """Skip mark for a test that does not depend on the megatron-core release (the command
    line's input checks, the import cost, the pytest plugin): the matrix runs it once per
    Python, in the first leg."""
    import pytest

    return pytest.mark.skipif(
        not ONCE_PER_PYTHON,
        reason="release-independent: tools/matrix.py runs it in the first leg of this Python",
    )


def needs_bridge():
    """Skip mark for a test that needs Megatron-Bridge (the matrix's bridge legs have it)."""
    import pytest

    return pytest.mark.skipif(
        not HAVE_BRIDGE,
        reason="Megatron-Bridge is not on the path (it runs in the matrix's bridge legs: "
        "tools/matrix.py bridge-0.3.1 / bridge-main)",
    )


def free_port(tries=50):
    """A loopback port nobody listens on now (as a string), for a rendezvous or Megatron-Bridge's
    own group (MASTER_PORT, default 12355, which parallel tests would otherwise share). Chosen
    below the kernel's ephemeral range where it can (``ip_local_port_range``): a port from
    that range may meanwhile be taken by any outgoing connection (Gloo opens many), and rank 0
    would then fail with EADDRINUSE."""
    import random

    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = [random.randrange(10000, low) for _ in range(tries)] if low > 10000 else []
    for port in candidates + [0]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return str(s.getsockname()[1])


def run_bridge(code, *args, **env):
    """``run_python`` for a child that converts through Megatron-Bridge: its own master port;
    the last stdout line parsed as JSON. Fails the test with the child's stderr if it failed."""
    import json

    result = run_python(code, args=args, MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), **env)
    assert result.returncode == 0, result.stderr[-6000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


IMPORT_CKPT = """
import sys
import mcore_cpu_shim
from megatron.bridge import AutoBridge
AutoBridge.import_ckpt(sys.argv[1], sys.argv[2])
print("{}")
"""


def bridge_checkpoint(family, folder):
    """``AutoBridge.import_ckpt`` of the tiny ``family`` model into ``folder`` (a child
    interpreter); the checkpoint's iteration folder (what ``load_model_config`` reads)."""
    run_bridge(IMPORT_CKPT, hf_model(family), str(folder))
    (iteration,) = [d for d in os.listdir(folder) if d.startswith("iter_")]
    return os.path.join(folder, iteration)


def hf_model(family):
    """A tiny HF model of ``family`` (mcore_cpu_shim.app.hf_models), written once per builder source
    and transformers version (all workers and sessions share it; never modified by a test): its
    folder."""
    import hashlib

    from importlib.metadata import PackageNotFoundError, version as installed

    builder = os.path.join(os.path.dirname(importlib.util.find_spec("mcore_cpu_shim").origin), "app", "hf_models.py")
    with open(builder, "rb") as source:
        digest = hashlib.sha256(source.read())  # a changed builder: new models
    # transformers 5 writes tokenizer files that transformers 4 cannot read, and the tox envs
    # (one /tmp) pin different transformers: one set of models per transformers version.
    try:
        digest.update(installed("transformers").encode())
    except PackageNotFoundError:
        pass  # writing fails below, saying so
    version = digest.hexdigest()[:12]
    folder = os.path.join(tempfile.gettempdir(), f"mcore-cpu-shim-models-{version}", family)
    if not os.path.isfile(os.path.join(folder, "config.json")):
        result = run_python(
            "import sys; from mcore_cpu_shim.app import hf_models; hf_models.write(sys.argv[1], sys.argv[2])",
            args=(family, folder + f".tmp{os.getpid()}"),
        )
        if result.returncode != 0:
            raise RuntimeError(f"writing the tiny {family} model failed:\n{result.stderr}")
        try:
            os.rename(folder + f".tmp{os.getpid()}", folder)
        except OSError:  # another worker was first: its copy is the same model
            shutil.rmtree(folder + f".tmp{os.getpid()}", ignore_errors=True)
    return folder


def init_gloo(store_dir, rank=0, world_size=1, expert_parallel=1, tensor_parallel=1):
    """A real Gloo process group over a file store, and megatron's parallel state on it."""
    import torch
    from megatron.core import parallel_state

    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size
    )
    parallel_state.initialize_model_parallel(tensor_parallel, 1, expert_model_parallel_size=expert_parallel)


def leave_group():
    """End a rank's process group in step with the other ranks: the last call of a run_ranks
    target whose ranks all finish their work.

    A Gloo group left for the interpreter's exit to tear down can abort a rank whose work
    succeeded ("terminate called without an active exception", exit -6: seen once in CI, in
    test_bridge_scatter_contiguous.py, after the rank had printed its result). A barrier, so
    that no rank closes its connections while another still uses them, then an explicit
    destroy, which joins the group's threads. Not for test_multirank.py's failing save: on
    megatron-core 0.13 the failing rank leaves save while the coordinator still waits in a
    gather that only the failing rank's exit ends, so a barrier there would never return."""
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def tiny_gpt(seed, **config):
    """A 2-layer local-spec GPTModel built on the CPU."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    settings = dict(num_layers=2, hidden_size=32, num_attention_heads=4)
    settings.update(config)
    cfg = TransformerConfig(use_cpu_initialization=True, params_dtype=torch.float32, **settings)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=64, max_sequence_length=16)


def tensors(module):
    return {k: v for k, v in module.state_dict().items() if hasattr(v, "shape")}


def save_and_reload(model, fresh, checkpoint_dir):
    """Save ``model`` as torch_dist, load it into ``fresh``; return ``fresh``."""
    from megatron.core import dist_checkpointing

    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), str(checkpoint_dir))
    loaded = dist_checkpointing.load(fresh.sharded_state_dict(), str(checkpoint_dir))
    fresh.load_state_dict(loaded)
    return fresh


def assert_same_tensors(expected, actual):
    import torch

    assert expected.keys() == actual.keys()
    differing = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not differing, f"tensors differ after reload: {differing}"


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))


def with_tests_dir(pythonpath):
    """``pythonpath`` with this folder first, so a child process can import these helpers."""
    return os.pathsep.join(filter(None, [TESTS_DIR, pythonpath]))


def start_python(code, args=(), *, stdout, stderr, env=None, fresh=False):
    """``python -c code *args`` with ``env`` (default: this environment) in its own session,
    output to the named files. In a cuda_hidden session it is forked from the session's
    preloaded interpreter (tests/preloaded.py: torch already imported, ~8 s less per child);
    otherwise, or if ``fresh``, it is a new interpreter. Returns a ``subprocess.Popen``-like
    process."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = with_tests_dir(env.get("PYTHONPATH"))
    if preloaded.available() and not fresh:
        return preloaded.Process(textwrap.dedent(code), args, env=env, stdout=stdout, stderr=stderr)
    command = [sys.executable, "-c", textwrap.dedent(code), *args]
    with open(stdout, "w") as out, open(stderr, "a") as err:
        err = subprocess.STDOUT if stderr == stdout else err
        return subprocess.Popen(command, env=env, stdout=out, stderr=err, start_new_session=True)


def kill_session(process):
    """Kill the process's whole session, also after the process itself exited: megatron's
    checkpoint writer leaves a spawned helper behind when its process ends abruptly."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def run_python(code, fresh=False, args=(), **env):
    """Run ``code`` with this environment plus ``env`` (and this folder on PYTHONPATH) and
    return a ``subprocess.CompletedProcess`` with its text output. ``fresh``: in a new
    interpreter even where a preloaded one is available (when torch must not be loaded yet)."""
    with tempfile.TemporaryDirectory() as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        process = start_python(code, args, env=dict(os.environ, **env), stdout=out, stderr=err, fresh=fresh)
        try:
            process.wait(300)
        finally:
            kill_session(process)
        with open(out) as stdout, open(err) as stderr:
            return subprocess.CompletedProcess(code, process.returncode, stdout.read(), stderr.read())


def run_ranks(target, world_size, *args, timeout=300):
    """Run ``target(rank, world_size, *args)`` in ``world_size`` child interpreters at once.

    ``target`` is "module:function", a module importable from this directory (a test module);
    ``args`` are strings. Every rank inherits this environment (so a cuda_hidden test's hidden
    devices) and writes its output to a file, so a chatty rank cannot block on a full pipe.
    Returns ``[(returncode, output), ...]`` in rank order. Once one rank fails the others are
    killed (they would wait for it in a collective); if ranks are still running after
    ``timeout`` seconds, all are killed and TimeoutError carries what each one wrote.
    Each rank runs in its own session, so killing it also ends the processes it started.
    """
    module, function = target.split(":")
    bootstrap = (
        "import importlib, sys; "
        f"importlib.import_module({module!r}).{function}"
        "(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:])"
    )
    with tempfile.TemporaryDirectory() as folder:
        logs = [os.path.join(folder, f"rank{rank}.log") for rank in range(world_size)]
        ranks = []
        try:
            for rank, log in enumerate(logs):
                ranks.append(start_python(bootstrap, (str(rank), str(world_size), *args), stdout=log, stderr=log))
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                codes = [process.poll() for process in ranks]
                if None not in codes or any(code not in (None, 0) for code in codes):
                    break
                time.sleep(0.2)
            hung = [rank for rank, process in enumerate(ranks) if process.poll() is None]
            timed_out = hung and all(process.poll() in (None, 0) for process in ranks)
        finally:
            for process in ranks:
                kill_session(process)
        results = []
        for process, log in zip(ranks, logs):
            with open(log) as output:
                results.append((process.returncode, output.read()))
    if timed_out:
        tails = "".join(f"\n--- rank {rank} ---\n{output[-3000:]}" for rank, (_, output) in enumerate(results))
        raise TimeoutError(f"ranks {hung} still running after {timeout} s, all killed{tails}")
    return results


def run_without_fix(fix, code):
    """Run ``code`` with ``fix`` switched off, which must make it fail; return its stderr.

    Shows that the tests of a fix are real checks. Only in shim mode: patched megatron-core
    has no unfixed code to run.
    """
    import pytest

    if MODE != "shim":
        pytest.skip(f"mode {MODE}: megatron-core is patched, there is no unfixed code to run")
    result = run_python(code, MCORE_CPU_SHIM_DISABLE=fix)
    assert result.returncode != 0, f"{fix} disabled, yet this ran:\n{code}"
    return result.stderr


# --- The CPU forward check (fixes attention_buffers_device, moe_forward_device) ---

# GPT-OSS-like settings shared by every release: GQA, a 4-expert alltoall MoE layer with
# top-2 routing (0.13 refuses biases in MoE layers).
GPT_OSS_LIKE = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    ffn_hidden_size=64,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_token_dispatcher_type="alltoall",
    moe_router_load_balancing_type="aux_loss",
    add_bias_linear=False,
)
YARN = dict(
    yarn_rotary_scaling_factor=4.0,
    yarn_original_max_position_embeddings=8,
    yarn_beta_fast=32.0,
    yarn_beta_slow=1.0,
    yarn_mscale=1.0,
    yarn_mscale_all_dim=0.0,
    yarn_correction_range_round_to_int=True,
)


def inference_rng_tracker():
    """Megatron's no-op RNG tracker. The local attention forks the tracker's CUDA RNG state
    around its dropout in every forward; the training tracker can only be seeded through
    CUDA (model_parallel_cuda_manual_seed), the inference one needs no state. Call it before
    anything asks for the tracker."""
    from megatron.core.tensor_parallel import random

    random.initialize_rng_tracker(inference_rng_tracker=True)


def gpt_oss_like(seed, **config):
    """A GPT-OSS-like local-spec GPTModel on the CPU: YaRN RoPE and learnable softmax offsets
    where the release has them (0.15 on), else learned absolute positions (0.13/0.14 have no
    softmax offsets; plain RoPE, which rope_device fixes, is tested in test_rope_device.py)."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(GPT_OSS_LIKE)
    position = "learned_absolute"
    if MCORE_VERSION >= (0, 15):
        settings["softmax_type"] = "learnable"
        position = "yarn"
    settings.update(config)
    torch.manual_seed(seed)
    cfg = TransformerConfig(use_cpu_initialization=True, params_dtype=torch.float32, **settings)
    if position == "yarn":
        for name, value in YARN.items():  # GPTModel reads these off the config
            setattr(cfg, name, value)
    spec = get_gpt_layer_local_spec(num_experts=cfg.num_moe_experts)
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=spec,
        vocab_size=64,
        max_sequence_length=16,
        position_embedding_type=position,
    )
    # The demo's builder does the same: 0.15 leaves learnable offsets uninitialised.
    from mcore_cpu_shim.app.demo_worker import zero_uninitialised_softmax_offsets

    zero_uninitialised_softmax_offsets(model)
    return model


def cpu_logits(model, batch=2, tokens=8):
    """Logits of a fixed token batch, in eval mode without autograd."""
    import torch

    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 64, (batch, tokens), generator=generator)
    position_ids = torch.arange(tokens).unsqueeze(0).expand(batch, -1)
    model.eval()
    with torch.no_grad():
        return model(input_ids, position_ids, None)


def round_trip(tmp_path, family, *import_options):
    """Write a tiny ``family`` model (app/hf_models.py) and import it with ``--verify`` and
    ``import_options``: (its folder, its tensor count, the import's CompletedProcess)."""
    from mcore_cpu_shim.app import hf_models

    hf = hf_models.write(family, tmp_path / "hf")
    count = len(hf_models.tensors(hf))
    imported = convert_process("import", "--hf", hf, "--out", tmp_path / "megatron", "--verify", *import_options)
    return hf, count, imported


def assert_same_as(original, folder):
    """Every tensor of the Hugging Face model in ``folder`` equals the one in ``original``, and
    neither has a tensor the other lacks; returns how many there are."""
    import torch
    from mcore_cpu_shim.app import hf_models

    expected, actual = hf_models.tensors(original), hf_models.tensors(folder)
    assert expected.keys() == actual.keys()
    differing = [k for k in expected if not torch.equal(expected[k], actual[k])]
    assert not differing, f"{len(differing)}/{len(expected)} tensors differ: {differing}"
    return len(expected)


def convert_process(*args, timeout=600):
    """``python -m mcore_cpu_shim convert ARGS`` in a fresh interpreter, as a user runs it."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, "-m", "mcore_cpu_shim", "convert", *map(str, args)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )
