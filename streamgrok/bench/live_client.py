"""A scripted live client for the server benchmarks: frames, PCM audio and questions over the
documented websocket protocol, with what it saw (answers, TTFT, TBT, drops) recorded."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass, field

import cv2
import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from streamgrok.bench.speech_track import SpeechScore, SpeechTrack, Spoken
from streamgrok.media.samples import photo
from streamgrok.server.protocol import pack_media

QUESTIONS = ["What is on screen right now?", "What has changed in the last seconds?",
             "Describe the scene briefly.", "Is anybody there?"]
# asked in turn with QUESTIONS by a speaking client
SPEECH_QUESTIONS = ["What was said just now?", "What did the last announcement say?",
                    "Where should people go?", "What time was mentioned?"]
PHOTOS = ["astronaut", "coffee", "cat", "chelsea", "rocket"]
ADMISSION_PATIENCE_S = 10.0  # how long a client refused `busy` keeps asking to start


@dataclass
class ClientResult:
    """What one client saw."""

    name: str
    asked: int = 0
    answered: int = 0  # response.done with a finish reason other than "error"
    failed: int = 0  # answer_failed / response.done with finish_reason "error"
    refused: Counter = field(default_factory=Counter)  # error code -> queries refused
    unanswered: int = 0  # no response.done before the deadline
    ttfts: list[float] = field(default_factory=list)
    tbts: list[float] = field(default_factory=list)
    frames_sent: int = 0
    errors: Counter = field(default_factory=Counter)
    stats: dict = field(default_factory=dict)  # the last `stats` message
    first_stats: dict = field(default_factory=dict)  # the first one
    session_refused: str | None = None  # error code when session.start was refused
    handshake_failed: bool = False
    spoken: list[Spoken] = field(default_factory=list)  # sentences said (speaking clients)
    speech: SpeechScore = field(default_factory=SpeechScore)  # what the server heard

    @property
    def drops(self) -> dict:
        return self.stats.get("drops", {})


def frame_bytes(index: int, size: tuple[int, int] = (320, 240)) -> bytes:
    """A JPEG of a test photo (changing every 10 frames) with a red square moving across."""
    image = photo(PHOTOS[(index // 10) % len(PHOTOS)], *size).copy()
    x = (index * 17) % (size[0] - 40)
    image[100:140, x : x + 40] = (220, 40, 40)  # something moves, so frames are not deduped
    return cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR))[1].tobytes()


def audio_bytes(seconds: float, seed: int) -> bytes:
    """Room noise as 16 kHz PCM16 (what an open microphone sends between words)."""
    noise = np.random.default_rng(seed).normal(0, 300, int(16000 * seconds))
    return noise.astype("<i2").tobytes()


class _Queries:
    """Per-query timing: when asked, when the last delta came."""

    def __init__(self, result: ClientResult) -> None:
        self.result = result
        self.audio_started: float | None = None  # when the client's audio began
        self.asked_at: dict[str, float] = {}
        self.last_delta: dict[str, float] = {}
        self.open: set[str] = set()

    def ask(self, query: str) -> None:
        self.asked_at[query] = time.monotonic()
        self.open.add(query)
        self.result.asked += 1

    def on_message(self, message: dict) -> None:
        result = self.result
        kind, query = message["type"], message.get("query_id")
        now = time.monotonic()
        if kind == "response.delta" and query in self.open:
            if query in self.asked_at:
                result.ttfts.append(now - self.asked_at.pop(query))
            elif query in self.last_delta:
                result.tbts.append(now - self.last_delta[query])
            self.last_delta[query] = now
        elif kind == "response.done" and query in self.open:
            self.open.discard(query)
            self.asked_at.pop(query, None)
            self.last_delta.pop(query, None)
            if message.get("finish_reason") == "error":
                result.failed += 1
            else:
                result.answered += 1
        elif kind == "error":
            code = message["code"]
            result.errors[code] += 1
            refused = message.get("message_id")
            if refused in self.open and code != "answer_failed":  # the query was refused
                self.open.discard(refused)
                self.asked_at.pop(refused, None)
                result.refused[code] += 1
        elif kind == "stats":
            result.stats = message
            result.first_stats = result.first_stats or message
        elif kind == "event" and message.get("kind") == "note" and \
                self.audio_started is not None:
            result.speech.on_note(message, now - self.audio_started)


async def _start_session(ws, name: str, patience_s: float = ADMISSION_PATIENCE_S) -> dict:
    """`session.start`, sent again after the `retry_after_ms` a `busy` refusal suggests, as
    a client should, for up to `patience_s`; the server's last answer to it."""
    give_up = time.monotonic() + patience_s
    while True:
        await ws.send(json.dumps({"type": "session.start", "id": name}))
        first = json.loads(await asyncio.wait_for(ws.recv(), 120))
        retry_s = first.get("retry_after_ms", 0) / 1e3
        if first["type"] != "error" or first["code"] != "busy" or not retry_s \
                or time.monotonic() + retry_s > give_up:
            return first
        await asyncio.sleep(retry_s)


async def live_client(url: str, name: str, frames: list[bytes], seconds: float,
                      fps: float, ask_every: float, offset: float,
                      answer_timeout: float, speech: SpeechTrack | None = None) -> ClientResult:
    """Stream frames at `fps` and a second of audio a second (room noise, or `speech`'s
    sentences and pauses), ask every `ask_every` s (first after `offset` s; a speaking client
    asks about what was said every other time); then wait up to `answer_timeout` s for the
    open answers."""
    result = ClientResult(name)
    queries = _Queries(result)
    try:
        ws = await asyncio.wait_for(connect(url, max_size=None), 30)
    except (OSError, TimeoutError):
        result.handshake_failed = True
        return result
    async with ws:
        first = await _start_session(ws, name)
        if first["type"] == "error":
            result.session_refused = first["code"]
            return result

        async def reader() -> None:
            try:
                async for raw in ws:
                    queries.on_message(json.loads(raw))
            except ConnectionClosed:
                pass

        reading = asyncio.create_task(reader())
        start = queries.audio_started = time.monotonic()
        next_ask = start + offset
        next_frame = next_audio = start
        audio_sent = 0  # seconds of audio
        try:
            while (now := time.monotonic()) - start < seconds:
                t = now - start
                if now >= next_frame:
                    await ws.send(pack_media("video.frame", 0, t,
                                             frames[result.frames_sent % len(frames)]))
                    result.frames_sent += 1
                    next_frame += 1.0 / fps
                if now >= next_audio:
                    pcm = speech.chunk(audio_sent) if speech else \
                        audio_bytes(1.0, result.frames_sent)
                    await ws.send(pack_media("audio.pcm16", 0, float(audio_sent), pcm))
                    audio_sent += 1
                    next_audio += 1.0
                if now >= next_ask:
                    query = f"{name}-{result.asked}"
                    turn = result.asked
                    text = SPEECH_QUESTIONS[turn // 2 % len(SPEECH_QUESTIONS)] \
                        if speech and turn % 2 else QUESTIONS[turn % len(QUESTIONS)]
                    queries.ask(query)
                    await ws.send(json.dumps({"type": "query", "id": query, "text": text}))
                    next_ask += ask_every
                await asyncio.sleep(max(0.0, min(next_frame, next_audio, next_ask)
                                        - time.monotonic()))
            deadline = time.monotonic() + answer_timeout
            while queries.open and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if speech:  # the last sentence's transcript may still be on its way
                await asyncio.sleep(max(0.0, min(5.0, deadline - time.monotonic())))
            await ws.send(json.dumps({"type": "session.end"}))  # done: not left to resume
        except ConnectionClosed:
            pass
        result.unanswered = len(queries.open)
        if speech:
            result.spoken = speech.said_by(audio_sent)
        reading.cancel()
    return result
