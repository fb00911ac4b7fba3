"""llama.cpp `mmproj` GGUF files (the vision half a llama.cpp user keeps beside a text GGUF):
projector types `idefics3` (SmolVLM2) and `mlp` (LLaVA), tensor and key names as
llama.cpp's clip loader reads them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from streamgrok.errors import ModelLoadError, UnsupportedArchitecture
from streamgrok.model.gguf_loader import read_gguf, tensor_array, writable_float32
from streamgrok.vision.config import (
    IMAGENET_STANDARD,
    ConnectorConfig,
    PreprocessConfig,
    VisionConfig,
    layers_to,
)
from streamgrok.vision.encoder import VisionEncoder, build_encoder

PROJECTOR_TYPES = {"idefics3": "idefics3", "mlp": "llava"}
_BLOCK = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_out": "self_attn.out_proj",
          "ln1": "layer_norm1", "ln2": "layer_norm2", "ffn_up": "mlp.fc1",
          "ffn_down": "mlp.fc2"}
_GLOBAL = {"v.patch_embd.weight": "tower.embeddings.patch_embedding.weight",
           "v.patch_embd.bias": "tower.embeddings.patch_embedding.bias",
           "v.position_embd.weight": "tower.embeddings.position_embedding.weight",
           "v.class_embd": "tower.embeddings.class_embedding",
           "v.pre_ln.weight": "tower.pre_layrnorm.weight",
           "v.pre_ln.bias": "tower.pre_layrnorm.bias",
           "v.post_ln.weight": "tower.post_layernorm.weight",
           "v.post_ln.bias": "tower.post_layernorm.bias",
           "mm.model.fc.weight": "connector.modality_projection.proj.weight",
           "mm.0.weight": "connector.linear_1.weight", "mm.0.bias": "connector.linear_1.bias",
           "mm.2.weight": "connector.linear_2.weight", "mm.2.bias": "connector.linear_2.bias"}
_BLOCK_RE = re.compile(r"v\.blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_mmproj(path: str | Path, text_hidden: int, dtype: torch.dtype,
                device: torch.device | str) -> VisionEncoder:
    """The vision encoder in an mmproj GGUF; `text_hidden` is the text model's width,
    checked against the projector's output."""
    path = Path(path)
    reader, meta = read_gguf(path, "mmproj")
    kind = meta.get("clip.projector_type")
    if meta.get("general.architecture") != "clip" or kind is None:
        raise ModelLoadError(f"{path} is not an mmproj file (general.architecture "
                             f"{meta.get('general.architecture')!r}, no clip.projector_type)")
    family = PROJECTOR_TYPES.get(kind)
    if family is None:
        raise UnsupportedArchitecture(f"{path}: projector type {kind!r} is not supported "
                                      f"(supported: {', '.join(PROJECTOR_TYPES)})")
    tensors = {t.name: t for t in reader.tensors}
    vision, connector, preprocess = _configs(meta, family, tensors, text_hidden, path)
    state = {}
    for name, tensor in tensors.items():
        ours = _our_name(name, vision)
        if ours is not None:
            state[ours] = torch.from_numpy(writable_float32(tensor_array(tensor, path)))
    _fix_legacy_ffn(state, vision)
    return build_encoder(family, vision, connector, preprocess,
                         {k: v.to(dtype) for k, v in state.items()}, str(path)).to(device, dtype)


def _configs(meta: dict[str, Any], family: str, tensors: dict[str, Any], text_hidden: int,
             path: Path) -> tuple[VisionConfig, ConnectorConfig, PreprocessConfig]:
    def need(key: str) -> Any:
        if meta.get(key) is None:
            raise ModelLoadError(f"{path} lacks the key {key}")
        return meta[key]

    blocks = 1 + max((int(m.group(1)) for name in tensors
                      if (m := _BLOCK_RE.fullmatch(name))), default=-1)
    projection = int(meta.get("clip.vision.projection_dim") or text_hidden)
    if projection != text_hidden:
        raise ModelLoadError(f"{path} projects to {projection}-dim tokens but the language "
                             f"model needs {text_hidden}: is it this model's mmproj?")
    gelu = bool(meta.get("clip.use_gelu", False))
    feature = meta.get("clip.vision.feature_layer")
    if isinstance(feature, list):
        if len(feature) != 1:
            raise ModelLoadError(f"{path}: several vision feature layers are not supported")
        feature = feature[0]
    layers = int(need("clip.vision.block_count"))
    run = blocks if feature is None else layers_to(int(feature), layers)
    image_size = int(need("clip.vision.image_size"))
    vision = VisionConfig(
        hidden_size=int(need("clip.vision.embedding_length")),
        intermediate_size=int(need("clip.vision.feed_forward_length")),
        num_layers=max(layers, run), num_heads=int(need("clip.vision.attention.head_count")),
        image_size=image_size, patch_size=int(need("clip.vision.patch_size")),
        layer_norm_eps=float(meta.get("clip.vision.attention.layer_norm_epsilon", 1e-6)),
        activation="gelu_tanh" if gelu else "quick_gelu",
        patch_bias="v.patch_embd.bias" in tensors, class_token="v.class_embd" in tensors,
        pre_norm="v.pre_ln.weight" in tensors, post_norm="v.post_ln.weight" in tensors,
        feature_layers=run, drop_class_token="v.class_embd" in tensors)
    mean = tuple(float(x) for x in meta.get("clip.vision.image_mean") or IMAGENET_STANDARD)
    std = tuple(float(x) for x in meta.get("clip.vision.image_std") or IMAGENET_STANDARD)
    if family == "idefics3":
        scale = int(meta.get("clip.vision.projector.scale_factor") or 2)
        return (vision, ConnectorConfig("pixel_shuffle", text_hidden, scale, bias=False),
                PreprocessConfig("square", image_size, longest_edge=image_size, mean=mean,
                                 std=std))
    return (vision, ConnectorConfig("mlp", text_hidden, bias="mm.0.bias" in tensors),
            PreprocessConfig("crop", image_size, mean=mean, std=std, resample="bicubic"))


def _our_name(name: str, vision: VisionConfig) -> str | None:
    if name in _GLOBAL:
        return _GLOBAL[name]
    match = _BLOCK_RE.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK:
        return None
    block = int(match.group(1))
    if block >= vision.layers_run:
        return None
    return f"tower.encoder.layers.{block}.{_BLOCK[match.group(2)]}.{match.group(3)}"


def _fix_legacy_ffn(state: dict[str, torch.Tensor], vision: VisionConfig) -> None:
    """Older llava converters wrote fc1 as ffn_down and fc2 as ffn_up: swap by shape."""
    for i in range(vision.layers_run):
        up, down = (f"tower.encoder.layers.{i}.mlp.fc1.", f"tower.encoder.layers.{i}.mlp.fc2.")
        weight = state.get(up + "weight")
        if weight is not None and weight.shape[0] == vision.hidden_size \
                and vision.hidden_size != vision.intermediate_size:
            for part in ("weight", "bias"):
                state[up + part], state[down + part] = state[down + part], state[up + part]


__all__ = ["PROJECTOR_TYPES", "load_mmproj"]
