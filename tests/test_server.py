"""A real server on a loopback port and real websocket clients."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import cv2
import numpy as np
import pytest
from helpers import random_model, tiny_config, write_gguf
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamgrok.cache.config import CacheConfig
from streamgrok.media.samples import photo
from streamgrok.model.loader import load_model
from streamgrok.server.app import ServerConfig, StreamgrokServer
from streamgrok.server.protocol import pack_media

PIPELINE = "pipelines/live_qa.py"


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "tiny.gguf"
    return load_model(write_gguf(path, random_model(tiny_config(max_positions=4096))))


@pytest.fixture
async def server(tiny_loaded):
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          stats_interval_s=0.2, max_media_per_second=50)
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=256,
                                                            memory_gib=0.05))
    await srv.start()
    yield srv
    await srv.stop()


def url(server, path="/ws"):
    return f"ws://127.0.0.1:{server.port}{path}"


async def recv_until(ws, kind, limit=400):
    seen = []
    for _ in range(limit):
        message = json.loads(await asyncio.wait_for(ws.recv(), 20))
        seen.append(message)
        if message["type"] == kind:
            return message, seen
    raise AssertionError(f"no {kind} in {[m['type'] for m in seen]}")


def jpeg(name="astronaut"):
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(photo(name, 320, 240), cv2.COLOR_RGB2BGR))
    return data.tobytes()


async def start(ws):
    await ws.send(json.dumps({"type": "session.start", "id": "s1"}))
    started, _ = await recv_until(ws, "session.started")
    return started


async def test_session_lifecycle_streamed_answer_and_stats(server):
    async with connect(url(server)) as ws:
        started = await start(ws)
        assert started["pipeline"] == "live_qa"
        await ws.send(pack_media("video.frame", 0, 0.5, jpeg()))
        await ws.send(pack_media("audio.pcm16", 0, 0.5, np.zeros(8000, "<i2").tobytes()))
        await ws.send(json.dumps({"type": "input.text", "text": "The user waves."}))
        await ws.send(json.dumps({"type": "query", "id": "q1", "text": "What happened?"}))
        done, seen = await recv_until(ws, "response.done")
        assert done["query_id"] == "q1" and done["tokens"] > 0 and "ttft_ms" in done
        assert any(m["type"] == "response.delta" and m["query_id"] == "q1" for m in seen)
        while not any(m["type"] == "event" and m.get("kind") == "note" for m in seen):
            seen.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
        note = next(m for m in seen if m.get("kind") == "note")
        assert "face" in note["text"] and note["t"] == 0.5
        stats, _ = await recv_until(ws, "stats")
        assert stats["kv"]["pages_used"] > 0 and stats["kv"]["layer_tokens"]
        await ws.send(json.dumps({"type": "session.end"}))
        await recv_until(ws, "session.ended")
    await asyncio.sleep(0.2)
    assert server.engine.cache.pool.used_pages == 0


async def test_cancel_and_disconnect_mid_answer_free_all_pages(server):
    async with connect(url(server)) as ws:
        await start(ws)
        await ws.send(json.dumps({"type": "query", "id": "long", "text": "Tell me a story."}))
        await recv_until(ws, "response.delta")
        await ws.send(json.dumps({"type": "response.cancel", "query_id": "long"}))
        done, _ = await recv_until(ws, "response.done")
        assert done["finish_reason"] == "cancelled"
        await ws.send(json.dumps({"type": "query", "id": "again", "text": "And now?"}))
        await recv_until(ws, "response.delta")
    # closed mid-answer: everything must come back
    for _ in range(50):
        await asyncio.sleep(0.1)
        if server.engine.cache.pool.used_pages == 0 and server.active_sessions == 0:
            break
    assert server.engine.cache.pool.used_pages == 0 and server.active_sessions == 0


BAD_INPUTS = [
    ("not json", "bad_json"),
    ("[1, 2]", "bad_message"),
    (json.dumps({"type": "teleport"}), "unknown_type"),
    (json.dumps({"type": "query"}), "missing_field"),
    (json.dumps({"type": "query", "text": 5}), "bad_field"),
    (json.dumps({"type": "response.cancel", "query_id": "nope"}), "unknown_query"),
    (json.dumps({"type": "session.start"}), "session_exists"),
    (b"\x01\x00", "bad_media"),
    (pack_media("video.frame", 0, 1.0, b"this is no jpeg"), "bad_image"),
    (pack_media("audio.pcm16", 0, 1.0, b"\x00\x01\x02"), "bad_audio"),
    (b"\x09" + b"\x00" * 20, "bad_media"),
    (b"\x01" + b"\x00" * 10 + b"x" * (2 * 2**20 + 10), "too_large"),
]


async def test_bad_input_matrix_keeps_connection_and_others_alive(server):
    async with connect(url(server)) as other:
        await start(other)
        async with connect(url(server)) as ws:
            await ws.send(json.dumps({"type": "query", "id": "early", "text": "hi"}))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "no_session" and error["message_id"] == "early"
            await ws.send(pack_media("video.frame", 0, 0.0, jpeg()))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "no_session"
            await start(ws)
            for raw, code in BAD_INPUTS:
                await ws.send(raw)
                error, _ = await recv_until(ws, "error")
                assert error["code"] == code, (raw[:40], error)
            for i in range(60):  # a flood of frames beyond the per-second limit
                await ws.send(pack_media("video.frame", 0, i / 100, jpeg()))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "rate_limited"
            await ws.send(json.dumps({"type": "query", "id": "ok", "text": "still there?"}))
            done, _ = await recv_until(ws, "response.done")
            assert done["query_id"] == "ok"
        await other.send(json.dumps({"type": "query", "id": "o", "text": "and you?"}))
        done, _ = await recv_until(other, "response.done")
        assert done["query_id"] == "o"


async def test_too_many_queries_in_flight(server):
    async with connect(url(server)) as ws:
        await start(ws)
        for i in range(6):
            await ws.send(json.dumps({"type": "query", "id": f"q{i}", "text": "count"}))
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "too_many_queries"


async def test_concurrent_sessions(server):
    async def one(i):
        async with connect(url(server)) as ws:
            await start(ws)
            await ws.send(json.dumps({"type": "query", "id": f"c{i}", "text": f"hello {i}"}))
            done, _ = await recv_until(ws, "response.done")
            return done["query_id"]

    assert await asyncio.gather(*(one(i) for i in range(4))) == ["c0", "c1", "c2", "c3"]


def fetch(server, path, headers=None):
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}{path}",
                                     headers=headers or {})
    with urllib.request.urlopen(request, timeout=10) as response:
        return response.status, response.read().decode()


async def test_metrics_and_page(server):
    async with connect(url(server)) as ws:
        await start(ws)
        await ws.send(json.dumps({"type": "query", "id": "m", "text": "metrics?"}))
        await recv_until(ws, "response.done")
    status, text = await asyncio.to_thread(fetch, server, "/metrics")
    assert status == 200
    from prometheus_client.parser import text_string_to_metric_families

    names = {f.name for f in text_string_to_metric_families(text)}
    assert {"streamgrok_ttft_seconds", "streamgrok_kv_pages_in_use",
            "streamgrok_active_sessions", "streamgrok_generated_tokens"} <= names
    status, page = await asyncio.to_thread(fetch, server, "/")
    assert status == 200 and "<html" in page.lower()


async def test_token_required_off_loopback_and_checked(tiny_loaded, monkeypatch):
    monkeypatch.delenv("STREAMGROK_TOKEN", raising=False)
    with pytest.raises(ValueError, match="requires a token"):
        ServerConfig(PIPELINE, host="0.0.0.0")
    config = ServerConfig(PIPELINE, port=0, token="s3cret")
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(memory_gib=0.02))
    await srv.start()
    try:
        with pytest.raises(InvalidStatus) as refused:
            async with connect(url(srv)):
                pass
        assert refused.value.response.status_code == 401
        with pytest.raises(InvalidStatus):
            async with connect(url(srv, "/ws?token=wrong")):
                pass
        async with connect(url(srv, "/ws?token=s3cret")) as ws:
            await start(ws)
        async with connect(url(srv), additional_headers={"Authorization": "Bearer s3cret"}):
            pass
    finally:
        await srv.stop()


async def test_origin_allow_list(server):
    with pytest.raises(InvalidStatus) as refused:
        async with connect(url(server), origin="http://evil.example"):
            pass
    assert refused.value.response.status_code == 403
    async with connect(url(server), origin=f"http://127.0.0.1:{server.port}") as ws:
        await start(ws)
