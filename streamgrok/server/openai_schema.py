"""Requests and responses of the OpenAI-compatible API: validation of what a client sends
(an explicit list of what is supported; anything else is a clear 400) and the JSON shapes
OpenAI's clients parse."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from streamgrok.model.sampling import SamplingParams

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
DEFAULT_MAX_TOKENS = 256
MAX_STOPS = 4
MAX_STOP_CHARS = 64
# accepted only at their neutral value: the engine has no such control
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False,
           "top_logprobs": 0, "echo": False, "best_of": 1, "suffix": None,
           "parallel_tool_calls": None}


class ApiError(Exception):
    """An error response in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param,
                          "code": self.code}}


@dataclass
class Part:
    """One piece of a chat message: text, or an image (a data URL)."""

    text: str | None = None
    image_url: str | None = None


@dataclass
class ChatMessage:
    role: str
    parts: list[Part]


@dataclass
class GenerationRequest:
    """A validated /v1/chat/completions or /v1/completions request."""

    model: str
    sampling: SamplingParams
    stops: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    session: str | None = None  # a live websocket session to ask about
    messages: list[ChatMessage] = field(default_factory=list)  # chat
    prompt: str | None = None  # completions


def parse_chat(body: dict, max_tokens: int, max_images: int) -> GenerationRequest:
    request = _common(body, max_tokens)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    request.messages = [_message(m, i) for i, m in enumerate(messages)]
    if request.messages[-1].role != "user":
        raise ApiError(400, "the last message must be the user's (continuing an assistant "
                       "message is not supported)", param="messages")
    images = sum(p.image_url is not None for m in request.messages for p in m.parts)
    if images > max_images:
        raise ApiError(400, f"{images} images in one request (at most {max_images})",
                       param="messages")
    return request


def parse_completion(body: dict, max_tokens: int) -> GenerationRequest:
    request = _common(body, max_tokens)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, list):
        raise ApiError(400, "one prompt per request (a list of prompts is not supported)",
                       param="prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", param="prompt")
    request.prompt = prompt
    return request


def _common(body: dict, max_tokens: int) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError(400, "model must be a string (GET /v1/models lists it)", param="model")
    for name, neutral in NEUTRAL.items():
        if body.get(name, neutral) not in (neutral, None):
            raise ApiError(400, f"{name} is not supported by this server", param=name)
    if body.get("tools") or body.get("functions"):
        raise ApiError(400, "tools and function calling are not supported", param="tools")
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1", param="n")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise ApiError(400, "only the text response format is supported",
                       param="response_format")
    stream = _typed(body, "stream", bool, False)
    options = _typed(body, "stream_options", dict, None) or {}
    metadata = _typed(body, "metadata", dict, None) or {}
    session = metadata.get("session")
    if session is not None and not isinstance(session, str | int):
        raise ApiError(400, "metadata.session must be a session id", param="metadata")
    return GenerationRequest(
        model=model, sampling=_sampling(body, max_tokens), stops=_stops(body.get("stop")),
        stream=stream, include_usage=bool(options.get("include_usage")) and stream,
        session=None if session is None else str(session))


def _sampling(body: dict, limit: int) -> SamplingParams:
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is None:
        max_tokens = min(DEFAULT_MAX_TOKENS, limit)
    if not _is_int(max_tokens) or not 1 <= max_tokens <= limit:
        raise ApiError(400, f"max_tokens must be an integer from 1 to {limit}",
                       param="max_tokens")
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise ApiError(400, "top_p must be above 0", param="top_p")
    top_k = body.get("top_k", 0)
    if not _is_int(top_k) or top_k < 0:
        raise ApiError(400, "top_k must be an integer >= 0", param="top_k")
    penalty = _number(body, "repetition_penalty", 1.0, 0.01, 10.0)
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise ApiError(400, "seed must be an integer", param="seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                          repetition_penalty=penalty, max_tokens=max_tokens)


def _stops(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(
            isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stops):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOPS} strings "
                       f"of 1 to {MAX_STOP_CHARS} characters", param="stop")
    return stops


def _message(message: Any, index: int) -> ChatMessage:
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    role = message.get("role")
    if role in ("tool", "function") or message.get("tool_calls"):
        raise ApiError(400, "tool messages are not supported", param=f"{where}.role")
    if role not in ROLES:
        raise ApiError(400, f"{where}.role must be one of {', '.join(ROLES)}",
                       param=f"{where}.role")
    content = message.get("content")
    if content is None and role == "assistant":
        content = ""
    if isinstance(content, str):
        return ChatMessage(ROLES[role], [Part(text=content)])
    if not isinstance(content, list):
        raise ApiError(400, f"{where}.content must be a string or a list of parts",
                       param=f"{where}.content")
    return ChatMessage(ROLES[role], [_part(p, f"{where}.content[{i}]")
                                     for i, p in enumerate(content)])


def _part(part: Any, where: str) -> Part:
    if not isinstance(part, dict):
        raise ApiError(400, f"{where} must be an object", param=where)
    kind = part.get("type")
    if kind == "text" and isinstance(part.get("text"), str):
        return Part(text=part["text"])
    if kind == "image_url":
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else image
        if isinstance(url, str):
            return Part(image_url=url)
    if kind == "input_audio":
        raise ApiError(400, "audio in chat content is not supported: stream it over /ws or "
                       "/v1/realtime", param=where)
    raise ApiError(400, f"{where} must be a text part or an image_url part", param=where)


def _typed(body: dict, name: str, kind: type, default: Any) -> Any:
    value = body.get(name, default)
    if value is not None and not isinstance(value, kind):
        raise ApiError(400, f"{name} must be a {kind.__name__}", param=name)
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or \
            not math.isfinite(value) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}", param=name)
    return float(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- responses ---------------------------------------------------------------------------

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_completion(request_id: str, model: str, text: str, finish: str, used: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": {"role": "assistant",
                                                                 "content": text},
                                         "finish_reason": finish, "logprobs": None}],
            "usage": used}


def chat_chunk(request_id: str, model: str, delta: dict, finish: str | None = None,
               used: dict | None = None) -> dict:
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
             "model": model, "choices": [] if used else [
                 {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
    if used:
        chunk["usage"] = used
    return chunk


def text_completion(request_id: str, model: str, text: str, finish: str | None,
                    used: dict | None, chunk: bool = False) -> dict:
    body = {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": [] if chunk and used else [
                {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if used:
        body["usage"] = used
    return body
