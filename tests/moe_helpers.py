"""Tiny random mixture-of-experts models in transformers (test-only), written as Hugging
Face folders the loaders read."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from helpers import CHAT_TEMPLATE, add_byte_tokenizer, byte_tokenizer, byte_vocab, permute_rotary

# layout -> (transformers config class, model class, extra config fields)
LAYOUTS = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       shared_expert_intermediate_size=64, mlp_only_layers=[1],
                       num_hidden_layers=3)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                       head_dim=16, norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM",
              dict(num_experts=4, num_experts_per_tok=2, clip_qkv=3.0)),
}


def hf_moe_model(layout: str, seed: int = 0):
    """A transformers model of `layout` with random weights large enough that the router's
    choices differ from token to token (norm weights perturbed so they matter)."""
    import transformers

    config_class, model_class, extra = LAYOUTS[layout]
    fields = dict(vocab_size=len(byte_vocab()), hidden_size=64, intermediate_size=96,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)
    fields.update(extra)
    config = getattr(transformers, config_class)(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.normal_(0, 0.08)
    return model.eval()


def write_hf_moe_folder(folder: Path, model) -> Path:
    """`model.save_pretrained` (the Hub's per-expert layout) with the byte tokenizer."""
    model.save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "bos_token": "<|im_start|>",
                    "chat_template": CHAT_TEMPLATE}))
    return folder


# llama.cpp's architecture name of each layout (a Mixtral is a Llama with experts)
GGUF_ARCHITECTURES = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe",
                      "olmoe": "olmoe"}
_GGUF_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def write_moe_gguf(path: Path, model, layout: str,
                   qtype: gguf.GGMLQuantizationType = gguf.GGMLQuantizationType.F32) -> Path:
    """`model` (from `hf_moe_model`) as llama.cpp's converter writes it: experts as 3-D
    `*_exps` tensors, q/k permuted for a Mixtral; 2-D and 3-D weights in `qtype` (the
    router, norms and the shared expert's gate in F32)."""
    config = model.config
    arch = GGUF_ARCHITECTURES[layout]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_count(getattr(config, "num_experts", None) or config.num_local_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    if getattr(config, "clip_qkv", None):
        writer.add_clamp_kqv(config.clip_qkv)
    add_byte_tokenizer(writer)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads

    def add(name: str, array: np.ndarray) -> None:
        keep = array.ndim == 1 or name.endswith(("ffn_gate_inp.weight",
                                                 "ffn_gate_inp_shexp.weight"))
        if qtype != gguf.GGMLQuantizationType.F32 and not keep:
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(array))

    for key, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if key == "model.embed_tokens.weight":
            add("token_embd.weight", array)
        elif key == "model.norm.weight":
            add("output_norm.weight", array)
        elif key == "lm_head.weight":
            add("output.weight", array)
        else:
            _, _, layer, rest = key.split(".", 3)
            if rest == "mlp.experts.gate_up_proj":
                gate, up = np.split(array, 2, axis=1)
                add(f"blk.{layer}.ffn_gate_exps.weight", gate)
                add(f"blk.{layer}.ffn_up_exps.weight", up)
                continue
            if rest == "mlp.experts.down_proj":
                add(f"blk.{layer}.ffn_down_exps.weight", array)
                continue
            name = _GGUF_NAMES[rest]
            if arch == "llama" and name.startswith("attn_q."):
                array = permute_rotary(array, heads)
            elif arch == "llama" and name.startswith("attn_k."):
                array = permute_rotary(array, kv_heads)
            elif name == "ffn_gate_inp_shexp.weight":
                array = array.reshape(-1)
            add(f"blk.{layer}.{name}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
