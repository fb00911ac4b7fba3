"""`/v1/realtime` driven by the `openai` package's Realtime client against a real server on a
loopback port; every server event is validated against the package's published event schema."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil

import numpy as np
import pytest
from openai import AsyncOpenAI
from openai.types.realtime.realtime_server_event import RealtimeServerEvent
from pydantic import TypeAdapter
from test_openai_api import data_url
from websockets.asyncio.client import connect

from streamgrok.cache.config import CacheConfig
from streamgrok.server.app import ServerConfig, StreamgrokServer

PIPELINE = "pipelines/live_qa.py"
SCHEMA = TypeAdapter(RealtimeServerEvent)


async def started(tiny_loaded, transcribe: bool) -> StreamgrokServer:
    config = ServerConfig(PIPELINE, port=0, token="k", load_tick_s=None,
                          pipeline_options={"transcribe": str(transcribe).lower()})
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=1024,
                                                            memory_gib=0.05))
    await srv.start()
    return srv


@pytest.fixture
async def server(tiny_loaded):
    srv = await started(tiny_loaded, transcribe=False)
    yield srv
    await srv.stop()


def realtime(server):
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k",
                         max_retries=0)
    return client.realtime.connect(model="tiny")


async def events_until(connection, kind: str, limit: int = 2000) -> list[dict]:
    """Raw server events up to and including the first `kind`, each checked against the
    published schema."""
    seen = []
    for _ in range(limit):
        event = json.loads(await connection.recv_bytes())
        SCHEMA.validate_python(event)
        seen.append(event)
        if event["type"] == kind:
            return seen
    raise AssertionError(f"no {kind} in {[e['type'] for e in seen]}")


async def test_text_and_image_in_a_streamed_answer_out(server):
    async with realtime(server) as connection:
        created = await events_until(connection, "session.created")
        assert created[-1]["session"]["output_modalities"] == ["text"]
        await connection.session.update(session={"type": "realtime", "instructions":
                                                  "Answer briefly.", "max_output_tokens": 12})
        updated = await events_until(connection, "session.updated")
        assert updated[-1]["session"]["max_output_tokens"] == 12
        await connection.conversation.item.create(item={
            "type": "message", "role": "user", "content": [
                {"type": "input_text", "text": "Who is in the picture?"},
                {"type": "input_image", "image_url": data_url()}]})
        added = await events_until(connection, "conversation.item.done")
        assert added[-1]["item"]["role"] == "user"
        await connection.response.create()
        events = await events_until(connection, "response.done")
        kinds = [e["type"] for e in events]
        assert kinds.index("response.created") < kinds.index("response.output_text.delta") \
            < kinds.index("response.output_text.done") < kinds.index("response.done")
        text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
        done = events[-1]["response"]
        assert done["status"] in ("completed", "incomplete")
        assert done["output"][0]["content"][0]["text"] == text
        assert 0 < done["usage"]["output_tokens"] <= 12
        assert done["usage"]["input_tokens"] > 0
    # the image went into the live stream: the observers described it in the session


async def test_cancel_stops_the_response_and_errors_keep_the_session(server):
    async with realtime(server) as connection:
        await events_until(connection, "session.created")
        await connection.send({"type": "teleport"})
        error = (await events_until(connection, "error"))[-1]["error"]
        assert error["code"] == "unknown_type" and "supported" in error["message"]
        await connection.send({"type": "response.cancel"})
        assert (await events_until(connection, "error"))[-1]["error"]["code"] == \
            "response_cancel_not_active"
        await connection.send({"type": "input_audio_buffer.append", "audio": "not base64!"})
        assert (await events_until(connection, "error"))[-1]["error"]["code"] == "bad_audio"
        await connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me a long story."}]})
        await connection.response.create()
        await events_until(connection, "response.output_text.delta")
        await connection.response.cancel()
        done = (await events_until(connection, "response.done"))[-1]["response"]
        assert done["status"] == "cancelled"
        # the session goes on: another question is answered
        await connection.conversation.item.create(item={
            "type": "message", "role": "user", "content": [{"type": "input_text",
                                                            "text": "And now?"}]})
        await connection.response.create()
        assert (await events_until(connection, "response.done"))[-1]["response"]["status"] \
            in ("completed", "incomplete")
    for _ in range(100):  # pages and the session count are released one after the other
        if server.engine.cache.pool.used_pages == 0 and server.active_sessions == 0:
            break
        await asyncio.sleep(0.05)
    assert server.engine.cache.pool.used_pages == 0 and server.active_sessions == 0


async def test_a_realtime_session_asked_resumable_resumes_with_its_handle(server):
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="k",
                         max_retries=0)
    async with client.realtime.connect(model="tiny", extra_query={"resumable": "true"}) \
            as connection:
        created = (await events_until(connection, "session.created"))[-1]
        handle = created["resume"]["handle"]
        await connection.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Remember the word pelican."}]})
        await events_until(connection, "conversation.item.done")
    url = f"ws://127.0.0.1:{server.port}/v1/realtime?model=tiny&resume={handle}"
    auth = {"Authorization": "Bearer k"}
    async with connect(f"ws://127.0.0.1:{server.port}/ws", additional_headers=auth) as ws:
        await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
        error = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert error["code"] == "bad_request" and "/v1/realtime" in error["message"]
    async with connect(url, additional_headers=auth) as ws:
        resumed = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert resumed["type"] == "session.resumed" and resumed["gap"]["seconds"] >= 0
        assert resumed["resume"]["handle"] != handle
        await ws.send(json.dumps({"type": "response.create"}))
        while (event := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] \
                != "response.done":
            SCHEMA.validate_python(event)  # after session.resumed, the published events
        assert event["response"]["status"] in ("completed", "incomplete")
    async with connect(url, additional_headers=auth) as ws:  # the old handle is spent
        error = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert error["type"] == "error" and error["error"]["code"] == "resume_expired"
        created = json.loads(await asyncio.wait_for(ws.recv(), 20))
        assert created["type"] == "session.created"  # a new session instead


@pytest.mark.skipif(shutil.which("espeak-ng") is None,
                    reason="espeak-ng is not installed (make test installs it)")
async def test_speech_at_24_khz_is_transcribed_and_answered(tiny_loaded):
    import av

    from streamgrok.media.samples import speak

    speech = speak("Attention please. The delivery truck arrives at gate seven.", 24_000)
    pcm = (np.concatenate([np.zeros(12_000), speech, np.zeros(36_000)]) * 32767
           ).astype("<i2")
    assert av  # PyAV resamples on the server side
    srv = await started(tiny_loaded, transcribe=True)
    try:
        async with realtime(srv) as connection:
            await events_until(connection, "session.created")
            for start in range(0, len(pcm), 4800):  # 200 ms appends, as clients send them
                await connection.input_audio_buffer.append(
                    audio=base64.b64encode(pcm[start:start + 4800].tobytes()).decode())
            await connection.input_audio_buffer.commit()
            await events_until(connection, "input_audio_buffer.committed")
            await connection.response.create()
            events = await events_until(connection, "response.done")
            heard = " ".join(e["transcript"] for e in events if e["type"] ==
                             "conversation.item.input_audio_transcription.completed").lower()
            assert "delivery truck" in heard and "gate" in heard
            assert events[-1]["response"]["usage"]["output_tokens"] > 0
    finally:
        await srv.stop()
