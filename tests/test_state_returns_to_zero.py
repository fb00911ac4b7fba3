"""State returns to zero: a hypothesis state machine drives a real server on loopback (the
load governor on, measuring real engine steps) through websocket sessions (protocol v1), the
HTTP API and Realtime: opening and ending sessions, asking, cancelling before and after the
first token (twice, and for unknown ids), clients that vanish mid-answer, malformed messages
and media, appended text. At every quiescent point nothing stays counted (answers in flight,
waiting questions, the engine's answers and sessions, KV pages once no session holds any),
and a question on the idle server is admitted and answered."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    precondition,
    rule,
)
from websockets.sync.client import ClientConnection, connect

from streamgrok.cache.config import CacheConfig
from streamgrok.server.app import ServerConfig, StreamgrokServer
from streamgrok.server.load import LoadLimits
from streamgrok.server.protocol import pack_media

PIPELINE = "pipelines/live_qa.py"
WAIT_S = 30.0  # the most any one reply may take on a busy machine
MAX_SESSIONS = 4  # open at once in the machine (the server allows more)

# (message, the error code it must get); each leaves the session usable
MALFORMED = [
    ("not json", "bad_json"),
    ("[1, 2]", "bad_message"),
    (json.dumps({"type": "query"}), "missing_field"),
    (json.dumps({"type": "query", "text": 5}), "bad_field"),
    (json.dumps({"type": "session.start"}), "session_exists"),
    (b"\x01\x00", "bad_media"),
    (pack_media("video.frame", 0, 1.0, b"this is no jpeg"), "bad_image"),
    (pack_media("audio.pcm16", 0, 1.0, b"\x00\x01\x02"), "bad_audio"),
]


class ServerThread:
    """A StreamgrokServer on its own event loop in a thread (the state machine's clients are
    synchronous); `call` runs a function on that loop, where the server's state lives."""

    def __init__(self, loaded) -> None:
        # the governor on, ticking often; the CPU and first-token rules out of reach, so a
        # busy test machine cannot refuse sessions (the question rules stay as served)
        limits = LoadLimits(cpu_high=100.0, cpu_low=99.0, ttft_target_s=60.0)
        config = ServerConfig(PIPELINE, port=0, pipeline_options={"transcribe": "false"},
                              stats_interval_s=3600, load_tick_s=0.1, load_limits=limits,
                              max_sessions=16, max_media_per_second=1000)  # every reply counts
        self.server = StreamgrokServer(loaded, config, CacheConfig(budget_tokens=512,
                                                                   memory_gib=0.05))
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.run(self.server.start())
        self.port = self.server.port

    def run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(WAIT_S * 2)

    def call(self, function) -> Any:
        async def on_loop():
            return function()
        return self.run(on_loop())

    def stop(self) -> None:
        self.run(self.server.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def counts(server: StreamgrokServer) -> dict:
    """What must be zero when nothing runs (read on the server's loop)."""
    now = time.monotonic()
    snapshot = server.engine.snapshot()
    answers = snapshot.answers
    return {
        "answers in flight": sum(c.answers_in_flight() for c in server.connections),
        "oldest question wait": server.oldest_wait(now),
        "backlog tokens": server.backlog_tokens(),
        "engine answers in flight": answers.in_flight,
        "engine questions waiting": answers.waiting,
        "engine queued tokens": sum(snapshot.queue_tokens.values()),
        "question refused on idle": str(server.governor.admit_question(
            server.oldest_wait(now), server.backlog_tokens(), 1024, now) or ""),
    }


class Session:
    """One protocol v1 client with a running session."""

    def __init__(self, port: int, handle: str | None = None) -> None:
        """A new session, or with `handle` the detached one it resumes."""
        self.ws: ClientConnection = connect(f"ws://127.0.0.1:{port}/ws", open_timeout=WAIT_S,
                                            legacy=True)
        self.asked = 0
        self.pings = 0
        if handle is None:
            self.send({"type": "session.start", "id": "start"})
            started = self.until(lambda m: m["type"] == "session.started")[-1]
        else:
            self.send({"type": "session.resume", "handle": handle})
            started = self.until(lambda m: m["type"] == "session.resumed")[-1]
        self.handle: str = started["resume"]["handle"]

    def send(self, message: dict | str | bytes) -> None:
        self.ws.send(json.dumps(message) if isinstance(message, dict) else message)

    def until(self, stop, allowed_errors: tuple[str, ...] = ()) -> list[dict]:
        """Messages up to the first that `stop` accepts; errors other than `allowed_errors`
        fail the test."""
        seen = []
        deadline = time.monotonic() + WAIT_S
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            seen.append(message)
            if stop(message):
                return seen
            if message["type"] == "error":
                assert message["code"] in allowed_errors, message

    def sync(self, allowed_errors: tuple[str, ...] = ()) -> list[dict]:
        """Everything the server says before it answers a message sent now (it handles one
        client's messages in order): the replies to what was sent before."""
        self.pings += 1
        ping = f"sync{self.pings}"
        self.send({"type": "teleport", "id": ping})
        return self.until(lambda m: m["type"] == "error" and m.get("message_id") == ping,
                          allowed_errors)

    def query(self) -> str:
        self.asked += 1
        query_id = f"q{self.asked}"
        self.send({"type": "query", "id": query_id, "text": f"Question {self.asked}?"})
        return query_id

    def done(self, query_id: str, allowed_errors: tuple[str, ...] = ()) -> dict:
        return self.until(lambda m: m["type"] == "response.done"
                          and m["query_id"] == query_id, allowed_errors)[-1]


class ServerStateMachine(RuleBasedStateMachine):
    """Clients do what clients do; the server's counts come back to zero."""

    server_thread: ServerThread  # set by the test, one server for every example

    sessions = Bundle("sessions")
    away = Bundle("away")  # resume handles of sessions whose client vanished

    def __init__(self) -> None:
        super().__init__()
        self.open: list[Session] = []
        self.detached: list[str] = []

    # -- sessions -------------------------------------------------------------------------

    @precondition(lambda self: len(self.open) < MAX_SESSIONS)
    @rule(target=sessions)
    def open_session(self) -> Session:
        session = Session(self.server_thread.port)
        self.open.append(session)
        return session

    @rule(session=consumes(sessions))
    def end_session(self, session: Session) -> None:
        end(session)
        self.open.remove(session)

    @precondition(lambda self: len(self.detached) < MAX_SESSIONS)
    @rule(target=away, session=consumes(sessions), mid_answer=st.booleans())
    def vanish(self, session: Session, mid_answer: bool) -> str:
        """The client goes away without a word, possibly with an answer streaming: its
        session waits, detached, for a resume."""
        if mid_answer:
            query_id = session.query()
            session.until(lambda m: m["type"] in ("response.delta", "response.done")
                          and m.get("query_id") == query_id)
        session.ws.close()
        self.open.remove(session)
        self.detached.append(session.handle)
        return session.handle

    @precondition(lambda self: len(self.open) < MAX_SESSIONS)
    @rule(target=sessions, handle=consumes(away))
    def come_back(self, handle: str) -> Session:
        """The vanished client resumes its session on a new connection."""
        session = Session(self.server_thread.port, handle)
        self.detached.remove(handle)
        self.open.append(session)
        return session

    # -- questions ------------------------------------------------------------------------

    @rule(session=sessions)
    def ask(self, session: Session) -> None:
        """Nobody is ahead of it (every rule ends quiescent): answered, never `busy`."""
        done = session.done(session.query())
        assert done["finish_reason"] in ("stop", "length"), done

    @rule(session=sessions, twice=st.booleans())
    def cancel_before_the_first_token(self, session: Session, twice: bool) -> None:
        query_id = session.query()
        for _ in range(2 if twice else 1):
            session.send({"type": "response.cancel", "query_id": query_id})
        session.done(query_id, allowed_errors=("unknown_query",))
        session.sync(allowed_errors=("unknown_query",))  # a cancel that came after the end

    @rule(session=sessions, twice=st.booleans())
    def cancel_after_the_first_token(self, session: Session, twice: bool) -> None:
        query_id = session.query()
        seen = session.until(lambda m: m["type"] in ("response.delta", "response.done")
                             and m.get("query_id") == query_id)
        for _ in range(2 if twice else 1):
            session.send({"type": "response.cancel", "query_id": query_id})
        if seen[-1]["type"] != "response.done":
            session.done(query_id, allowed_errors=("unknown_query",))
        session.sync(allowed_errors=("unknown_query",))

    @rule(session=sessions, query_id=st.text(min_size=1, max_size=12))
    def cancel_an_unknown_query(self, session: Session, query_id: str) -> None:
        session.send({"type": "response.cancel", "query_id": f"never-{query_id}", "id": "c"})
        error = session.until(lambda m: m["type"] == "error")[-1]
        assert error["code"] == "unknown_query", error

    # -- input ----------------------------------------------------------------------------

    @rule(session=sessions, bad=st.sampled_from(MALFORMED))
    def malformed(self, session: Session, bad: tuple[str | bytes, str]) -> None:
        message, code = bad
        session.send(message)
        error = session.until(lambda m: m["type"] == "error")[-1]
        assert error["code"] == code, (message[:40], error)

    @rule(session=sessions, text=st.text(max_size=200))
    def append_text(self, session: Session, text: str) -> None:
        session.send({"type": "input.text", "text": text})
        session.sync()

    # -- the HTTP API and Realtime ----------------------------------------------------------

    @rule(vanish=st.booleans())
    def http_chat(self, vanish: bool) -> None:
        """A streamed chat completion, read to its end or dropped after its first chunk."""
        connection = http.client.HTTPConnection("127.0.0.1", self.server_thread.port,
                                                timeout=WAIT_S)
        body = json.dumps({"model": "tiny", "stream": True, "max_tokens": 24,
                           "messages": [{"role": "user", "content": "Say something."}]})
        connection.request("POST", "/v1/chat/completions", body,
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()[:300]
        first = response.readline()
        assert first.startswith(b"data:"), first
        if not vanish:
            rest = response.read()
            assert rest.rstrip().endswith(b"data: [DONE]"), rest[-200:]
        connection.close()

    @rule(cancel=st.booleans())
    def realtime_response(self, cancel: bool) -> None:
        """A Realtime session: a text item, a response, cancelled after its first delta or
        read to the end; then the client leaves."""
        with connect(f"ws://127.0.0.1:{self.server_thread.port}/v1/realtime?model=tiny",
                     open_timeout=WAIT_S) as ws:
            def until(kind: str) -> dict:
                deadline = time.monotonic() + WAIT_S
                while True:
                    event = json.loads(ws.recv(timeout=max(0.1, deadline - time.monotonic())))
                    assert event["type"] != "error" or cancel, event
                    if event["type"] in kind.split("|"):
                        return event
            until("session.created")
            ws.send(json.dumps({"type": "conversation.item.create", "item": {
                "type": "message", "role": "user",
                "content": [{"type": "input_text", "text": "Tell me a story."}]}}))
            until("conversation.item.done")
            ws.send(json.dumps({"type": "response.create"}))
            if cancel:
                event = until("response.output_text.delta|response.done")
                if event["type"] != "response.done":
                    ws.send(json.dumps({"type": "response.cancel"}))
            done = until("response.done")
            assert done["response"]["status"] in ("completed", "incomplete", "cancelled"), done

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def nothing_stays_counted(self) -> None:
        server = self.server_thread.server
        zero = {"answers in flight": 0, "oldest question wait": 0.0, "backlog tokens": 0,
                "engine answers in flight": 0, "engine questions waiting": 0,
                "engine queued tokens": 0,
                "question refused on idle": ""}
        deadline = time.monotonic() + WAIT_S
        while True:  # a vanished client's session ends on the server's own time
            now = self.server_thread.call(lambda: counts(server))
            sessions = self.server_thread.call(lambda: server.active_sessions)
            pages = server.engine.snapshot().kv_pages_used
            settled = (now == zero and sessions == len(self.open) + len(self.detached)
                       and (self.open or pages == 0))  # a detached session holds no page
            if settled:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"not back to zero: {now}, sessions {sessions} (open "
                                     f"{len(self.open)}), KV pages {pages}")
            time.sleep(0.05)

    def teardown(self) -> None:
        for session in self.open:
            session.ws.close()
            self.detached.append(session.handle)
        self.open.clear()
        self.nothing_stays_counted()
        for handle in list(self.detached):  # every detached session comes back and ends
            end(Session(self.server_thread.port, handle))
            self.detached.remove(handle)
        self.nothing_stays_counted()
        # and the idle server answers a question
        session = Session(self.server_thread.port)
        done = session.done(session.query())
        assert done["finish_reason"] in ("stop", "length"), done
        end(session)
        self.nothing_stays_counted()


def end(session: Session) -> None:
    session.send({"type": "session.end"})
    session.until(lambda m: m["type"] == "session.ended")
    session.ws.close()


@pytest.fixture(scope="module")
def server_thread(tiny_loaded):
    thread = ServerThread(tiny_loaded)
    yield thread
    thread.stop()


def test_state_returns_to_zero(server_thread):
    ServerStateMachine.server_thread = server_thread
    run = ServerStateMachine.TestCase
    run.settings = settings(max_examples=15, stateful_step_count=30, deadline=None,
                            suppress_health_check=list(HealthCheck), derandomize=True)
    run().runTest()
