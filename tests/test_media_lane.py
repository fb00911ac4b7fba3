"""A client's media waits on its own lane: its questions are never queued behind its frames,
a full lane drops the oldest frame (counted) and never audio."""

from __future__ import annotations

import asyncio
import json
import threading
from dataclasses import dataclass

import pytest
from test_server import PIPELINE, jpeg, recv_until, start, url
from websockets.asyncio.client import connect

from streamgrok.cache.config import CacheConfig
from streamgrok.server.app import ServerConfig, StreamgrokServer
from streamgrok.server.media_lane import MediaLane
from streamgrok.server.protocol import pack_media


@dataclass
class Media:
    kind: str
    name: str


async def test_a_full_lane_drops_its_oldest_frame_and_keeps_audio():
    lane = MediaLane(3)
    for item in (Media("audio.pcm16", "a0"), Media("video.frame", "f0"),
                 Media("video.frame", "f1")):
        await lane.put(item)
    await lane.put(Media("audio.pcm16", "a1"))  # full: f0 goes
    assert lane.dropped_frames == 1
    assert [(await lane.get()).name for _ in range(3)] == ["a0", "f1", "a1"]


async def test_a_lane_of_audio_only_waits_for_room_instead_of_dropping():
    lane = MediaLane(2)
    await lane.put(Media("audio.pcm16", "a0"))
    await lane.put(Media("audio.pcm16", "a1"))
    waiting = asyncio.create_task(lane.put(Media("audio.pcm16", "a2")))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # nothing it may drop: the sender waits
    assert (await lane.get()).name == "a0"
    await asyncio.wait_for(waiting, 5)
    assert [(await lane.get()).name for _ in range(2)] == ["a1", "a2"] and not lane.dropped_frames


def test_a_lane_needs_room():
    with pytest.raises(ValueError):
        MediaLane(0)


@pytest.fixture
async def live_server(tiny_loaded):
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          load_tick_s=None)
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
                                                            memory_gib=0.05))
    await srv.start()
    yield srv
    await srv.stop()


async def test_a_question_is_answered_while_the_clients_frames_wait_for_a_worker(live_server):
    """Every media worker is stuck on this client's first frame; the frames behind it and
    the audio queue up, and the question sent after them is answered all the same."""
    pool = live_server.resources.media_pool
    release, entered = threading.Event(), threading.Event()
    decode = pool.decode_image

    def stuck(data: bytes):
        entered.set()
        release.wait(30)
        return decode(data)

    pool.decode_image = stuck
    try:
        async with connect(url(live_server)) as ws:
            await start(ws)
            frame = jpeg()
            for i in range(6):
                await ws.send(pack_media("video.frame", 0, i * 0.1, frame))
            await asyncio.to_thread(entered.wait, 10)
            await ws.send(json.dumps({"type": "query", "id": "q", "text": "Anyone there?"}))
            done, seen = await recv_until(ws, "response.done")
            assert done["query_id"] == "q" and done["finish_reason"] in ("stop", "length")
            assert not [m for m in seen if m["type"] == "error"], seen
            release.set()
            await ws.send(json.dumps({"type": "session.end"}))
            await recv_until(ws, "session.ended")
    finally:
        release.set()
        pool.decode_image = decode
