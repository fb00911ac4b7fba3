"""A loaded vision tower + connector + preprocessing: frames in, language-model vectors out."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from streamgrok.vision.config import ConnectorConfig, PreprocessConfig, VisionConfig
from streamgrok.vision.connector import build_connector
from streamgrok.vision.framing import FrameFraming
from streamgrok.vision.preprocess import FramePreprocessor
from streamgrok.vision.tower import VisionTower


@dataclass
class VisionEncoder:
    """A vision-language model's image path. `encode` gives [n, tokens_per_frame, hidden]
    vectors in the text model's embedding space; `frame_rows` adds the framing text's own
    token embeddings around them, so a frame enters the cache as one whole group."""

    family: str  # idefics3 | llava
    vision: VisionConfig
    connector_config: ConnectorConfig
    preprocess: PreprocessConfig
    tower: VisionTower
    connector: nn.Module
    source: str  # where the weights came from (a folder or an mmproj file)
    random_weights: bool = False

    def __post_init__(self) -> None:
        self.preprocessor = FramePreprocessor(self.preprocess)
        self.framing = FrameFraming(self.family)
        self.tokens_per_frame = self.connector_config.tokens_per_image(self.vision)

    @property
    def device(self) -> torch.device:
        return self.tower.embeddings.patch_embedding.weight.device

    def describe(self) -> dict:
        """What `session.started` and the page header report as the vision path."""
        return {"kind": "vlm", "family": self.family, "tokens_per_frame": self.tokens_per_frame,
                "image_size": self.preprocess.image_size, "source": self.source,
                "random_weights": self.random_weights}

    @torch.inference_mode()
    def pixels(self, frames: list[np.ndarray]) -> torch.Tensor:
        """The preprocessed pixel tensor [n, 3, S, S] (float32, on the host)."""
        return self.preprocessor(frames)

    @torch.inference_mode()
    def features(self, pixels: torch.Tensor) -> torch.Tensor:
        """Vision tower output [n, patches, vision hidden] for preprocessed pixels."""
        return self.tower(pixels.to(self.device))

    @torch.inference_mode()
    def encode(self, frames: list[np.ndarray]) -> torch.Tensor:
        """Frames (RGB uint8 [H, W, 3]) -> [n, tokens_per_frame, text hidden] float32 on the
        host."""
        if not frames:
            return torch.empty(0, self.tokens_per_frame, self.connector_config.text_hidden)
        return self.encode_pixels(self.pixels(frames))

    @torch.inference_mode()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed pixels [n, 3, S, S] -> [n, tokens_per_frame, text hidden] float32
        on the host."""
        return self.connector(self.features(pixels)).float().cpu()

    @torch.inference_mode()
    def frame_rows(self, vectors: torch.Tensor, pts: float | None, tokenizer,
                   embedding: nn.Embedding) -> torch.Tensor:
        """One frame's rows for the stream [framing + tokens_per_frame + framing, hidden]:
        the image vectors between the embeddings of the framing text's tokens (the same
        values the model's own embedding lookup gives those ids). `pts` None: a still
        image of a chat turn (no time line)."""
        head = self.framing.before_image() if pts is None else self.framing.before(pts)
        before = tokenizer.encode(head, add_bos=False)
        after = tokenizer.encode(self.framing.after(), add_bos=False)
        text = token_rows([*before, *after], embedding)
        return torch.cat([text[: len(before)], vectors.float(), text[len(before):]])

    def to(self, device: torch.device | str, dtype: torch.dtype) -> VisionEncoder:
        self.tower.to(device=device, dtype=dtype)
        self.connector.to(device=device, dtype=dtype)
        return self


@torch.inference_mode()
def token_rows(ids: list[int], embedding: nn.Module) -> torch.Tensor:
    """The embedding rows [n, hidden] of token ids, float32 on the host (what the model's own
    lookup gives them, ready to travel as embedding rows beside image tokens). `embedding`
    is the model's table (`nn.Embedding` or `Int8Embedding`)."""
    table = next(itertools.chain(embedding.parameters(), embedding.buffers()))
    index = torch.tensor(ids, dtype=torch.long, device=table.device)
    return embedding(index).float().cpu()


def build_encoder(family: str, vision: VisionConfig, connector: ConnectorConfig,
                  preprocess: PreprocessConfig, state: dict[str, torch.Tensor],
                  source: str) -> VisionEncoder:
    """Modules built on the meta device and filled from `state` (names as in the Hugging
    Face vision_model / connector), checked: a missing or surplus weight names itself."""
    from streamgrok.errors import ModelLoadError

    with torch.device("meta"):
        tower, conn = VisionTower(vision), build_connector(connector, vision)
    for prefix, module in (("tower.", tower), ("connector.", conn)):
        own = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
        missing, unexpected = sorted(shapes.keys() - own.keys()), sorted(own.keys() - shapes.keys())
        if missing or unexpected:
            raise ModelLoadError(f"{source}: vision weights do not match the {family} "
                                 f"{prefix[:-1]}: missing {missing[:4]}, unexpected "
                                 f"{unexpected[:4]}")
        for name, tensor in own.items():
            if tuple(tensor.shape) != shapes[name]:
                raise ModelLoadError(f"{source}: vision weight {prefix}{name} has shape "
                                     f"{tuple(tensor.shape)}, expected {shapes[name]}")
        module.load_state_dict(own, assign=True, strict=True)
    return VisionEncoder(family, vision, connector, preprocess, tower.eval().requires_grad_(False),
                         conn.eval().requires_grad_(False), source)
