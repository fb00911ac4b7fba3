"""`streamgrok info --memory`: what a server process holds, component by component, as each
is loaded in turn here (resident memory, RSS, measured before and after)."""

from __future__ import annotations

import gc
from collections.abc import Callable

import psutil

from streamgrok.cache.config import CacheConfig
from streamgrok.loading.loader import LoadedModel

MIB = 2**20


def _rss() -> int:
    gc.collect()
    return psutil.Process().memory_info().rss


def _grew(load: Callable[[], object]) -> tuple[int, object]:
    before = _rss()
    kept = load()
    return _rss() - before, kept


def memory_rows(baseline: int, model_growth: int, loaded: LoadedModel,
                cache_config: CacheConfig, speech_model: str = "base") -> list[tuple[str, str]]:
    """Rows of the memory report: torch and the libraries (`baseline`, the RSS before the
    model was loaded), the model (`model_growth`), the KV page pool (made here: reserved vs
    committed), then the speech models, loaded here as the first live session would."""
    from streamgrok.cache.paged_cache import PagedKVCache
    from streamgrok.media.audio import SpeechModel
    from streamgrok.media.transcribers import load_transcriber
    from streamgrok.model.quantized import paged_cache_dtype

    model = loaded.model
    config = cache_config.for_model(paged_cache_dtype(model))  # as the engine resolves it
    pool_growth, cache = _grew(lambda: PagedKVCache(loaded.config, config, model.dtype,
                                                    model.device))
    reserved = cache.pool.num_pages * cache.page_bytes
    rows = [
        ("memory: torch and libraries", f"{baseline / MIB:.0f} MiB (RSS before the model)"),
        ("memory: model", f"+{model_growth / MIB:.0f} MiB ({model.weight_bytes() / MIB:.0f} "
                          "MiB of weights)"),
        ("memory: KV page pool", f"+{pool_growth / MIB:.0f} MiB now, up to "
                                 f"{reserved / MIB:.0f} MiB as pages are used "
                                 f"({cache.pool.num_pages} pages of {config.kv_dtype})"),
    ]
    try:
        vad, _ = _grew(SpeechModel)
        rows.append(("memory: voice activity", f"+{vad / MIB:.0f} MiB (loaded by the first "
                                               "live session with audio)"))
        asr, _ = _grew(lambda: load_transcriber(speech_model))
        rows.append((f"memory: transcriber ({speech_model})",
                     f"+{asr / MIB:.0f} MiB (loaded by the first live session that "
                     "transcribes)"))
    except Exception as error:  # a speech model this install cannot load: say so
        rows.append(("memory: speech models", f"not loaded ({type(error).__name__}: {error})"))
    rows.append(("memory: total", f"{_rss() / MIB:.0f} MiB RSS; media worker processes "
                                   "start on first use and are not counted"))
    return rows
