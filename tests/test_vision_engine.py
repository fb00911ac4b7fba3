"""A tiny SmolVLM2 streaming frames through the engine and the pipelines: frames batched by
the engine's vision thread, kept or evicted whole, answers the same as recomputing from the
frames eviction kept."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from vlm_helpers import smolvlm_folder

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.tokens import MODALITY, SOURCE
from streamgrok.engine import Engine, EngineConfig
from streamgrok.loading.loader import load_model
from streamgrok.media.samples import Scene, write_clip
from streamgrok.model.sampling import SamplingParams
from streamgrok.pipeline import IngestConfig
from streamgrok.pipeline.pipeline import DEFAULT_VISION_SYSTEM, Pipeline, PipelineRunner
from streamgrok.stream_tokens import Modality

pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=8)


@pytest.fixture(scope="module")
def one_layer_vlm(tmp_path_factory):
    """One text layer: a token's K/V then depend on its own embedding and its cache position
    only, so a bounded session's cache must equal a fresh prefill of what it kept."""
    folder = tmp_path_factory.mktemp("vlm1")
    smolvlm_folder(folder, seed=3, text_layers=1)
    loaded = load_model(folder)
    assert loaded.config.num_layers == 1
    return loaded


def picture(index: int) -> np.ndarray:
    rng = np.random.default_rng(index)
    return rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)


async def test_frames_are_batched_across_sessions_and_evicted_whole(one_layer_vlm):
    cache = CacheConfig(policy="h2o", budget_tokens=128, evict_slack_tokens=64,
                        memory_gib=0.02)
    async with Engine(one_layer_vlm, cache, EngineConfig(merge_window_s=0)) as engine:
        assert engine.cache.config.frame_aware  # a vision model's default
        sessions = [engine.new_session("sys") for _ in range(3)]
        rows = await asyncio.gather(*(engine.vision.encode(picture(i), i / 2)
                                      for i in range(12)))
        assert engine.vision.stats.frames == 12
        width = rows[0].shape[0]
        assert width == 16 + len(one_layer_vlm.tokenizer.encode(
            engine.vision.encoder.framing.before(0.0) + engine.vision.encoder.framing.after()))
        for i, frame_rows in enumerate(rows):
            session = sessions[i % 3]
            await session.wait_for_room(width)
            session.append_embeddings(frame_rows, i / 2, i, droppable=False)
        for session in sessions:
            assert await session.ask("what?", SamplingParams(max_tokens=2)).text() is not None
        async with engine.paused():  # between steps: the records are not being written
            for session in sessions:
                for layer in engine.cache.sequences[session._state.seq_id].layers:
                    frames = layer.column(MODALITY) == int(Modality.FRAME)
                    counts = torch.bincount(layer.column(SOURCE)[frames].long())
                    assert set(counts.tolist()) <= {0, width}  # whole frames only


async def test_waiting_frames_of_many_sessions_go_through_the_tower_together(one_layer_vlm):
    from streamgrok.vision.batcher import FrameBatcher

    batcher = FrameBatcher(one_layer_vlm.vision, one_layer_vlm.tokenizer,
                           one_layer_vlm.model.embed, max_batch=4, queue_size=32)
    pending = [asyncio.create_task(batcher.encode(picture(i), i)) for i in range(12)]
    bad = asyncio.create_task(batcher.encode(np.zeros((4, 4), np.uint8), 0.0))
    while batcher._queue.qsize() < 13:
        await asyncio.sleep(0)
    batcher.start()  # twelve frames waiting: three batches of four, the bad frame alone fails
    try:
        rows = await asyncio.gather(*pending)
        with pytest.raises(Exception, match="frame encoding failed"):
            await bad
    finally:
        await asyncio.to_thread(batcher.stop)
    assert batcher.stats.batches in (3, 4) and batcher.stats.largest_batch == 4
    assert batcher.stats.frames == 12 and batcher.stats.errors == 1
    alone = one_layer_vlm.vision.encode([picture(5)])[0]
    torch.testing.assert_close(rows[5][-17:-1], alone, atol=1e-5, rtol=0)


async def test_answers_equal_a_recompute_from_the_retained_frames(one_layer_vlm):
    bounded = CacheConfig(policy="h2o", budget_tokens=150, evict_slack_tokens=64,
                          memory_gib=0.02)
    async with Engine(one_layer_vlm, bounded, EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        rows = [await engine.vision.encode(picture(i), float(i)) for i in range(10)]
        for i, frame_rows in enumerate(rows):
            await session.wait_for_room(frame_rows.shape[0])
            session.append_embeddings(frame_rows, float(i), i, droppable=False)
        while session._state.pending.pending_tokens():  # all taken; paused() waits for
            await asyncio.sleep(0.01)  # the step that prefills the last of them
        async with engine.paused():  # between steps: cut to the budget, read what is kept
            engine.cache.evict(force=True)
            layer = engine.cache.sequences[session._state.seq_id].layers[0]
            frames = layer.column(MODALITY) == int(Modality.FRAME)
            kept = sorted(set(layer.column(SOURCE)[frames].long().tolist()))
            answer = session.ask("which frames?", GREEDY)
        bounded_text = await answer.text()
    assert 0 < len(kept) < 10
    async with Engine(one_layer_vlm, CacheConfig(policy="full", memory_gib=0.02),
                      EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        for i in kept:
            await session.wait_for_room(rows[i].shape[0])
            session.append_embeddings(rows[i], float(i), i, droppable=False)
        recomputed = await session.ask("which frames?", GREEDY).text()
    assert bounded_text == recomputed


async def test_pipelines_stream_vlm_frame_tokens_and_say_so(one_layer_vlm, tmp_path):
    clip = write_clip(tmp_path / "clip.mp4", [Scene("astronaut", 1.5), Scene("coffee", 1.5)],
                      with_audio=False)

    class Collect:
        events: list = []

        async def send(self, event):
            self.events.append(event)

    pipeline = Pipeline("vlm", ingest=IngestConfig(fps=2, audio=False, transcribe=False))
    async with Engine(one_layer_vlm, CacheConfig(budget_tokens=512, memory_gib=0.02),
                      EngineConfig(merge_window_s=0)) as engine:
        runner = PipelineRunner(pipeline, engine, [Collect()])
        runner.start()
        path = runner.vision_path()
        assert path["kind"] == "vlm" and path["family"] == "idefics3"
        assert path["tokens_per_frame"] == 16
        assert runner.answer_context() == "stream"  # the frames are only in the stream
        stats = await runner.run(str(clip))
        assert engine.vision.stats.frames > 0
        assert stats.frame_tokens == engine.vision.stats.frames * (
            16 + len(one_layer_vlm.tokenizer.encode(
                engine.vision.encoder.framing.before(0) + engine.vision.encoder.framing.after())))
        assert runner.session is not None
    off = Pipeline("notes", ingest=IngestConfig(fps=2, audio=False, transcribe=False),
                   vision_tokens=False)
    async with Engine(one_layer_vlm, CacheConfig(budget_tokens=512, memory_gib=0.02),
                      EngineConfig(merge_window_s=0)) as engine:
        runner = PipelineRunner(off, engine, [Collect()])
        runner.start()
        assert runner.vision_path()["kind"] == "notes"
        assert runner.answer_context() == "notes"  # the notes say all the stream holds
        assert (await runner.run(str(clip))).frame_tokens == 0
    with pytest.raises(ValueError, match="answer_context"):
        Pipeline("bad", answer_context="everything")


def test_the_vision_system_prompt_names_frames():
    assert "Frame from" in DEFAULT_VISION_SYSTEM


async def test_a_server_on_a_vision_model_sees_pushed_frames(one_layer_vlm):
    import json

    import cv2
    from websockets.asyncio.client import connect

    from streamgrok.media.samples import photo
    from streamgrok.server.app import ServerConfig, StreamgrokServer
    from streamgrok.server.protocol import pack_media

    config = ServerConfig("pipelines/live_qa.py", port=0,
                          pipeline_options={"transcribe": "false"}, stats_interval_s=0.2,
                          max_media_per_second=50, load_tick_s=None)
    server = StreamgrokServer(one_layer_vlm, config, CacheConfig(budget_tokens=512,
                                                                 memory_gib=0.02))
    await server.start()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/ws") as ws:
            await ws.send(json.dumps({"type": "session.start", "id": "s1"}))
            while (started := json.loads(await asyncio.wait_for(ws.recv(), 20)))["type"] \
                    != "session.started":
                pass
            assert started["vision"]["kind"] == "vlm"
            assert started["vision"]["tokens_per_frame"] == 16
            # four seconds of camera without a microphone: the merge stops waiting for audio
            # two seconds behind the newest frame, and the first frames go into the session
            for i, name in enumerate(("astronaut", "coffee", "astronaut", "coffee")):
                ok, data = cv2.imencode(".jpg", photo(name, 160, 120))
                await ws.send(pack_media("video.frame", i, i * 1.0, data.tobytes()))
            (connection,) = server.connections
            for _ in range(3000):  # the frames reach the session, then the question
                if connection.runner.stats.frame_tokens > 0:
                    break
                await asyncio.sleep(0.01)
            await ws.send(json.dumps({"type": "query", "id": "q1", "text": "What is seen?"}))
            while (done := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] \
                    != "response.done":
                pass
            assert done["query_id"] == "q1"
            assert connection.runner.stats.frame_tokens % (16 + len(
                one_layer_vlm.tokenizer.encode(
                    server.engine.vision.encoder.framing.before(0)
                    + server.engine.vision.encoder.framing.after()))) == 0
        assert server.engine.vision.stats.frames >= 1
        assert server.engine.snapshot().vision["frames"] >= 1
        import urllib.request

        exposition = await asyncio.to_thread(lambda: urllib.request.urlopen(
            f"http://127.0.0.1:{server.port}/metrics", timeout=10).read().decode())
        assert "streamgrok_vision_frames_total" in exposition
    finally:
        await server.stop()


def test_the_frame_index_finds_the_nearest_frames_and_drops_the_oldest():
    from streamgrok.media.frame_index import FrameIndex

    index = FrameIndex(capacity=4)
    vectors = torch.nn.functional.normalize(torch.randn(6, 8), dim=-1)
    for i, v in enumerate(vectors):
        index.add(float(i), i, v)
    assert len(index) == 4 and index.dropped == 2
    best = index.search(vectors[4], top_k=2)
    assert best[0].frame == 4 and best[0].score == pytest.approx(1.0, abs=1e-2)
    assert best[0].score >= best[1].score
    assert all(m.frame >= 2 for m in index.search(vectors[0], top_k=4))  # 0 and 1 are gone


async def test_clip_indexes_the_frames_beside_the_vlm_tokens_for_text_search(one_layer_vlm,
                                                                              tmp_path):
    from streamgrok.media.clip import ClipEncoder

    clip_file = write_clip(tmp_path / "clip.mp4",
                           [Scene("astronaut", 1.5), Scene("coffee", 1.5)], with_audio=False)
    clip = ClipEncoder("ViT-B-32", allow_random=True)  # speed and plumbing, not meaning
    pipeline = Pipeline("vlm+clip", ingest=IngestConfig(fps=2, audio=False, transcribe=False,
                                                        observers=False), clip=clip)

    class Null:
        async def send(self, event):
            pass

    async with Engine(one_layer_vlm, CacheConfig(budget_tokens=512, memory_gib=0.02),
                      EngineConfig(merge_window_s=0)) as engine:
        runner = PipelineRunner(pipeline, engine, [Null()])
        runner.start()
        assert runner.vision_path()["kind"] == "vlm" and runner.vision_path()["clip_index"]
        stats = await runner.run(str(clip_file))
        matches = await runner.search_frames("an astronaut", top_k=3)
    assert stats.frame_tokens > 0 and len(runner.frame_index) > 0
    assert 0 < len(matches) <= 3
    assert [m.score for m in matches] == sorted((m.score for m in matches), reverse=True)
    assert all(0 <= m.pts <= 3.0 for m in matches)


async def test_frame_search_without_clip_is_a_clear_error(one_layer_vlm):
    from streamgrok.errors import StreamgrokError

    async with Engine(one_layer_vlm, CacheConfig(budget_tokens=512, memory_gib=0.02),
                      EngineConfig(merge_window_s=0)) as engine:
        runner = PipelineRunner(Pipeline("x", ingest=IngestConfig(audio=False)), engine, [])
        runner.start()
        with pytest.raises(StreamgrokError, match="needs CLIP"):
            await runner.search_frames("a red car")


async def test_chat_completions_with_an_image_give_a_vision_model_the_image_tokens(
        one_layer_vlm):
    import base64

    import cv2
    from openai import AsyncOpenAI

    from streamgrok.media.samples import photo
    from streamgrok.server.app import ServerConfig, StreamgrokServer

    config = ServerConfig("pipelines/live_qa.py", port=0, load_tick_s=None,
                          pipeline_options={"transcribe": "false"}, max_completion_tokens=16)
    server = StreamgrokServer(one_layer_vlm, config, CacheConfig(budget_tokens=512,
                                                                 memory_gib=0.02))
    await server.start()
    try:
        api = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                          max_retries=0, timeout=60)
        ok, data = cv2.imencode(".jpg", cv2.cvtColor(photo("astronaut", 160, 120),
                                                     cv2.COLOR_RGB2BGR))
        url = "data:image/jpeg;base64," + base64.b64encode(data.tobytes()).decode()
        question = [{"type": "text", "text": "What is this?"}]
        plain = await api.chat.completions.create(
            model=one_layer_vlm.name, max_tokens=2, temperature=0,
            messages=[{"role": "user", "content": question}])
        before = server.engine.vision.stats.frames
        seen = await api.chat.completions.create(
            model=one_layer_vlm.name, max_tokens=2, temperature=0,
            messages=[{"role": "user", "content": question + [
                {"type": "image_url", "image_url": {"url": url}}]}])
        assert server.engine.vision.stats.frames == before + 1  # through the tower
        framing = len(one_layer_vlm.tokenizer.encode(
            server.engine.vision.encoder.framing.before_image()
            + server.engine.vision.encoder.framing.after()))
        assert seen.usage.prompt_tokens >= plain.usage.prompt_tokens + 16 + framing
        bad = "data:image/png;base64," + base64.b64encode(b"not a png").decode()
        with pytest.raises(Exception, match="JPEG/PNG"):
            await api.chat.completions.create(
                model=one_layer_vlm.name, max_tokens=2,
                messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": bad}}]}])
        assert (await api.chat.completions.create(  # the server goes on
            model=one_layer_vlm.name, max_tokens=2,
            messages=[{"role": "user", "content": question}])).choices
    finally:
        await server.stop()
