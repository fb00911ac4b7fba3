"""The state directory's format: versioned, checksummed, refused with a reason."""

from __future__ import annotations

import json
import time

import torch
from helpers import tiny_config
from test_paged_cache import append_random

from streamgrok.cache.config import CacheConfig
from streamgrok.cache.paged_cache import PagedKVCache
from streamgrok.server.session_store import FORMAT, Refused, SavedSession, SessionStore

IDENTITY = {"model": "tiny", "kv_dtype": "float32", "page_size": 16}
KEY = "ab" * 32


def saved_session(detached_wall: float | None = None) -> SavedSession:
    cache = PagedKVCache(tiny_config(), CacheConfig(policy="full", budget_tokens=None),
                         num_pages=32)
    cache.add_sequence(1)
    append_random(cache, 1, 40, seed=1)
    cache.index_frame(1, 3, torch.ones(8))
    cache.park(1)
    return SavedSession(KEY, b"\x01" * 32, detached_wall or time.time(), {"fps": 2},
                        {"notes": [], "instructions": "be brief", "stream_time": 4.0},
                        cache.export_sequence(1), 4.0, [("response.done", "{}")])


def test_a_saved_session_reads_back_whole(tmp_path):
    store = SessionStore(tmp_path, IDENTITY)
    session = saved_session()
    store.save(session)
    read = store.load(KEY)
    assert isinstance(read, SavedSession)
    assert read.owner == session.owner and read.options == {"fps": 2}
    assert read.held == [("response.done", "{}")]
    assert read.snapshot.stream_pos == 40 and set(read.snapshot.frame_embeddings) == {3}
    for a, b in zip(session.snapshot.layers, read.snapshot.layers):
        assert all(torch.equal(x, y) for x, y in zip(a.entries, b.entries))
        assert torch.equal(a.meta, b.meta) and torch.equal(a.score, b.score)
    assert store.load("cd" * 32) is None and store.load("../etc/passwd") is None


def test_damage_another_model_or_format_is_refused_with_a_reason(tmp_path):
    store = SessionStore(tmp_path, IDENTITY)
    store.save(saved_session())
    other = SessionStore(tmp_path, {**IDENTITY, "kv_dtype": "int8"})
    refused = other.load(KEY)
    assert isinstance(refused, Refused) and "another model or KV format" in refused.reason
    data = tmp_path / f"{KEY}.safetensors"
    raw = data.read_bytes()
    data.write_bytes(raw[:-8] + bytes(b ^ 0xFF for b in raw[-8:]))
    assert "checksum" in store.load(KEY).reason
    header = tmp_path / f"{KEY}.json"
    body = json.loads(header.read_text())
    body["owner"] = "00" * 32  # edited: the owner of the handle must not be swappable
    header.write_text(json.dumps(body))
    assert "checksum" in store.load(KEY).reason
    body["format"] = FORMAT + 1
    header.write_text(json.dumps(body))
    assert "format" in store.load(KEY).reason


def test_sessions_past_their_resume_time_are_deleted(tmp_path):
    store = SessionStore(tmp_path, IDENTITY)
    store.save(saved_session(detached_wall=time.time() - 100))
    assert store.remove_expired(ttl_s=300, now=time.time()) == 0
    assert store.remove_expired(ttl_s=60, now=time.time()) == 1
    assert not list(tmp_path.iterdir())
