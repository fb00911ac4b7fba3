"""What the assistant is fed is true: Whisper transcripts, event observers, grounded prompts."""

from __future__ import annotations

import itertools
import shutil

import numpy as np
import pytest

from streamgrok.media.items import AudioChunk, Note, VideoFrame
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.media.native_worker import Detections
from streamgrok.media.observers import FrameObserver
from streamgrok.media.samples import Scene, draw_caption, draw_events, photo, speak
from streamgrok.media.sampling import SceneCutDetector
from streamgrok.media.tracking import MotionTracker
from streamgrok.media.transcribers import Transcript, Word
from streamgrok.pipeline.grounding import NoteLog, grounded_prompt, relevant_notes

needs_espeak = pytest.mark.skipif(shutil.which("espeak-ng") is None,
                                  reason="espeak-ng is not installed (make test installs it)")
needs_tesseract = pytest.mark.skipif(shutil.which("tesseract") is None,
                                     reason="tesseract is not installed (make test installs it)")
PHOTOS = ["astronaut", "coffee", "chelsea", "camera", "rocket", "hubble_deep_field",
          "immunohistochemistry", "retina", "page", "text", "coins", "colorwheel", "cell", None]


@pytest.fixture(scope="module")
def whisper():
    from streamgrok.media.transcribers import WhisperTranscriber

    return WhisperTranscriber("base")


def test_the_packaged_whisper_model_assembles_once_and_is_verified(tmp_path):
    from streamgrok.media.whisper_files import MODEL_SIZE, VERIFIED, packaged_whisper_base

    folder = packaged_whisper_base(tmp_path)
    assert (folder / "model.bin").stat().st_size == MODEL_SIZE and (folder / VERIFIED).exists()
    stamp = (folder / "model.bin").stat().st_mtime_ns
    assert packaged_whisper_base(tmp_path) == folder  # the second call reuses it
    assert (folder / "model.bin").stat().st_mtime_ns == stamp
    (folder / "model.bin").write_bytes(b"truncated")  # a damaged cache is rebuilt
    assert (packaged_whisper_base(tmp_path) / "model.bin").stat().st_size == MODEL_SIZE


def test_an_unknown_speech_model_is_a_clear_error():
    from streamgrok.media.transcribers import SpeechModelUnavailable, load_transcriber

    with pytest.raises(SpeechModelUnavailable, match="unknown speech model 'nonsense'"):
        load_transcriber("nonsense")


@needs_espeak
def test_whisper_hears_the_announcement(whisper):
    transcript = whisper.transcribe(
        speak("Attention please. The delivery truck arrives at gate seven."), 16_000)
    text = transcript.text.lower()
    assert "delivery truck" in text and "gate" in text and ("7" in text or "seven" in text)
    assert [w.start for w in transcript.words] == sorted(w.start for w in transcript.words)
    assert len(transcript.sentences()) == 2


def test_sentences_start_at_their_first_word():
    transcript = Transcript("Hello there. How are you?", (
        Word(" Hello", 0.0, 0.4), Word(" there.", 0.4, 0.8), Word(" How", 1.5, 1.7),
        Word(" are", 1.7, 1.8), Word(" you?", 1.8, 2.1)))
    assert transcript.sentences() == [(0.0, "Hello there."), (1.5, "How are you?")]


def test_words_the_recogniser_was_unsure_of_are_named_in_the_note_and_kept_when_joined():
    from streamgrok.media.audio import SpeechSegment, speech_notes
    from streamgrok.pipeline.grounding import join_speech

    transcript = Transcript("The meeting is at 430. In room 12.", (
        Word(" The", 0.0, 0.2, 0.9), Word(" meeting", 0.2, 0.6, 0.95),
        Word(" is", 0.6, 0.7, 0.9), Word(" at", 0.7, 0.8, 0.9), Word(" 430.", 0.8, 1.2, 0.2),
        Word(" In", 1.5, 1.6, 0.9), Word(" room", 1.6, 1.9, 0.9), Word(" 12.", 1.9, 2.2, 0.8)))
    segment = SpeechSegment(10.0, 13.0, np.zeros(16_000 * 3, dtype=np.float32))
    notes = speech_notes(segment, transcript)
    assert [n.text for n in notes] == ['said: "The meeting is at 430." (unsure of: 430)',
                                       'said: "In room 12."']
    log = log_of(*[(n.pts, n.text, n.tags) for n in notes])
    joined = join_speech(list(log.notes))
    assert [n.shown for n in joined] == \
        ['said: "The meeting is at 430. In room 12." (unsure of: 430)']


@needs_espeak
def test_long_speech_is_cut_into_partial_segments_at_a_quiet_point():
    from streamgrok.media.audio import RATE, SpeechDetector

    text = ("The weather today is sunny with a light breeze from the west and temperatures "
            "rising slowly through the afternoon until the evening when clouds arrive")
    audio = np.concatenate([speak(text, speed=190), np.zeros(RATE, np.float32)])
    detector = SpeechDetector(max_segment_s=4.0)
    segments = []
    for start in range(0, len(audio), RATE // 2):
        chunk = audio[start : start + RATE // 2]
        segments += detector.feed(AudioChunk(chunk, start / RATE, RATE))
    segments += detector.flush()
    assert len(segments) >= 2 and segments[0].continues and not segments[-1].continues
    for before, after in itertools.pairwise(segments):
        assert before.end == pytest.approx(after.start)  # nothing lost between the parts


@pytest.mark.parametrize("before,after", list(itertools.permutations(PHOTOS, 2)))
def test_a_hard_cut_between_unrelated_pictures_fires(before, after):
    cuts = SceneCutDetector()
    assert cuts.is_cut(cuts.thumbnail(photo(before, 320, 240)),
                       cuts.thumbnail(photo(after, 320, 240)))


@pytest.mark.parametrize("name", PHOTOS)
def test_motion_lighting_and_captions_are_not_cuts(name):
    cuts = SceneCutDetector()
    still = photo(name, 320, 240)
    changed = [np.clip(still.astype(int) + 30, 0, 255).astype(np.uint8),
               np.clip((still.astype(float) - 128) * 1.3 + 128, 0, 255).astype(np.uint8)]
    mover = Scene(None, 4.0, moving_square=True, mover_colour=(230, 210, 40))
    changed += [draw_events(still.copy(), mover, i, 10) for i in (0, 20, 39)]
    changed.append(draw_events(still.copy(), Scene(None, 4.0, person_from=0.0), 0, 10))
    captioned = still.copy()
    draw_caption(captioned, "OPEN 24 HOURS")
    changed.append(captioned)
    for other in changed:
        if name is None and other is changed[0]:
            continue  # a flat picture brightened is another flat picture: nothing to compare
        assert not cuts.is_cut(cuts.thumbnail(still), cuts.thumbnail(other))


@pytest.mark.parametrize("direction", ["left to right", "right to left", "downwards"])
def test_a_moving_object_is_reported_with_its_colour_and_direction(direction):
    tracker = MotionTracker()
    scene = Scene(None, 6.0, moving_square=True, mover_colour=(40, 80, 200),
                  mover_direction=direction)
    background = photo(None, 320, 240)
    events = []
    for i in range(0, 60, 10):  # one frame a second
        events += tracker.events(draw_events(background.copy(), scene, i, 10), cut=i == 0)
    assert any("blue object appeared" in e for e in events)
    assert f"the blue object is moving {direction}" in events
    assert all("ghost" not in e and "grey" not in e for e in events)


class ScriptedDetectors:
    """Counts that follow a script, one entry per detection."""

    def __init__(self, script: list[Detections]) -> None:
        self.script = list(script)

    def detect(self, image, faces, people, cats=False):
        return self.script.pop(0) if len(self.script) > 1 else self.script[0]


def test_people_are_events_with_counts_and_nothing_repeats():
    detectors = ScriptedDetectors([Detections(), Detections(people=1), Detections(people=2),
                                   Detections()])
    observer = FrameObserver(detectors, text=False)
    still = photo("coffee", 320, 240)
    notes = [observer.observe(VideoFrame(still, float(t), t)) for t in range(0, 40, 10)]
    texts = [n.text if n else None for n in notes]
    assert texts[1] == "1 person appeared (1 in view)"
    assert texts[2] == "1 person appeared (2 in view)"
    assert texts[3] == "2 people left (none in view)"
    assert notes[0].events[0] == ("first view", frozenset())  # each event with its own tags
    assert notes[0].events[1][1] == frozenset({"colour"})
    assert notes[3].events == (("2 people left (none in view)", frozenset({"person"})),)


@needs_tesseract
def test_text_on_screen_is_read_once_and_its_end_is_reported():
    """Read as the server reads it: by Tesseract, run by a media worker process (with time
    enough for a busy machine: the server's 5 s limit gives up on a read, by design)."""
    pool = NativeMediaPool(workers=1, timeout_s=180.0, ocr_timeout_s=120.0)
    observer = FrameObserver(pool)
    plain = photo(None, 320, 240)
    sign = plain.copy()
    draw_caption(sign, "OPEN 24 HOURS")
    frames = [plain, sign, sign, plain]
    notes = []
    try:
        for t, image in enumerate(frames):
            frame = VideoFrame(image, t * 5.0, t)
            frame.scene_cut = t > 0 and not np.array_equal(image, frames[t - 1])
            notes.append(observer.observe(frame))
    finally:
        pool.close()
    assert notes[1] is not None and 'text on screen: "OPEN 24 HOURS"' in notes[1].text
    assert notes[2] is None
    assert "the text on screen is gone" in notes[3].text


def log_of(*notes: tuple[float, str, set[str]]) -> NoteLog:
    log = NoteLog()
    for pts, text, tags in notes:
        log.add(Note(text, pts, tags=tags))
    return log


def test_a_speech_question_gets_the_transcript_and_an_absent_topic_is_said_plainly():
    log = log_of((0.0, "first view; colours dark grey", {"colour"}),
                 (2.0, 'said: "The delivery truck arrives at gate 7."', {"speech", "transcript"}),
                 *[(3.0 + i, f"colours blue, red {i}", {"colour"}) for i in range(30)])
    chosen = relevant_notes("What did the announcement say?", log)
    assert any("delivery truck" in n.text for n in chosen)
    prompt = grounded_prompt("Was there a person on screen?", log)
    assert "never: no person or face was seen" in prompt
    assert prompt.rstrip().endswith("Was there a person on screen?")


def test_counting_questions_get_the_totals():
    log = log_of((4.0, "scene cut: a different scene", {"cut"}),
                 (6.0, "1 face appeared (1 in view)", {"face"}),
                 (8.0, "scene cut: a different scene; 1 face left (none in view)", {"cut"}))
    cuts = grounded_prompt("How many scene cuts were there?", log)
    assert "in all: 2 scene cuts\n" in cuts  # only the total asked for
    people = grounded_prompt("How many people were in view at most?", log)
    assert "in all: at most 1 face in view at once\n" in people
    everything = grounded_prompt("How many were there?", log)
    assert "2 scene cuts" in everything and "at most 1 face in view" in everything


def test_a_note_shows_only_its_events_that_answer_the_question():
    log = NoteLog()
    log.add(Note("the blue object is moving right to left", 3.0, tags={"motion"},
                 events=(("the blue object is moving right to left", frozenset({"motion"})),)))
    both = (("colours dark grey, yellow", frozenset({"colour"})),
            ("the yellow object is moving left to right", frozenset({"motion"})),
            ("the blue object left, right to left", frozenset({"motion"})))
    log.add(Note("; ".join(text for text, _ in both), 8.0, tags={"motion", "colour"},
                 events=both))
    blue = grounded_prompt("Which way did the blue object move?", log)
    assert "blue object is moving right to left" in blue and "yellow" not in blue
    yellow = grounded_prompt("Which way did the yellow object move?", log)
    assert "at 8 seconds: the yellow object is moving left to right\n" in yellow
    assert "blue" not in yellow
    colours = grounded_prompt("What colours were seen?", log)
    assert "colours dark grey, yellow" in colours


def test_a_grounded_prompt_leaves_out_the_oldest_notes_to_fit_its_room():
    log = log_of(*[(float(i), f'said: "sentence number {i}"', {"speech", "transcript"})
                   for i in range(20)])
    chosen = relevant_notes("What was said?", log)
    full = grounded_prompt("What was said?", log)
    fitted = grounded_prompt("What was said?", log, room=len(full) - 1, count=len)
    assert len(fitted) < len(full)
    assert chosen[-1].text in fitted and chosen[0].text not in fitted
    assert fitted.rstrip().endswith("What was said?")
    assert grounded_prompt("What was said?", log, room=20, count=len) == "What was said?"


@pytest.mark.parametrize("selection", ["words", "meaning"])
def test_where_the_notes_decide_an_answer_it_is_given_its_first_words(selection):
    from streamgrok.pipeline.grounding import answer_stem

    log = log_of((1.0, "1 face appeared (1 in view)", {"face"}),
                 (3.0, 'said: "hello"', {"transcript"}))
    def stem(question: str, notes: NoteLog = log) -> str:
        return answer_stem(question, notes, selection)

    if selection == "words":
        assert stem("Was a cat seen?") == "No"
        assert stem("Was any text shown on screen?") == "No"
        assert stem("How many cats were seen?") == "No"
    else:  # the answer says what was not seen
        assert stem("Was a cat seen?") == "No, I did not see a cat"
        assert stem("Was any text shown on screen?") == "No, I did not see any text"
        assert stem("How many cats were seen?") == "None: I did not see any cats"
        assert stem("How many animals were seen?") == "None: I did not see an animal"
        assert stem("What animal was on screen?") == "I did not see an animal"
        assert stem("Did a car drive past?") == "No, I did not see a car"
        assert stem("Where should the car park?") == 'I heard: "'  # what was said decides
        assert stem("What did the speaker say?", NoteLog()) == "I did not hear anyone speak"
    words = selection == "words"
    assert stem("Was there a person on screen?") == ("" if words else "Yes, I saw a person")
    assert stem("Did anyone speak?") == ("" if words else "Yes, I heard someone speak")
    assert stem("Did anyone speak about the weather?") == ""  # the model reads the notes
    assert stem("What was said?") == ""  # the model words it
    assert stem("How many faces were seen?") == ""  # the totals say
    assert stem("Who was on screen?") == "A person"  # never a name
    assert stem("Who was on screen?", NoteLog()) == "No one"
    assert stem("Did the scene change?") == ""  # cuts are not "never noted"


async def test_an_answer_prefix_is_the_answers_first_words(tiny_loaded):
    from streamgrok.cache.config import CacheConfig
    from streamgrok.engine import Engine, EngineConfig
    from streamgrok.model.sampling import SamplingParams

    async with Engine(tiny_loaded, CacheConfig(budget_tokens=256, memory_gib=0.02),
                      EngineConfig(merge_window_s=0)) as engine:
        session = engine.new_session("sys")
        answer = session.ask("was it there?", SamplingParams(max_tokens=3),
                             answer_prefix="No")
        deltas = [d async for d in answer]
    assert deltas[0] == "No" and "".join(deltas).startswith("No")


def test_sentences_said_one_after_another_are_one_quote():
    log = log_of((2.0, 'said: "Attention please!"', {"speech", "transcript"}),
                 (4.0, 'said: "The truck arrives at gate 7."', {"speech", "transcript"}),
                 (30.0, 'said: "Much later."', {"speech", "transcript"}))
    prompt = grounded_prompt("What did the announcement say?", log)
    assert '- at 2 seconds: said: "Attention please! The truck arrives at gate 7."' in prompt
    assert '- at 30 seconds: said: "Much later."' in prompt  # too far apart to join


def test_what_was_said_is_asked_as_a_quote_but_a_sign_is_not():
    log = log_of((1.0, 'said: "my name is Oliver"', {"transcript"}),
                 (2.0, 'text on screen: "OPEN"', {"text"}))
    assert "quotes the words said" in grounded_prompt("What name did the speaker say?", log)
    assert "quotes the words said" not in grounded_prompt("What did the sign say?", log)
    assert "quotes" not in grounded_prompt("When did the speaker talk?", log)


def test_the_grounding_score_wants_the_fact_not_a_word_that_looks_like_it():
    from benchmarks.grounding import Question

    count = Question("How many faces were seen?", "counting", (("1", "one"),))
    assert count.score("One face was seen.") and count.score("1")
    assert not count.score("No one was seen.")  # "no one" is not the number
    absent = Question("Was a cat seen?", "presence", absent=True)
    assert absent.score("No, no cat was seen.") and not absent.score("A cat was seen.")
