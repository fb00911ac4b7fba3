"""Load a Llama-family model and its tokenizer from a GGUF file with the `gguf` package."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from streamgrok.errors import ModelLoadError, UnsupportedArchitecture, UnsupportedQuantization
from streamgrok.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, MoEConfig, RopeScaling

SUPPORTED_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)

_LAYER_NAMES = {
    "attn_norm.weight": "attn_norm.weight",
    "attn_q.weight": "attn.wq.weight",
    "attn_q.bias": "attn.wq.bias",
    "attn_k.weight": "attn.wk.weight",
    "attn_k.bias": "attn.wk.bias",
    "attn_v.weight": "attn.wv.weight",
    "attn_v.bias": "attn.wv.bias",
    "attn_output.weight": "attn.wo.weight",
    "ffn_norm.weight": "ffn_norm.weight",
    "ffn_gate.weight": "ffn.w_gate.weight",
    "ffn_up.weight": "ffn.w_up.weight",
    "ffn_down.weight": "ffn.w_down.weight",
    "attn_q_norm.weight": "attn.q_norm.weight",
    "attn_k_norm.weight": "attn.k_norm.weight",
    "ffn_gate_inp.weight": "ffn.router.weight",
    "ffn_gate_shexp.weight": "ffn.shared.w_gate.weight",
    "ffn_up_shexp.weight": "ffn.shared.w_up.weight",
    "ffn_down_shexp.weight": "ffn.shared.w_down.weight",
    "ffn_gate_inp_shexp.weight": "ffn.shared_gate.weight",
}
# a layer's experts, one 3-D tensor [experts, out, in] each, read one expert at a time
_EXPERT_STACKS = {
    "ffn_gate_exps.weight": "w_gate",
    "ffn_up_exps.weight": "w_up",
    "ffn_down_exps.weight": "w_down",
}
# GGUF architecture names -> ours (a Llama GGUF with experts is a Mixtral)
_ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2",
                  "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "olmoe": "olmoe"}
# whether the chosen experts' weights are renormalised, as llama.cpp does for each
# architecture (a GGUF does not record it)
_NORMALIZED_EXPERT_WEIGHTS = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True,
                              "olmoe": False}
_GLOBAL_NAMES = {
    "token_embd.weight": "embed.weight",
    "output_norm.weight": "norm.weight",
    "output.weight": "output.weight",
}
DEQUANTIZE_BLOCK_BYTES = 1 << 20  # quantized bytes dequantized at a time
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")

# Architectures whose GGUF converter permutes q/k rows for adjacent-pair rotary.
_PERMUTED_ROTARY = frozenset({"llama", "mistral", "mixtral"})


@dataclass
class GGUFContents:
    """What a GGUF file holds, in streamgrok's terms."""

    config: ModelConfig
    metadata: dict[str, Any]
    reader: GGUFReader
    path: Path

    def release_metadata(self) -> None:
        """Drop the decoded metadata and the reader's fields (a vocabulary's strings are
        over 100 MB as Python objects); the tensors stay readable."""
        self.metadata = {}
        self.reader.fields.clear()


def open_gguf(path: str | Path) -> GGUFContents:
    """Read a GGUF header and build the model config; tensors are read later, lazily."""
    path = Path(path)
    reader, metadata = read_gguf(path)
    return GGUFContents(_config_from_metadata(metadata, reader, path), metadata, reader, path)


def read_gguf(path: Path, what: str = "model") -> tuple[GGUFReader, dict[str, Any]]:
    """The reader and the decoded metadata of a GGUF file (`what` names it in errors)."""
    if not path.is_file():
        raise ModelLoadError(f"{what} file not found: {path}")
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # the gguf package raises bare ValueError/IndexError
        raise ModelLoadError(
            f"{path} is not a readable GGUF file (truncated or corrupt): {exc}"
        ) from exc
    return reader, {name: _field_value(field) for name, field in reader.fields.items()}


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a field type contents() cannot decode; keep the raw parts
        return None


def _config_from_metadata(meta: dict[str, Any], reader: GGUFReader, path: Path) -> ModelConfig:
    arch = meta.get("general.architecture")
    if arch not in _ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"{path}: architecture {arch!r} is not supported "
            f"(supported: {', '.join(_ARCHITECTURES)})"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(
            f"{path}: per-frequency rope factors (rope_freqs.weight) are not supported yet; "
            "load the Hugging Face folder of this model instead"
        )

    def key(name: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{name}")
        return value

    num_heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    num_layers = int(key("block_count"))
    tensor_names = {t.name for t in reader.tensors}
    scaling = RopeScaling()
    if meta.get(f"{arch}.rope.scaling.type") == "linear":
        scaling = RopeScaling(kind="linear", factor=float(key("rope.scaling.factor")))
    vocab = meta.get(f"{arch}.vocab_size") or len(meta.get("tokenizer.ggml.tokens") or [])
    ours = _ARCHITECTURES[arch]
    moe = None
    if int(meta.get(f"{arch}.expert_count") or 0):
        ours = "mixtral" if ours in ("llama", "mistral") else ours
        moe = _moe_config(ours, key, num_layers, tensor_names)
    elif ours not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path}: a {arch} GGUF without experts (expert_count)")
    clip = meta.get(f"{arch}.attention.clamp_kqv")
    return ModelConfig(
        architecture=ours,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length",
                                  moe.expert_intermediate_size if moe else None)),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=int(key("attention.key_length", hidden // num_heads)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        tie_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        max_positions=int(key("context_length", 8192)),
        moe=moe,
        qk_norm=("none" if "blk.0.attn_q_norm.weight" not in tensor_names
                 else "projection" if ours == "olmoe" else "head"),
        clip_qkv=float(clip) if clip else None,
    )


def _moe_config(arch: str, key: Callable[..., Any], num_layers: int,
                tensor_names: set[str]) -> MoEConfig:
    """The experts of a GGUF (llama.cpp's keys); a layer without a router is dense."""
    shared = int(key("expert_shared_feed_forward_length", 0))
    if shared == 0 and "blk.0.ffn_gate_shexp.weight" in tensor_names:
        raise ModelLoadError("GGUF metadata lacks expert_shared_feed_forward_length")
    return MoEConfig(
        num_experts=int(key("expert_count")),
        experts_per_token=int(key("expert_used_count")),
        expert_intermediate_size=int(key("expert_feed_forward_length",
                                         key("feed_forward_length", 0))),
        normalize_weights=_NORMALIZED_EXPERT_WEIGHTS[arch],
        shared_intermediate_size=shared,
        shared_gated="blk.0.ffn_gate_inp_shexp.weight" in tensor_names,
        dense_layers=tuple(i for i in range(num_layers)
                           if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names),
    )


def unpermute_rotary(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (adjacent-pair rotary -> half-split rotary)."""
    rows = weight.shape[0]
    head_dim = rows // num_heads
    rest = weight.shape[1:]
    return (
        weight.reshape(num_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)
    )


def iter_state_dict(
    contents: GGUFContents, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (parameter name, tensor) pairs, dequantized one tensor (one expert) at a
    time."""
    config = contents.config
    for tensor in contents.reader.tensors:
        match = _LAYER_RE.fullmatch(tensor.name)
        if match and match.group(2) in _EXPERT_STACKS:
            part = _EXPERT_STACKS[match.group(2)]
            for expert in range(int(tensor.shape[-1])):
                name = f"layers.{match.group(1)}.ffn.experts.{expert}.{part}.weight"
                array = tensor_array(tensor, contents.path, expert)
                yield name, torch.from_numpy(writable_float32(array)).to(dtype)
            continue
        name = _parameter_name(tensor.name)
        if name is None:
            continue
        array = tensor_array(tensor, contents.path)
        if config.architecture in _PERMUTED_ROTARY:
            if name.endswith(("attn.wq.weight", "attn.wq.bias")):
                array = unpermute_rotary(array, config.num_heads)
            elif name.endswith(("attn.wk.weight", "attn.wk.bias")):
                array = unpermute_rotary(array, config.num_kv_heads)
        if name.endswith("shared_gate.weight"):
            array = array.reshape(1, -1)  # stored as a vector [hidden]
        yield name, torch.from_numpy(writable_float32(array)).to(dtype)


def tensor_array(tensor: Any, path: Path, index: int | None = None) -> np.ndarray:
    """One GGUF tensor dequantized to a numpy array (its type checked, errors naming it);
    with `index`, only that slice of its first dimension (one expert of a stack)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedQuantization(
            f"{path}: tensor {tensor.name} uses quantization type {qtype.name}, "
            f"which streamgrok cannot load (supported: "
            f"{', '.join(sorted(t.name for t in SUPPORTED_TYPES))})"
        )
    try:
        return _dequantized_by_rows(tensor.data if index is None else tensor.data[index],
                                    qtype)
    except Exception as exc:
        raise ModelLoadError(
            f"{path}: tensor {tensor.name} could not be read (truncated or corrupt file): {exc}"
        ) from exc


def _dequantized_by_rows(data: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """`dequantize` a block of rows at a time into one float32 array: its temporaries are
    several times the output, which for a large table (a 49k-row embedding) is hundreds of
    MB."""
    if data.ndim < 2 or qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
                                  GGMLQuantizationType.BF16):
        return dequantize(data, qtype)
    step = max(1, DEQUANTIZE_BLOCK_BYTES // max(1, data[0].nbytes))
    first = dequantize(data[:step], qtype)
    if len(data) <= step:
        return first
    out = np.empty((len(data), *first.shape[1:]), dtype=first.dtype)
    out[:step] = first
    for start in range(step, len(data), step):
        out[start:start + step] = dequantize(data[start:start + step], qtype)
    return out


def writable_float32(array: np.ndarray) -> np.ndarray:
    """A contiguous float32 array torch may own (a float tensor viewed straight from the
    file is read-only)."""
    array = np.ascontiguousarray(array, dtype=np.float32)
    return array.copy() if not array.flags.writeable else array


def _parameter_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_RE.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        return f"layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}"
    return None
