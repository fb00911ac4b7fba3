"""Helpers for pipeline files: typed options and the optional CLIP frame encoders."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from streamgrok.media.clip import ClipEncoder
from streamgrok.media.projector import Projector

T = TypeVar("T")


def option(options: dict[str, Any], key: str, default: T, kind: Callable[[Any], T] = None) -> T:
    """options[key] converted to the default's type (command-line values arrive as text)."""
    if key not in options:
        return default
    value = options[key]
    convert = kind or type(default)
    if convert is bool and isinstance(value, str):
        return value.lower() in ("1", "true", "yes", "on")  # type: ignore[return-value]
    try:
        return convert(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"option {key}={value!r}: expected {convert.__name__}") from exc


def frame_encoders(options: dict[str, Any]) -> tuple[ClipEncoder | None, Projector | None]:
    """CLIP + projector when both `clip_weights` and `projector` options are given, else none
    (the pipeline then runs on the offline observers and transcripts)."""
    weights, projector = options.get("clip_weights"), options.get("projector")
    if not weights or not projector:
        return None, None
    encoder = ClipEncoder(options.get("clip_model", "ViT-B-32"), pretrained=weights)
    hidden = options.get("hidden_size")
    return encoder, Projector.load(projector, hidden=int(hidden) if hidden else None)
