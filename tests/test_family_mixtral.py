"""Mixtral, the one family of the matrix no Megatron-Bridge converts (neither 0.3.1 nor main has a
Mixtral bridge), converted with megatron-core directly on a host without CUDA.

The tiny model of ``hf_models`` is mapped onto megatron-core's GPT model with the local layer
spec (what a host without Transformer Engine builds: plain RoPE, GQA, a top-2 softmax router
with four SequentialMLP experts), its CPU logits compared with HF's, saved as ``torch_dist``,
loaded into a fresh model and mapped back: every HF tensor ``torch.equal``, the logits the same
before and after the checkpoint. The mapping is the usual one (fused q/k/v by query group, gate
and up projections stacked in ``linear_fc1``); the checks are of megatron-core on the CPU, which
is what the shim fixes (``rope_device``, ``moe_dispatcher_device``, ``moe_forward_device``,
``dcp_collective_device``, ``rng_tracker_device``).

Runs in the Bridge legs' shim mode, next to test_demo.py::test_bridge_family (those legs have
``transformers``: 4.x on megatron-core 0.16.1, 5.x on the pin of Bridge main, whose Mixtral
keeps its experts fused in ``gate_up_proj``/``down_proj``); the matrix report lists it in the
family table.
"""

import pytest
from helpers import HAVE_BRIDGE, MODE, hf_model, run_bridge

pytestmark = [
    pytest.mark.cuda_hidden,
    pytest.mark.skipif(not HAVE_BRIDGE, reason="runs in the matrix's Bridge legs (they have transformers)"),
    pytest.mark.skipif(MODE != "shim", reason=f"mode {MODE}: the family matrix runs in the Bridge legs' shim mode"),
]

CONVERT = r"""
import json, sys, tempfile
import torch
import mcore_cpu_shim
from helpers import init_gloo, save_and_reload
from pathlib import Path
from mcore_cpu_shim.app import demo_bridge
from megatron.core import tensor_parallel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.transformer.transformer_config import TransformerConfig

folder, work = sys.argv[1], Path(sys.argv[2])
init_gloo(tempfile.mkdtemp())
ids = demo_bridge.tokens(256, 2, 32)
expected, c = demo_bridge.hf_logits(folder, ids)  # float32, eager attention
import transformers
source = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
theta = getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"]
layers, experts, heads, groups, d = (c.num_hidden_layers, c.num_local_experts, c.num_attention_heads,
                                     c.num_key_value_heads, c.head_dim)
fused = "model.layers.0.mlp.experts.gate_up_proj" in source  # transformers 5
moe = "mlp" if fused else "block_sparse_moe"

def build():
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(
        num_layers=layers, hidden_size=c.hidden_size, num_attention_heads=heads, num_query_groups=groups,
        kv_channels=d, ffn_hidden_size=c.intermediate_size, num_moe_experts=experts,
        moe_ffn_hidden_size=c.intermediate_size, moe_router_topk=c.num_experts_per_tok,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0, gated_linear_unit=True,
        activation_func=torch.nn.functional.silu, add_bias_linear=False, normalization="RMSNorm",
        layernorm_epsilon=c.rms_norm_eps, hidden_dropout=0.0, attention_dropout=0.0,
        use_cpu_initialization=True, params_dtype=torch.float32)
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=c.vocab_size,
                    max_sequence_length=c.max_position_embeddings, position_embedding_type="rope",
                    rotary_base=theta, share_embeddings_and_output_weights=False)

def qkv(i):
    q, k, v = (source[f"model.layers.{i}.self_attn.{p}_proj.weight"] for p in "qkv")
    per = heads // groups
    return torch.cat([torch.cat([q[g * per * d:(g + 1) * per * d], k[g * d:(g + 1) * d], v[g * d:(g + 1) * d]])
                      for g in range(groups)])

def split_qkv(w):
    per = heads // groups
    blocks = w.view(groups, (per + 2) * d, -1)
    return {"q": blocks[:, :per * d].reshape(heads * d, -1), "k": blocks[:, per * d:(per + 1) * d].reshape(groups * d, -1),
            "v": blocks[:, (per + 1) * d:].reshape(groups * d, -1)}

def one_to_one():  # (megatron name, HF name) of every tensor that maps unchanged
    pairs = [("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             ("decoder.final_layernorm.weight", "model.norm.weight"), ("output_layer.weight", "lm_head.weight")]
    for i in range(layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        pairs += [(m + "input_layernorm.weight", h + "input_layernorm.weight"),
                  (m + "self_attention.linear_proj.weight", h + "self_attn.o_proj.weight"),
                  (m + "pre_mlp_layernorm.weight", h + "post_attention_layernorm.weight"),
                  (m + "mlp.router.weight", h + f"{moe}.gate.weight")]
    return pairs

def to_megatron():
    out = {megatron: source[hf] for megatron, hf in one_to_one()}
    for i in range(layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        out[m + "self_attention.linear_qkv.weight"] = qkv(i)
        for e in range(experts):
            x = m + f"mlp.experts.local_experts.{e}."
            if fused:
                out[x + "linear_fc1.weight"] = source[h + "mlp.experts.gate_up_proj"][e]
                out[x + "linear_fc2.weight"] = source[h + "mlp.experts.down_proj"][e]
            else:
                w = h + f"block_sparse_moe.experts.{e}."
                out[x + "linear_fc1.weight"] = torch.cat([source[w + "w1.weight"], source[w + "w3.weight"]])
                out[x + "linear_fc2.weight"] = source[w + "w2.weight"]
    return out

def to_hf(params):
    out = {hf: params[megatron] for megatron, hf in one_to_one()}
    for i in range(layers):
        m, h = f"decoder.layers.{i}.", f"model.layers.{i}."
        for p, w in split_qkv(params[m + "self_attention.linear_qkv.weight"]).items():
            out[h + f"self_attn.{p}_proj.weight"] = w
        fc1 = [params[m + f"mlp.experts.local_experts.{e}.linear_fc1.weight"] for e in range(experts)]
        fc2 = [params[m + f"mlp.experts.local_experts.{e}.linear_fc2.weight"] for e in range(experts)]
        if fused:
            out[h + "mlp.experts.gate_up_proj"], out[h + "mlp.experts.down_proj"] = torch.stack(fc1), torch.stack(fc2)
        else:
            for e in range(experts):
                w = h + f"block_sparse_moe.experts.{e}."
                out[w + "w1.weight"], out[w + "w3.weight"] = fc1[e].chunk(2)
                out[w + "w2.weight"] = fc2[e]
    return out

def logits(model):
    model.eval()
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1]).unsqueeze(0).expand_as(ids), None)

with mcore_cpu_shim.forbid_cuda() as touched:
    model = build()
    mapped = to_megatron()
    params = {name: p for name, p in model.named_parameters()}
    assert sorted(mapped) == sorted(params), sorted(set(mapped) ^ set(params))
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(mapped[name])
    before = logits(model)
    reloaded = save_and_reload(model, build(), work / "torch_dist")
    after = logits(reloaded)
    back = to_hf(dict(reloaded.named_parameters()))
equal = [name for name in source if name in back and torch.equal(back[name], source[name])]
print(json.dumps({"touched": touched, "tensors": len(source), "equal": len(equal), "extra": sorted(set(back) - set(source)),
                  "fused": fused, "same_after_reload": torch.equal(before, after),
                  "parity": demo_bridge.parity(expected, before)}))
"""


def test_mixtral_converts_with_megatron_core(tmp_path, record_property):
    report = run_bridge(CONVERT, hf_model("mixtral"), str(tmp_path))
    assert report["touched"] == [], report["touched"]
    assert (report["equal"], report["extra"]) == (report["tensors"], []), report
    # per layer q, k, v, o, two norms, the router, the experts (fused: 2 tensors; else 3 each)
    assert report["tensors"] == 3 + 2 * (7 + (2 if report["fused"] else 3 * 4))
    assert report["same_after_reload"] is True
    logits = report["parity"]
    assert logits["max_abs_diff"] <= logits["bar"], logits
    assert logits["argmax_equal"] == logits["positions"] == 64, logits
    record_property("family", f"{report['equal']}/{report['tensors']} tensors equal, logits max abs diff "
                              f"{logits['max_abs_diff']:.1e} (scale {logits['scale']:.1e}); megatron-core directly")
