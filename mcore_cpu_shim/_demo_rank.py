"""One rank of ``mcore-cpu-shim demo``: run the conversion steps, record each one.

Started by demo.py as ``python -m mcore_cpu_shim._demo_rank SPEC RANK`` in a fresh interpreter
(importing the package first, so MCORE_CPU_SHIM_DISABLE decides whether the fixes are on and
MCORE_CPU_SHIM_TE whether the Transformer Engine import guard is).
SPEC is a JSON file the parent wrote (model size, world, where to write). Every step appends
one JSON line to ``<events>/rank<RANK>.jsonl`` as soon as it ends, so the parent can print
progress and still knows how far a rank got if it has to be killed; a last line holds the
facts (tensors compared, CUDA initialised, driver libraries mapped, fix states).

The steps run under ``forbid_cuda()`` when SPEC says ``strict``: a CUDA call that megatron-core
catches and hides still fails the step.
"""

import contextlib
import json
import multiprocessing
import os
import re
import sys
import time
import traceback

from .doctor import driver_libraries

STEPS = ("build model", "save torch_dist", "build fresh + load", "compare tensors", "forward compare")

MEGATRON_FRAME = re.compile(r'File "([^"]*megatron/core/[^"]*)", line (\d+), in (\S+)')


def _short(path):
    return path[path.rfind("megatron/core/") :] if "megatron/core/" in path else path


def where(exc):
    """Where in megatron-core ``exc`` happened: its innermost megatron-core frame, as text."""
    frames = [
        f"{_short(frame.filename)}:{frame.lineno} in {frame.name}"
        for frame in traceback.extract_tb(exc.__traceback__)
        if "megatron/core/" in frame.filename
    ]
    # forbid_cuda() raises on exit for a call that was caught: the call's stack is in the text.
    frames += [f"{_short(f)}:{line} in {name}" for f, line, name in MEGATRON_FRAME.findall(str(exc))]
    return frames[-1] if frames else "outside megatron-core"


def yarn_settings(config):
    """GPT-OSS's YaRN settings; megatron-core reads them from the config as extra attributes."""
    config.yarn_rotary_scaling_factor = 32.0
    config.yarn_original_max_position_embeddings = 4096
    config.yarn_beta_fast = 32.0
    config.yarn_beta_slow = 1.0
    config.yarn_mscale = 1.0
    config.yarn_mscale_all_dim = 0.0
    config.yarn_correction_range_round_to_int = False


def features():
    """What of GPT-OSS this megatron-core can build: YaRN in GPTModel (0.15+), softmax offsets (0.15+)."""
    import inspect

    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    return {
        "yarn": "'yarn'" in inspect.getsource(GPTModel.__init__),
        "learnable_softmax": "softmax_type" in TransformerConfig.__dataclass_fields__,
    }


def build_model(spec, seed):
    """The GPT-OSS-like model: local spec, YaRN RoPE, learnable softmax offsets, grouped-query
    attention, top-k routed alltoall MoE with gated experts, all on the CPU."""
    import torch
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    have = features()
    settings = dict(
        num_layers=spec["layers"],
        hidden_size=spec["hidden"],
        num_attention_heads=spec["heads"],
        num_query_groups=spec["query_groups"],
        ffn_hidden_size=spec["ffn"],
        num_moe_experts=spec["experts"],
        moe_ffn_hidden_size=spec["ffn"],
        moe_router_topk=spec["topk"],
        moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0,
        expert_model_parallel_size=spec["ep"],
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,  # 0.13 refuses biases in MoE layers
        normalization="RMSNorm",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        params_dtype=getattr(torch, spec.get("dtype", "float32")),
    )
    if have["learnable_softmax"]:
        settings["softmax_type"] = "learnable"
    torch.manual_seed(seed)
    config = TransformerConfig(**settings)
    if have["yarn"]:
        yarn_settings(config)
    layer_spec = get_gpt_layer_local_spec(num_experts=spec["experts"], normalization="RMSNorm")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec,
        vocab_size=spec["vocab"],
        max_sequence_length=spec["seq_len"],
        # Without YaRN (0.13/0.14) learned positions: their plain RoPE moves itself to CUDA
        # in forward.
        position_embedding_type="yarn" if have["yarn"] else "learned_absolute",
        share_embeddings_and_output_weights=False,
    )
    zero_uninitialised_softmax_offsets(model)
    return model


def zero_uninitialised_softmax_offsets(model):
    """megatron-core 0.15 creates the learnable softmax offsets with torch.empty and never
    initialises them (0.16 does): each rank would hold different leftover memory in a tensor
    that is replicated, saved once and reloaded everywhere. Start them at zero there."""
    import torch

    from ._mcore_tree import mcore_version

    if mcore_version().startswith("0.15."):
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith("softmax_offset"):
                    parameter.zero_()


def parameter_count(model, ep):
    """Parameters of the whole model: expert weights are split over the ``ep`` ranks of an
    expert-parallel group (``allreduce`` False on them), everything else is whole on each rank."""
    dense = sum(p.numel() for p in model.parameters() if getattr(p, "allreduce", True))
    experts = sum(p.numel() for p in model.parameters() if not getattr(p, "allreduce", True))
    return dense + experts * ep


def tensors(model):
    return {k: v for k, v in model.state_dict().items() if hasattr(v, "shape")}


def same_bits(a, b):
    """Bit-identical (so also where a value is NaN, e.g. never-initialised memory)."""
    import torch

    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def directory_size(path):
    return sum(
        os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names
    )


def logits(model, spec):
    import torch

    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, spec["vocab"], (2, spec["seq_len"]), generator=generator)
    positions = torch.arange(spec["seq_len"]).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, None)


class Rank:
    def __init__(self, spec, rank):
        self.spec, self.rank = spec, rank
        self.events = open(os.path.join(spec["events"], f"rank{rank}.jsonl"), "a")
        self.facts = {}

    def record(self, **event):
        self.events.write(json.dumps(event) + "\n")
        self.events.flush()

    def step(self, name, action):
        guard = contextlib.nullcontext()
        if self.spec["strict"]:
            from .tripwire import forbid_cuda

            guard = forbid_cuda()
        start = time.perf_counter()
        try:
            with guard:
                extra = action() or {}
        except BaseException as exc:  # noqa: BLE001  (report whatever ended the step)
            message = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}".strip()
            self.record(step=name, ok=False, seconds=time.perf_counter() - start, error=message,
                        where=where(exc), traceback=traceback.format_exc()[-4000:])
            return False
        self.record(step=name, ok=True, seconds=time.perf_counter() - start, **extra)
        return True

    def run(self):
        spec = self.spec
        models = {}

        def build():
            import torch
            from megatron.core import parallel_state
            from megatron.core.tensor_parallel import random

            torch.distributed.init_process_group(
                "gloo", init_method=f"file://{spec['store']}", rank=self.rank, world_size=spec["ranks"]
            )
            parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=spec["ep"])
            # Megatron's RNG tracker for inference: the local attention forks the tracker
            # around its dropout in every forward, and the training tracker can only be seeded
            # through CUDA (model_parallel_cuda_manual_seed).
            random.initialize_rng_tracker(inference_rng_tracker=True)
            # The same seed on every rank: non-expert weights are replicas across ranks.
            models["original"] = build_model(spec, seed=1)
            self.facts["parameters"] = parameter_count(models["original"], spec["ep"])

        def save():
            import torch
            from megatron.core import dist_checkpointing

            os.makedirs(spec["checkpoint"], exist_ok=True)
            dist_checkpointing.save(models["original"].sharded_state_dict(), spec["checkpoint"])
            torch.distributed.barrier()
            return {"size": directory_size(spec["checkpoint"])} if self.rank == 0 else {}

        def load():
            from megatron.core import dist_checkpointing

            models["reloaded"] = fresh = build_model(spec, seed=2)
            loaded = dist_checkpointing.load(fresh.sharded_state_dict(), spec["checkpoint"])
            fresh.load_state_dict(loaded)

        def compare():
            expected, actual = tensors(models["original"]), tensors(models["reloaded"])
            if expected.keys() != actual.keys():
                raise AssertionError(f"state dict keys differ: {sorted(expected.keys() ^ actual.keys())}")
            differing = [k for k in expected if not same_bits(expected[k], actual[k])]
            self.facts.update(tensors=len(expected), equal=len(expected) - len(differing))
            if differing:
                raise AssertionError(f"{len(differing)} tensor(s) differ after reload, e.g. {differing[0]}")

        def forward():
            original, reloaded = logits(models["original"], spec), logits(models["reloaded"], spec)
            equal = same_bits(original, reloaded)
            self.facts["logits_equal"] = equal
            if not equal:
                raise AssertionError("logits of the original and the reloaded model differ")
            return {"shape": list(original.shape)}

        for name, action in zip(STEPS, (build, save, load, compare, forward)):
            if not self.step(name, action):
                return False
        return True

    def finish(self, passed):
        import torch

        from . import _te_guard, status
        from ._mcore_tree import mcore_version

        self.record(
            done=True,
            passed=passed,
            cuda_initialized=torch.cuda.is_initialized(),
            driver_libraries=driver_libraries(),
            fixes={name: fix["state"] for name, fix in status().items()},
            te_guard={k: v for k, v in _te_guard.state().items() if k in ("mode", "reason")},
            mcore=mcore_version(),  # package_info: a source tree has no package metadata
            torch=torch.__version__,
            features=features() if "megatron.core" in sys.modules else {},
            **self.facts,
        )


def main(spec_path, rank):
    with open(spec_path) as f:
        spec = json.load(f)
    worker = Rank(spec, rank)
    passed = worker.run()
    worker.finish(passed)
    if passed:
        import torch

        torch.distributed.destroy_process_group()
    # A failed rank may leave others waiting in a collective, and its exit handlers with them:
    # leave at once (the parent ends the others), but not without the helper processes
    # megatron-core's checkpoint writer started.
    for child in multiprocessing.active_children():
        child.kill()
    sys.stdout.flush()
    os._exit(0 if passed else 1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
