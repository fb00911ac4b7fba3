"""/metrics shows the shared speech recognisers' work and what a session is learned to cost
(the numbers admission weighs), by recogniser and by part."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from streamgrok.media.speech_batcher import BatcherStats
from streamgrok.server.metrics import ServerMetrics


def samples(metrics: ServerMetrics) -> dict[tuple[str, tuple], float]:
    text = metrics.render().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_recognisers_work_and_a_session_s_learned_cost_are_exported():
    stats = BatcherStats(segments=12, calls=12, audio_s=30.5, busy_s=4.25, dropped=1)
    stats.waits.extend([0.1, 0.2, 0.9])
    cost = {"media": 0.02, "speech": None}  # no speech measured yet: not exported
    metrics = ServerMetrics(speech=lambda: {"whisper base": stats.as_dict()},
                            session_cost=lambda: cost)
    got = samples(metrics)
    who = (("recogniser", "whisper base"),)
    assert got[("streamgrok_speech_segments_total", who)] == 12
    assert got[("streamgrok_speech_audio_seconds_total", who)] == 30.5
    assert got[("streamgrok_speech_busy_seconds_total", who)] == 4.2  # as stats round it
    assert got[("streamgrok_speech_dropped_total", who)] == 1
    assert 0.2 < got[("streamgrok_speech_queue_wait_p95_seconds", who)] <= 0.9
    assert got[("streamgrok_session_cost_ratio", (("part", "media"),))] == 0.02
    assert ("streamgrok_session_cost_ratio", (("part", "speech"),)) not in got
    cost["speech"] = 0.03  # read at every scrape
    assert samples(metrics)[("streamgrok_session_cost_ratio", (("part", "speech"),))] == 0.03


def test_a_server_without_speech_exports_no_recogniser_samples():
    got = samples(ServerMetrics())
    assert not [name for name, _ in got if name.startswith("streamgrok_speech_")]
