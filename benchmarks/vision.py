"""Vision tower throughput at real model shapes, random weights (speed does not depend on
the values): SmolVLM2-256M's SigLIP tower + pixel shuffle, and CLIP ViT-B/32 both as our
own tower and as open_clip's (the baseline, in the same run), at batch 1 and 16, on
decoded 640x360 frames, preprocessing included."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from streamgrok.vision.config import (
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    ConnectorConfig,
    PreprocessConfig,
    VisionConfig,
)
from streamgrok.vision.connector import build_connector
from streamgrok.vision.encoder import VisionEncoder
from streamgrok.vision.tower import VisionTower


@dataclass(frozen=True)
class TowerShape:
    name: str
    family: str
    vision: VisionConfig
    connector: ConnectorConfig
    preprocess: PreprocessConfig


SMOLVLM2_256M = TowerShape(
    "SmolVLM2-256M (SigLIP-B/16 512px, shuffle 4)", "idefics3",
    VisionConfig(768, 3072, 12, 12, 512, 16),
    ConnectorConfig("pixel_shuffle", 576, scale_factor=4, bias=False),
    PreprocessConfig("square", 512, longest_edge=512))
CLIP_B32 = TowerShape(
    "CLIP ViT-B/32 224px (LLaVA-style, MLP)", "llava",
    VisionConfig(768, 3072, 12, 12, 224, 32, layer_norm_eps=1e-5, activation="quick_gelu",
                 patch_bias=False, class_token=True, pre_norm=True, post_norm=False,
                 feature_layers=11, drop_class_token=True),
    ConnectorConfig("mlp", 576),
    PreprocessConfig("crop", 224, mean=OPENAI_CLIP_MEAN, std=OPENAI_CLIP_STD,
                     resample="bicubic"))


def random_encoder(shape: TowerShape, seed: int = 0) -> VisionEncoder:
    """An encoder of `shape` with random weights, labelled as such."""
    torch.manual_seed(seed)
    tower, connector = VisionTower(shape.vision), build_connector(shape.connector, shape.vision)
    with torch.no_grad():
        for p in [*tower.parameters(), *connector.parameters()]:
            p.normal_(0, 0.02)
    return VisionEncoder(shape.family, shape.vision, shape.connector, shape.preprocess,
                         tower.eval().requires_grad_(False), connector.eval(), "random",
                         random_weights=True)


def tower_flops(shape: TowerShape) -> float:
    """Multiply-adds x 2 of one image through the tower layers that run and the connector."""
    v = shape.vision
    n = v.patches_per_side ** 2 + (1 if v.class_token else 0)
    d, f = v.hidden_size, v.intermediate_size
    per_layer = 2 * n * (4 * d * d + 2 * d * f) + 4 * n * n * d
    patches = 2 * v.patches_per_side ** 2 * d * 3 * v.patch_size ** 2
    out = shape.connector.tokens_per_image(v)
    if shape.connector.kind == "pixel_shuffle":
        conn = 2 * out * d * shape.connector.scale_factor ** 2 * shape.connector.text_hidden
    else:
        h = shape.connector.text_hidden
        conn = 2 * out * (d * h + h * h)
    return patches + v.layers_run * per_layer + conn


def time_batches(encode, images: list[np.ndarray], batch: int, frames: int) -> float:
    """Frames per second encoding `frames` images `batch` at a time (after one warm-up)."""
    encode(images[:batch])
    started = time.perf_counter()
    done = 0
    while done < frames:
        start = done % len(images)
        chunk = images[start : start + batch]
        encode(chunk)
        done += len(chunk)
    return done / (time.perf_counter() - started)


def vision_bench(images: list[np.ndarray], baseline_fps: dict[int, float] | None = None,
                 out_dir: str | Path | None = None,
                 frames: dict[int, int] | None = None) -> dict:
    """Rows of frames/s, tokens/s and achieved GFLOP/s per tower and batch; a PNG plot.
    `baseline_fps`: open_clip's ViT-B/32 frames/s by batch, measured by the caller in the
    same run."""
    frames = frames or {1: 4, 16: 16}
    results: dict[str, float] = {}
    rows = []
    for shape in (SMOLVLM2_256M, CLIP_B32):
        encoder = random_encoder(shape)
        flops = tower_flops(shape)
        for batch, count in frames.items():
            fps = time_batches(encoder.encode, images, batch, count)
            key = f"vision_{shape.family}_b{batch}_fps"
            results[key] = fps
            rows.append((shape.name + " (ours)", batch, fps))
            print(f"vision     {shape.name}, RANDOM weights, batch {batch:>2}: {fps:6.2f} "
                  f"frames/s, {fps * encoder.tokens_per_frame:7.0f} LM tokens/s, "
                  f"{fps * flops / 1e9:6.1f} GFLOP/s")
    flops = tower_flops(CLIP_B32)
    for batch, fps in (baseline_fps or {}).items():  # open_clip's ViT-B/32: the baseline
        results[f"vision_open_clip_b{batch}_fps"] = fps
        rows.append(("open_clip ViT-B/32 (baseline)", batch, fps))
        ours = results[f"vision_llava_b{batch}_fps"]
        print(f"vision     open_clip ViT-B/32 baseline batch {batch:>2}: {fps:6.2f} frames/s"
              f" (~{fps * flops / 1e9:.1f} GFLOP/s); ours at that shape {ours / fps:.2f}x")
    if out_dir is not None:
        results["plot"] = str(plot(rows, Path(out_dir) / "vision_towers.png"))
        print(f"plot: {results['plot']}")
    return results


def plot(rows: list[tuple[str, int, float]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    names = list(dict.fromkeys(r[0] for r in rows))
    batches = sorted({r[1] for r in rows})
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(batches)
    for j, batch in enumerate(batches):
        values = [next((r[2] for r in rows if r[0] == n and r[1] == batch), 0) for n in names]
        ax.barh([i + j * width for i in range(len(names))], values, width,
                label=f"batch {batch}")
    ax.set_yticks([i + width * (len(batches) - 1) / 2 for i in range(len(names))], names)
    ax.set_xlabel("frames/s (random weights, this machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
