"""The browser assistant end to end in headless Chromium with fake camera and microphone.

Chromium is driven over the DevTools protocol with the `websockets` client. The Makefile
installs Debian's chromium; where it is missing the test is skipped and says why.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from pathlib import Path

import pytest
from websockets.asyncio.client import connect

from streamgrok.cache.config import CacheConfig
from streamgrok.server.app import ServerConfig, StreamgrokServer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"

pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="Chromium is not installed (make test installs Debian's chromium)"
)


class DevTools:
    """Minimal Chrome DevTools protocol client for one page."""

    def __init__(self, ws, session: str) -> None:
        self.ws, self.session, self.next_id = ws, session, 1

    @classmethod
    async def open(cls, browser_url: str):
        ws = await connect(browser_url, max_size=64 * 2**20)
        tools = cls(ws, "")
        targets = await tools.call("Target.getTargets", session=False)
        page = next(t for t in targets["targetInfos"] if t["type"] == "page")
        attached = await tools.call("Target.attachToTarget",
                                    {"targetId": page["targetId"], "flatten": True},
                                    session=False)
        tools.session = attached["sessionId"]
        return tools

    async def call(self, method: str, params: dict | None = None, session: bool = True):
        message = {"id": self.next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = self.session
        self.next_id += 1
        await self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(await asyncio.wait_for(self.ws.recv(), 30))
            if reply.get("id") == message["id"]:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    async def js(self, expression: str):
        result = await self.call("Runtime.evaluate", {"expression": expression,
                                                      "awaitPromise": True,
                                                      "returnByValue": True})
        return result.get("result", {}).get("value")

    async def wait_for(self, expression: str, seconds: float = 60.0):
        for _ in range(int(seconds * 5)):
            value = await self.js(expression)
            if value:
                return value
            await asyncio.sleep(0.2)
        raise AssertionError(f"timed out waiting for {expression}")


async def test_assistant_page_streams_media_and_shows_an_answer(tiny_loaded, tmp_path):
    config = ServerConfig("pipelines/live_qa.py", port=0, stats_interval_s=0.5,
                          pipeline_options={"transcribe": "false"}, load_tick_s=None,
                          state_dir=str(tmp_path / "state"))
    cache = CacheConfig(budget_tokens=512, memory_gib=0.05)
    server = StreamgrokServer(tiny_loaded, config, cache)
    await server.start()
    profile = tmp_path / "profile"
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
         "--autoplay-policy=no-user-gesture-required", f"--user-data-dir={profile}",
         "--remote-debugging-port=0", "--window-size=1280,800",
         f"http://127.0.0.1:{server.port}/"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        port_file = profile / "DevToolsActivePort"
        for _ in range(150):
            if port_file.exists() and len(port_file.read_text().split()) == 2:
                break
            await asyncio.sleep(0.2)
        port, path = port_file.read_text().split()
        tools = await DevTools.open(f"ws://127.0.0.1:{port}{path}")
        await tools.wait_for("document.readyState === 'complete' && "
                             "document.getElementById('status').textContent.startsWith('session')")
        assert "legend" in await tools.js(
            "document.getElementById('timeline-legend').className")
        padding = await tools.js("parseFloat(getComputedStyle(document.getElementById("
                                 "'events')).paddingLeft)")
        assert padding >= 30  # room for three-digit event numbers
        # a question before Start: answered from an empty context, and it says so
        await tools.js("document.getElementById('question').value = 'Anyone there?';"
                       "document.getElementById('ask').requestSubmit()")
        notice = await tools.wait_for(
            "(() => { const b = document.querySelector('.qa[data-id=\"q1\"]');"
            " return b && b.dataset.done && b.querySelector('.n').textContent; })()")
        assert "before the camera started" in notice
        await tools.js("document.getElementById('start').click()")
        await tools.wait_for("document.getElementById('camera').videoWidth > 0")
        assert await tools.js("!document.getElementById('stop').disabled && "
                              "!document.getElementById('mute').disabled")
        await tools.wait_for("document.getElementById('clock').textContent !== '--:--'")
        await asyncio.sleep(3)  # a few frames and some audio go up
        await tools.js("document.getElementById('question').value = 'What do you see?';"
                       "document.getElementById('ask').requestSubmit()")
        answer = await tools.wait_for(
            "(() => { const b = document.querySelector('.qa[data-id=\"q2\"][data-done]');"
            " return b && b.querySelector('.m').textContent; })()")
        assert "tokens" in answer and "first token" in answer
        assert await tools.js("document.querySelector('.qa[data-thinking]') === null")
        assert await tools.js("(() => { const a = document.getElementById('answers');"
                              " return a.scrollTop + a.clientHeight >= a.scrollHeight - 2; })()")
        # the connection drops: the page says so, keeps a question typed meanwhile,
        # reconnects, resumes the same session and sends it
        session_id = next(c.runner.session.id for c in server.connections if c.runner)
        for connection in list(server.connections):
            await connection.ws.close(1012, "restart")
        await tools.wait_for("document.getElementById('status').textContent"
                             ".includes('reconnecting')")
        await tools.js("document.getElementById('question').value = 'Still there?';"
                       "document.getElementById('ask').requestSubmit()")
        await tools.wait_for(
            "(() => { const b = document.querySelector('.qa[data-id=\"q3\"][data-done]');"
            " return b && b.querySelector('.m').textContent; })()", seconds=90)
        events = await tools.js("document.getElementById('events').textContent")
        assert "resumed after" in events and "a new session" not in events
        assert f"session {session_id} " in await tools.js(
            "document.getElementById('status').textContent")
        await tools.wait_for("document.getElementById('kv').textContent.includes('pages')")
        frames_in = server.engine.snapshot()
        assert frames_in.prefill_tokens > 0
        # the server restarts (SIGTERM's drain saves the session; a new process on the same
        # port): the page resumes the same session there
        config.port = server.port
        await server.drain(5)
        server = StreamgrokServer(tiny_loaded, config, cache)
        await server.start()
        await tools.wait_for("document.getElementById('events').textContent"
                             ".split('resumed after').length === 3", seconds=60)
        events = await tools.js("document.getElementById('events').textContent")
        assert "shutting down" in events and "a new session" not in events
        await tools.wait_for("document.getElementById('status').className === ''")
        shot = await tools.call("Page.captureScreenshot", {"format": "png"})
        ARTIFACTS.mkdir(exist_ok=True)
        target = ARTIFACTS / "assistant.png"
        target.write_bytes(base64.b64decode(shot["data"]))
        assert target.stat().st_size > 10_000
        await tools.js("document.getElementById('stop').click()")
        assert await tools.js("document.getElementById('camera').srcObject === null && "
                              "!document.getElementById('start').disabled")
        await tools.ws.close()
    finally:
        browser.terminate()
        try:
            browser.wait(timeout=10)
        except subprocess.TimeoutExpired:
            browser.kill()
        await server.stop()
