"""The load governor driven by a real server's engine events: answers asked, cancelled at
their first token, finished; a live session's question is never refused for load, and a
request nobody is ahead of is always admitted."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import asynccontextmanager

import httpx2 as httpx
from prometheus_client import generate_latest
from test_server import PIPELINE, recv_until, start, url
from websockets.asyncio.client import connect

from streamgrok.cache.config import CacheConfig
from streamgrok.server.app import ServerConfig, StreamgrokServer
from streamgrok.server.load import LoadReading


def governed_server(tiny_loaded, tick_s: float) -> StreamgrokServer:
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          load_tick_s=tick_s)
    return StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
                                                             memory_gib=0.05))


@asynccontextmanager
async def after_the_slowest_reading(tiny_loaded):
    """A server whose governor measures only by hand, a session on it, and the state the
    issue found: the last decode-rate reading so low (1 token in a 2 s tick of wall time)
    that any answer would pass the deadline."""
    srv = governed_server(tiny_loaded, tick_s=3600)
    await srv.start()
    try:
        async with connect(url(srv)) as ws:
            await start(ws)
            srv.governor.tick(LoadReading(cpu=0.1, media_cpu=0.0, ttft_s=0.5, stale=0.0,
                                          sessions=1, decode_rate=0.5))
            yield srv, ws
    finally:
        await srv.stop()


async def test_an_idle_session_is_answered_after_the_slowest_reading(tiny_loaded):
    """With nothing in flight the question is admitted and answered; before, every question
    got `busy` until a restart."""
    async with after_the_slowest_reading(tiny_loaded) as (_, ws):
        await ws.send(json.dumps({"type": "query", "id": "idle", "text": "Hello?"}))
        done, seen = await recv_until(ws, "response.done")
        assert not [m for m in seen if m["type"] == "error"], seen
        assert done["query_id"] == "idle" and done["finish_reason"] in ("stop", "length")


async def test_a_live_question_while_the_engine_is_behind_is_answered_shorter(tiny_loaded):
    """A session admitted is a session served: a question asked while another is in flight
    and the measured rate says it could not finish in time is queued anyway, its answer
    shortened to the floor, and /metrics counts the shortening under its rule."""
    async with after_the_slowest_reading(tiny_loaded) as (srv, ws):
        async with srv.engine.paused():  # the first answer cannot finish yet
            await ws.send(json.dumps({"type": "query", "id": "first", "text": "One?"}))
            while not any("first" in c.answers for c in srv.connections):
                await asyncio.sleep(0.01)
            await ws.send(json.dumps({"type": "query", "id": "second", "text": "Two?"}))
            while not any("second" in c.answers for c in srv.connections):
                await asyncio.sleep(0.01)
        answered = {}
        while len(answered) < 2:
            done, seen = await recv_until(ws, "response.done")
            assert not [m for m in seen if m["type"] == "error"], seen
            answered[done["query_id"]] = done
        floor = srv.governor.limits.min_answer_tokens
        assert answered["second"]["finish_reason"] in ("stop", "length")
        assert answered["second"]["tokens"] <= floor < 64
        text = generate_latest(srv.metrics.registry).decode()
        assert 'streamgrok_answers_shortened_total{reason="answer_deadline"} 1.0' in text
        assert "streamgrok_questions_refused_total{" not in text
        assert srv.answers_shortened.burst == 1
        await ws.send(json.dumps({"type": "query", "id": "third", "text": "Three?"}))
        await recv_until(ws, "response.done")  # nobody ahead: full length, the burst ends
        assert srv.answers_shortened.burst == 0


async def test_a_stateless_request_while_the_engine_is_behind_is_refused_by_rule(tiny_loaded):
    """An HTTP request is a session of one question: admitted or refused as it arrives. One
    that could not finish in time gets 429 naming its rule, counted in /metrics."""
    async with after_the_slowest_reading(tiny_loaded) as (srv, ws):
        async with srv.engine.paused():
            await ws.send(json.dumps({"type": "query", "id": "first", "text": "One?"}))
            while not any("first" in c.answers for c in srv.connections):
                await asyncio.sleep(0.01)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}",
                                         timeout=30) as http:
                reply = await http.post("/v1/chat/completions", json={
                    "model": "tiny", "max_tokens": 16,
                    "messages": [{"role": "user", "content": "Two?"}]})
        assert reply.status_code == 429, reply.text
        error = reply.json()["error"]
        assert error["code"] == "busy" and "(rule: answer_deadline)" in error["message"]
        assert "tokens of answers in flight at 0 tokens/s" in error["message"]
        await recv_until(ws, "response.done")
        text = generate_latest(srv.metrics.registry).decode()
        assert 'streamgrok_questions_refused_total{reason="answer_deadline"} 1.0' in text
        assert srv.question_refusals.burst == 1


async def test_answers_cancelled_at_their_first_token_never_leave_the_server_refusing(
        tiny_loaded):
    """The issue's sequence: one session asks, cancels at the first delta, waits for done,
    asks again, for several governor ticks; then a question on the idle server is answered."""
    srv = governed_server(tiny_loaded, tick_s=0.1)
    await srv.start()
    try:
        async with connect(url(srv)) as ws:
            await start(ws)
            deadline, asked = time.monotonic() + 3.0, 0
            while time.monotonic() < deadline:
                asked += 1
                await ws.send(json.dumps({"type": "query", "id": f"q{asked}", "text": "Hi?"}))
                first, seen = await recv_until(ws, "response.delta")
                assert not any(m["type"] == "error" for m in seen), seen
                await ws.send(json.dumps({"type": "response.cancel", "query_id": f"q{asked}"}))
                await recv_until(ws, "response.done")
            await asyncio.sleep(0.5)  # idle ticks
            await ws.send(json.dumps({"type": "query", "id": "last", "text": "Still there?"}))
            done, seen = await recv_until(ws, "response.done")
            errors = [m for m in seen if m["type"] == "error"]
            assert not errors, errors
            assert done["query_id"] == "last"
    finally:
        await srv.stop()
