"""The load governor alone: synthetic readings in, degradation level and admission out."""

from __future__ import annotations

from streamgrok.pipeline.degradation import Degradation
from streamgrok.server.load import LoadGovernor, LoadLimits, LoadReading


def reading(cpu=0.3, media_cpu=None, ttft_s=0.4, stale=0.0, sessions=4,
            decode_rate=None, recogniser_busy=0.0) -> LoadReading:
    media_cpu = cpu / 2 if media_cpu is None else media_cpu
    return LoadReading(cpu=cpu, media_cpu=media_cpu, ttft_s=ttft_s, stale=stale,
                       sessions=sessions, decode_rate=decode_rate,
                       recogniser_busy=recogniser_busy)


def governor() -> LoadGovernor:
    return LoadGovernor(Degradation(), LoadLimits(min_fps_scale=0.25, calm_ticks=2))


def test_overload_degrades_live_sampling_first_then_refuses_new_sessions():
    gov = governor()
    slow = reading(cpu=0.5, ttft_s=5.0, sessions=4)
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.5 and "first token" in gov.degradation.reason
    assert gov.admit(4) is None  # degrading first: new sessions still come in
    gov.tick(slow)
    refused = gov.admit(4)  # busy
    assert gov.degradation.fps_scale == 0.25 and "first token" in str(refused)
    assert refused.rule == "overload"
    gov.tick(slow)
    assert gov.degradation.fps_scale == 0.25  # never below the floor


def test_calm_restores_the_rate_step_by_step_and_admits_again():
    gov = governor()
    for _ in range(2):
        gov.tick(reading(cpu=0.97, sessions=8))
    assert gov.admit(8).detail.startswith("CPU at 97%")
    calm = reading(cpu=0.3, sessions=4)
    gov.tick(calm)  # sessions left: no longer over, admitted, but not restored at once
    assert gov.admit(4) is None
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
    """One session's media was measured taking 12% of the CPU at the full rate: of 40
    clients connecting together, 7 fit at the full rate; halving the rate halves what each
    costs, so up to 15 fit at half and 30 at a quarter, and the rest get busy."""
    gov = governor()
    gov.tick(reading(cpu=0.12, media_cpu=0.12, sessions=1))
    admitted, refused, scales = 0, [], []
    for _ in range(40):
        why = gov.admit(admitted)
        if why:
            refused.append(why)
        else:
            admitted += 1
            scales.append(gov.degradation.fps_scale)
    assert admitted == 30 and len(refused) == 10
    assert scales.count(1.0) == 7 and scales.count(0.5) == 8 and scales.count(0.25) == 15
    assert "of the CPU" in str(refused[0]) and refused[0].rule == "session_cpu"
    assert gov.admit(3) is None  # sessions that leave free their share at once


def test_the_cost_learned_at_a_lower_rate_is_a_cost_at_the_full_rate():
    """Media measured at a quarter of the rate costs four times as much at the full one."""
    gov = governor()
    gov.degradation.fps_scale = 0.25
    gov.tick(reading(cpu=0.2, media_cpu=0.2, ttft_s=0.1, sessions=10))
    assert abs(gov.session_cpu - 0.08) < 1e-9


def test_a_live_answer_is_shortened_to_what_fits_never_refused():
    gov = governor()
    assert gov.answer_tokens(10_000, 64) == (64, None)  # rate unknown: full length
    gov.tick(reading(sessions=8, decode_rate=50.0), now=100.0)
    assert gov.answer_tokens(900, 64, now=101.0) == (64, None)  # 19.3 s: fits
    tokens, why = gov.answer_tokens(950, 64, now=101.0)  # 1000 fit in 20 s: 50 are left
    assert tokens == 50 and why.rule == "answer_deadline" and "shortened to 50" in str(why)
    tokens, why = gov.answer_tokens(5000, 64, now=101.0)  # far behind: the floor
    assert tokens == gov.limits.min_answer_tokens and why is not None
    assert gov.answer_tokens(5000, 16, now=101.0) == (16, None)  # already under the floor
    gov.tick(reading(sessions=1, decode_rate=0.01), now=102.0)
    assert gov.answer_tokens(0, 1024, 0.0, now=103.0) == (1024, None)  # nobody ahead


def test_recent_first_tokens_are_a_sliding_window():
    gov = governor()
    gov.record_ttft(9.0, now=0.0)
    gov.record_ttft(0.5, now=25.0)
    assert gov.recent_ttft(now=25.0) == 0.5  # the 9 s one fell out of the 20 s window


def test_questions_are_refused_while_the_engine_is_behind():
    gov = governor()
    assert gov.admit_question(1.5, backlog_tokens=10) is None  # within the 2 s target
    refused = gov.admit_question(3.0, backlog_tokens=10)
    assert refused.rule == "first_token_wait" and "waited 3.0 s" in str(refused)
    assert "(rule: first_token_wait)" in str(refused)
    assert gov.admit_question(0.5, backlog_tokens=10_000, max_tokens=64) is None  # rate unknown
    gov.tick(reading(sessions=8, decode_rate=50.0), now=100.0)  # 50 tokens/s of decode steps
    assert gov.admit_question(0.5, backlog_tokens=900, max_tokens=64, now=101.0) is None
    refused = gov.admit_question(0.5, backlog_tokens=1000, max_tokens=64, now=101.0)
    assert refused.rule == "answer_deadline"  # 21.3 s > 20 s
    assert "1000 tokens of answers in flight at 50 tokens/s" in str(refused)


def test_a_question_nobody_is_ahead_of_is_always_admitted():
    """However slow the last reading, with no answer in flight and no question waiting
    there is no queue for the new one to wait in."""
    gov = governor()
    gov.tick(reading(sessions=1, decode_rate=0.01), now=0.0)
    assert gov.admit_question(0.0, backlog_tokens=0, max_tokens=1024, now=1.0) is None
    assert gov.admit_question(0.0, backlog_tokens=5, max_tokens=1024, now=1.0) is not None


def test_a_decode_rate_reading_expires():
    gov = governor()
    gov.tick(reading(sessions=1, decode_rate=1.0), now=0.0)
    assert gov.admit_question(0.1, backlog_tokens=50, max_tokens=64, now=10.0) is not None
    assert gov.current_decode_rate(now=10.0) == 1.0
    assert gov.current_decode_rate(now=31.0) is None  # older than rate_ttl_s (30 s)
    assert gov.admit_question(0.1, backlog_tokens=50, max_tokens=64, now=31.0) is None
    gov.tick(reading(sessions=1, decode_rate=40.0), now=40.0)  # a fresh reading, not averaged
    assert gov.current_decode_rate(now=40.0) == 40.0           # with the expired one


def test_one_answer_s_burst_is_not_taken_for_a_session_s_engine_cost():
    """One session's answer kept the engine busy (60% of the CPU) for one 2-s tick of a
    minute; its media costs 2%. Over the window its engine work is 2% of the cores: with the
    media, 4% a session, so 22 fit before anything degrades (not 1, as the burst alone would
    say)."""
    gov = governor()
    for t in range(30):
        cpu = 0.62 if t == 0 else 0.02
        gov.tick(reading(cpu=cpu, media_cpu=0.02, sessions=1), now=100.0 + 2 * t)
    assert abs(gov.session_engine - 0.6 / 30) < 1e-9
    assert all(gov.admit(n, now=200.0) is None for n in range(1, 22))
    assert not gov.degradation.degraded
    gov.admit(22, now=200.0)
    assert gov.degradation.degraded


def test_the_engine_s_work_per_session_counts_in_admission():
    """Eight sessions kept the cores 88% busy, 24% of it their media workers: the engine's
    64% is 8% a session. The ninth and tenth are admitted at half and a quarter of the
    sampling rate (their media cheaper); the eleventh is refused, as the engine alone would
    then take 88% of the cores."""
    gov = governor()
    gov.tick(reading(cpu=0.88, media_cpu=0.24, sessions=8), now=100.0)
    assert abs(gov.session_engine - 0.08) < 1e-9
    assert gov.admit(8, now=101.0) is None and gov.degradation.fps_scale == 0.5
    assert gov.admit(9, now=101.0) is None and gov.degradation.fps_scale == 0.25
    refused = gov.admit(10, now=101.0)
    assert refused is not None and refused.rule == "session_cpu"


def test_a_server_left_idle_admits_again_at_once():
    gov = governor()
    for _ in range(3):
        gov.record_ttft(6.0)
        gov.tick(reading(ttft_s=6.0, sessions=8))
    assert gov.admit(8)  # at the floor and slow: busy
    gov.tick(reading(cpu=0.1, ttft_s=gov.recent_ttft(0.0), sessions=0))  # everyone left
    assert gov.admit(0) is None and gov.recent_ttft(1e9) == 0.0


def test_the_decode_rate_is_read_from_decode_step_time_only():
    from streamgrok.server.load import decode_rate

    assert decode_rate(100, 2.0) == 50.0  # 100 tokens in 2 s of decode steps
    assert decode_rate(1, 0.02) == 50.0  # an answer cancelled at its first decoded token
    assert decode_rate(0, 0.0) is None  # nothing decoded: nothing measured
    assert decode_rate(0, 1.0) is None


def test_speech_waiting_for_the_recogniser_is_overload():
    """Transcripts more than 3 s late: live sampling halves (the detectors' cores go to the
    recogniser), and at the floor new sessions are refused."""
    gov = governor()
    late = LoadReading(cpu=0.5, media_cpu=0.1, ttft_s=0.3, stale=0.0, sessions=6,
                       speech_wait_s=8.0)
    gov.tick(late)
    assert gov.degradation.fps_scale == 0.5 and "recogniser" in gov.degradation.reason
    gov.tick(late)
    refused = gov.admit(6)
    assert refused.rule == "overload" and "speech has waited 8.0 s" in str(refused)
    heard = LoadReading(cpu=0.3, media_cpu=0.1, ttft_s=0.3, stale=0.0, sessions=6,
                        speech_wait_s=1.0)
    gov.tick(heard)
    assert gov.admit(6) is None


def admitted_of(gov: LoadGovernor, clients: int) -> tuple[int, list]:
    """Of `clients` connecting together, how many are admitted, and the refusals."""
    admitted, refused = 0, []
    for _ in range(clients):
        why = gov.admit(admitted)
        if why:
            refused.append(why)
        else:
            admitted += 1
    return admitted, refused


def test_sessions_are_admitted_up_to_what_the_speech_recogniser_can_hear():
    """Four sessions kept the shared recogniser busy 16% of a tick: 4% each, so 17 fit under
    its 70% limit and the rest of 32 clients connecting together are refused with a hint
    to retry; live sampling is not degraded for it (the frame rate costs the recogniser
    nothing)."""
    gov = governor()
    gov.tick(reading(cpu=0.1, media_cpu=0.0, sessions=4, recogniser_busy=0.16))
    admitted, refused = admitted_of(gov, 32)
    assert admitted == 17 and len(refused) == 15
    assert refused[0].rule == "speech_capacity" and "busy 72%" in refused[0].detail
    assert refused[0].retry_after_s == gov.limits.retry_after_s
    assert not gov.degradation.degraded


def test_the_recogniser_s_time_counts_in_the_cpu_a_session_adds():
    """On one core, four sessions cost 8% in media workers and 20% in the recogniser: 7%
    each, beside 2% of the rest. Twelve fit at the full rate (without the recogniser's share,
    44 would); the thirteenth halves live sampling."""
    gov = LoadGovernor(Degradation(), LoadLimits(recogniser_high=1.0), cores=1)
    gov.tick(reading(cpu=0.3, media_cpu=0.08, sessions=4, recogniser_busy=0.2))
    assert all(gov.admit(n) is None for n in range(12))
    assert not gov.degradation.degraded
    assert gov.admit(12) is None and gov.degradation.fps_scale == 0.5


def test_a_server_that_has_not_measured_a_session_admits_a_few_then_asks_to_retry():
    gov = governor()
    gov.measuring = True  # its ticks are coming, none with sessions yet
    gov.tick(reading(sessions=0))
    admitted, refused = admitted_of(gov, 12)
    assert admitted == gov.limits.unmeasured_sessions == 8
    assert {r.rule for r in refused} == {"unmeasured"}
    assert all(r.retry_after_s == gov.limits.retry_after_s for r in refused)
    gov.tick(reading(cpu=0.2, media_cpu=0.04, sessions=8))  # measured: 0.5% a session
    assert gov.admit(8) is None


def test_speech_is_learned_over_a_window_and_not_while_sessions_come_and_go():
    """A sentence is heard in one call: one tick's busy share is a burst, the window's
    average is the cost. Right after admissions the new sessions have not spoken yet, and
    right after sessions leave the recogniser still hears what they said: those ticks teach
    nothing (the cost learned before holds)."""
    gov = governor()
    for t, busy in enumerate([0.4, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]):  # 2-s ticks
        gov.tick(reading(cpu=0.2, media_cpu=0.0, sessions=4, recogniser_busy=busy),
                 now=100.0 + 2 * t)
    assert abs(gov.session_speech - 0.4 / 32) < 1e-9  # not 0.1, the burst's tick alone
    assert gov.admit(4, now=120.0) is None
    gov.tick(reading(cpu=0.2, media_cpu=0.0, sessions=5, recogniser_busy=0.0), now=122.0)
    assert abs(gov.session_speech - 0.4 / 32) < 1e-9  # settling: not learned from
    gov.tick(reading(cpu=0.2, media_cpu=0.0, sessions=5, recogniser_busy=0.5), now=143.0)
    learned = gov.session_speech
    assert abs(learned - 0.9 / 37) < 1e-9  # settled: the window (100-114 s, 143 s) learns
    gov.tick(reading(cpu=0.2, media_cpu=0.0, sessions=2, recogniser_busy=0.9), now=145.0)
    assert gov.session_speech == learned  # three left, their speech still being heard
