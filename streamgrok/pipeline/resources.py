"""What one process loads once and lends to every session's pipeline.

The server (or `streamgrok run`) owns one `SharedResources`: CLIP encoders and projectors,
the speech transcriber and voice-activity model, and the media worker pool are loaded once,
never per session; the live `degradation` level is shared the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

from streamgrok.media.audio import SpeechModel
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.media.speech_batcher import SpeechBatcher
from streamgrok.media.transcribers import load_transcriber
from streamgrok.pipeline.degradation import Degradation

T = TypeVar("T")


class SharedResources:
    """Loaded-once resources, thread-safe; `close()` stops the media workers."""

    def __init__(self, media_pool: NativeMediaPool | None = None) -> None:
        self.media_pool = media_pool
        self.degradation = Degradation()  # written by the server's load governor
        self._loaded: dict[Hashable, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Hashable, load: Callable[[], T]) -> T:
        """The resource under `key`, loaded by `load()` the first time it is asked for."""
        with self._lock:
            if key not in self._loaded:
                self._loaded[key] = load()
            return self._loaded[key]

    def transcriber(self, name: str = "base") -> SpeechBatcher:
        """The shared speech recogniser `name` (see `load_transcriber`), every session's
        segments batched into its calls (`SpeechBatcher`; thread-safe)."""
        return self.get(("transcriber", name), lambda: SpeechBatcher(load_transcriber(name)))

    def _recognisers(self) -> list[SpeechBatcher]:
        """The shared speech recognisers loaded so far."""
        with self._lock:
            return [r for r in self._loaded.values() if isinstance(r, SpeechBatcher)]

    def speech_stats(self) -> dict[str, dict]:
        """What each shared speech recogniser loaded so far did, by name."""
        return {r.name: r.stats.as_dict() for r in self._recognisers()}

    def speech_busy_s(self) -> float:
        """Seconds the shared speech recognisers have worked so far, all of them together."""
        return sum(r.stats.busy_s for r in self._recognisers())

    def speech_model(self) -> SpeechModel:
        """The shared voice-activity model (thread-safe; each session keeps its own state)."""
        return self.get("speech_model", SpeechModel)

    def speech_wait(self) -> float:
        """How long the oldest speech segment waiting for a shared recogniser has waited."""
        return max((r.oldest_wait() for r in self._recognisers()), default=0.0)

    def close(self) -> None:
        """Stop the media workers and the speech recognisers' threads."""
        if self.media_pool is not None:
            self.media_pool.close()
        for recogniser in self._recognisers():
            recogniser.close()


class PipelineOptions(dict):
    """The options `build_pipeline(options)` receives: a plain dict of option values, plus
    the `resources` of the process running it (None when built outside a runner)."""

    def __init__(self, values: dict[str, Any] | None = None,
                 resources: SharedResources | None = None) -> None:
        super().__init__(values or {})
        self.resources = resources
