"""The vision half of a Hugging Face vision-language folder: SmolVLM2 / Idefics3
(`SmolVLMForConditionalGeneration`, `Idefics3ForConditionalGeneration`) and LLaVA
(`LlavaForConditionalGeneration`), config.json, preprocessor configs and *.safetensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from streamgrok.errors import ModelLoadError, UnsupportedArchitecture
from streamgrok.model.hf_loader import (
    VLM_ARCHITECTURES,
    iter_hf_state_dict,
    read_json,
    renamed,
    vlm_family,
)
from streamgrok.vision.config import (
    IMAGENET_STANDARD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ConnectorConfig,
    PreprocessConfig,
    VisionConfig,
    layers_to,
)
from streamgrok.vision.encoder import VisionEncoder, build_encoder

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu",
                "quick_gelu": "quick_gelu"}
_RESAMPLE = {1: "lanczos", 2: "bilinear", 3: "bicubic"}
# checkpoint prefixes (old and new transformers layouts) -> our module prefixes
_PREFIXES = {
    "idefics3": [("model.vision_model.", "tower."), ("model.connector.", "connector.")],
    "llava": [("model.vision_tower.vision_model.", "tower."), ("vision_tower.vision_model.",
              "tower."), ("model.vision_tower.", "tower."), ("vision_tower.", "tower."),
              ("model.multi_modal_projector.", "connector."),
              ("multi_modal_projector.", "connector.")],
}


def vision_configs(raw: dict[str, Any], family: str, processor: dict[str, Any],
                   where: Path) -> tuple[VisionConfig, ConnectorConfig, PreprocessConfig]:
    """The tower, connector and preprocessing shapes from config.json and the processor's
    own config (preprocessor_config.json / video_preprocessor_config.json)."""
    vc, text = raw.get("vision_config") or {}, raw.get("text_config") or {}
    try:
        act = vc.get("hidden_act", "gelu_pytorch_tanh" if family == "idefics3" else "quick_gelu")
        if act not in _ACTIVATIONS:
            raise ModelLoadError(f"{where}: vision activation {act!r} is not supported")
        layers = int(vc["num_hidden_layers"])
        common = dict(hidden_size=int(vc["hidden_size"]),
                      intermediate_size=int(vc["intermediate_size"]), num_layers=layers,
                      num_heads=int(vc["num_attention_heads"]),
                      image_size=int(vc["image_size"]), patch_size=int(vc["patch_size"]),
                      activation=_ACTIVATIONS[act])
        text_hidden = int(text["hidden_size"])
    except KeyError as exc:
        raise ModelLoadError(f"{where}/config.json lacks vision/text field {exc.args[0]!r}") \
            from exc
    if family == "idefics3":
        vision = VisionConfig(**common, layer_norm_eps=float(vc.get("layer_norm_eps", 1e-6)))
        connector = ConnectorConfig("pixel_shuffle", text_hidden,
                                    scale_factor=int(raw.get("scale_factor", 2)), bias=False)
        return vision, connector, _square_preprocess(processor, vision.image_size, where)
    layer = raw.get("vision_feature_layer", -2)
    if not isinstance(layer, int):
        raise ModelLoadError(f"{where}: several vision feature layers ({layer}) are not "
                             "supported")
    strategy = raw.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ModelLoadError(f"{where}: feature selection {strategy!r} is not supported")
    if raw.get("projector_hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"{where}: projector activation "
                             f"{raw['projector_hidden_act']!r} is not supported")
    vision = VisionConfig(**common, layer_norm_eps=float(vc.get("layer_norm_eps", 1e-5)),
                          patch_bias=False, class_token=True, pre_norm=True, post_norm=False,
                          feature_layers=layers_to(layer, layers),
                          drop_class_token=strategy == "default")
    connector = ConnectorConfig("mlp", text_hidden,
                                bias=bool(raw.get("multimodal_projector_bias", True)))
    return vision, connector, _crop_preprocess(processor, vision.image_size)


def _square_preprocess(proc: dict[str, Any], image_size: int, where: Path) -> PreprocessConfig:
    side = (proc.get("max_image_size") or {}).get("longest_edge", image_size)
    if int(side) != image_size:
        raise ModelLoadError(f"{where}: frames of {side}px do not fit the vision tower's "
                             f"{image_size}px")
    video = (proc.get("video_sampling") or {}).get("video_size") or proc.get("size") or {}
    return PreprocessConfig("square", image_size, longest_edge=video.get("longest_edge"),
                            mean=tuple(proc.get("image_mean", IMAGENET_STANDARD)),
                            std=tuple(proc.get("image_std", IMAGENET_STANDARD)),
                            resample=_RESAMPLE.get(proc.get("resample", 1), "lanczos"))


def _crop_preprocess(proc: dict[str, Any], image_size: int) -> PreprocessConfig:
    return PreprocessConfig("crop", image_size,
                            mean=tuple(proc.get("image_mean", OPENAI_CLIP_MEAN)),
                            std=tuple(proc.get("image_std", OPENAI_CLIP_STD)),
                            resample=_RESAMPLE.get(proc.get("resample", 3), "bicubic"))


def processor_config(folder: Path) -> dict[str, Any]:
    """The video processor's config over the image processor's (either may be absent)."""
    merged: dict[str, Any] = {}
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        if (folder / name).is_file():
            merged.update(read_json(folder / name))
    return merged


def _vision_name(key: str, family: str, vision: VisionConfig) -> str | None:
    name = renamed(key, _PREFIXES[family])
    if name is None or name.endswith("position_ids") or (
            not vision.post_norm and ".post_layernorm." in name):
        return None
    if name.startswith("tower.encoder.layers."):
        if int(name.split(".")[3]) >= vision.layers_run:
            return None
    return name


def load_hf_vision(folder: Path, raw: dict[str, Any], dtype: torch.dtype,
                   device: torch.device | str) -> VisionEncoder:
    """The vision tower and connector of a supported vision-language folder."""
    family = vlm_family(raw)
    if family is None:
        raise UnsupportedArchitecture(f"{folder} is not a supported vision-language model "
                                      f"(supported: {', '.join(VLM_ARCHITECTURES)})")
    vision, connector, preprocess = vision_configs(raw, family, processor_config(folder),
                                                   folder)
    state = dict(iter_hf_state_dict(folder, dtype,
                                    lambda key: _vision_name(key, family, vision)))
    return build_encoder(family, vision, connector, preprocess, state, str(folder)).to(
        device, dtype)
