"""bench grounding's generated clips and scoring, and grounding's note choice by meaning:
questions that share no word with their note still see it; absent things are said so."""

from __future__ import annotations

import pytest

from benchmarks.grounding_clips import generated_clips
from benchmarks.grounding_questions import Question, digits, invented, says_absent
from streamgrok.media.items import Note
from streamgrok.pipeline.grounding import answer_stem, grounded_prompt
from streamgrok.pipeline.note_log import NoteLog
from streamgrok.pipeline.question_kinds import asked_kinds, named_things


def test_generated_clips_are_drawn_from_their_seed():
    first, again, other = generated_clips(7, 3), generated_clips(7, 3), generated_clips(8, 3)
    assert [c.questions for c in first] == [c.questions for c in again]
    assert [c.questions for c in first] != [c.questions for c in other]
    assert [[s.speech for s in c.scenes] for c in first] == \
        [[s.speech for s in c.scenes] for c in again]


@pytest.mark.parametrize("seed", range(20))
def test_paraphrased_questions_share_no_stem_with_their_note(seed):
    log = NoteLog()
    for clip in generated_clips(seed, 4):
        sets = {q.set for q in clip.questions}
        assert {"direct", "paraphrase", "absent"} <= sets
        for question in clip.questions:
            if question.set == "paraphrase":
                assert not log.words(question.text) & log.words(question.source), question
            if question.set == "direct":
                assert log.words(question.text) & log.words(question.source), question


def test_numbers_are_matched_however_they_are_written():
    assert digits("at four thirty in room twelve") == ["430", "12"]
    assert digits("Flight 200 and 5 boards at 4:30") == ["205", "430"]
    meeting = Question("When?", "speech", (("#4:30",),))
    assert meeting.score("It starts at 4:30.") and meeting.score("at four thirty")
    assert meeting.score("at 430") and not meeting.score("at 12:30")
    gate = Question("Which gate?", "speech", (("#7",),))
    assert gate.score("Gate seven.") and not gate.score("Gate 17.")


def test_an_absent_answer_says_so_or_is_counted_as_invented():
    notes = ['said: "please take the stairs on the left."']
    assert says_absent("No, I did not see a dog.") and says_absent("No one walked in.")
    assert not says_absent("The dog ran to the left.")
    assert invented("The answer is: the city of paris.", "Where should people go?", notes)
    assert not invented("Take the stairs on the left.", "Where should people go?", notes)
    assert not invented("I did not see a dog.", "What did the dog do?", notes)


@pytest.mark.parametrize(("question", "kinds"), [
    ("Where should visitors go?", ["speech", "text"]),  # an instruction: said or posted
    ("What did the announcement say?", ["speech"]),
    ("Who introduced themselves?", ["speech"]),
    ("What did the sign say?", ["text"]),
    ("Did anybody show up in the picture?", ["people"]),
    ("What hue was the shape that crossed the picture?", ["colour", "motion"]),
    ("At what moment did the picture switch to another view?", ["change"]),
    ("Which stairs are on the left?", []),  # "left" alone is not motion
    ("When did the person appear?", ["people"]),
])
def test_a_question_is_read_for_the_kind_of_note_it_asks_about(question, kinds):
    assert asked_kinds(question) == kinds


def test_things_named_are_the_ones_a_viewer_would_report():
    assert named_things("Did a dog appear?") == ["dog"]
    assert named_things("Which way did the ball roll?") == []  # a ball is a moving object
    assert named_things("Where should passengers of the plane wait?") == []  # said


def busy_log() -> NoteLog:
    log = NoteLog()
    log.add(Note('said: "please take the stairs on the left."', 2.0,
                 tags={"speech", "transcript"}))
    for i in range(40):
        log.add(Note(f"colours dark grey, blue {i}", 3.0 + i, tags={"colour"}))
    log.add(Note('text on screen: "EXIT 42"', 50.0, tags={"text"}))
    return log


def test_a_question_in_other_words_still_sees_its_note():
    log = busy_log()
    meaning = grounded_prompt("Where should visitors go?", log)
    assert "take the stairs on the left" in meaning.split("\n\n")[0]
    assert "EXIT 42" not in meaning  # said or posted: what was said comes first
    words = grounded_prompt("Where should visitors go?", log, selection="words")
    assert "take the stairs" not in words.split("\n\n")[0]  # the old choice missed it


def test_a_question_whose_words_reach_nothing_sees_the_latest_of_every_kind():
    prompt = grounded_prompt("What is going on?", busy_log())
    assert "stairs" in prompt and "EXIT 42" in prompt and "blue 39" in prompt


def test_what_was_not_seen_is_said_in_the_prompt_and_the_answer():
    log = busy_log()
    prompt = grounded_prompt("What colour was the car?", log)
    assert "never: no car was seen" in prompt
    assert answer_stem("What colour was the car?", log) == "I did not see a car"
    assert answer_stem("Did a dog appear?", log) == "No, I did not see a dog"
    assert answer_stem("Who walked into view?", log) == "No one"
    assert answer_stem("Where should visitors go?", log) == \
        'I heard: "please take the stairs on the left."'  # told what to do: the instruction
    assert answer_stem("When should visitors leave?", busy_log()) == 'I heard: "' 


def test_asked_for_the_first_of_several_the_prompt_shows_the_first():
    log = NoteLog()
    for at in (3.0, 9.0, 15.0):
        log.add(Note("scene cut: a different scene", at, tags={"cut"}))
    prompt = grounded_prompt("At what moment did the picture first switch to another view?",
                             log)
    assert "at 3 seconds: scene cut" in prompt and "at 15 seconds" not in prompt
    assert "the first of the scene cuts at 3 seconds" in prompt
    last = grounded_prompt("When was the last scene cut?", log)
    assert "at 15 seconds: scene cut" in last and "at 3 seconds" not in last


def test_a_thing_named_in_a_question_not_about_the_picture_is_not_denied():
    log = busy_log()
    assert answer_stem("How many minutes late is the bus?", log) == ""
    assert answer_stem("Was a bus on screen?", log) == "No, I did not see a bus"


def test_asked_what_to_do_the_instruction_is_nearest_the_question():
    log = NoteLog()
    log.add(Note('said: "Please take the stairs on the left."', 2.0,
                 tags={"speech", "transcript"}))
    log.add(Note('said: "The meeting starts at 4:30 in room 12."', 9.0,
                 tags={"speech", "transcript"}))
    notes = grounded_prompt("Where should visitors go?", log).split("\n\n")[0]
    assert notes.splitlines()[-1].endswith('said: "Please take the stairs on the left."')


def test_asked_what_a_sign_said_the_sign_is_shown_not_that_it_went():
    log = NoteLog()
    log.add(Note('text on screen: "PLATFORM 3"', 10.0, tags={"text"}))
    log.add(Note("the text on screen is gone", 14.0, tags={"text"}))
    prompt = grounded_prompt("Where do trains depart from, per the display?", log)
    assert "PLATFORM 3" in prompt and "gone" not in prompt
    when = grounded_prompt("When did the sign disappear?", log)
    assert "at 14 seconds: the text on screen is gone" in when


def test_a_clients_instructions_lead_a_grounded_prompt():
    prompt = grounded_prompt("Where should visitors go?", busy_log(),
                             instructions="Answer in French.")
    assert prompt.startswith("Instructions: Answer in French.\nNotes")
    assert grounded_prompt("Where should visitors go?", busy_log(), room=10,
                           count=len, instructions="x") == "Where should visitors go?"
