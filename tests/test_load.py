"""The load governor alone: synthetic readings in, degradation level and admission out."""

from __future__ import annotations

from streamgrok.pipeline.degradation import Degradation
from streamgrok.server.load import LoadGovernor, LoadLimits, LoadReading

CALM = LoadReading(cpu=0.3, ttft_s=0.4, stale=0.0, sessions=4)


def governor() -> LoadGovernor:
    return LoadGovernor(Degradation(), LoadLimits(min_fps_scale=0.25, calm_ticks=2))


def test_overload_degrades_live_sampling_first_then_refuses_new_sessions():
    gov = governor()
    slow = LoadReading(cpu=0.5, ttft_s=5.0, stale=0.0, sessions=16)
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.5 and "first token" in gov.degradation.reason
    assert gov.refusal(16) == ""  # degrading first: new sessions still come in
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.25 and gov.refusal(16)  # at the floor: busy
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.25  # never below the floor


def test_calm_restores_the_rate_step_by_step_and_admits_again():
    gov = governor()
    for _ in range(2):
        gov.tick(LoadReading(cpu=0.97, ttft_s=0.5, stale=0.0, sessions=8))
    assert gov.refusal(8).startswith("CPU at 97%")
    gov.tick(CALM)  # a session left: no longer over, admitted, but not restored at once
    assert gov.refusal(4) == ""
    assert gov.degradation.fps_scale == 0.25
    gov.tick(CALM)
    assert gov.degradation.fps_scale == 0.5
    gov.tick(CALM)
    gov.tick(CALM)
    assert gov.degradation.fps_scale == 1.0 and not gov.degradation.degraded
    assert gov.degradation.reason == ""


def test_stale_frames_count_as_overload():
    gov = governor()
    gov.tick(LoadReading(cpu=0.4, ttft_s=0.3, stale=0.6, sessions=8))
    assert gov.degradation.fps_scale == 0.5 and "stale" in gov.degradation.reason


def test_a_session_that_would_not_fit_at_the_lowest_rate_is_refused():
    gov = governor()
    gov.degradation.fps_scale = 0.25
    gov.tick(LoadReading(cpu=0.85, ttft_s=0.3, stale=0.0, sessions=8))
    assert "one more session" in gov.refusal(8)  # 0.85 * 9 / 8 > 0.9
    assert gov.refusal(4) == ""  # four left: 0.85 * 5 / 8 fits


def test_recent_first_tokens_are_a_sliding_window():
    gov = governor()
    gov.record_ttft(9.0, now=0.0)
    gov.record_ttft(0.5, now=25.0)
    assert gov.recent_ttft(now=25.0) == 0.5  # the 9 s one fell out of the 20 s window
