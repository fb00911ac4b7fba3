"""Pushed PCM16 mono audio at any sample rate, resampled (PyAV/libswresample) to the 16 kHz
float the speech stages take; one resampler per stream keeps the filter state across chunks."""

from __future__ import annotations

import av
import numpy as np

from streamgrok.media.decode import AUDIO_RATE
from streamgrok.media.items import AudioChunk

MIN_RATE = 8_000
MAX_RATE = 192_000


def checked_rate(rate: object) -> int:
    """`rate` when it is a sample rate pushed audio may have, else ValueError saying why."""
    if not isinstance(rate, int) or isinstance(rate, bool) or not MIN_RATE <= rate <= MAX_RATE:
        raise ValueError(f"audio sample rate must be an integer from {MIN_RATE} to "
                         f"{MAX_RATE} Hz, got {rate!r}")
    return rate


class PcmResampler:
    """PCM16 mono chunks at `rate` Hz in, `AudioChunk`s at 16 kHz out, timed on one clock."""

    def __init__(self, rate: int) -> None:
        self.rate = checked_rate(rate)
        self._resampler = None if rate == AUDIO_RATE else \
            av.AudioResampler(format="flt", layout="mono", rate=AUDIO_RATE)
        self._samples_in = 0  # input samples so far: the clock of the next chunk

    def push(self, data: bytes, pts: float | None = None) -> AudioChunk:
        """Resample one chunk; `pts` (seconds) defaults to the end of the previous one."""
        if len(data) % 2:
            raise ValueError(f"PCM16 audio needs an even number of bytes, got {len(data)}")
        start = self._samples_in / self.rate if pts is None else pts
        pcm = np.frombuffer(data, dtype="<i2")
        self._samples_in += pcm.size
        if self._resampler is None:
            return AudioChunk(pcm.astype(np.float32) / 32768.0, start, AUDIO_RATE)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        out = [f.to_ndarray().reshape(-1) for f in self._resampler.resample(frame)]
        samples = np.concatenate(out).astype(np.float32) if out else np.zeros(0, np.float32)
        return AudioChunk(samples, start, AUDIO_RATE)
