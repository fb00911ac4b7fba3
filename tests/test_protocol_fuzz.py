"""Property-based fuzzing of the protocol: the control parser, the binary media header, and
a live server connection that must stay usable whatever it is sent."""

from __future__ import annotations

import asyncio
import json
import math
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamgrok.server.protocol import (
    CLIENT_TYPES,
    ERROR_CODES,
    HEADER,
    ProtocolError,
    event,
    parse_binary,
    parse_text,
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12,
)
messages = st.fixed_dictionaries(
    {"type": st.sampled_from(sorted(CLIENT_TYPES)) | json_values},
    optional={"id": json_values, "text": json_values | st.text(), "query_id": json_values,
              "options": json_values},
)
raw_texts = st.one_of(
    messages.map(lambda m: json.dumps(m)),  # allow_nan: NaN/Infinity literals included
    st.text(max_size=200),
    st.sampled_from(["[" * 50_000, "{" * 3000, '{"type": "query", "text": "\\ud800"}',
                     '{"type": "query", "text": "x", "id": ' + "7" * 5000 + "}"]),
)


def strict_json(text: str) -> dict:
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in output"))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw_texts)
def test_control_parser_accepts_or_names_a_documented_code(raw):
    try:
        message = parse_text(raw)
    except ProtocolError as exc:
        assert exc.code in ERROR_CODES
        reply = strict_json(event("error", code=exc.code, message=str(exc),
                                  message_id=exc.message_id))
        assert reply["code"] == exc.code
        return
    assert message["type"] in CLIENT_TYPES
    for name in CLIENT_TYPES[message["type"]]:
        assert name in message
    strict_json(event("error", code="x", message="y", message_id=message.get("id")))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=64), st.integers(0, 255), st.floats(allow_nan=True))
def test_binary_header_accepts_or_names_a_documented_code(tail, kind, timestamp):
    for raw in (tail, HEADER.pack(kind, 0, timestamp) + tail):
        try:
            media = parse_binary(raw)
        except ProtocolError as exc:
            assert exc.code in ERROR_CODES
            continue
        assert math.isfinite(media.timestamp) and media.timestamp >= 0


def test_event_output_is_strict_json_even_with_non_finite_numbers():
    reply = strict_json(event("stats", a=float("nan"), b=[float("inf"), 1.5], c={"d": -1e999}))
    assert reply == {"type": "stats", "a": None, "b": [None, 1.5], "c": {"d": None}}


fuzz_messages = st.one_of(
    raw_texts,
    st.binary(max_size=40),
    st.builds(lambda k, t, p: struct.pack("<BHd", k, 0, t) + p,
              st.integers(0, 4), st.floats(allow_nan=True), st.binary(max_size=32)),
)


async def test_a_live_connection_stays_usable_under_fuzzed_messages(tiny_loaded):
    """Fuzzed messages into one started session on a real server: every reply is strict
    JSON with a documented code, and afterwards the same connection still gets answers."""
    from websockets.asyncio.client import connect

    from streamgrok.cache.config import CacheConfig
    from streamgrok.server.app import ServerConfig, StreamgrokServer

    config = ServerConfig("pipelines/live_qa.py", port=0, max_media_per_second=1000,
                          pipeline_options={"transcribe": "false"}, stats_interval_s=60,
                          load_tick_s=None)
    server = StreamgrokServer(tiny_loaded, config, CacheConfig(budget_tokens=512,
                                                               memory_gib=0.05))
    await server.start()
    sent = []

    @settings(max_examples=60, deadline=None, database=None)
    @given(st.lists(fuzz_messages, min_size=1, max_size=5))
    def collect(batch):
        sent.extend(batch)

    collect()
    try:
        async with connect(f"ws://127.0.0.1:{server.port}/ws", max_size=None) as ws:
            await ws.send(json.dumps({"type": "session.start", "id": "s"}))
            while strict_json(await asyncio.wait_for(ws.recv(), 20))["type"] != "session.started":
                pass
            for message in sent:
                if isinstance(message, str) and '"session.end"' in message:
                    continue  # ending the session on purpose is not a failure
                await ws.send(message)
            final = json.dumps({"type": "query", "id": "final", "text": "still there?"})
            await ws.send(final)
            refused = False
            while True:
                reply = strict_json(await asyncio.wait_for(ws.recv(), 60))
                if reply["type"] == "error":
                    assert reply["code"] in ERROR_CODES and reply["code"] != "internal", reply
                    # fuzzed queries still answering (a slow machine) may fill the in-flight
                    # limit: the refusal comes before their answers end
                    if reply.get("message_id") == "final":
                        assert reply["code"] in ("too_many_queries", "busy"), reply
                        refused = True
                if reply["type"] == "response.done":
                    if reply["query_id"] == "final":
                        break
                    if refused:  # a slot is free now
                        refused = False
                        await ws.send(final)
    finally:
        await server.stop()


def test_every_error_code_is_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[1] / "docs" / "PROTOCOL.md").read_text()
    assert [code for code in ERROR_CODES if f"| `{code}` |" not in doc] == []
