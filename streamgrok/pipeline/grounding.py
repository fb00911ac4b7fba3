"""Grounded questions: the notes that bear on a question are restated beside it.

A small model answers from what sits next to the question far better than from notes spread
over thousands of tokens of context. `grounded_prompt` picks a question's notes from the
session's `NoteLog`, by meaning (`note_retrieval`: the kinds of note the question asks about,
BM25, recency) or, as `selection="words"`, by shared word stems and topic words (the old
way); the most relevant sit nearest the question. It adds the times a "when" question asks
about and the totals a "how many" question needs, and says plainly what was never seen or
heard of what the question asks; `answer_stem` gives the answer's first words where the
notes decide them ("No, I did not see a dog"), so the model has a true answer to give
instead of an invented one.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from streamgrok.media.observers import COUNTED
from streamgrok.pipeline.note_log import WORD, Event, LoggedNote, NoteLog
from streamgrok.pipeline.note_retrieval import retrieve
from streamgrok.pipeline.question_kinds import (
    CUES,
    article,
    asked_kinds,
    asks_what_to_do,
    instruction,
    named_things,
    plan_form,
    said_form,
    seen_form,
    words_form,
)

# words that ask about scene changes only when the question names nothing else that changed
# ("when did the person appear" asks about the person)
CHANGE_VERBS = frozenset("change changed changes happen happened events appear appeared appears "
                         "disappear disappeared disappears gone vanish vanished".split())
# topic -> (words in a question that ask about it, tags of the notes that answer it, what to
# say when no note has it)
TOPICS: dict[str, tuple[frozenset[str], frozenset[str], str]] = {
    "speech": (frozenset("say said says saying speak spoke spoken talk talked announcement "
                         "announce announced words voice speech hear heard mention mentioned "
                         "tell told".split()),
               frozenset({"transcript", "speech"}), "no speech was heard"),
    "people": (frozenset("who person people anyone anybody someone man woman men women face "
                         "faces human humans somebody visitor visitors".split()),
               frozenset({"person", "face"}), "no person or face was seen"),
    "cat": (frozenset({"cat", "cats", "kitten", "animal", "animals", "pet"}), frozenset({"cat"}),
            "no cat was seen"),
    "text": (frozenset("text written write writing sign signs read reads caption title "
                       "label word words".split()),
             frozenset({"text"}), "no text was read on screen"),
    "colour": (frozenset({"colour", "color", "colours", "colors", "coloured", "colored"}),
               frozenset({"colour", "motion"}), "no colours were noted"),
    "motion": (frozenset("move moving moved motion direction going travel travelled crossing "
                         "crossed ball object objects left right".split()),
               frozenset({"motion"}), "no moving object was seen"),
    "change": (frozenset("cut cuts scene scenes switch switched".split()) | CHANGE_VERBS,
               frozenset({"cut"}), "no scene change was seen"),
}
# "meaning": what to say of a kind of note the log lacks, in the prompt and as the answer
MISSING = {"cat": "no animal was seen"}
NOT_OBSERVED = {"speech": "I did not hear anyone speak", "people": "I did not see anyone",
                "cat": "I did not see an animal", "text": "I did not see any text",
                "motion": "I did not see anything move", "colour": "I did not see any colours"}
OBSERVED = {"speech": "Yes, I heard someone speak", "people": "Yes, I saw a person",
            "cat": "Yes, I saw an animal", "text": "Yes, I saw text on screen",
            "motion": "Yes, I saw something move", "colour": "Yes, I saw colours"}
# the start of an answer that quotes what was read or said, where that is what is asked
QUOTING = {"text": 'The text on screen read "', "speech": 'I heard: "'}
SELECTIONS = ("meaning", "words")
# the words of a yes/no question that asks only whether something was there
PRESENCE_WORDS = frozenset(
    "was were is are did do does has have had there any a an the on in into at screen "
    "picture view video frame camera seen see saw shown show visible appear appeared "
    "show up come came enter entered walk walked anyone anybody someone somebody anything "
    "something".split())
RECENT = 1  # the latest notes always go in: "what is happening now"
PLURAL = {one: many for _, one, many, _ in COUNTED} | {many: many for _, _, many, _ in COUNTED}
SINGULAR = {many: one for _, one, many, _ in COUNTED}
# what a "when" question's time line calls each topic's notes
TIMED = {"change": "scene cuts", "people": "people or faces came or went",
         "cat": "cats came or went", "text": "text on screen changed",
         "motion": "moving objects noted", "speech": "speech heard"}
YES_NO = re.compile(r"^\s*(was|were|is|are|did|does|do|has|have|had|can|could)\b", re.I)
QUOTE = re.compile(r'^said: "(.*)"( \(unsure of: [^)]*\))?( \(continues\))?$')  # speech_notes
WHO = re.compile(r"^\s*who\b", re.I)
HOW_MANY = re.compile(r"\bhow many\b", re.I)
WHEN = re.compile(r"^\s*(when|at what time|what time)\b|\bhow long\b", re.I)
WHEN_ASKED = re.compile(r"^\s*(when|(at )?what (time|moment|point|second))\b|\bhow long\b",
                        re.I)  # "meaning": any way of asking for a time
IN_VIEW = re.compile(r"\d+ (" + "|".join(sorted(PLURAL, key=len, reverse=True)) + r") "
                     r"(?:appeared|left) \((\d+|none) in view\)")  # observers.count_change


def topics_of(question: str) -> list[str]:
    asked = set(WORD.findall(question.lower()))
    found = [name for name, (cues, _, _) in TOPICS.items() if asked & cues]
    if found != ["change"] and not asked & (TOPICS["change"][0] - CHANGE_VERBS):
        found = [name for name in found if name != "change"]
    return found


def relevant_notes(question: str, log: NoteLog, limit: int = 6) -> list[LoggedNote]:
    """The notes that bear on `question`: by topic and shared words (the latest one when
    none does, the recent story for what happened); the most relevant last, next to the
    question (a small model answers from what is nearest), equally relevant ones in stream
    order. A note is shown with only its events that answer best among those on the same
    topic: for "which way did the blue object move" the blue object's motion, not the yellow
    one's in the same note."""
    topics = topics_of(question)
    notes = list(log.notes)
    shown = best_events(question, topics, log)
    score = {i: value for i, (value, _) in shown.items()}
    ranked = sorted(score, key=lambda i: (-score[i], -i))
    chosen = set(ranked[:limit])
    if not topics or "change" in topics:  # "what happened?": the whole recent story
        chosen |= set(range(max(0, len(notes) - limit), len(notes)))
    if not chosen:  # nothing bears on it: what is happening now (a note on another topic
        # would only distract from the ones that answer)
        chosen |= set(range(max(0, len(notes) - RECENT), len(notes)))
    kept = sorted(chosen)[-limit * 2:]
    return [replace(notes[i], events=shown[i][1]) if i in shown else notes[i]
            for i in sorted(kept, key=lambda i: (score.get(i, 0.0), i))]


def best_events(question: str, topics: list[str],
                log: NoteLog) -> dict[int, tuple[float, tuple[Event, ...]]]:
    """For each note with an event that bears on `question` (on an asked topic: 2, plus a
    point a shared word): its best score and the events it keeps, those that score the most
    among the events on the same asked topics (off every asked topic: the most of all)."""
    asked = log.words(question)
    wanted = set().union(*(TOPICS[t][1] for t in topics))
    scored = []
    for index, note in enumerate(log.notes):
        for event in note.events:
            on_topic = event.tags & wanted
            value = 2.0 * bool(on_topic) + len(asked & event.words)
            if value > 0:
                scored.append((index, event, value, on_topic))
    best: dict[frozenset[str], float] = {}
    for _, _, value, group in scored:
        best[group] = max(best.get(group, 0.0), value)
    if best:
        best[frozenset()] = max(best.values())
    shown: dict[int, tuple[float, tuple[Event, ...]]] = {}
    for index, event, value, group in scored:
        if value >= best[group]:
            top, events = shown.get(index, (0.0, ()))
            shown[index] = (max(top, value), (*events, event))
    return shown


@dataclass(frozen=True)
class Reading:
    """What the "meaning" selection finds for a question, once: the kinds of note it asks
    about, the things it names that no note mentions, the times a "when" question gets,
    and its notes, the most relevant last (before sentences said together are joined)."""

    kinds: list[str]
    unseen: list[str]
    times: str | None
    found: list[LoggedNote]


def read_question(question: str, log: NoteLog) -> Reading:
    """The question's `Reading` against `log` (see `note_retrieval.retrieve`); a prompt and
    a stem built from one reading search the log once."""
    kinds = asked_kinds(question)
    times = None if said_form(question) else timeline(question, kinds, log, WHEN_ASKED)
    asked = set(WORD.findall(question.lower()))
    pick = ("first" if "first" in asked else "last" if "last" in asked else None) \
        if times else None
    found = retrieve(question, kinds, log, story_told=times is not None, pick=pick,
                     quotes_first=not WHEN_ASKED.search(question))
    return Reading(kinds, unseen_things(question, kinds, log), times, found)


def answer_stem(question: str, log: NoteLog, selection: str = "meaning",
                reading: Reading | None = None) -> str:
    """How the answer must begin, where the notes decide it. "words" (the old selection):
    "No" for a yes/no or how-many question about something the observers never noted (a
    person, a cat, text, motion, speech); for "who", "A person" or "No one" as a person or
    face was noted or not (observers see that someone is there, never who: a name can only
    come from what was said); else nothing. "meaning" also says what was not seen or heard:
    "I did not see a dog" for a thing named that no note mentions, "I did not hear anyone
    speak" for a kind of note asked about that the log lacks ("No, " first for a yes/no
    question), "Yes, I saw a person" for a yes/no question only about whether something of a
    noted kind was there; and it opens a quote for what a sign read or someone said, where
    that is what is asked. The model words the rest. A small model otherwise answers "a cat
    was seen" beside "never: no cat was seen", names someone it made up, or writes a sentence
    about the display instead of what it read. `reading`: the question's, when already
    read."""
    if selection == "words":
        topics = [t for t in topics_of(question) if t in TIMED and t != "change"]
        if WHO.search(question) and "people" in topics:
            return "A person" if noted("people", log) else "No one"
        if not topics or any(noted(t, log) for t in topics):
            return ""
        return "No" if YES_NO.search(question) or HOW_MANY.search(question) else ""
    yes_no = "No, " if YES_NO.search(question) else "None: " if HOW_MANY.search(question) \
        else ""
    reading = reading or read_question(question, log)
    if reading.unseen:
        return f"{yes_no}I did not see {article(reading.unseen[0])}"
    kinds = [k for k in reading.kinds if k in TIMED and k != "change"]
    if not kinds:
        return ""
    if WHO.search(question) and kinds[0] == "people":
        return "A person" if noted("people", log) else "No one"
    if plan_form(question) and not yes_no:  # said or posted: quoted, whichever was noted
        told = instruction_heard(question, reading.found)
        if told:  # asked what to do, and told: the instruction itself
            return f'{QUOTING["speech"]}{told}"'
        found = [k for k in kinds if k in QUOTING and noted(k, log)]
        if found:
            return QUOTING[found[0]]
    if not noted(kinds[0], log):
        return yes_no + NOT_OBSERVED[kinds[0]]
    if yes_no:
        return OBSERVED[kinds[0]] if only_presence(question, kinds[0]) else ""
    if WHEN_ASKED.search(question):
        return ""
    if kinds[0] == "text":  # the words on screen, quoted: not a sentence about the display
        return QUOTING["text"]
    return QUOTING["speech"] if kinds[0] == "speech" and words_form(question) else ""


def instruction_heard(question: str, found: list[LoggedNote]) -> str | None:
    """For a question asking what to do, the instruction that answers it, when the note
    that bears on it most (the last of `found`) is one ("please take the stairs on the
    left."); else None. The 135M model, given only the opening of a quote, sometimes writes
    one of its own."""
    if not asks_what_to_do(question) or WHEN_ASKED.search(question):
        return None
    best = found[-1:]
    if not best or "transcript" not in best[0].tags:
        return None
    quote = QUOTE.match(best[0].shown)
    return quote.group(1) if quote and instruction(quote.group(1)) else None


def unseen_things(question: str, kinds: list[str], log: NoteLog) -> list[str]:
    """The objects and animals a question about what was seen names that no note mentions
    (not for a question about a display's or a speaker's words, "where do trains leave,
    per the sign?", nor one that does not ask what was seen: "how late is the bus?")."""
    if "text" in kinds or "speech" in kinds or not (seen_form(question) or kinds):
        return []
    return [thing for thing in named_things(question) if not mentioned(thing, log)]


def only_presence(question: str, kind: str) -> bool:
    """Whether a yes/no question asks only whether something of `kind` was there ("was
    there a person on screen?", not "did anyone speak about the weather?")."""
    words = set(WORD.findall(question.lower())) - PRESENCE_WORDS - CUES[kind]
    return not words


def mentioned(thing: str, log: NoteLog) -> bool:
    """Whether any note's words include `thing` (stemmed: "dogs" matches "dog")."""
    stems = log.words(thing)
    return any(stems & event.words for note in log.notes for event in note.events)


def noted(topic: str, log: NoteLog) -> bool:
    """Whether any note of the log is on `topic`."""
    return any(n.tags & TOPICS[topic][1] for n in log.notes)


def timeline(question: str, topics: list[str], log: NoteLog,
             when: re.Pattern = WHEN) -> str | None:
    """For a "when" question (as `when` finds them): the times of the notes on what it asks
    about, first to last (only the first or the last where the question asks for it)."""
    if not when.search(question):
        return None
    asked = set(WORD.findall(question.lower()))
    parts = []
    for topic in topics:
        if topic not in TIMED:
            continue
        times = sorted({round(n.pts) for n in log.notes if n.tags & TOPICS[topic][1]})
        if not times:
            continue
        if "first" in asked or "last" in asked:
            which = "first" if "first" in asked else "last"
            at = times[0] if which == "first" else times[-1]
            parts.append(f"the {which} of the {TIMED[topic]} at {at} seconds")
            continue
        when = ", ".join(str(t) for t in times[:8])
        first = f" (first at {times[0]} seconds)" if len(times) > 1 else ""
        parts.append(f"{TIMED[topic]} at {when} seconds{first}")
    return "; ".join(parts) or None


def grounded_prompt(question: str, log: NoteLog, room: int | None = None,
                    count: Callable[[str], int] | None = None,
                    selection: str = "meaning", instructions: str = "",
                    reading: Reading | None = None) -> str:
    """The question with the notes it should be answered from, and what was not observed.
    `selection` "meaning" picks notes by the kinds the question asks about, BM25 and
    recency (`note_retrieval`); "words" by shared word stems and topic words (the old
    way, kept as the benchmark's baseline). `instructions` (a client's standing ones) lead
    the prompt. With `room` (tokens, as `count` measures text)
    the least relevant chosen notes are left out until the prompt fits, and the bare
    question goes when nothing else does (it is never cut). `reading`: the question's,
    when already read."""
    if selection == "words":
        topics = topics_of(question)
        notes = join_speech(relevant_notes(question, log))
        missing = [TOPICS[t][2] for t in topics if not noted(t, log)]
        times = timeline(question, topics, log)
        form = _answer_form(question, topics)
    else:
        reading = reading or read_question(question, log)
        topics, times = reading.kinds, reading.times
        notes = join_speech(reading.found)
        form = _answer_form(question, topics, quote_text=True)
        missing = [MISSING.get(t, TOPICS[t][2]) for t in topics if not noted(t, log)]
        if plan_form(question) and len(missing) < 2:  # said or posted: one is enough
            missing = []
        missing += [f"no {thing} was seen" for thing in reading.unseen]
    totals = counts(log, topics) if HOW_MANY.search(question) else None
    ask = f"Using only these notes, answer in {form}: {question}"
    # a plan's or a schedule's notes without their times: a small model asked when the
    # store closes answers with the time the sentence was heard
    timed = selection == "words" or not plan_form(question)
    lead = f"Instructions: {instructions}\n" if instructions else ""
    prompt = lead + _layout(ask, notes, missing, totals, times, timed)
    if room is None or count is None:
        return prompt
    while notes and count(prompt) > room:  # the least relevant go first
        notes = notes[1:]
        prompt = lead + _layout(ask, notes, missing, totals, times, timed)
    return prompt if count(prompt) <= room else question


def join_speech(notes: list[LoggedNote], gap_s: float = 4.0) -> list[LoggedNote]:
    """Sentences said one after another (adjacent here, in stream order, at most `gap_s`
    apart) as one quote: asked what was said, a small model quotes one line, not two."""
    joined: list[LoggedNote] = []
    for note in notes:
        before = joined[-1] if joined else None
        first = QUOTE.match(before.shown) if before else None
        second = QUOTE.match(note.shown) if "transcript" in note.tags else None
        if first and second and "transcript" in before.tags and not first.group(3) \
                and 0 <= note.pts - before.pts <= gap_s:
            doubts = [m.group(2)[len(" (unsure of: "):-1] for m in (first, second) if m.group(2)]
            doubt = f" (unsure of: {', '.join(doubts)})" if doubts else ""
            text = f'said: "{first.group(1)} {second.group(1)}"{doubt}{second.group(3) or ""}'
            joined[-1] = replace(before, text=text, events=(Event(text, before.tags),))
        else:
            joined.append(note)
    return joined


def _answer_form(question: str, topics: list[str], quote_text: bool = False) -> str:
    """What the answer should be: a short sentence, quoting the words for what was said
    (and with `quote_text`, the text for what was on screen), from the words said for a
    plan or instruction, with the number for how many."""
    if "speech" in topics and "text" not in topics and not WHEN.search(question):
        return "one short sentence that quotes the words said"  # not a caption's words
    if quote_text and topics[:1] == ["text"] and not WHEN_ASKED.search(question):
        return "one short sentence that quotes the text on screen"
    if plan_form(question):  # "when does the meeting start?": not when it was said
        return "one short sentence with what was said or shown about it"
    if said_form(question):
        return "one short sentence with what was said about it"
    if HOW_MANY.search(question):
        return "one short sentence with the number"
    return "one short sentence"


def _layout(ask: str, notes: list[LoggedNote], missing: list[str],
            totals: str | None, times: str | None = None, timed: bool = True) -> str:
    lines = ["Notes (time, what was seen or heard):"]
    lines += [note.line(timed) for note in notes] or ["- nothing seen or heard yet"]
    if missing:
        lines.append("- never: " + "; ".join(missing))
    if totals:
        lines.append("- in all: " + totals)
    if times:
        lines.append("- times: " + times)
    lines.append("")
    lines.append(ask)
    return "\n".join(lines)


def counts(log: NoteLog, topics: list[str] | tuple[str, ...] = ()) -> str:
    """What the log adds up to: cuts, moving objects, sentences, the most in view at once;
    only those on `topics` when any of them is counted (a small model asked how many people
    picks another total's number when it sits beside)."""
    most: dict[str, int] = {}
    for note in log.notes:
        for kind, now in IN_VIEW.findall(note.text):
            kind = PLURAL[kind]
            most[kind] = max(most.get(kind, 0), 0 if now == "none" else int(now))
    cuts = sum("cut" in note.tags for note in log.notes)
    movers = sum(note.text.count("object appeared") for note in log.notes)
    said = sum("transcript" in note.tags for note in log.notes)
    parts = [("change", f"{cuts} scene cut{'s' if cuts != 1 else ''}"),
             ("motion", f"{movers} moving object{'s' if movers != 1 else ''} appeared"),
             ("speech", f"{said} sentence{'s' if said != 1 else ''} said")]
    parts += [("cat" if kind == "cat faces" else "people",
               f"at most {n} {SINGULAR.get(kind, kind) if n == 1 else kind} in view at once")
              for kind, n in sorted(most.items())]
    asked = [text for topic, text in parts if topic in topics]
    for topic, nobody in (("people", "no person or face"), ("cat", "no cat face")):
        if topic in topics and not any(t == topic for t, _ in parts):
            asked.append(f"{nobody} in view at any time")
    return "; ".join(asked or [text for _, text in parts])
