"""The shapes of OpenAI Realtime server events (the GA names: `response.output_text.delta`,
`conversation.item.added`, ...), built for a text-only streamgrok session."""

from __future__ import annotations

from typing import Any

DEFAULT_INPUT_RATE = 24_000


def session_object(session_id: str, model: str, instructions: str, input_rate: int,
                   max_output_tokens: int) -> dict:
    """The effective session configuration (what session.created/updated report)."""
    return {
        "type": "realtime", "id": session_id, "object": "realtime.session", "model": model,
        "instructions": instructions, "output_modalities": ["text"],
        "audio": {"input": {"format": {"type": "audio/pcm", "rate": input_rate},
                            "turn_detection": None,
                            "transcription": {"model": "whisper"}}},
        "max_output_tokens": max_output_tokens, "tools": [], "tool_choice": "none",
    }


def user_item(item_id: str, content: list[dict]) -> dict:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user",
            "status": "completed", "content": content}


def assistant_item(item_id: str, text: str | None, status: str) -> dict:
    content = [] if text is None else [{"type": "output_text", "text": text}]
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "assistant",
            "status": status, "content": content}


def response_object(response_id: str, status: str, output: list[dict],
                    max_output_tokens: int, usage: dict | None = None,
                    reason: str | None = None) -> dict:
    response: dict[str, Any] = {
        "id": response_id, "object": "realtime.response", "status": status,
        "output": output, "output_modalities": ["text"], "conversation_id": "conv_default",
        "max_output_tokens": max_output_tokens,
        "status_details": None if reason is None else {
            "type": status, "reason": reason},
    }
    if usage is not None:
        response["usage"] = {"input_tokens": usage["prompt_tokens"],
                             "output_tokens": usage["completion_tokens"],
                             "total_tokens": usage["total_tokens"],
                             "input_token_details": {"text_tokens": usage["prompt_tokens"],
                                                     "audio_tokens": 0, "image_tokens": 0,
                                                     "cached_tokens": 0},
                             "output_token_details": {"text_tokens":
                                                      usage["completion_tokens"],
                                                      "audio_tokens": 0}}
    return response


def status_of(finish_reason: str) -> tuple[str, str | None]:
    """A Realtime response status (and its reason) for an engine finish reason."""
    if finish_reason == "cancelled":
        return "cancelled", "client_cancelled"
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None
