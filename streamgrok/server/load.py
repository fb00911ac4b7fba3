"""The server's sustainable load: measured, then enforced by thinning live media, shortening
answers, and refusing new sessions.

A session admitted is a session served: load is refused at `session.start`, never at a live
session's question. Every tick the governor reads what the server measures: the CPU the
server process and its media workers use against the machine's cores, the time to first
token of recent answers (and how long the oldest question has waited for one), how long the
oldest speech segment has waited for the shared recogniser, and the share of live frames that
went stale before they could be processed. Over the limits, live sessions degrade first:
their sampling rate halves (down to `min_fps_scale`) and the costly detectors run that much
less often, which also leaves the recogniser more of the cores. Well under them for a while,
the rate doubles back. Still over at the lowest rate, new sessions are refused `busy`.

Admission also looks ahead. From the ticks with sessions it learns the CPU one more session
adds: its media work (frame decoding and detectors, in the media worker processes) adds up per
session and scales with the sampling rate, so the governor learns the workers' CPU per session
at the full rate (what it measured, divided by the rate it measured at). A session that would
push the CPU past its limit at the current rate first halves live sampling (admitted, and
projected again at the new rate); at the lowest rate it is refused, also when many clients
connect at once. Speech is the next cost that adds up per session: the one shared recogniser
(one thread) is learned as its busy share per session, which the sampling rate does not
change. The engine's own CPU (prefilling each session's frames, notes and transcripts, and
its answers) is learned per session the same way, above what the idle server uses. Both are
bursty (a sentence is heard in one call after it ends, an answer is decoded in a few
seconds), so they are averaged over the ticks of the last `speech_window_s`, and only over
ticks at least `settle_s` after the number of sessions last changed: sessions that just
started have not spoken yet and would make speech look cheap, and the recogniser still
working through the segments of sessions that just left would make it look dear. One more
session is refused when it would keep the recogniser busy more than `recogniser_high` of the
time (a queue that full makes transcripts late); its recogniser time and its engine share
count in the CPU projection too (the engine's share is a little high where many answers
decode in one batch: projected on the safe side). Until a tick with sessions has measured
these costs (a server just started), at most `unmeasured_sessions` are admitted; the rest are
refused with a retry hint of one tick, by when the cost is known.

The engine's time does not add up that way (the answers of many sessions decode in one
batch), so it is guarded at the question instead, by its length: when the
tokens the answers in flight may still generate, plus this answer's, would take longer than
the answer deadline at the decode rate measured under load, a live session's question is
still queued but its answer is shortened to what fits (not below `min_answer_tokens`). The
decode rate is measured from the engine's own decode steps (tokens decoded over the seconds
those steps took), never from wall time, so idle time or answers cancelled at their first
token cannot make the engine look slow; a reading older than `rate_ttl_s` is forgotten.

A stateless HTTP request is a session of one question: it is admitted or refused `busy` as
it arrives, by the same rules (the oldest question's wait for its first token past the
target, or the answer deadline), and a request with nobody ahead of it (no answer in flight,
no question waiting) is always admitted. A session that leaves frees its share at once.

Every refusal is a `Refusal`: the rule that refused and a message with the measured values.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import psutil

from streamgrok.engine.metrics import percentile
from streamgrok.pipeline.degradation import Degradation


@dataclass(frozen=True)
class LoadLimits:
    """When the server counts as overloaded (any one) and as calm (all)."""

    cpu_high: float = 0.90  # fraction of all cores
    cpu_low: float = 0.65
    ttft_target_s: float = 2.0
    speech_wait_s: float = 3.0  # a speech segment waiting longer for the recogniser
    stale_high: float = 0.25  # fraction of live frames that went stale
    stale_low: float = 0.05
    answer_deadline_s: float = 20.0  # a new answer should be done within this
    min_fps_scale: float = 0.25
    calm_ticks: int = 3  # calm ticks in a row before the rate doubles back
    ttft_window_s: float = 20.0
    rate_ttl_s: float = 30.0  # a decode-rate reading older than this is forgotten
    min_answer_tokens: int = 32  # a live session's answer is never shortened below this
    recogniser_high: float = 0.7  # the shared speech recogniser's busy share, at most
    unmeasured_sessions: int = 8  # admitted before any tick has measured a session's cost
    retry_after_s: float = 2.0  # what a refusal for load suggests (about one tick)
    settle_s: float = 20.0  # after an admission, ticks this long are not used to learn speech
    speech_window_s: float = 60.0  # the recogniser's share per session: averaged over this


@dataclass(frozen=True)
class Refusal:
    """Why something was refused `busy`: the `rule` (a short name, the metrics' label) and
    a message with the values measured."""

    rule: str
    detail: str
    retry_after_s: float | None = None  # when a retry may succeed, where that is known

    def __str__(self) -> str:
        return f"{self.detail} (rule: {self.rule})"


@dataclass
class LoadReading:
    """One tick's measurements."""

    cpu: float  # fraction of all cores (server and media workers)
    media_cpu: float  # the part of `cpu` the media worker processes used
    ttft_s: float  # p95 of recent first tokens, or the oldest wait for one, if longer
    stale: float  # fraction of live frames that went stale since the last tick
    sessions: int
    decode_rate: float | None = None  # tokens per second of the engine's decode steps
    speech_wait_s: float = 0.0  # how long the oldest speech segment has waited to be heard
    recogniser_busy: float = 0.0  # share of the tick the shared speech recogniser worked


@dataclass
class LoadGovernor:
    """Owns the live `degradation` level and the admission decision (event-loop only)."""

    degradation: Degradation
    limits: LoadLimits = field(default_factory=LoadLimits)
    cores: int = 1  # the machine's cores: `LoadReading.cpu` is a share of all of them
    measuring: bool = False  # ticks are coming (the server measures); else only admit by cost
    last: LoadReading | None = None
    refusing: str = ""  # why new sessions are refused now, empty when admitted
    session_cpu: float | None = None  # the share of the cores a session adds at full rate
    session_speech: float | None = None  # the recogniser's busy share a session adds
    session_engine: float | None = None  # the share of the cores a session's engine work adds
    idle_cpu: float = 0.0  # the share of the cores the server uses with no session
    decode_rate: float | None = None  # tokens/s of the engine's decode steps (average)
    decode_rate_at: float = float("-inf")  # when decode_rate was last measured
    _calm: int = 0
    _ttfts: deque = field(default_factory=deque)  # (when, seconds)
    _shares: deque = field(default_factory=deque)  # (when, recogniser, engine, sessions)
    _admitted_at: float = float("-inf")  # when the last session was admitted
    _changed_at: float = float("-inf")  # when a tick last saw another number of sessions

    def record_ttft(self, seconds: float, now: float | None = None) -> None:
        self._ttfts.append((time.monotonic() if now is None else now, seconds))

    def recent_ttft(self, now: float) -> float:
        while self._ttfts and now - self._ttfts[0][0] > self.limits.ttft_window_s:
            self._ttfts.popleft()
        return percentile([s for _, s in self._ttfts], 95) if self._ttfts else 0.0

    def tick(self, reading: LoadReading, now: float | None = None) -> None:
        """Apply one tick's measurements (taken at `now`, monotonic) to the degradation level
        and admission."""
        now = time.monotonic() if now is None else now
        if self.last is not None and reading.sessions != self.last.sessions:
            self._changed_at = now
        self.last = reading
        if reading.decode_rate:
            self.decode_rate = _average(self.current_decode_rate(now), reading.decode_rate)
            self.decode_rate_at = now
        if not reading.sessions:  # nobody left: what the last load measured no longer holds
            self.idle_cpu = _average(self.idle_cpu, reading.cpu)
            self._ttfts.clear()
            self._shares.clear()  # (the costs learned so far stay)
            self.refusing, self._calm = "", 0
            self.decode_rate, self.decode_rate_at = None, float("-inf")
            self.degradation.fps_scale, self.degradation.reason = 1.0, ""
            return
        # measured at the rate the sessions ran at during the tick: per session at full rate
        self.session_cpu = _average(self.session_cpu, reading.media_cpu / reading.sessions
                                    / self.degradation.fps_scale)
        self._learn_shares(reading, now)
        limits, level = self.limits, self.degradation
        over = self._overload(reading)
        if over:
            self._calm = 0
            self._halve_rate(over)
            level.reason = over
            self.refusing = over if level.fps_scale <= limits.min_fps_scale else ""
            return
        self.refusing = ""
        calm = reading.cpu < limits.cpu_low and reading.stale < limits.stale_low \
            and reading.ttft_s < limits.ttft_target_s / 2 \
            and reading.speech_wait_s < limits.speech_wait_s / 2
        self._calm = self._calm + 1 if calm else 0
        if self._calm >= limits.calm_ticks and level.degraded:
            self._calm = 0
            level.fps_scale = min(1.0, level.fps_scale * 2)
            level.reason = "" if not level.degraded else level.reason

    def _learn_shares(self, reading: LoadReading, now: float) -> None:
        """The recogniser's busy share and the engine's share of the cores per session, over
        the settled ticks of the window."""
        if now - max(self._admitted_at, self._changed_at) < self.limits.settle_s:
            return  # what was learned before holds
        engine = max(0.0, self._in_process_cpu(reading) - self.idle_cpu)
        self._shares.append((now, reading.recogniser_busy, engine, reading.sessions))
        while self._shares and now - self._shares[0][0] > self.limits.speech_window_s:
            self._shares.popleft()
        sessions = sum(n for *_, n in self._shares)
        self.session_speech = sum(s[1] for s in self._shares) / sessions
        self.session_engine = sum(s[2] for s in self._shares) / sessions

    def _in_process_cpu(self, reading: LoadReading) -> float:
        """The share of the cores a reading's server used outside its media workers and its
        recogniser's thread: the engine and the rest of the process."""
        return reading.cpu - reading.media_cpu - reading.recogniser_busy / self.cores

    def current_decode_rate(self, now: float) -> float | None:
        """The decode rate measured within the last `rate_ttl_s` at `now`, else None."""
        if now - self.decode_rate_at > self.limits.rate_ttl_s:
            return None
        return self.decode_rate

    def admit(self, sessions: int, now: float | None = None) -> Refusal | None:
        """Why one more session (beside `sessions`) must be refused now, None to admit it.
        A session that would push the learned CPU cost past its limit first degrades live
        sampling (admitted when the cost fits at the lower rate); at the lowest rate it is
        refused. An admission (at `now`, monotonic) is remembered: ticks within `settle_s`
        after it do not teach the speech cost."""
        refused = self._refusal(sessions)
        if refused is None:
            self._admitted_at = time.monotonic() if now is None else now
        return refused

    def _refusal(self, sessions: int) -> Refusal | None:
        limits = self.limits
        if self.refusing:
            return Refusal("overload", self.refusing, limits.retry_after_s)
        cost, last = self.session_cpu, self.last
        if cost is None or last is None:
            if not self.measuring or sessions < limits.unmeasured_sessions:
                return None
            return Refusal("unmeasured", f"{sessions} sessions started before a session's "
                           f"cost was measured; it is known within a tick",
                           limits.retry_after_s)
        speech = (sessions + 1) * (self.session_speech or 0.0)
        if speech > limits.recogniser_high:
            return Refusal("speech_capacity", f"{sessions + 1} sessions would keep the speech "
                           f"recogniser busy {speech:.0%} of the time "
                           f"(at most {limits.recogniser_high:.0%})", limits.retry_after_s)
        # the recogniser's one thread, as a share of all the cores
        speech_cpu = (self.session_speech or 0.0) / self.cores
        # the engine and the rest of this process: as measured, or as the sessions add it
        rest = max(self._in_process_cpu(last),
                   self.idle_cpu + (sessions + 1) * (self.session_engine or 0.0))
        while True:
            # the media workers' CPU at the current rate and the recogniser's for every
            # session, plus the rest
            scale = self.degradation.fps_scale
            projected = rest + (sessions + 1) * (cost * scale + speech_cpu)
            if projected <= limits.cpu_high:
                return None
            why = f"{sessions + 1} sessions would need {projected:.0%} of the CPU"
            if not self._halve_rate(why):
                return Refusal("session_cpu", why, limits.retry_after_s)

    def _halve_rate(self, why: str) -> bool:
        """Halve live sampling for `why`, not below the floor; False when already there."""
        level, floor = self.degradation, self.limits.min_fps_scale
        if level.fps_scale <= floor:
            return False
        level.fps_scale, level.reason = max(floor, level.fps_scale / 2), why
        return True

    def admit_question(self, oldest_wait_s: float, backlog_tokens: int = 0,
                       max_tokens: int = 0, now: float | None = None) -> Refusal | None:
        """Why a stateless request (of up to `max_tokens`) must be refused now (None: queue
        it). A request with nobody ahead of it (no answer in flight: `backlog_tokens` 0, no
        question waiting: `oldest_wait_s` 0) is always admitted. Otherwise the engine is
        behind when the oldest question still waiting for its first token has waited past
        the first-token target, or when the tokens the answers in flight may still generate
        (`backlog_tokens`), plus this answer's `max_tokens`, would take longer than the
        answer deadline at the decode rate measured within the last `rate_ttl_s`."""
        if backlog_tokens <= 0 and oldest_wait_s <= 0:
            return None
        limits = self.limits
        if oldest_wait_s > limits.ttft_target_s:
            return Refusal("first_token_wait",
                           f"the engine is behind: a question has waited {oldest_wait_s:.1f} s "
                           f"for its first token (target {limits.ttft_target_s:g} s)")
        rate = self.current_decode_rate(time.monotonic() if now is None else now)
        if rate and (backlog_tokens + max_tokens) / rate > limits.answer_deadline_s:
            return Refusal("answer_deadline",
                           f"the engine is behind: {backlog_tokens} tokens of answers in flight "
                           f"at {rate:.0f} tokens/s would keep a new answer past "
                           f"{limits.answer_deadline_s:g} s")
        return None

    def answer_tokens(self, backlog_tokens: int, max_tokens: int, oldest_wait_s: float = 0.0,
                      now: float | None = None) -> tuple[int, Refusal | None]:
        """The length a live session's answer may have now: `max_tokens`, or, when the
        answers in flight (`backlog_tokens` still to generate) and this one would run past the
        answer deadline at the measured decode rate, what fits before it (not below
        `min_answer_tokens`), with the rule that shortened it. An answer with nobody ahead of
        it (no answer in flight, no question waiting: `oldest_wait_s` 0) keeps its length.
        Never a refusal: an admitted session's question is always queued."""
        if backlog_tokens <= 0 and oldest_wait_s <= 0:
            return max_tokens, None
        rate = self.current_decode_rate(time.monotonic() if now is None else now)
        limits = self.limits
        if not rate or (backlog_tokens + max_tokens) / rate <= limits.answer_deadline_s:
            return max_tokens, None
        fits = int(limits.answer_deadline_s * rate) - backlog_tokens
        tokens = min(max_tokens, max(limits.min_answer_tokens, fits))
        if tokens >= max_tokens:
            return max_tokens, None
        return tokens, Refusal("answer_deadline",
                               f"{backlog_tokens} tokens of answers in flight at {rate:.0f} "
                               f"tokens/s: this answer shortened to {tokens} tokens")

    def _overload(self, reading: LoadReading) -> str:
        limits = self.limits
        if reading.ttft_s > limits.ttft_target_s:
            return f"time to first token {reading.ttft_s:.1f} s > {limits.ttft_target_s:g} s"
        if reading.speech_wait_s > limits.speech_wait_s:
            return (f"speech has waited {reading.speech_wait_s:.1f} s for the recogniser "
                    f"> {limits.speech_wait_s:g} s")
        if reading.cpu > limits.cpu_high:
            return f"CPU at {reading.cpu:.0%} of the cores"
        if reading.stale > limits.stale_high:
            return f"{reading.stale:.0%} of live frames went stale"
        return ""


def decode_rate(decoded: int, decode_seconds: float) -> float | None:
    """Tokens a second the engine decodes, from what its decode steps did between two reads:
    `decoded` tokens in `decode_seconds` of steps that decoded (time the engine idled, or
    spent on steps with nothing to decode, is not in it); None when nothing was decoded."""
    if decoded <= 0 or decode_seconds <= 0:
        return None
    return decoded / decode_seconds


class CpuMeter:
    """CPU used by this process and its child processes (media workers, demuxers) between
    two reads, as a fraction of all the machine's cores."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.cores = psutil.cpu_count() or 1
        self._last: tuple[float, float] | None = None

    def read(self) -> tuple[float, float]:
        """(all, child processes only) since the last read, as fractions of the cores."""
        now, used = time.monotonic(), tree_cpu_seconds(self.process)
        last, self._last = self._last, (now, used)
        if last is None or now <= last[0]:
            return 0.0, 0.0
        scale = (now - last[0]) * self.cores
        return (max(0.0, used[0] + used[1] - last[1][0] - last[1][1]) / scale,
                max(0.0, used[1] - last[1][1]) / scale)


def tree_cpu_seconds(process: psutil.Process) -> tuple[float, float]:
    """(the process, its child processes) CPU seconds so far. Children include the programs
    they ran and waited for (Tesseract runs of a media worker, a second each), which a look
    at the live processes alone would never see; a child that just exited is skipped."""
    own = process.cpu_times()
    children = own.children_user + own.children_system
    for child in process.children(recursive=True):
        try:
            times = child.cpu_times()
        except psutil.Error:
            continue
        children += times.user + times.system + times.children_user + times.children_system
    return own.user + own.system, children


def _average(old: float | None, new: float) -> float:
    """A moving average that follows the last few ticks."""
    return new if old is None else 0.7 * old + 0.3 * new
