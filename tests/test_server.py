"""A real server on a loopback port and real websocket clients."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import cv2
import numpy as np
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from streamgrok.cache.config import CacheConfig
from streamgrok.media.samples import photo
from streamgrok.server.app import ServerConfig, StreamgrokServer
from streamgrok.server.protocol import pack_media

PIPELINE = "pipelines/live_qa.py"


@pytest.fixture
async def server(tiny_loaded):
    # the load governor is driven by hand in its own test: measured load on a busy test
    # machine must not refuse the other tests' sessions
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          stats_interval_s=0.2, max_media_per_second=50, load_tick_s=None)
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
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
        assert started["vision"]["kind"] == "notes"  # a text model: the observers' notes only
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
    # closed mid-answer: every page comes back (the session waits, detached, for a resume)
    for _ in range(50):
        await asyncio.sleep(0.1)
        if server.engine.cache.pool.used_pages == 0 and \
                server.engine.snapshot().parked_sessions == 1:
            break
    assert server.engine.cache.pool.used_pages == 0
    assert server.active_sessions == len(server.shelf.detached()) == 1


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
    # strict JSON and field types
    ("[" * 100_000, "bad_json"),
    ('{"type": "query", "text": "hi", "id": NaN}', "bad_json"),
    ('{"type": "query", "text": "hi", "id": ' + "9" * 5000 + "}", "bad_json"),
    (json.dumps({"text": "no type"}), "missing_field"),
    (json.dumps({"type": "query", "text": "hi", "id": {"a": 1}}), "bad_field"),
    (json.dumps({"type": 7}), "bad_field"),
    ('{"type": "query", "text": "\\ud800 lone"}', "bad_field"),
    ('{"type": "input.text", "text": "\\udfff"}', "bad_field"),
    (json.dumps({"type": "query", "text": "why " * 10_000}), "too_large"),
    (json.dumps({"type": "input.text", "text": "x" * 40_000}), "too_large"),
    (json.dumps({"type": "session.start", "options": "fps=2"}), "bad_field"),
    (json.dumps({"type": "query", "text": "why " * 300}), "too_large"),  # over the KV budget
    # media headers: timestamps must be finite and bounded
    (pack_media("video.frame", 0, float("inf"), b"x"), "bad_media"),
    (pack_media("video.frame", 0, 1e308, b"x"), "bad_media"),
    (pack_media("video.chunk", 0, 0.0, b"garbage, no container header"), "bad_media"),
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
            await asyncio.sleep(1.1)  # the flood is over: frames are taken again
            await ws.send(pack_media("video.frame", 0, 2.0, jpeg()))
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

    families = list(text_string_to_metric_families(text))
    names = {f.name for f in families}
    assert {"streamgrok_ttft_seconds", "streamgrok_kv_pages_in_use", "streamgrok_kv_usage_ratio",
            "streamgrok_active_sessions", "streamgrok_generated_tokens",
            "streamgrok_engine_dropped", "streamgrok_build_info"} <= names
    for family in families:  # the Prometheus naming conventions
        for sample in family.samples:
            assert not sample.name.endswith("_created"), sample.name
            if family.type == "counter":
                assert sample.name.endswith("_total"), sample.name
            if family.type == "gauge":
                assert not sample.name.endswith("_total"), sample.name
    assert 'streamgrok_ttft_seconds_bucket{le="60.0",model="tiny"}' in text
    assert 'streamgrok_build_info{version="' in text and 'model="tiny"' in text
    ratio = next(f for f in families if f.name == "streamgrok_kv_usage_ratio").samples[0]
    assert 0 <= ratio.value <= 1
    status, page = await asyncio.to_thread(fetch, server, "/")
    assert status == 200 and "<html" in page.lower()


async def test_token_required_off_loopback_and_checked(tiny_loaded, monkeypatch):
    monkeypatch.delenv("STREAMGROK_TOKEN", raising=False)
    monkeypatch.delenv("STREAMGROK_API_KEY", raising=False)
    with pytest.raises(ValueError, match="requires an API key"):
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


def encoded(image: np.ndarray, ext: str = ".jpg") -> bytes:
    return cv2.imencode(ext, image)[1].tobytes()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height (a decompression bomb's shape)."""
    import struct
    import zlib

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    idat = zlib.compress(b"\x00" * 4096)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


async def test_small_odd_and_huge_frames_never_hurt_the_server(server):
    """Frames that crashed OpenCV's people detector (64x64, 96x72), frames below the minimum
    size and a 20000x20000 PNG header: refused or observed, and both clients keep working."""
    async with connect(url(server)) as other, connect(url(server)) as ws:
        await start(other)
        await start(ws)
        for w, h in [(1, 1), (32, 24), (20, 400)]:
            await ws.send(pack_media("video.frame", 0, 0.1, encoded(np.zeros((h, w, 3), "u1"))))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "bad_image" and "smaller than the minimum" in error["message"]
        await ws.send(pack_media("video.frame", 0, 0.2, png_header_only(20_000, 20_000)))
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "bad_image"
        for i, (w, h) in enumerate([(64, 64), (96, 72), (64, 128), (33, 500)]):
            image = np.random.default_rng(i).integers(0, 255, (h, w, 3), dtype=np.uint8)
            await ws.send(pack_media("video.frame", 0, 1.0 + i, encoded(image)))
        await ws.send(json.dumps({"type": "query", "id": "after", "text": "ok?"}))
        done, seen = await recv_until(ws, "response.done")
        assert done["query_id"] == "after"
        assert not [m for m in seen if m["type"] == "error"]
        await other.send(json.dumps({"type": "query", "id": "o", "text": "and you?"}))
        done, _ = await recv_until(other, "response.done")
        assert done["query_id"] == "o"
    assert server.resources.media_pool.stats.crashes == 0


async def test_a_media_worker_crash_costs_one_frame_only(server):
    """A worker dying natively (os.abort) while two clients stream: the worker is replaced,
    the frames after it are observed, and the other client's answers never stop."""
    pool = server.resources.media_pool
    async with connect(url(server)) as other, connect(url(server)) as ws:
        await start(other)
        await start(ws)
        await ws.send(pack_media("video.frame", 0, 0.5, jpeg()))
        from streamgrok.media.native_pool import MediaWorkerError

        with pytest.raises(MediaWorkerError, match="crashed"):
            await asyncio.to_thread(pool.crash_one_worker)
        await other.send(json.dumps({"type": "query", "id": "o", "text": "still?"}))
        for t in (1.5, 4.0):  # the later frame releases the notes before it (no audio here)
            await ws.send(pack_media("video.frame", 0, t, jpeg("coffee")))
        note, seen = await recv_until(ws, "event")
        assert note["kind"] == "note" and not [m for m in seen if m["type"] == "error"]
        await ws.send(json.dumps({"type": "query", "id": "w", "text": "and now?"}))
        done, seen = await recv_until(ws, "response.done")
        assert done["query_id"] == "w" and not [m for m in seen if m["type"] == "error"]
        done, _ = await recv_until(other, "response.done")
        assert done["query_id"] == "o"
    assert pool.stats.crashes == 1


@pytest.mark.parametrize("options, fragment", [
    ('{"clip_weights": "/etc/passwd"}', "cannot be set by a client"),
    ('{"projector": "../../../etc/passwd"}', "cannot be set by a client"),
    ('{"live": false}', "cannot be set by a client"),
    ('{"fps": 0}', "must be in (0.0, 30.0]"),
    ('{"fps": -1}', "must be in"),
    ('{"fps": 1e999}', "must be finite"),  # a JSON number that overflows to infinity
    ('{"fps": "abc"}', "must be a float"),
    ('{"fps": true}', "must be a number"),
    ('{"transcribe": "maybe"}', "true or false"),
])
async def test_session_options_are_an_allow_list(server, options, fragment):
    async with connect(url(server)) as ws:
        await ws.send('{"type": "session.start", "id": "s", "options": ' + options + "}")
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "bad_option" and error["message_id"] == "s"
        assert fragment in error["message"] and "passwd" not in error["message"]
        await ws.send(json.dumps({"type": "session.start", "id": "s2",
                                  "options": {"fps": 2, "transcribe": "false"}}))
        await recv_until(ws, "session.started")  # the connection is still usable


async def test_http_path_with_a_nul_byte_is_a_bad_request(server):
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(b"GET /ind\x00ex.html HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    status = await asyncio.wait_for(reader.readline(), 10)
    writer.close()
    assert status.split()[1] == b"400"


@pytest.fixture(scope="module")
def webm_clip(tmp_path_factory):
    from streamgrok.media.samples import Scene, write_clip

    return write_clip(tmp_path_factory.mktemp("clip") / "pushed.webm",
                      [Scene("astronaut", 1.5), Scene("coffee", 1.5)]).read_bytes()


async def test_pushed_container_stream_is_decoded_in_its_own_process(server, webm_clip):
    async with connect(url(server)) as ws:
        await start(ws)
        for i in range(0, len(webm_clip), 16_384):
            await ws.send(pack_media("video.chunk", 0, 0.0, webm_clip[i : i + 16_384]))
        note, seen = await recv_until(ws, "event")
        assert note["kind"] == "note" and not [m for m in seen if m["type"] == "error"]
        (connection,) = [c for c in server.connections
                         if c.live is not None and c.live.container is not None]
        worker = connection.live.container.process
        assert worker.pid != __import__("os").getpid() and worker.returncode is None
        worker.kill()  # as a crash inside FFmpeg would end it
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "bad_media" and "container decoder stopped" in error["message"]
        await ws.send(json.dumps({"type": "query", "id": "after", "text": "still there?"}))
        done, _ = await recv_until(ws, "response.done")
        assert done["query_id"] == "after"


async def test_drops_reach_stats_and_metrics_by_reason(server):
    from prometheus_client.parser import text_string_to_metric_families

    async with connect(url(server)) as ws:
        await start(ws)
        for i in range(80):  # over the 50 media messages a second the server takes
            await ws.send(pack_media("audio.pcm16", 0, i / 100, b"\x00\x00" * 160))
        while True:
            stats, _ = await recv_until(ws, "stats")
            if stats["drops"]["rate_limited"]:
                break
        assert {"frames", "frames_stale", "frames_queue", "frames_full", "frames_duplicate",
                "notes_superseded", "outbound"} <= stats["drops"].keys()
        assert stats["load"] == {"requested_fps": 1.0, "fps": 1.0, "degraded": False,
                                 "reason": ""}
        _, text = await asyncio.to_thread(fetch, server, "/metrics")
        dropped = {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
                   if f.name == "streamgrok_dropped" for s in f.samples}
        assert dropped["rate_limited"] >= stats["drops"]["rate_limited"] > 0
    _, text = await asyncio.to_thread(fetch, server, "/metrics")
    assert 'streamgrok_dropped_total{reason="rate_limited"}' in text  # kept after it left


async def test_busy_past_capacity_and_a_session_that_leaves_frees_it(tiny_loaded):
    from streamgrok.server.load import LoadReading

    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          stats_interval_s=0.2, max_sessions=3, load_tick_s=None)
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512, memory_gib=0.05))
    await srv.start()
    try:
        async with connect(url(srv)) as first, connect(url(srv)) as second, \
                connect(url(srv)) as extra:
            for ws in (first, second, extra):
                await start(ws)
            async with connect(url(srv)) as third:  # over max_sessions
                await third.send(json.dumps({"type": "session.start", "id": "s3"}))
                error, _ = await recv_until(third, "error")
                assert error["code"] == "busy" and "at most 3 sessions" in error["message"]
            await extra.send(json.dumps({"type": "session.end"}))
            await recv_until(extra, "session.ended")
            await second.send(json.dumps({"type": "session.end"}))
            await recv_until(second, "session.ended")
            overloaded = LoadReading(cpu=0.1, media_cpu=0.05, ttft_s=5.0, stale=0.0, sessions=1)
            srv.governor.tick(overloaded)  # the measured load: live sampling degrades first
            stats, _ = await recv_until(first, "stats")
            assert stats["load"]["degraded"] and stats["load"]["fps"] == 0.5
            assert "first token" in stats["load"]["reason"]
            async with connect(url(srv)) as fourth:  # degraded, not yet refusing
                await start(fourth)
            srv.governor.tick(overloaded)
            srv.governor.tick(overloaded)  # at the lowest rate and still over: busy
            async with connect(url(srv)) as fifth:
                await fifth.send(json.dumps({"type": "session.start", "id": "s5"}))
                error, _ = await recv_until(fifth, "error")
                assert error["code"] == "busy" and "sustainable load" in error["message"]
                assert error["retry_after_ms"] == 2000  # about a tick of the governor
            srv.governor.tick(LoadReading(cpu=0.2, media_cpu=0.05, ttft_s=0.1,
                                           stale=0.0, sessions=1))
            async with connect(url(srv)) as sixth:  # the load fell: admitted again
                await start(sixth)
    finally:
        await srv.stop()


async def test_a_live_question_is_queued_while_the_engine_is_behind(tiny_loaded):
    """A question of an admitted session is never refused for load: asked while another
    has waited 10 s for its first token, it is queued, and both are answered."""
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          load_tick_s=3600)  # the governor on, its measurements far away
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512, memory_gib=0.05))
    await srv.start()
    try:
        async with connect(url(srv)) as ws, connect(url(srv)) as other:
            await start(ws)
            await start(other)
            async with srv.engine.paused():  # the first question cannot start yet
                await ws.send(json.dumps({"type": "query", "id": "old", "text": "first?"}))
                while not any("old" in c.answers for c in srv.connections):
                    await asyncio.sleep(0.01)
                for connection in srv.connections:  # it has waited 10 s for a first token
                    for answer in connection.answers.values():
                        answer.metrics.asked_at -= 10.0
                await other.send(json.dumps({"type": "query", "id": "new", "text": "me?"}))
                while not any("new" in c.answers for c in srv.connections):
                    await asyncio.sleep(0.01)
            for client, query in ((ws, "old"), (other, "new")):
                done, seen = await recv_until(client, "response.done")
                assert not [m for m in seen if m["type"] == "error"], seen
                assert done["query_id"] == query and done["finish_reason"] != "error"
    finally:
        await srv.stop()


async def test_audio_at_another_sample_rate_is_resampled(server):
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "audio.format", "rate": 48000}))
        await start(ws)
        await ws.send(json.dumps({"type": "audio.format", "rate": 100}))
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "bad_audio" and "8000" in error["message"]
        await ws.send(pack_media("audio.pcm16", 0, 0.0, np.zeros(48000, "<i2").tobytes()))
        await ws.send(json.dumps({"type": "query", "id": "a", "text": "Heard anything?"}))
        await recv_until(ws, "response.done")  # the session took 48 kHz audio and goes on
    from streamgrok.media.pcm_resampler import PcmResampler

    tone = (np.sin(2 * np.pi * 440 * np.arange(48000) / 48000) * 8000).astype("<i2")
    resampler = PcmResampler(48000)
    chunks = [resampler.push(tone[i:i + 4800].tobytes()) for i in range(0, 48000, 4800)]
    samples = np.concatenate([c.samples for c in chunks])
    assert chunks[-1].pts == pytest.approx(0.9) and chunks[-1].rate == 16000
    assert abs(samples.size - 16000) < 64  # one second at 16 kHz (less the filter delay)
    spectrum = np.abs(np.fft.rfft(samples[1000:15000]))
    assert abs(np.argmax(spectrum) * 16000 / 14000 - 440) < 3  # the same tone


async def test_a_text_models_notes_stay_beside_questions_not_in_the_stream(server):
    """Questions of a text model are answered over their notes (`answer_context` "notes"):
    what a client writes becomes a note a question can be grounded in, and nothing is
    prefilled into a stream no answer reads."""
    async with connect(url(server)) as ws:
        await start(ws)
        (connection,) = server.connections
        runner = connection.runner
        assert runner.answer_context() == "notes" and not runner.notes_in_stream
        while not (before := (await runner.session.cache_info())["layer_tokens"])[0]:
            await asyncio.sleep(0.01)  # the system prompt, prefilled as the session starts
        await ws.send(json.dumps({"type": "input.text", "text": "The code word is pelican."}))
        await ws.send(json.dumps({"type": "query", "id": "q", "text": "What is the code word?"}))
        done, _ = await recv_until(ws, "response.done")
        assert done["finish_reason"] in ("stop", "length")
        assert [n.text for n in runner.notes.notes] == [
            'the user wrote: "The code word is pelican."']
        assert done["prompt_tokens"] > len(server.loaded.tokenizer.encode("pelican"))
        assert (await runner.session.cache_info())["layer_tokens"] == before
        await runner.set_instructions("Answer in French.")  # Realtime session.update
        assert runner.instructions == "Answer in French."
        assert (await runner.session.cache_info())["layer_tokens"] == before


async def test_text_sent_faster_than_the_model_reads_it_is_refused_not_stalled(tiny_loaded):
    """With the engine held, a client floods input.text: past the session's text queue the
    texts are refused with `text_backlog` (quickly, so the socket keeps being read), the
    connection stays up, and every text not refused reaches the stream once the engine goes
    on; nothing stays queued after."""
    from streamgrok.engine import EngineConfig

    config = ServerConfig(PIPELINE, port=0, stats_interval_s=0.2, load_tick_s=None,
                          text_wait_s=0.3,
                          pipeline_options={"transcribe": "false", "answer_context": "stream"})
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512, memory_gib=0.05),
                           EngineConfig(text_queue_tokens=256))
    await srv.start()
    try:
        async with connect(url(srv)) as ws:
            await start(ws)
            sent = [f"Item {i}: a lantern by the river." for i in range(40)]
            before = srv.engine.snapshot().prefill_tokens
            async with srv.engine.paused():
                for i, text in enumerate(sent):
                    await ws.send(json.dumps({"type": "input.text", "id": f"t{i}",
                                              "text": text}))
                # messages are handled in order: this one's error comes after every text's
                await ws.send(json.dumps({"type": "response.cancel", "query_id": "none",
                                          "id": "last"}))
                refused = set()
                while True:  # the held engine reads nothing: past the queue, texts are refused
                    message = json.loads(await asyncio.wait_for(ws.recv(), 20))
                    if message["type"] == "error" and message["message_id"] == "last":
                        break
                    if message["type"] == "error":
                        assert message["code"] == "text_backlog", message
                        refused.add(message["message_id"])
            accepted = [t for i, t in enumerate(sent) if f"t{i}" not in refused]
            assert refused and accepted  # the queue took some, then refused the rest
            await ws.send(json.dumps({"type": "query", "id": "q", "text": "Which item?"}))
            done, _ = await recv_until(ws, "response.done")
            assert done["finish_reason"] in ("stop", "length")
            tokens = sum(len(tiny_loaded.tokenizer.encode(t)) for t in accepted)
            assert srv.engine.snapshot().prefill_tokens - before >= tokens
            await ws.send(json.dumps({"type": "session.end"}))
            await recv_until(ws, "session.ended")
        assert srv.engine.snapshot().kv_pages_used == 0
    finally:
        await srv.stop()
