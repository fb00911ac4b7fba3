"""CLIP frame embeddings with open_clip, weights from a local file or a locally cached tag.

Nothing is downloaded: HF_HUB_OFFLINE is set before open_clip loads, so a missing cache
fails at once. Without weights the encoder refuses to start and says how to provide them;
random weights only with `allow_random=True` (tests, benchmarks), and `random_weights` says so.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from streamgrok.errors import StreamgrokError

CLIP_WEIGHTS_HELP = (
    "CLIP needs weights: pass --clip-weights PATH (an open_clip checkpoint file for {model}, "
    "e.g. open_clip_pytorch_model.bin or .safetensors), or set STREAMGROK_CLIP_WEIGHTS. "
    "Without CLIP the pipeline still runs with the offline observers and transcripts."
)


class ClipWeightsMissing(StreamgrokError):
    """CLIP cannot start because no weights are available locally."""


class ClipEncoder:
    """Embeds RGB frames into L2-normalised vectors (512-dim for ViT-B-32), batched, no grad."""

    def __init__(
        self,
        model_name: str = "ViT-B-32",
        pretrained: str | None = None,
        device: torch.device | str = "cpu",
        allow_random: bool = False,
    ) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        try:
            import open_clip
        except ImportError:
            raise StreamgrokError("CLIP frame tokens need open_clip: pip install "
                                  "'streamgrok[clip]'") from None

        if model_name not in open_clip.list_models():
            raise StreamgrokError(f"unknown CLIP model {model_name!r}")
        pretrained = pretrained or os.environ.get("STREAMGROK_CLIP_WEIGHTS")
        self.random_weights = False
        if pretrained is None:
            if not allow_random:
                raise ClipWeightsMissing(CLIP_WEIGHTS_HELP.format(model=model_name))
            self.random_weights = True
        elif Path(pretrained).suffix and not Path(pretrained).is_file():
            raise ClipWeightsMissing(
                f"CLIP weights file not found: {pretrained}. "
                + CLIP_WEIGHTS_HELP.format(model=model_name)
            )
        try:
            model, _, preprocess = open_clip.create_model_and_transforms(
                model_name, pretrained=pretrained, device=device
            )
        except Exception as exc:
            raise ClipWeightsMissing(
                f"CLIP weights {pretrained!r} could not be loaded ({exc}). "
                + CLIP_WEIGHTS_HELP.format(model=model_name)
            ) from exc
        self.model = model.eval().requires_grad_(False)
        self.preprocess = preprocess
        self.tokenize = open_clip.get_tokenizer(model_name)
        self.device = torch.device(device)
        self.model_name = model_name
        self.dim = int(self.model.visual.output_dim)

    @torch.inference_mode()
    def encode(self, images: list[np.ndarray]) -> torch.Tensor:
        """[n, dim] unit vectors for RGB uint8 images [H, W, 3]."""
        from PIL import Image

        if not images:
            return torch.empty(0, self.dim)
        batch = torch.stack([self.preprocess(Image.fromarray(im)) for im in images])
        features = self.model.encode_image(batch.to(self.device))
        return F.normalize(features.float(), dim=-1).cpu()


    @torch.inference_mode()
    def encode_text(self, texts: list[str]) -> torch.Tensor:
        """[n, dim] unit vectors for texts, in the same space as the frames' (text-to-frame
        search)."""
        features = self.model.encode_text(self.tokenize(texts).to(self.device))
        return F.normalize(features.float(), dim=-1).cpu()


class EmbeddingDedup:
    """Drop a frame whose embedding is nearly the same as the last kept one's."""

    def __init__(self, threshold: float = 0.95) -> None:
        self.threshold = threshold
        self._last: torch.Tensor | None = None
        self.dropped = 0

    def keep(self, embedding: torch.Tensor, scene_cut: bool = False) -> bool:
        if self._last is not None and not scene_cut:
            if float(embedding @ self._last) >= self.threshold:
                self.dropped += 1
                return False
        self._last = embedding
        return True
