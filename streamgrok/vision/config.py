"""Shapes of a vision tower, its connector to the language model, and its preprocessing."""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu", "gelu_tanh", "quick_gelu")
IMAGENET_STANDARD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def layers_to(feature_layer: int, num_layers: int) -> int:
    """Encoder layers that produce a `vision_feature_layer` (negative: counted from the end
    of the hidden states, which start with the embeddings: -2 runs all but one layer)."""
    return num_layers + 1 + feature_layer if feature_layer < 0 else feature_layer


@dataclass(frozen=True)
class VisionConfig:
    """A ViT: SigLIP (SmolVLM2/Idefics3: no class token, post-norm on the output) or CLIP
    (LLaVA: class token, pre-norm, features from an inner layer)."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    layer_norm_eps: float = 1e-6
    activation: str = "gelu_tanh"
    patch_bias: bool = True
    class_token: bool = False
    pre_norm: bool = False
    post_norm: bool = True
    # layers run to produce the features (LLaVA's vision_feature_layer -2 runs all but one)
    feature_layers: int | None = None
    drop_class_token: bool = False  # LLaVA's "default" feature selection

    def __post_init__(self) -> None:
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unknown vision activation {self.activation!r} "
                             f"(known: {', '.join(ACTIVATIONS)})")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"vision hidden size {self.hidden_size} is not a multiple of "
                             f"{self.num_heads} heads")
        if self.image_size % self.patch_size:
            raise ValueError(f"image size {self.image_size} is not a multiple of the patch "
                             f"size {self.patch_size}")
        if self.layers_run < 1:
            raise ValueError(f"vision feature layers must be in [1, {self.num_layers}]")

    @property
    def patches_per_side(self) -> int:
        return self.image_size // self.patch_size

    @property
    def layers_run(self) -> int:
        return self.num_layers if self.feature_layers is None else self.feature_layers


@dataclass(frozen=True)
class ConnectorConfig:
    """How vision features become language-model tokens: `pixel_shuffle` (Idefics3: merge
    scale x scale neighbouring patches, one linear map) or `mlp` (LLaVA: linear, GELU,
    linear)."""

    kind: str
    text_hidden: int
    scale_factor: int = 1
    bias: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("pixel_shuffle", "mlp"):
            raise ValueError(f"unknown connector {self.kind!r} (pixel_shuffle, mlp)")

    def tokens_per_image(self, vision: VisionConfig) -> int:
        """Language-model tokens one image becomes."""
        patches = vision.patches_per_side ** 2
        if self.kind == "pixel_shuffle":
            if vision.patches_per_side % self.scale_factor:
                raise ValueError(f"{vision.patches_per_side} patches a side do not split by "
                                 f"the scale factor {self.scale_factor}")
            return patches // self.scale_factor ** 2
        return patches + (0 if vision.drop_class_token or not vision.class_token else 1)


@dataclass(frozen=True)
class PreprocessConfig:
    """The reference processor's steps for one video frame.

    `square` (SmolVLM2's video processor): resize the longest edge to `longest_edge`
    (keeping the aspect ratio, even sides), then to `image_size` x `image_size`, Lanczos.
    `crop` (CLIP / LLaVA): resize the shortest edge to `image_size` (bicubic), center-crop
    a square. Then scale to [0, 1] and normalise with `mean` / `std`."""

    mode: str
    image_size: int
    longest_edge: int | None = None
    mean: tuple[float, float, float] = IMAGENET_STANDARD
    std: tuple[float, float, float] = IMAGENET_STANDARD
    resample: str = "lanczos"

    def __post_init__(self) -> None:
        if self.mode not in ("square", "crop"):
            raise ValueError(f"unknown preprocessing {self.mode!r} (square, crop)")
        if self.resample not in ("lanczos", "bicubic", "bilinear"):
            raise ValueError(f"unknown resample filter {self.resample!r}")
