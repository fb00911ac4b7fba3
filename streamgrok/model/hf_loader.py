"""Load a Llama-family model from a Hugging Face folder (config.json + *.safetensors)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from streamgrok.errors import ModelLoadError, UnsupportedArchitecture
from streamgrok.model.config import ModelConfig, MoEConfig, RopeScaling

_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn.wq.weight",
    "self_attn.q_proj.bias": "attn.wq.bias",
    "self_attn.k_proj.weight": "attn.wk.weight",
    "self_attn.k_proj.bias": "attn.wk.bias",
    "self_attn.v_proj.weight": "attn.wv.weight",
    "self_attn.v_proj.bias": "attn.wv.bias",
    "self_attn.o_proj.weight": "attn.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn.w_gate.weight",
    "mlp.up_proj.weight": "ffn.w_up.weight",
    "mlp.down_proj.weight": "ffn.w_down.weight",
    "self_attn.q_norm.weight": "attn.q_norm.weight",
    "self_attn.k_norm.weight": "attn.k_norm.weight",
    "mlp.gate.weight": "ffn.router.weight",
    "block_sparse_moe.gate.weight": "ffn.router.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn.shared.w_gate.weight",
    "mlp.shared_expert.up_proj.weight": "ffn.shared.w_up.weight",
    "mlp.shared_expert.down_proj.weight": "ffn.shared.w_down.weight",
    "mlp.shared_expert_gate.weight": "ffn.shared_gate.weight",
    # experts as one 3-D tensor each (transformers 5's layout): split per expert as read
    "mlp.experts.gate_up_proj": "ffn.experts.gate_up_proj",
    "mlp.experts.down_proj": "ffn.experts.down_proj",
}
_EXPERT_RE = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight")
_EXPERT_NAMES = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down",
                 "w1": "w_gate", "w3": "w_up", "w2": "w_down"}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")
# the text model inside a vision-language checkpoint (old and new transformers layouts)
_TEXT_PREFIXES = [("model.text_model.", "model."), ("model.language_model.", "model."),
                  ("language_model.model.", "model."), ("language_model.lm_head.", "lm_head.")]
_TEXT_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2"}
# vision-language folders whose language model loads here (their towers: streamgrok.vision)
VLM_ARCHITECTURES = {
    "SmolVLMForConditionalGeneration": "idefics3",
    "Idefics3ForConditionalGeneration": "idefics3",
    "LlavaForConditionalGeneration": "llava",
}


def vlm_family(raw: dict[str, Any]) -> str | None:
    """idefics3 or llava when config.json is a supported vision-language model."""
    archs = raw.get("architectures") or []
    return VLM_ARCHITECTURES.get(archs[0]) if archs else None


def read_json(path: Path) -> dict[str, Any]:
    """Parse a JSON file, naming the file when it is missing or malformed."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as exc:
        raise ModelLoadError(f"missing file: {path}") from exc
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}") from exc


def config_from_hf(folder: Path, raw: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face config.json."""
    raw = read_json(folder / "config.json") if raw is None else raw
    archs = raw.get("architectures") or [raw.get("model_type", "?")]
    arch = _ARCHITECTURES.get(archs[0])
    if vlm_family(raw) is not None:  # the language model of a vision-language folder
        tie = raw.get("tie_word_embeddings", False)
        raw = dict(raw.get("text_config") or {})
        raw["tie_word_embeddings"] = tie
        arch = _TEXT_TYPES.get(raw.get("model_type", "llama"))
        if arch is None:
            raise UnsupportedArchitecture(
                f"{folder}: text model type {raw.get('model_type')!r} is not supported")
    if arch is None:
        raise UnsupportedArchitecture(
            f"{folder}: architecture {archs[0]!r} is not supported "
            f"(supported: {', '.join([*_ARCHITECTURES, *VLM_ARCHITECTURES])})"
        )
    rope = raw.get("rope_parameters") or {}
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rope_theta=float(raw.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=_rope_scaling(raw.get("rope_scaling") or rope or None),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("qkv_bias", raw.get("attention_bias",
                                                            arch in ("qwen2", "qwen2_moe")))),
            max_positions=int(raw.get("max_position_embeddings", 8192)),
            moe=_moe_config(arch, raw),
            qk_norm={"qwen3_moe": "head", "olmoe": "projection"}.get(arch, "none"),
            clip_qkv=float(raw["clip_qkv"]) if raw.get("clip_qkv") is not None else None,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{folder}/config.json lacks {exc.args[0]!r}") from exc


def _moe_config(arch: str, raw: dict[str, Any]) -> MoEConfig | None:
    """The experts of a mixture-of-experts config.json (None for a dense model)."""
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return None
    experts = int(raw.get("num_experts") or raw["num_local_experts"])
    layers = int(raw["num_hidden_layers"])
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in raw.get("mlp_only_layers") or []}
    dense |= {i for i in range(layers) if (i + 1) % step}
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if arch == "qwen2_moe" else 0
    return MoEConfig(
        num_experts=experts,
        experts_per_token=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw.get("moe_intermediate_size")
                                     or raw["intermediate_size"]),
        # Mixtral always renormalises; the others as their config says
        normalize_weights=arch == "mixtral" or bool(raw.get("norm_topk_prob", False)),
        shared_intermediate_size=shared,
        shared_gated=shared > 0,
        dense_layers=tuple(sorted(dense)),
    )


def _rope_scaling(raw: dict[str, Any] | None) -> RopeScaling:
    if not raw:
        return RopeScaling()
    kind = raw.get("rope_type") or raw.get("type") or "none"
    if kind in ("default", "none"):
        return RopeScaling()
    if kind not in ("linear", "llama3"):
        raise ModelLoadError(f"rope scaling type {kind!r} is not supported")
    return RopeScaling(
        kind=kind,
        factor=float(raw.get("factor", 1.0)),
        low_freq_factor=float(raw.get("low_freq_factor", 1.0)),
        high_freq_factor=float(raw.get("high_freq_factor", 4.0)),
        original_max_positions=int(raw.get("original_max_position_embeddings", 8192)),
    )


def iter_hf_state_dict(
    folder: Path, dtype: torch.dtype, name_of: Callable[[str], str | None] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (parameter name, tensor) from every *.safetensors file in the folder; `name_of`
    maps a checkpoint key to ours, None to skip it (default: the text model's names)."""
    name_of = name_of or _parameter_name
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} holds no *.safetensors weights")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for key in handle.keys():
                    name = name_of(key)
                    if name is not None:
                        yield from split_experts(name, handle.get_tensor(key).to(dtype))
        except ModelLoadError:
            raise
        except Exception as exc:
            raise ModelLoadError(f"{file} could not be read (truncated or corrupt): {exc}") from exc


def split_experts(name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
    """A layer's experts stored as one tensor [experts, out, in] as one weight per expert
    (gate and up stacked in `gate_up_proj`, gate first); any other tensor as it is."""
    layer, _, part = name.rpartition(".experts.")
    if part == "gate_up_proj":
        for expert, weight in enumerate(tensor):
            gate, up = weight.chunk(2, dim=0)
            yield f"{layer}.experts.{expert}.w_gate.weight", gate.contiguous()
            yield f"{layer}.experts.{expert}.w_up.weight", up.contiguous()
    elif part == "down_proj":
        for expert, weight in enumerate(tensor):
            yield f"{layer}.experts.{expert}.w_down.weight", weight.contiguous()
    else:
        yield name, tensor


def renamed(key: str, prefixes: list[tuple[str, str]]) -> str | None:
    """`key` with the first matching prefix replaced, None when none matches."""
    for prefix, replacement in prefixes:
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return None


def _parameter_name(key: str) -> str | None:
    key = renamed(key, _TEXT_PREFIXES) or key
    if key in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[key]
    match = _LAYER_RE.fullmatch(key)
    if match is None:
        return None
    layer, rest = match.groups()
    if rest in _LAYER_NAMES:
        return f"layers.{layer}.{_LAYER_NAMES[rest]}"
    expert = _EXPERT_RE.fullmatch(rest)
    if expert and expert.group(2) in _EXPERT_NAMES:
        return f"layers.{layer}.ffn.experts.{expert.group(1)}." \
               f"{_EXPERT_NAMES[expert.group(2)]}.weight"
    return None
