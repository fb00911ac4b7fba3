"""Session resumption over protocol v1: a dropped client comes back to the same session."""

from __future__ import annotations

import asyncio
import contextlib
import json

import pytest
from test_server import fetch, recv_until, start, url
from websockets.asyncio.client import connect

from streamgrok.cache.config import CacheConfig
from streamgrok.server.app import ServerConfig, StreamgrokServer

PIPELINE = "pipelines/live_qa.py"


def config(**fields) -> ServerConfig:
    fields.setdefault("pipeline_options", {"transcribe": "false"})
    return ServerConfig(PIPELINE, port=0, stats_interval_s=0.2, load_tick_s=None, **fields)


@pytest.fixture
async def server(tiny_loaded):
    async with running(tiny_loaded, resume_ttl_s=30) as srv:
        yield srv


async def wait_for(condition, seconds: float = 10.0) -> None:
    for _ in range(int(seconds / 0.05)):
        if condition():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached")


@contextlib.asynccontextmanager
async def running(loaded, cache: CacheConfig | None = None, **fields):
    """A server on a loopback port for the block (`fields` go to its ServerConfig)."""
    srv = StreamgrokServer(loaded, config(**fields),
                           cache or CacheConfig(budget_tokens=512, memory_gib=0.05))
    await srv.start()
    try:
        yield srv
    finally:
        await srv.stop()


async def test_a_dropped_session_resumes_with_its_context_and_a_new_handle(server):
    async with connect(url(server)) as ws:
        started = await start(ws)
        handle = started["resume"]["handle"]
        assert started["resume"]["ttl_s"] == 30
        context = started["context"]
        assert context["target_tokens"] == 512 and context["trigger_tokens"] > 512
        assert context["pinned_tokens"] > 0 and context["positions"] == "cache-relative"
        await ws.send(json.dumps({"type": "input.text", "text": "The code word is pelican."}))
        await ws.send(json.dumps({"type": "query", "id": "q1", "text": "Word?"}))
        await recv_until(ws, "response.done")
        stats, _ = await recv_until(ws, "stats")
        assert stats["resume"]["handle"] == handle
        tokens_before = stats["kv"]["layer_tokens"]
    engine = server.engine
    await wait_for(lambda: engine.snapshot().parked_sessions == 1)
    assert engine.snapshot().kv_pages_used == 0  # the detached session holds no pages
    assert engine.snapshot().parked_bytes > 0 and server.active_sessions == 1
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.resume", "id": "r", "handle": handle}))
        resumed, _ = await recv_until(ws, "session.resumed")
        assert resumed["id"] == "r" and resumed["session_id"] == started["session_id"]
        assert resumed["gap"]["seconds"] >= 0 and resumed["gap"]["end"] >= resumed["gap"]["start"]
        assert resumed["resume"]["handle"] != handle  # rotated: the old one is spent
        assert engine.snapshot().parked_sessions == 0
        stats, _ = await recv_until(ws, "stats")
        assert stats["kv"]["layer_tokens"] == tokens_before  # the context is all there
        await ws.send(json.dumps({"type": "query", "id": "q2", "text": "And now?"}))
        done, _ = await recv_until(ws, "response.done")
        assert done["query_id"] == "q2" and done["tokens"] > 0
        await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "session_exists"
    async with connect(url(server)) as ws:  # the replaced handle no longer works
        await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "resume_expired"
    _, metrics = await asyncio.to_thread(fetch, server, "/metrics")
    assert 'streamgrok_detached_sessions_ended_total{outcome="resumed"} 1.0' in metrics
    assert "streamgrok_resumes_refused_total 1.0" in metrics


async def test_an_answer_finished_while_away_is_delivered_once_on_resume(server):
    async with connect(url(server)) as ws:
        handle = (await start(ws))["resume"]["handle"]
        await ws.send(json.dumps({"type": "query", "id": "long", "text": "Tell me a story."}))
        await recv_until(ws, "response.delta")
    await wait_for(lambda: server.engine.snapshot().parked_sessions == 1)  # after the answer
    async with connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
        resumed, seen = await recv_until(ws, "session.resumed")
        assert seen == [resumed] and resumed["delivered"] >= 1  # session.resumed comes first
        done, seen = await recv_until(ws, "response.done")
        assert done["query_id"] == "long" and done["text"]
        assert not any(m["type"] == "response.delta" for m in seen)  # done carries the text
        await ws.send(json.dumps({"type": "session.end"}))
        _, seen = await recv_until(ws, "session.ended")
        assert not any(m["type"] == "response.done" for m in seen)  # delivered once only
    await wait_for(lambda: server.active_sessions == 0)
    assert server.engine.cache.pool.used_pages == 0 and server.engine.cache.parked_bytes == 0


async def test_unknown_in_use_and_other_key_handles_are_refused(tiny_loaded):
    async with running(tiny_loaded, resume_ttl_s=30, token="alice-key,bob-key") as srv:
        alice = {"Authorization": "Bearer alice-key"}
        bob = {"Authorization": "Bearer bob-key"}
        async with connect(url(srv), additional_headers=alice) as ws:
            handle = (await start(ws))["resume"]["handle"]
            async with connect(url(srv), additional_headers=alice) as other:
                await other.send(json.dumps({"type": "session.resume", "handle": handle}))
                assert (await recv_until(other, "error"))[0]["code"] == "resume_in_use"
                await other.send(json.dumps({"type": "session.resume", "handle": "guess"}))
                assert (await recv_until(other, "error"))[0]["code"] == "resume_unknown"
                await other.send(json.dumps({"type": "session.resume", "handle": 7}))
                assert (await recv_until(other, "error"))[0]["code"] == "bad_field"
        await wait_for(lambda: srv.shelf.detached())
        async with connect(url(srv), additional_headers=bob) as ws:
            await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
            assert (await recv_until(ws, "error"))[0]["code"] == "resume_forbidden"
            await ws.send(json.dumps({"type": "session.resume", "handle": "gone",
                                      "or_start": True}))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "resume_unknown"
            assert (await recv_until(ws, "session.started"))[0]["resume"]["handle"]
        async with connect(url(srv), additional_headers=alice) as ws:  # still resumable
            await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
            await recv_until(ws, "session.resumed")
    assert srv.active_sessions == 0


async def test_detached_sessions_expire_and_are_bounded(tiny_loaded):
    async with running(tiny_loaded, resume_ttl_s=1.0, max_detached=2) as srv:
        handles = []
        for _ in range(3):
            async with connect(url(srv)) as ws:
                handles.append((await start(ws))["resume"]["handle"])
            count = len(handles)
            await wait_for(lambda: srv.shelf.stats.evicted + len(srv.shelf.detached())
                           == count)  # noqa: B023 (awaited in this iteration)
        await wait_for(lambda: srv.active_sessions == 2)
        assert len(srv.shelf.detached()) == 2 and srv.shelf.stats.evicted == 1  # the oldest
        await wait_for(lambda: srv.active_sessions == 0, 10)  # their time ran out
        assert srv.shelf.stats.expired == 2
        assert srv.engine.snapshot().parked_bytes == 0
        assert srv.engine.cache.pool.used_pages == 0
        async with connect(url(srv)) as ws:
            await ws.send(json.dumps({"type": "session.resume", "handle": handles[1]}))
            assert (await recv_until(ws, "error"))[0]["code"] == "resume_expired"


async def test_without_resumption_a_dropped_session_ends(tiny_loaded):
    async with running(tiny_loaded, resume_ttl_s=0) as srv:
        async with connect(url(srv)) as ws:
            assert (await start(ws))["resume"] is None
        await wait_for(lambda: srv.active_sessions == 0)
        assert srv.engine.cache.pool.used_pages == 0


async def test_a_fact_told_before_the_drop_is_answered_after_the_resume(smollm2):
    async with running(smollm2, CacheConfig(budget_tokens=1024, memory_gib=0.2),
                       resume_ttl_s=30) as srv:
        async with connect(url(srv)) as ws:
            handle = (await start(ws))["resume"]["handle"]
            await ws.send(json.dumps({"type": "input.text",
                                      "text": "The visitors' meeting room is room 42."}))
            await recv_until(ws, "stats")
        await wait_for(lambda: srv.shelf.detached())
        async with connect(url(srv)) as ws:
            await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
            await recv_until(ws, "session.resumed")
            await ws.send(json.dumps({"type": "query", "id": "q",
                                      "text": "Which room is the visitors' meeting room?"}))
            done, _ = await recv_until(ws, "response.done")
            assert "42" in done["text"], done["text"]
            await ws.send(json.dumps({"type": "session.end"}))
            await recv_until(ws, "session.ended")


async def test_sessions_resume_on_another_process_from_the_state_directory(tiny_loaded,
                                                                          tmp_path):
    """A replica drains (SIGTERM) and saves its sessions in a folder shared with another
    replica (or its own next process): their clients resume there."""
    state = str(tmp_path / "state")
    cache = CacheConfig(budget_tokens=512, memory_gib=0.05)
    async with running(tiny_loaded, cache, resume_ttl_s=30, state_dir=state) as other:
        async with running(tiny_loaded, cache, resume_ttl_s=30, state_dir=state) as first:
            async with connect(url(first)) as attached:
                handle = (await start(attached))["resume"]["handle"]
                await attached.send(json.dumps({"type": "input.text", "text": "Remember 7."}))
                await recv_until(attached, "stats")
                stats, _ = await recv_until(attached, "stats")
                tokens = stats["kv"]["layer_tokens"]
                async with connect(url(first)) as away:  # a second client, gone before
                    away_handle = (await start(away))["resume"]["handle"]
                await wait_for(lambda: first.shelf.detached())
                draining = asyncio.ensure_future(first.drain(5))
                going, _ = await recv_until(attached, "session.going_away")
                assert going["resumable"] is True
                await draining
                await attached.wait_closed()
                assert attached.close_code == 1012  # service restart: resume elsewhere
        saved = list((tmp_path / "state").glob("*.json"))
        assert len(saved) == 2  # both saved; the handles themselves are not written
        assert handle not in "".join(p.read_text() for p in saved)
        assert other.active_sessions == 0  # restored when resumed, not before
        async with connect(url(other)) as ws:
            await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
            resumed, _ = await recv_until(ws, "session.resumed")
            stats, _ = await recv_until(ws, "stats")
            assert stats["kv"]["layer_tokens"] == tokens  # the same context
            await ws.send(json.dumps({"type": "query", "id": "q", "text": "What number?"}))
            done, _ = await recv_until(ws, "response.done")
            assert done["tokens"] > 0
        assert len(list((tmp_path / "state").glob("*.json"))) == 1  # it lives here now
        async with connect(url(other)) as ws:
            await ws.send(json.dumps({"type": "session.resume", "handle": away_handle}))
            await recv_until(ws, "session.resumed")
            await ws.send(json.dumps({"type": "session.end"}))
            await recv_until(ws, "session.ended")
        await wait_for(lambda: other.shelf.detached())
        await other.drain(5)  # the first session, detached again: saved again
    int8 = CacheConfig(budget_tokens=512, memory_gib=0.05, kv_dtype="int8")
    async with running(tiny_loaded, int8, resume_ttl_s=30, state_dir=state) as third:
        async with connect(url(third)) as ws:  # another KV format: refused, saying why
            await ws.send(json.dumps({"type": "session.resume",
                                      "handle": resumed["resume"]["handle"]}))
            error, _ = await recv_until(ws, "error")
            assert error["code"] == "resume_expired" and "KV format" in error["message"]
        assert len(list((tmp_path / "state").glob("*.json"))) == 1  # left on disk


async def test_a_client_bounds_its_context_below_the_servers_budget(tiny_loaded):
    stream = {"transcribe": "false", "answer_context": "stream"}  # text joins the KV stream
    async with running(tiny_loaded, pipeline_options=stream) as server, \
            connect(url(server)) as ws:
        await ws.send(json.dumps({"type": "session.start", "context": {"target_tokens": 2}}))
        error, _ = await recv_until(ws, "error")
        assert error["code"] == "bad_field" and "target_tokens" in error["message"]
        await ws.send(json.dumps({"type": "session.start",
                                  "context": {"target_tokens": 256, "trigger_tokens": 300}}))
        started, _ = await recv_until(ws, "session.started")
        assert started["context"]["target_tokens"] == 256
        assert started["context"]["trigger_tokens"] == 300
        for i in range(8):
            await ws.send(json.dumps({"type": "input.text", "text": f"note {i} " * 30}))
        for _ in range(50):  # the stream grows past the trigger; layers come back to target
            stats, _ = await recv_until(ws, "stats")
            if stats["evicted_tokens"] > 0 and not server.engine.snapshot().queue_tokens.get(
                    started["session_id"]):
                break
        assert stats["evicted_tokens"] > 0
        assert max(stats["kv"]["layer_tokens"]) <= 300  # the server's budget is 512
