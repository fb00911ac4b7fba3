"""Async engine: long-lived sessions, continuous batching, chunked prefill mixed with decode.

Ordering rule: an answer sees the session's context exactly as it was when the question was
asked. Everything appended before `ask()` is prefilled first; then the answer runs on a fork of
the session's sequence (pages shared copy-on-write) while later appends keep streaming into the
session itself. When the answer finishes, the question and answer join the session's context
as protected text, after whatever was appended meanwhile. A question asked with
`own_context` instead runs over the session's system prompt (its pages shared) and itself
alone, at once, and is not remembered.
"""

from streamgrok.engine.config import EngineConfig
from streamgrok.engine.engine import Engine
from streamgrok.engine.session import Answer, Session

__all__ = ["Answer", "Engine", "EngineConfig", "Session"]
