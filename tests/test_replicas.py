"""Two `streamgrok serve` replicas behind nginx with the shipped recipe
(deploy/nginx/streamgrok.conf): each session stays on one replica, HTTP questions about a live
stream reach its replica, and a replica going away fails only its own sessions, which
reconnect onto the other; a dropped session resumes on its replica, and from the shared state
folder on the other replica once its own has drained."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from helpers import free_port
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

RECIPE = Path(__file__).parents[1] / "deploy" / "nginx" / "streamgrok.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
pytestmark = pytest.mark.skipif(NGINX is None, reason="nginx is not installed (apt-get "
                                "install nginx-light; `make test` installs it as root)")


async def start_replica(model: Path, name: str, *extra: str
                        ) -> tuple[asyncio.subprocess.Process, int]:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "streamgrok", "serve", "pipelines/live_qa.py", "--port", "0",
        "--model", str(model), "--kv-budget", "512", "--kv-memory-gib", "0.05",
        "--set", "transcribe=false", "--replica-name", name, "--load-tick", "0", *extra,
        stdout=asyncio.subprocess.PIPE, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    while True:
        line = (await asyncio.wait_for(process.stdout.readline(), 120)).decode()
        assert line, f"replica {name} exited before serving"
        if match := re.search(r"on http://127\.0\.0\.1:(\d+)/", line):
            return process, int(match.group(1))


def start_nginx(folder: Path, listen: int, replicas: list[int]) -> subprocess.Popen:
    """nginx with the shipped recipe, its listen port and upstream servers swapped in."""
    recipe = RECIPE.read_text().replace("listen 127.0.0.1:8800;", f"listen 127.0.0.1:{listen};")
    upstreams = "".join(f"    server 127.0.0.1:{port} max_fails=1 fail_timeout=10s;\n"
                        for port in replicas)
    recipe, count = re.subn(r"(    server 127\.0\.0\.1:880\d[^\n]*\n)+", upstreams, recipe)
    assert count == 1, "the recipe's upstream block changed: update this test"
    (folder / "streamgrok.conf").write_text(recipe)
    temps = "\n".join(f"  {kind}_temp_path {folder / kind};"
                      for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (folder / "nginx.conf").write_text(
        f"worker_processes 1;\ndaemon off;\npid {folder / 'nginx.pid'};\n"
        f"error_log {folder / 'error.log'} warn;\nevents {{ worker_connections 256; }}\n"
        f"http {{\n  access_log off;\n{temps}\n  include {folder / 'streamgrok.conf'};\n}}\n")
    folder.chmod(0o755)  # nginx workers drop root for nobody
    return subprocess.Popen([NGINX, "-e", "stderr", "-p", str(folder), "-c",
                             str(folder / "nginx.conf")], stderr=subprocess.PIPE)


async def stop_all(sockets: list, nginx: subprocess.Popen,
                   replicas: tuple[asyncio.subprocess.Process, ...]) -> None:
    """Close the clients, then nginx, then the replicas still running."""
    for ws in sockets:
        await ws.close()
    nginx.terminate()
    nginx.wait(timeout=10)
    for process in replicas:
        if process.returncode is None:
            process.terminate()
            await process.wait()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


async def wait_healthy(port: int, nginx: subprocess.Popen) -> None:
    for _ in range(100):
        assert nginx.poll() is None, nginx.stderr.read().decode()
        try:
            if (await asyncio.to_thread(get_json, f"http://127.0.0.1:{port}/health"))["status"] \
                    == "ok":
                return
        except OSError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("nginx never answered /health")


async def recv_until(ws, kind: str, predicate=lambda m: True, limit: int = 500) -> dict:
    for _ in range(limit):
        message = json.loads(await asyncio.wait_for(ws.recv(), 30))
        if message["type"] == kind and predicate(message):
            return message
    raise AssertionError(f"no {kind}")


async def open_session(port: int, key: str):
    ws = await connect(f"ws://127.0.0.1:{port}/ws?affinity={key}")
    await ws.send(json.dumps({"type": "session.start", "id": key}))
    started = await recv_until(ws, "session.started")
    return ws, started


async def ask(ws, text: str) -> dict:
    await ws.send(json.dumps({"type": "query", "id": text, "text": text}))
    return await recv_until(ws, "response.done", lambda m: m.get("query_id") == text)


def chat_about(port: int, key: str, session_id: int) -> int:
    body = json.dumps({"model": "tiny", "max_tokens": 3,
                       "messages": [{"role": "user", "content": "what is on screen?"}]})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", body.encode(), method="POST",
        headers={"Content-Type": "application/json", "X-Streamgrok-Affinity": key,
                 "X-Streamgrok-Session": str(session_id)})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.status


async def test_sessions_keep_their_replica_and_survive_the_other_going_away(tiny_gguf,
                                                                            tmp_path):
    (a, port_a), (b, port_b) = await asyncio.gather(start_replica(tiny_gguf, "rA"),
                                                    start_replica(tiny_gguf, "rB"))
    proxy = free_port()
    nginx = start_nginx(tmp_path, proxy, [port_a, port_b])
    sockets = []
    try:
        await wait_healthy(proxy, nginx)
        # keys until both replicas hold sessions (where a key lands depends on the ports)
        home: dict[str, str] = {}
        sessions: dict[str, tuple] = {}
        for i in range(40):
            key = f"camera-{i}"
            ws, started = await open_session(proxy, key)
            sockets.append(ws)
            home[key], sessions[key] = started["replica"], (ws, started["session_id"])
            if len(set(home.values())) == 2 and i >= 5:
                break
        assert set(home.values()) == {"rA", "rB"}

        # the same key lands on the same replica again (a second connection, a reconnect)
        for key in list(home)[:4]:
            ws, started = await open_session(proxy, key)
            sockets.append(ws)
            assert started["replica"] == home[key]

        # an HTTP question about a live stream reaches that stream's session: its websocket
        # sees the question answered (session ids repeat across replicas, so a wrong replica
        # would answer some other session or none)
        for replica in ("rA", "rB"):
            key = next(k for k, r in home.items() if r == replica)
            ws, session_id = sessions[key]
            assert await asyncio.to_thread(chat_about, proxy, key, session_id) == 200
            done = await recv_until(ws, "response.done",
                                    lambda m: str(m.get("query_id", "")).startswith("http-"))
            assert done["query_id"].startswith("http-")

        # replica A goes away: only its sessions end; B's sessions keep answering
        a.send_signal(signal.SIGKILL)
        await a.wait()
        for key, replica in home.items():
            ws, _ = sessions[key]
            if replica == "rA":
                with pytest.raises(ConnectionClosed):
                    while True:
                        await asyncio.wait_for(ws.recv(), 30)
            else:
                assert (await ask(ws, f"still there {key}?"))["finish_reason"] in ("stop",
                                                                                    "length")
        # A's clients reconnect with their keys and land on B
        for key in [k for k, r in home.items() if r == "rA"]:
            ws, started = await open_session(proxy, key)
            sockets.append(ws)
            assert started["replica"] == "rB"
            assert (await ask(ws, "back?"))["finish_reason"] in ("stop", "length")
    finally:
        await stop_all(sockets, nginx, (a, b))


async def resume(port: int, key: str, handle: str):
    """Reconnect through the proxy with the stream's affinity key and resume."""
    ws = await connect(f"ws://127.0.0.1:{port}/ws?affinity={key}")
    await ws.send(json.dumps({"type": "session.resume", "handle": handle}))
    return ws, await recv_until(ws, "session.resumed")


async def held_tokens(ws) -> list[int]:
    """What each layer of the session holds, once two stats in a row agree (prefilled)."""
    last = None
    while (now := (await recv_until(ws, "stats"))["kv"]["layer_tokens"]) != last:
        last = now
    return now


async def test_a_dropped_session_resumes_on_its_replica_or_from_the_shared_state(tiny_gguf,
                                                                                 tmp_path):
    state = tmp_path / "state"
    extra = ("--resume-ttl", "120", "--state-dir", str(state))
    (a, port_a), (b, port_b) = await asyncio.gather(start_replica(tiny_gguf, "rA", *extra),
                                                    start_replica(tiny_gguf, "rB", *extra))
    replicas = {"rA": a, "rB": b}
    proxy = free_port()
    (tmp_path / "nginx").mkdir()
    nginx = start_nginx(tmp_path / "nginx", proxy, [port_a, port_b])
    sockets = []
    try:
        await wait_healthy(proxy, nginx)
        ws, started = await open_session(proxy, "phone-1")
        home, handle = started["replica"], started["resume"]["handle"]
        await ws.send(json.dumps({"type": "input.text", "text": "The gate code is 4312."}))
        tokens = await held_tokens(ws)
        await ws.close()  # the network drops: the session waits, detached, on its replica

        ws, resumed = await resume(proxy, "phone-1", handle)
        sockets.append(ws)
        assert resumed["replica"] == home  # the key brought the client back to its replica
        assert await held_tokens(ws) == tokens
        handle = resumed["resume"]["handle"]
        await ws.close()

        # its replica is redeployed: SIGTERM drains it, saving the detached session in the
        # folder both replicas share; the key now reaches the other one, which restores it
        replicas[home].send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(replicas[home].wait(), 60) == 0
        assert list(state.glob("*.json"))
        ws, resumed = await resume(proxy, "phone-1", handle)
        sockets.append(ws)
        assert resumed["replica"] != home
        assert await held_tokens(ws) == tokens  # the same context
        assert (await ask(ws, "What is the gate code?"))["finish_reason"] in ("stop", "length")
    finally:
        await stop_all(sockets, nginx, (a, b))
