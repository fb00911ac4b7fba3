"""The OpenAI-compatible HTTP API, driven by the `openai` package against a real server on a
loopback port (and a websocket client for questions about a live session)."""

from __future__ import annotations

import asyncio
import base64
import json

import cv2
import httpx2 as httpx
import openai
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from openai import AsyncOpenAI
from websockets.asyncio.client import connect

from streamgrok.cache.config import CacheConfig
from streamgrok.media.samples import photo
from streamgrok.server.app import ServerConfig, StreamgrokServer

PIPELINE = "pipelines/live_qa.py"
KEY = "test-key"


@pytest.fixture
async def server(tiny_loaded):
    config = ServerConfig(PIPELINE, port=0, token=KEY, pipeline_options={"transcribe": "false"},
                          load_tick_s=None, max_completion_tokens=64)
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
                                                            memory_gib=0.05))
    await srv.start()
    yield srv
    await srv.stop()


def client(server, key=KEY) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key,
                       max_retries=0, timeout=60)


def data_url(name="astronaut") -> str:
    ok, data = cv2.imencode(".jpg", cv2.cvtColor(photo(name, 320, 240), cv2.COLOR_RGB2BGR))
    return "data:image/jpeg;base64," + base64.b64encode(data.tobytes()).decode()


async def pages_freed(server) -> bool:
    for _ in range(100):
        if server.engine.cache.pool.used_pages == 0:
            return True
        await asyncio.sleep(0.05)
    return False


async def test_models_lists_the_served_model(server):
    models = await client(server).models.list()
    assert [m.id for m in models.data] == [server.model_name] == ["tiny"]


async def test_chat_completion_streamed_and_not_agree_and_report_usage(server):
    api = client(server)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say something."}]
    whole = await api.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                              temperature=0)
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert whole.usage.prompt_tokens > 10 and 0 < whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    stream = await api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = [chunk async for chunk in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == choice.finish_reason and not any(finishes[:-1])
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert await pages_freed(server)


async def test_completions_and_stop_strings(server):
    api = client(server)
    full = await api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16,
                                        temperature=0)
    text = full.choices[0].text
    assert full.usage.completion_tokens > 0 and full.object == "text_completion"
    assert len(text) > 2, "the tiny model wrote too little to cut"
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = await api.completions.create(model="tiny", prompt="Once upon a time", max_tokens=16,
                                       temperature=0, stop=[stop])
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = await api.completions.create(model="tiny", prompt="Once upon a time",
                                            max_tokens=16, temperature=0, stop=stop,
                                            stream=True)
    assert "".join([c.choices[0].text async for c in streamed if c.choices]) == \
        text[:text.index(stop)]
    assert await pages_freed(server)


async def test_an_image_in_the_content_reaches_the_model_as_what_the_observers_see(server):
    api = client(server)
    question = [{"type": "text", "text": "Who is this?"}]
    plain = await api.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": question}])
    seen = await api.chat.completions.create(
        model="tiny", max_tokens=2, temperature=0,
        messages=[{"role": "user", "content": question + [
            {"type": "image_url", "image_url": {"url": data_url()}}]}])
    assert seen.usage.prompt_tokens > plain.usage.prompt_tokens + 5
    from streamgrok.server.image_notes import describe_image, image_bytes

    described = await describe_image(server.resources, image_bytes(data_url()), 0)
    assert described.startswith("image 1 (320x240)") and "face" in described


@pytest.mark.parametrize("change, status, fragment", [
    ({"model": "gpt-9"}, 404, "not served here"),
    ({"temperature": 7}, 400, "temperature"),
    ({"max_tokens": 100_000}, 400, "max_tokens"),
    ({"n": 3}, 400, "n must be 1"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, 400, "role"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}]}, 400, "data URL"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]}]},
     400, "JPEG/PNG"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    ({"presence_penalty": 1.0}, 400, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "word " * 2000}]}, 400, "KV budget"),
])
async def test_bad_requests_get_openai_shaped_errors(server, change, status, fragment):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **change}
    with pytest.raises(openai.APIStatusError) as failed:
        await client(server).chat.completions.create(**body)
    assert failed.value.status_code == status
    assert fragment in failed.value.message
    error = failed.value.body
    assert set(error) >= {"message", "type", "param", "code"}
    # the server goes on
    ok = await client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert ok.choices[0].message.content is not None


async def test_auth_origin_body_limits_and_json(server):
    with pytest.raises(openai.AuthenticationError):
        await client(server, key="wrong").models.list()
    base = f"http://127.0.0.1:{server.port}"
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        auth = {"Authorization": f"Bearer {KEY}"}
        refused = await http.get("/v1/models", headers={**auth, "Origin": "http://evil.example"})
        assert refused.status_code == 403 and refused.json()["error"]["type"]
        not_json = await http.post("/v1/chat/completions", content=b"{nope", headers=auth)
        assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
        nan = await http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a", '
                              b'"temperature": NaN}', headers=auth)
        assert nan.status_code == 400
        huge = await http.post("/v1/chat/completions", content=b" " * (9 * 2**20),
                               headers=auth)
        assert huge.status_code == 413
        health = await http.get("/health")  # health and version need no key
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert (await http.get("/version")).json()["version"]
        assert (await http.get("/metrics")).status_code == 401


async def test_a_client_that_leaves_mid_stream_frees_its_session(server):
    base = f"http://127.0.0.1:{server.port}"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story."}],
            "max_tokens": 64, "stream": True, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=base, timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {KEY}"}) as response:
            async for line in response.aiter_lines():
                if '"content"' in line:
                    break
    assert await pages_freed(server)


async def test_an_http_question_about_a_live_websocket_session(server):
    url = f"ws://127.0.0.1:{server.port}/ws?token={KEY}"
    async with connect(url) as ws:
        await ws.send(json.dumps({"type": "session.start", "id": "s"}))
        while (started := json.loads(await ws.recv()))["type"] != "session.started":
            pass
        await ws.send(json.dumps({"type": "input.text", "text": "The user waves."}))
        answer = await client(server).chat.completions.create(
            model="tiny", max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": "What happened?"}],
            extra_headers={"X-Streamgrok-Session": str(started["session_id"])})
        assert answer.choices[0].message.content is not None
        assert answer.usage.completion_tokens > 0
        seen = []
        while not any(m["type"] == "response.done" for m in seen):
            seen.append(json.loads(await asyncio.wait_for(ws.recv(), 20)))
        done = next(m for m in seen if m["type"] == "response.done")
        assert done["query_id"].startswith("http-")  # the streaming client saw it too
        assert done["text"] == answer.choices[0].message.content
    with pytest.raises(openai.NotFoundError):
        await client(server).chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}],
            metadata={"session": "12345"})


async def test_health_is_503_until_the_model_is_loaded(tiny_loaded):
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          load_tick_s=None)
    srv = StreamgrokServer(None, config, CacheConfig(budget_tokens=512, memory_gib=0.05))
    await srv.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as http:
            loading = await http.get("/health")
            assert loading.status_code == 503 and loading.json()["status"] == "loading"
            early = await http.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
            assert early.status_code == 503 and early.json()["error"]["code"] == "model_loading"
            await srv.load(tiny_loaded)
            assert (await http.get("/health")).status_code == 200
    finally:
        await srv.stop()


@given(st.text("ab\n", max_size=30), st.lists(st.text("ab\n", min_size=1, max_size=3),
                                              min_size=1, max_size=3),
       st.lists(st.integers(0, 30), max_size=6))
@example(text="aba", stops=["b", "aba"], cuts=[2])  # a longer stop that began earlier wins
def test_stop_strings_cut_the_same_however_the_text_is_split(text, stops, cuts):
    from streamgrok.server.stop_strings import StopScanner

    bounds = sorted({0, len(text), *[min(c, len(text)) for c in cuts]})
    scanner = StopScanner(stops)
    shown = "".join(scanner.feed(text[a:b]) for a, b in zip(bounds, bounds[1:]))
    shown += scanner.flush()
    first = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    assert shown == text[:first]
    assert scanner.stopped == any(s in text for s in stops)


async def test_an_allowed_browser_origin_may_call_the_api(tiny_loaded):
    config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                          load_tick_s=None, allowed_origins=["http://app.example"])
    srv = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
                                                            memory_gib=0.05))
    await srv.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{srv.port}") as http:
            preflight = await http.options("/v1/chat/completions", headers={
                "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization,content-type"})
            assert preflight.status_code == 200
            assert preflight.headers["access-control-allow-origin"] == "http://app.example"
            models = await http.get("/v1/models", headers={"Origin": "http://app.example"})
            assert models.status_code == 200
            assert models.headers["access-control-allow-origin"] == "http://app.example"
            other = await http.get("/v1/models", headers={"Origin": "http://other.example"})
            assert other.status_code == 403
    finally:
        await srv.stop()


async def test_the_serve_benchmark_client_measures_concurrent_streams(server):
    """`bench serve`'s client against the real server: every request streams its tokens,
    with a first-token time and gaps; the server ends with no pages held."""
    import os

    from streamgrok.bench.http_load import run_row

    row = await run_row("streamgrok", f"http://127.0.0.1:{server.port}", server.model_name,
                        os.getpid(), 3, 0, 8, api_key=KEY)
    assert row.failed == 0 and len(row.requests) == 3
    for request in row.requests:
        assert 1 <= request.tokens <= 8 and request.ttft is not None and request.ttft > 0
        assert len(request.arrivals) >= 1 and all(gap >= 0 for gap in request.gaps())
    assert row.tokens == sum(r.tokens for r in row.requests) and row.throughput() > 0
    assert row.peak_rss_mb > 0
    assert await pages_freed(server)
