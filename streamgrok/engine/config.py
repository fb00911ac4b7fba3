"""Engine and scheduler parameters (defaults from the origin document where it gives them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches work.

    max_batch: decode sequences per step. step_tokens: tokens (decode + prefill) per step.
    merge_window_s: after idling, wait this long for more work before the first step.
    length_ratio: decode sequences are grouped into nano-batches of similar cache length
    (shortest/longest >= ratio) to cut padding. nano_batches: split each step this many ways.
    media_batch_tokens / media_wait_s: a session's pending media is prefilled once that many
    tokens wait, the oldest has waited that long, or a question is queued behind it (fewer,
    larger prefill spans per step).
    frame_queue / text_queue_tokens: per-session pending bounds (frames drop oldest; text waits).
    media_freshness_s: a live frame not prefilled this long after it was queued is dropped
    ("stale"), so a question never waits behind more than this much live media.
    """

    max_batch: int = 32
    step_tokens: int = 512
    decode_step_prefill: int = 128  # prefill tokens a step with decodes may carry (TBT bound)
    min_prefill_share: int = 32
    merge_window_s: float = 0.010
    length_ratio: float = 0.8
    nano_batches: int = 1
    media_batch_tokens: int = 16
    media_wait_s: float = 0.25
    frame_queue: int = 64
    media_freshness_s: float = 1.0
    text_queue_tokens: int = 16_384
    max_append_tokens: int = 8_192  # one text append; larger ones are refused (RequestTooLarge)
    protect_answers: bool = True
    max_protected_fraction: float = 0.5
    max_sessions: int = 256
    recent_steps: int = 1024  # step records kept for the p50/p95 step-time stats
    # CPU threads of small steps (decode); None = the step threads. On the engine's own
    # thread OpenMP stops spinning once it manages more threads than cores, and bare decode
    # steps ran faster on 1 thread than 2 on 2 cores, but `bench serve` at 8 live sessions
    # did not get faster (README, CPU decode): so this is opt-in.
    small_step_threads: int | None = None
    small_step_tokens: int = 32  # steps of at most this many tokens are small

    def __post_init__(self) -> None:
        if self.max_batch < 1 or self.step_tokens < 1 or self.nano_batches < 1:
            raise ValueError("max_batch, step_tokens and nano_batches must be >= 1")
        if self.min_prefill_share < 1:
            raise ValueError("min_prefill_share must be >= 1")
        if not self.media_freshness_s > 0:
            raise ValueError("media_freshness_s must be > 0")
