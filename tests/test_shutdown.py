"""`streamgrok serve` as a real process: SIGTERM and SIGINT drain and exit 0."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


async def start_server(model, *extra: str) -> tuple[asyncio.subprocess.Process, int]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamgrok", "serve", "pipelines/live_qa.py", "--port", "0",
        *extra,
        "--model", str(model), "--kv-budget", "512", "--kv-memory-gib", "0.05",
        "--set", "transcribe=false", "--shutdown-timeout", "60",
        # the governor measures the machine: on a busy one it would refuse the test's question
        "--load-tick", "0",
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        assert line, "the server exited before serving"
        if match := re.search(r"on http://127\.0\.0\.1:(\d+)/", line):
            return process, int(match.group(1))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
async def test_signal_drains_answers_then_ends_sessions_and_exits_zero(tiny_gguf, sig):
    process, port = await start_server(tiny_gguf)
    try:
        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            await ws.send(json.dumps({"type": "session.start", "id": "s"}))
            while json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] != "session.started":
                pass
            await ws.send(json.dumps({"type": "query", "id": "q", "text": "Tell me a story."}))
            while json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] != "response.delta":
                pass
            process.send_signal(sig)  # an answer is in flight
            kinds = []
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                    kinds.append((message["type"], message.get("finish_reason")))
        assert closed.value.rcvd.code == 1001
        done = kinds.index(("response.done", "stop")) if ("response.done", "stop") in kinds \
            else kinds.index(("response.done", "length"))
        assert kinds.index(("session.ended", None)) > done  # the answer finished first
        assert kinds.index(("session.going_away", None)) < done  # told before the drain
        assert await asyncio.wait_for(process.wait(), 60) == 0
        with pytest.raises(OSError):  # no longer accepting
            await asyncio.open_connection("127.0.0.1", port)
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def test_a_session_resumes_on_the_next_server_process(tiny_gguf, tmp_path):
    state = str(tmp_path / "state")
    process, port = await start_server(tiny_gguf, "--state-dir", state)
    try:
        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            await ws.send(json.dumps({"type": "session.start", "id": "s"}))
            while (started := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] \
                    != "session.started":
                pass
            process.send_signal(signal.SIGTERM)
            while (message := json.loads(await asyncio.wait_for(ws.recv(), 60)))["type"] \
                    != "session.going_away":
                pass
            assert message["resumable"] is True
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    await asyncio.wait_for(ws.recv(), 60)
        assert closed.value.rcvd.code == 1012
        assert await asyncio.wait_for(process.wait(), 60) == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
    process, port = await start_server(tiny_gguf, "--state-dir", state)
    try:
        async with connect(f"ws://127.0.0.1:{port}/ws") as ws:
            await ws.send(json.dumps({"type": "session.resume",
                                      "handle": started["resume"]["handle"]}))
            while (resumed := json.loads(await asyncio.wait_for(ws.recv(), 30)))["type"] \
                    != "session.resumed":
                assert resumed["type"] != "error", resumed
            assert resumed["gap"]["seconds"] >= 0
    finally:
        process.send_signal(signal.SIGTERM)
        await asyncio.wait_for(process.wait(), 60)
