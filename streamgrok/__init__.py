"""streamgrok: live multimodal inference with a paged streaming KV cache.

The main API, importable from the top level (loaded on first use, so `import streamgrok` and
the command line stay fast)::

    from streamgrok import CacheConfig, Engine, SamplingParams, load_model
    from streamgrok import Edge, IngestConfig, Note, OnNote, Pipeline, Stage, option
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

EXPORTS = {
    "load_model": "streamgrok.loading.loader",
    "LoadedModel": "streamgrok.loading.loader",
    "SamplingParams": "streamgrok.model.sampling",
    "Engine": "streamgrok.engine",
    "EngineConfig": "streamgrok.engine",
    "Session": "streamgrok.engine",
    "Answer": "streamgrok.engine",
    "CacheConfig": "streamgrok.cache.config",
    "Pipeline": "streamgrok.pipeline",
    "PipelineRunner": "streamgrok.pipeline",
    "IngestConfig": "streamgrok.pipeline",
    "Stage": "streamgrok.pipeline",
    "Edge": "streamgrok.pipeline",
    "Event": "streamgrok.pipeline",
    "Trigger": "streamgrok.pipeline",
    "At": "streamgrok.pipeline",
    "Every": "streamgrok.pipeline",
    "OnNote": "streamgrok.pipeline",
    "ClientOption": "streamgrok.pipeline",
    "option": "streamgrok.pipeline",
    "frame_encoders": "streamgrok.pipeline",
    "run_chain": "streamgrok.pipeline",
    "load_pipeline": "streamgrok.pipeline.loader",
    "Note": "streamgrok.media.items",
    "VideoFrame": "streamgrok.media.items",
    "AudioChunk": "streamgrok.media.items",
    "FrameTokens": "streamgrok.media.items",
    "StreamgrokError": "streamgrok.errors",
    "ServerConfig": "streamgrok.server.app",
    "StreamgrokServer": "streamgrok.server.app",
}
__all__ = [
    "__version__", "load_model", "LoadedModel", "SamplingParams", "Engine", "EngineConfig",
    "Session", "Answer", "CacheConfig", "Pipeline", "PipelineRunner", "IngestConfig", "Stage",
    "Edge", "Event", "Trigger", "At", "Every", "OnNote", "ClientOption", "option",
    "frame_encoders", "run_chain", "load_pipeline", "Note", "VideoFrame", "AudioChunk",
    "FrameTokens", "StreamgrokError", "ServerConfig", "StreamgrokServer",
]


def __getattr__(name: str) -> Any:
    if name in EXPORTS:
        return getattr(import_module(EXPORTS[name]), name)
    raise AttributeError(f"module 'streamgrok' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from streamgrok.cache.config import CacheConfig
    from streamgrok.engine import Answer, Engine, EngineConfig, Session
    from streamgrok.errors import StreamgrokError
    from streamgrok.loading.loader import LoadedModel, load_model
    from streamgrok.media.items import AudioChunk, FrameTokens, Note, VideoFrame
    from streamgrok.model.sampling import SamplingParams
    from streamgrok.pipeline import (
        At,
        ClientOption,
        Edge,
        Event,
        Every,
        IngestConfig,
        OnNote,
        Pipeline,
        PipelineRunner,
        Stage,
        Trigger,
        frame_encoders,
        option,
        run_chain,
    )
    from streamgrok.pipeline.loader import load_pipeline
    from streamgrok.server.app import ServerConfig, StreamgrokServer
