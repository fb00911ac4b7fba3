"""Helpers for pipeline files: typed options and the optional CLIP frame encoders."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from streamgrok.errors import StreamgrokError
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
    """CLIP when the `clip_weights` option is given (each frame's index: dedup and
    text-to-frame search), and its projector to frame tokens when `projector` is given too
    (a model with its own vision tower needs none); else none (the pipeline then runs on
    the offline observers and transcripts, or the model's own tower). Loaded once per
    process when `options` carries shared resources (a `PipelineOptions` from a runner)."""
    weights, projector = options.get("clip_weights"), options.get("projector")
    if not weights:
        return None, None
    model = options.get("clip_model", "ViT-B-32")
    hidden = options.get("hidden_size")
    hidden = int(hidden) if hidden else None

    def load() -> tuple[ClipEncoder, Projector | None]:
        return (ClipEncoder(model, pretrained=weights),
                Projector.load(projector, hidden=hidden) if projector else None)

    resources = getattr(options, "resources", None)
    if resources is None:
        return load()
    return resources.get(("frame_encoders", model, str(weights), str(projector), hidden), load)


class OptionError(StreamgrokError):
    """An option a client may not set, or a value outside its declared type or range."""


@dataclass(frozen=True)
class ClientOption:
    """A pipeline option a remote client may set (`session.start` options), with its type
    and range. Everything not declared, above all anything naming files, models or devices,
    is server configuration only."""

    kind: type  # bool, int, float or str
    minimum: float | None = None
    maximum: float | None = None
    exclusive_minimum: bool = False
    choices: tuple[str, ...] | None = None
    max_length: int = 64
    help: str = ""

    def parse(self, name: str, value: Any) -> Any:
        """The checked value (numbers may arrive as JSON numbers or numeric strings)."""
        if self.kind is bool:
            return self._parse_bool(name, value)
        if self.kind is str:
            return self._parse_str(name, value)
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise OptionError(f"option {name!r} must be a number")
        try:
            number = float(value) if self.kind is float else int(value)
        except (ValueError, OverflowError):
            raise OptionError(f"option {name!r} must be a {self.kind.__name__}") from None
        if not math.isfinite(number):
            raise OptionError(f"option {name!r} must be finite")
        low_ok = self.minimum is None or (
            number > self.minimum if self.exclusive_minimum else number >= self.minimum)
        if not low_ok or (self.maximum is not None and number > self.maximum):
            raise OptionError(f"option {name!r} must be in {self.describe_range()}")
        return number

    def describe_range(self) -> str:
        low = "(" if self.exclusive_minimum else "["
        return f"{low}{self.minimum}, {self.maximum}]"

    def _parse_bool(self, name: str, value: Any) -> bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise OptionError(f"option {name!r} must be true or false")

    def _parse_str(self, name: str, value: Any) -> str:
        if not isinstance(value, str) or len(value) > self.max_length:
            raise OptionError(f"option {name!r} must be a string of at most "
                              f"{self.max_length} characters")
        if self.choices is not None and value not in self.choices:
            raise OptionError(f"option {name!r} must be one of {', '.join(self.choices)}")
        return value


DEFAULT_CLIENT_OPTIONS: dict[str, ClientOption] = {
    "fps": ClientOption(float, 0.0, 30.0, exclusive_minimum=True,
                        help="frames sampled per second"),
    "transcribe": ClientOption(bool, help="transcribe speech"),
}


def check_client_options(allowed: dict[str, ClientOption], given: Any) -> dict[str, Any]:
    """A client's `session.start` options checked against the pipeline's allow-list."""
    if given is None:
        return {}
    if not isinstance(given, dict):
        raise OptionError("options must be a JSON object")
    checked = {}
    for name, value in given.items():
        spec = allowed.get(name)
        if spec is None:
            settable = ", ".join(sorted(allowed)) or "none"
            raise OptionError(f"option {name!r} cannot be set by a client (settable: "
                              f"{settable})")
        checked[name] = spec.parse(name, value)
    return checked
