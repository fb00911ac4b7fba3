"""Video frames to the normalised pixel tensors a vision tower takes, step for step as each
model's reference processor does it (torchvision resizes on uint8, as transformers' own
torchvision processors do)."""

from __future__ import annotations

import numpy as np
import torch

from streamgrok.vision.config import PreprocessConfig

MAX_SIDE = 4096  # the processors' cap on a resized side


def longest_edge_size(height: int, width: int, longest: int) -> tuple[int, int]:
    """SmolVLM's video resize target: the longest edge to `longest`, the other keeping the
    aspect ratio, rounded up to an even number."""
    longest = min(MAX_SIDE, longest)
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    return max(height, 1), max(width, 1)


def shortest_edge_size(height: int, width: int, shortest: int) -> tuple[int, int]:
    """CLIP's resize target: the shortest edge to `shortest`, the other keeping the ratio."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shortest * long / short)
    return (new_long, shortest) if width <= height else (shortest, new_long)


def center_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    """A size x size crop from the middle ([..., H, W]; both sides at least `size`)."""
    height, width = image.shape[-2:]
    top, left = int((height - size) / 2.0), int((width - size) / 2.0)
    return image[..., top : top + size, left : left + size]


class FramePreprocessor:
    """RGB uint8 frames [H, W, 3] -> float32 [n, 3, S, S]."""

    def __init__(self, config: PreprocessConfig) -> None:
        # torchvision (~90 MB resident, seconds to import) loads only where frames are resized
        from torchvision.transforms.v2 import InterpolationMode, functional

        self.config = config
        self.filter = InterpolationMode(config.resample)
        self._resize_image = functional.resize
        scale = 1 / 255.0  # rescale folded into the normalisation, as the processors do
        self.mean = torch.tensor(config.mean, dtype=torch.float32).view(3, 1, 1) / scale
        self.std = torch.tensor(config.std, dtype=torch.float32).view(3, 1, 1) / scale

    def __call__(self, frames: list[np.ndarray]) -> torch.Tensor:
        return torch.stack([self.one(frame) for frame in frames])

    def one(self, frame: np.ndarray) -> torch.Tensor:
        if frame.ndim != 3 or frame.shape[2] != 3 or frame.dtype != np.uint8:
            raise ValueError(f"a frame must be RGB uint8 [H, W, 3], got {frame.dtype} "
                             f"{tuple(frame.shape)}")
        image = np.ascontiguousarray(frame)
        if not image.flags.writeable:  # a decoded frame may be read-only; torch wants to own
            image = image.copy()
        image = torch.from_numpy(image).permute(2, 0, 1)
        c, size = self.config, self.config.image_size
        if c.mode == "square":
            if c.longest_edge:
                image = self._resize(image, longest_edge_size(*image.shape[-2:],
                                                              c.longest_edge))
            image = self._resize(image, (size, size))
        else:
            image = center_crop(self._resize(image, shortest_edge_size(*image.shape[-2:],
                                                                       size)), size)
        return (image.float() - self.mean) / self.std

    def _resize(self, image: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        if tuple(image.shape[-2:]) == size:
            return image
        return self._resize_image(image, list(size), interpolation=self.filter, antialias=True)
