"""The load governor alone: synthetic readings in, degradation level and admission out."""

from __future__ import annotations

from streamgrok.pipeline.degradation import Degradation
from streamgrok.server.load import LoadGovernor, LoadLimits, LoadReading


def reading(cpu=0.3, media_cpu=None, ttft_s=0.4, stale=0.0, sessions=4,
            decode_rate=None) -> LoadReading:
    media_cpu = cpu / 2 if media_cpu is None else media_cpu
    return LoadReading(cpu=cpu, media_cpu=media_cpu, ttft_s=ttft_s, stale=stale,
                       sessions=sessions, decode_rate=decode_rate)


def governor() -> LoadGovernor:
    return LoadGovernor(Degradation(), LoadLimits(min_fps_scale=0.25, calm_ticks=2))


def test_overload_degrades_live_sampling_first_then_refuses_new_sessions():
    gov = governor()
    slow = reading(cpu=0.5, ttft_s=5.0, sessions=4)
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.5 and "first token" in gov.degradation.reason
    assert gov.admit(4) == ""  # degrading first: new sessions still come in
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.25 and "first token" in gov.admit(4)  # busy
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.25  # never below the floor


def test_calm_restores_the_rate_step_by_step_and_admits_again():
    gov = governor()
    for _ in range(2):
        gov.tick(reading(cpu=0.97, sessions=8))
    assert gov.admit(8).startswith("CPU at 97%")
    calm = reading(cpu=0.3, sessions=4)
    gov.tick(calm)  # sessions left: no longer over, admitted, but not restored at once
    assert gov.admit(4) == ""
    assert gov.degradation.fps_scale == 0.25
    gov.tick(calm)
    assert gov.degradation.fps_scale == 0.5
    gov.tick(calm)
    gov.tick(calm)
    assert gov.degradation.fps_scale == 1.0 and not gov.degradation.degraded
    assert gov.degradation.reason == ""


def test_stale_frames_count_as_overload():
    gov = governor()
    gov.tick(reading(stale=0.6, sessions=8))
    assert gov.degradation.fps_scale == 0.5 and "stale" in gov.degradation.reason


def test_many_sessions_at_once_are_admitted_up_to_the_learned_cost_then_refused():
    """One session's media was measured taking 12% of the CPU: of 20 clients connecting
    together, 7 fit, the 8th and 9th degrade live sampling, and at its lowest the rest get
    busy."""
    gov = governor()
    gov.tick(reading(cpu=0.12, media_cpu=0.12, sessions=1))
    admitted, refused = 0, []
    for _ in range(20):
        why = gov.admit(admitted)
        if why:
            refused.append(why)
        else:
            admitted += 1
    assert admitted == 9 and len(refused) == 11
    assert "of the CPU" in refused[0] and gov.degradation.fps_scale == 0.25
    assert gov.admit(3) == ""  # sessions that leave free their share at once


def test_recent_first_tokens_are_a_sliding_window():
    gov = governor()
    gov.record_ttft(9.0, now=0.0)
    gov.record_ttft(0.5, now=25.0)
    assert gov.recent_ttft(now=25.0) == 0.5  # the 9 s one fell out of the 20 s window


def test_questions_are_refused_while_the_engine_is_behind():
    gov = governor()
    assert gov.admit_question(1.5) == ""  # within the 2 s first-token target: queued
    assert "waited 3.0 s" in gov.admit_question(3.0)
    assert gov.admit_question(0.5, backlog_tokens=10_000, max_tokens=64) == ""  # rate unknown
    gov.tick(reading(sessions=8, decode_rate=50.0))  # measured under load: 50 tokens/s
    assert gov.admit_question(0.5, backlog_tokens=900, max_tokens=64) == ""  # 19.3 s
    refused = gov.admit_question(0.5, backlog_tokens=1000, max_tokens=64)  # 21.3 s > 20 s
    assert "1000 tokens of answers in flight at 50 tokens/s" in refused


def test_the_engine_answering_one_session_is_not_taken_for_a_per_session_cost():
    """One session asking keeps the engine busy (half the CPU), but its media costs 2%: the
    next sessions add 2% each, so 20 fit before anything degrades."""
    gov = governor()
    gov.tick(reading(cpu=0.5, media_cpu=0.02, sessions=1))
    assert all(gov.admit(n) == "" for n in range(1, 20))
    assert not gov.degradation.degraded
    gov.admit(21)
    assert gov.degradation.degraded


def test_a_server_left_idle_admits_again_at_once():
    gov = governor()
    for _ in range(3):
        gov.record_ttft(6.0)
        gov.tick(reading(ttft_s=6.0, sessions=8))
    assert gov.admit(8)  # at the floor and slow: busy
    gov.tick(reading(cpu=0.1, ttft_s=gov.recent_ttft(0.0), sessions=0))  # everyone left
    assert gov.admit(0) == "" and gov.recent_ttft(1e9) == 0.0


def test_the_drain_rate_is_read_only_from_ticks_busy_from_start_to_end():
    from streamgrok.server.load import drain_rate

    assert drain_rate(100, 2.0, True, True) == 50.0
    assert drain_rate(1, 2.0, True, False) is None  # the answer ended early in the tick
    assert drain_rate(40, 2.0, False, True) is None  # it began during the tick
    assert drain_rate(0, 2.0, True, True) is None
