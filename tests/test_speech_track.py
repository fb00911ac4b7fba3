"""The speaking bench client's audio and its scoring: sentences laid between pauses, the
server's transcript notes matched to them by time, delays and WER."""

from __future__ import annotations

import numpy as np

from streamgrok.bench.speech_track import (
    RATE,
    SpeechScore,
    SpeechTrack,
    Spoken,
    word_error_rate,
)


def clips() -> list[tuple[str, np.ndarray]]:
    """Two 'sentences' of a loud tone, 1 s and 2 s long."""
    tone = np.sin(np.arange(2 * RATE) * 2 * np.pi * 440 / RATE).astype(np.float32) * 0.5
    return [("first one", tone[:RATE]), ("second one here", tone)]


def test_sentences_alternate_with_pauses_of_their_length():
    track = SpeechTrack(clips(), first=0, seed=1, offset=1.0)
    pcm = b"".join(track.chunk(t) for t in range(8))
    samples = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32767
    assert samples.shape[0] == 8 * RATE
    loud = np.abs(samples.reshape(-1, RATE // 4)).mean(axis=1) > 0.1  # quarter seconds
    assert list(loud[:4]) == [False] * 4  # a second of noise first
    first = track.spoken[0]
    assert (first.start, first.end) == (1.0, 2.0) and first.text == "first one"
    assert loud[4:8].all() and not loud[8:12].any()  # 1 s of speech, 1 s of pause
    assert [s.text for s in track.said_by(3.0)] == ["first one"]
    assert all(s.end > 3.0 for s in track.spoken[1:])


def test_transcripts_are_matched_by_time_with_their_delay():
    score = SpeechScore()
    score.on_note({"kind": "note", "text": 'said: "First one."', "t": 1.1,
                   "tags": ["speech", "transcript"]}, arrived=2.6)
    score.on_note({"kind": "note", "text": "1 person appeared", "t": 1.5, "tags": ["person"]},
                  arrived=2.0)  # not speech: ignored
    spoken = [Spoken(1.0, 2.0, "first one"), Spoken(4.0, 6.0, "second one here")]
    (first, heard, late), (second, nothing, never) = score.matches(spoken)
    assert heard == "First one." and abs(late - 0.6) < 1e-9
    assert nothing == "" and never is None
    assert word_error_rate([(first.text, heard)]) == 0.0
    assert word_error_rate([(second.text, nothing)]) == 1.0


def test_a_sentence_cut_in_two_notes_is_heard_whole():
    score = SpeechScore()
    for text, t, arrived in (('said: "the meeting starts" (continues)', 4.1, 6.5),
                             ('said: "at 4."', 5.2, 7.0)):
        score.on_note({"text": text, "t": t, "tags": ["transcript"]}, arrived)
    ((_, heard, late),) = score.matches([Spoken(4.0, 6.0, "The meeting starts at four.")])
    assert heard == "the meeting starts at 4." and late == 0.5
    assert word_error_rate([("The meeting starts at four.", heard)]) == 0.0
