"""One rank of ``mcore-cpu-shim demo``'s megatron-core-only round trip, phase by phase.

Started by the launcher (``launch.start_ranks``, through ``passes``) as ``python -m
<package>.app.demo_worker SPEC`` (``RANK`` set) in a fresh interpreter (importing the package
first, so MCORE_CPU_SHIM_DISABLE decides whether the fixes are on and MCORE_CPU_SHIM_TE whether
the Transformer Engine import guard is); the rank's life, its event records and its last facts
are ``worker.main``'s. SPEC holds the model size, the world and where to write. The steps are
phases: with ``strict`` in the spec each runs under ``forbid_cuda()``, so a CUDA call that
megatron-core catches and hides still fails it. The model is built here, once, for the demo, the
benchmarks and the tests.
"""

import os
import sys

from .worker import directory_size, init_gloo, main

STEPS = ("build model", "save torch_dist", "build fresh + load", "compare tensors", "forward compare")


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

    from ..engine import mcore_version

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


def logits(model, spec):
    import torch

    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, spec["vocab"], (2, spec["seq_len"]), generator=generator)
    positions = torch.arange(spec["seq_len"]).unsqueeze(0).expand_as(tokens)
    model.eval()
    with torch.no_grad():
        return model(tokens, positions, None)


def run(spec, rank, phases):
    """The round trip: build, save with ``dist_checkpointing``, build a fresh model and load
    into it, compare every tensor bit for bit, compare the logits of both."""
    phases.start(STEPS[0])
    import torch
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.tensor_parallel import random

    init_gloo(spec, rank)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=spec["ep"])
    # Megatron's RNG tracker for inference: the local attention forks the tracker around its
    # dropout in every forward, and the training tracker can only be seeded through CUDA
    # (model_parallel_cuda_manual_seed).
    random.initialize_rng_tracker(inference_rng_tracker=True)
    phases.facts["features"] = features()
    # The same seed on every rank: non-expert weights are replicas across ranks.
    original = build_model(spec, seed=1)
    phases.facts["parameters"] = parameter_count(original, spec["ep"])

    phases.start(STEPS[1])
    os.makedirs(spec["checkpoint"], exist_ok=True)
    dist_checkpointing.save(original.sharded_state_dict(), spec["checkpoint"])
    torch.distributed.barrier()
    phases.end(**({"size": directory_size(spec["checkpoint"])} if rank == 0 else {}))

    phases.start(STEPS[2])
    reloaded = build_model(spec, seed=2)
    reloaded.load_state_dict(dist_checkpointing.load(reloaded.sharded_state_dict(), spec["checkpoint"]))

    phases.start(STEPS[3])
    expected, actual = tensors(original), tensors(reloaded)
    if expected.keys() != actual.keys():
        raise AssertionError(f"state dict keys differ: {sorted(expected.keys() ^ actual.keys())}")
    differing = [k for k in expected if not same_bits(expected[k], actual[k])]
    phases.facts.update(tensors=len(expected), equal=len(expected) - len(differing))
    if differing:
        raise AssertionError(f"{len(differing)} tensor(s) differ after reload, e.g. {differing[0]}")

    phases.start(STEPS[4])
    before, after = logits(original, spec), logits(reloaded, spec)
    phases.facts["logits_equal"] = equal = same_bits(before, after)
    if not equal:
        raise AssertionError("logits of the original and the reloaded model differ")
    phases.end(shape=list(before.shape))


if __name__ == "__main__":
    main(sys.argv[1], int(os.environ["RANK"]), run)
