"""CLIP frame embeddings with weights from a local file the test writes, and the projector."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from streamgrok.media.clip import ClipEncoder, ClipWeightsMissing, EmbeddingDedup
from streamgrok.media.items import FrameTokens, Tick
from streamgrok.media.projector import Projector
from streamgrok.media.samples import Scene, photo, write_clip
from streamgrok.pipeline.ingest import Ingest, IngestConfig

TINY = {
    "embed_dim": 512,
    "vision_cfg": {"image_size": 64, "layers": 1, "width": 64, "patch_size": 32,
                   "head_width": 32},
    "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 64, "heads": 2,
                 "layers": 1},
}


@pytest.fixture(scope="module")
def tiny_clip_weights(tmp_path_factory):
    import open_clip

    folder = tmp_path_factory.mktemp("clip")
    (folder / "tiny-clip-test.json").write_text(json.dumps(TINY))
    open_clip.add_model_config(folder / "tiny-clip-test.json")
    torch.manual_seed(0)
    model = open_clip.create_model("tiny-clip-test")
    path = folder / "tiny_clip.pt"
    torch.save({"state_dict": model.state_dict()}, path)
    return path


def test_clip_from_local_weights(tiny_clip_weights):
    encoder = ClipEncoder("tiny-clip-test", pretrained=str(tiny_clip_weights))
    again = ClipEncoder("tiny-clip-test", pretrained=str(tiny_clip_weights))
    images = [photo(name, 128, 96) for name in ("astronaut", "coffee", "chelsea")]
    batch = encoder.encode(images)
    assert batch.shape == (3, 512) and not encoder.random_weights
    torch.testing.assert_close(batch.norm(dim=-1), torch.ones(3))
    singles = torch.cat([encoder.encode([im]) for im in images])
    torch.testing.assert_close(batch, singles, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(again.encode(images), batch)  # deterministic from the file


def test_clip_without_weights_names_the_fix(monkeypatch, tmp_path):
    monkeypatch.delenv("STREAMGROK_CLIP_WEIGHTS", raising=False)
    with pytest.raises(ClipWeightsMissing, match="--clip-weights"):
        ClipEncoder("ViT-B-32")
    with pytest.raises(ClipWeightsMissing, match="not found"):
        ClipEncoder("ViT-B-32", pretrained=str(tmp_path / "missing.bin"))
    assert ClipEncoder("tiny-clip-test", allow_random=True).random_weights


def test_embedding_dedup():
    dedup = EmbeddingDedup(0.95)
    a = torch.nn.functional.normalize(torch.randn(512), dim=0)
    assert dedup.keep(a) and not dedup.keep(a.clone()) and dedup.dropped == 1
    assert dedup.keep(a, scene_cut=True)
    assert dedup.keep(torch.nn.functional.normalize(torch.randn(512), dim=0))


async def test_ingest_emits_frame_tokens(tiny_clip_weights, tmp_path):
    clip = write_clip(tmp_path / "c.mp4", [Scene("astronaut", 1.0), Scene("coffee", 1.0)],
                      with_audio=False)
    encoder = ClipEncoder("tiny-clip-test", pretrained=str(tiny_clip_weights))
    projector = Projector(512, 64, tokens=2)
    ingest = Ingest(IngestConfig(fps=2, audio=False, observers=False), encoder, projector)
    items = [i async for i in ingest.run(str(clip))]
    tokens = [i for i in items if not isinstance(i, Tick)]
    assert tokens and all(isinstance(t, FrameTokens) for t in tokens)
    assert sum(isinstance(i, Tick) for i in items) >= 3  # stream time, every half second
    assert tokens[0].vectors.shape == (2, 64)
    assert np.all(np.diff([t.pts for t in tokens]) > 0)
