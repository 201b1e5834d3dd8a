"""The GPU leg: a checkpoint written by the local-spec model on a CUDA-less host loads into the
Transformer Engine model on a GPU, with the same tensors and (nearly) the same logits.

    CUDA_VISIBLE_DEVICES="" python te_leg.py write CKPT [--moe]   # the CPU stage
    python te_leg.py load CKPT [--moe]                            # the GPU stage, prints JSON

``write`` builds a tiny GPT with the local layer spec on the CPU (Gloo, CUDA hidden) and saves
it as torch_dist. ``load`` builds the same GPT with the TE layer spec on the GPU, loads the
checkpoint through ``mcore_cpu_shim.te_checkpoint.load``, and compares it with the local model
loaded from the same checkpoint (moved to the GPU): every checkpoint tensor by key and offset,
then the logits of one forward pass on the same tokens. Also used by
tests/test_te_checkpoint.py (cuda_visible).
"""

import argparse
import json
import os
import sys

SEED = 1
VOCAB = 64
SEQUENCE = 16


def init(store, device_visible):
    import torch
    from megatron.core import parallel_state

    os.makedirs(store, exist_ok=True)
    if device_visible:
        torch.cuda.set_device(0)
    torch.distributed.init_process_group(
        "gloo", init_method=f"file://{store}/store", rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel(1, 1)
    if device_visible:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(SEED)


def config(moe, cpu):
    import torch
    from megatron.core.transformer.transformer_config import TransformerConfig

    settings = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        add_bias_linear=False,  # 0.13 refuses biases with MoE; keeps the layouts comparable
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=torch.float32,
        use_cpu_initialization=cpu,
    )
    if moe:
        settings.update(num_moe_experts=4, moe_router_load_balancing_type="none")
    return TransformerConfig(**settings)


def gpt(moe, te):
    import torch
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.models.gpt.gpt_model import GPTModel

    torch.manual_seed(SEED)
    num_experts = 4 if moe else None
    if te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(num_experts=num_experts)
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(num_experts=num_experts)
    cfg = config(moe, cpu=not te)
    return GPTModel(config=cfg, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQUENCE)


def write(checkpoint, moe, store):
    import torch
    import mcore_cpu_shim  # noqa: F401  (the CPU-only fixes; the norm keys of MoE layers)
    from megatron.core import dist_checkpointing

    assert os.environ.get("CUDA_VISIBLE_DEVICES") == "", "write runs with CUDA hidden"
    init(store, device_visible=False)
    model = gpt(moe, te=False)
    generator = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # norms start at ones/zeros: random values make a swapped key show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(torch.randn(param.shape, generator=generator))
    os.makedirs(checkpoint, exist_ok=True)
    dist_checkpointing.save(model.sharded_state_dict(), checkpoint)
    assert not torch.cuda.is_initialized()


def tensors_by_checkpoint_key(model):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {
        (entry.key, tuple(entry.global_offset)): entry.data.detach().cpu()
        for entry in model.sharded_state_dict().values()
        if isinstance(entry, ShardedTensor)
    }


def load_and_compare(checkpoint, moe, store):
    import torch
    import mcore_cpu_shim
    from megatron.core import dist_checkpointing
    from mcore_cpu_shim import te_checkpoint

    init(store, device_visible=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False

    te_model = gpt(moe, te=True).cuda()
    loaded = te_checkpoint.load(te_model.sharded_state_dict(), checkpoint)
    # Not strict: from 0.15 TEDotProductAttention leaves its (empty) extra state out of its
    # sharded state dict, so load_state_dict misses it also for a TE-written checkpoint.
    result = te_model.load_state_dict(loaded, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]

    local = gpt(moe, te=False).cuda()
    local.load_state_dict(dist_checkpointing.load(local.sharded_state_dict(), checkpoint))

    reference, mine = tensors_by_checkpoint_key(local), tensors_by_checkpoint_key(te_model)
    compared = sorted(set(reference) & set(mine))
    differing = [f"{k}@{o}" for k, o in compared if not torch.equal(reference[k, o], mine[k, o])]

    te_model.eval()
    local.eval()
    tokens = torch.randint(0, VOCAB, (2, SEQUENCE), generator=torch.Generator().manual_seed(SEED))
    tokens = tokens.cuda()
    positions = torch.arange(SEQUENCE, device="cuda").unsqueeze(0).expand(2, -1)
    with torch.no_grad():
        te_logits = te_model(tokens, positions, None)
        local_logits = local(tokens, positions, None)
    import megatron.core

    return {
        "megatron_core": getattr(megatron.core, "__version__", "unknown"),
        "transformer_engine": _te_version(),
        "moe": moe,
        "fix_states": {name: info["state"] for name, info in mcore_cpu_shim.status().items()},
        "load_state_dict_missing": missing,
        "load_state_dict_missing_extra_state": sorted(set(result.missing_keys) - set(missing)),
        "load_state_dict_unexpected": list(result.unexpected_keys),
        "compared": len(compared),
        "missing_in_te": sorted(f"{k}@{o}" for k, o in set(reference) - set(mine)),
        "te_only": sorted(f"{k}@{o}" for k, o in set(mine) - set(reference)),
        "differing": differing,
        "max_logit_diff": float((te_logits.float() - local_logits.float()).abs().max()),
    }


def _te_version():
    try:
        import transformer_engine

        return getattr(transformer_engine, "__version__", "unknown")
    except Exception as exc:
        return f"not importable ({type(exc).__name__}: {exc})"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=["write", "load"])
    parser.add_argument("checkpoint")
    parser.add_argument("--moe", action="store_true")
    parser.add_argument("--store", default=None, help="folder for the Gloo file store")
    args = parser.parse_args(argv)
    store = args.store or f"{args.checkpoint}.{args.stage}-store"
    if args.stage == "write":
        write(args.checkpoint, args.moe, store)
        print(json.dumps({"written": args.checkpoint, "moe": args.moe}))
        return 0
    report = load_and_compare(args.checkpoint, args.moe, store)
    print(json.dumps(report, indent=1))
    ok = not report["missing_in_te"] and not report["differing"] and report["compared"] > 0
    ok = ok and not report["load_state_dict_missing"] and not report["load_state_dict_unexpected"]
    ok = ok and report["max_logit_diff"] < 1e-2
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
