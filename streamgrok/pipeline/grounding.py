"""Grounded questions: the notes that bear on a question are restated beside it.

A small model answers from what sits next to the question far better than from notes spread
over thousands of tokens of context. `NoteLog` keeps a session's notes (bounded: the oldest
go first); `grounded_prompt` picks the notes that share words or a topic with the question
(what was said, who was seen, text, colours, motion, cuts), or the latest one when none does,
the most relevant nearest the question, adds the times of what a "when" question asks about and the
totals a "how many" question needs, and says plainly when nothing was seen or heard of what
the question asks, so the model has a true answer to give instead of an invented one.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import NamedTuple

import snowballstemmer

from streamgrok.media.items import Note
from streamgrok.media.observers import COUNTED

WORD = re.compile(r"[a-z0-9]+")
STOP = frozenset(
    "a an the is are was were be been to of in on at and or what who whom which when where "
    "why how did do does has have had it its this that there any anything someone somebody "
    "so far you i me my we us our your please tell about from with for as by now yet ever "
    "see seen saw hear heard can could would should".split())

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
RECENT = 1  # the latest notes always go in: "what is happening now"
PLURAL = {one: many for _, one, many, _ in COUNTED} | {many: many for _, _, many, _ in COUNTED}
SINGULAR = {many: one for _, one, many, _ in COUNTED}
# what a "when" question's time line calls each topic's notes
TIMED = {"change": "scene cuts", "people": "people or faces came or went",
         "cat": "cats came or went", "text": "text on screen changed",
         "motion": "moving objects noted", "speech": "speech heard"}
SYNONYMS = {"vanish": "gone", "disappear": "gone", "came": "appear", "arriv": "appear"}  # stems
YES_NO = re.compile(r"^\s*(was|were|is|are|did|does|do|has|have|had|can|could)\b", re.I)
QUOTE = re.compile(r'^said: "(.*)"( \(continues\))?$')  # audio.speech_notes
WHO = re.compile(r"^\s*who\b", re.I)
HOW_MANY = re.compile(r"\bhow many\b", re.I)
WHEN = re.compile(r"^\s*(when|at what time|what time)\b|\bhow long\b", re.I)
IN_VIEW = re.compile(r"\d+ (" + "|".join(sorted(PLURAL, key=len, reverse=True)) + r") "
                     r"(?:appeared|left) \((\d+|none) in view\)")  # observers.count_change


class Event(NamedTuple):
    """One thing a note says happened."""

    text: str
    tags: frozenset[str]  # what it is about
    words: frozenset[str] = frozenset()  # its content words, stemmed once when logged


@dataclass(frozen=True)
class LoggedNote:
    text: str
    pts: float
    tags: frozenset[str]
    events: tuple[Event, ...]  # the note's parts; a prompt may show only some

    @property
    def shown(self) -> str:
        """The text of the events it shows."""
        return "; ".join(event.text for event in self.events)

    def line(self) -> str:
        return f"- at {self.pts:.0f} seconds: {self.shown}"


class NoteLog:
    """A session's notes in stream order; the oldest leave past `capacity`."""

    def __init__(self, capacity: int = 2000) -> None:
        self.notes: deque[LoggedNote] = deque(maxlen=capacity)
        self._stemmer = snowballstemmer.stemmer("english")

    def add(self, note: Note) -> None:
        tags = frozenset(note.tags)
        events = tuple(note.events) or ((note.text, tags),)
        self.notes.append(LoggedNote(note.text, note.pts, tags, tuple(
            Event(text, frozenset(about), frozenset(self.words(text)))
            for text, about in events)))

    def words(self, text: str) -> set[str]:
        """The content words of `text`, stemmed ("moving" and "move" are one word)."""
        stems = self._stemmer.stemWords([w for w in WORD.findall(text.lower())
                                         if w not in STOP])
        return {SYNONYMS.get(stem, stem) for stem in stems}


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


def answer_stem(question: str, log: NoteLog) -> str:
    """How the answer must begin, where the notes decide it: "No" for a yes/no or how-many
    question about something the observers never noted (a person, a cat, text, motion,
    speech); for "who", "A person" or "No one" as a person or face was noted or not
    (observers see that someone is there, never who: a name can only come from what was
    said); else nothing. The model words the rest. A small model otherwise answers "a cat
    was seen" beside "never: no cat was seen", or names someone it made up."""
    topics = [t for t in topics_of(question) if t in TIMED and t != "change"]
    if WHO.search(question) and "people" in topics:
        return "A person" if noted("people", log) else "No one"
    if not topics or any(noted(t, log) for t in topics):
        return ""
    return "No" if YES_NO.search(question) or HOW_MANY.search(question) else ""


def noted(topic: str, log: NoteLog) -> bool:
    """Whether any note of the log is on `topic`."""
    return any(n.tags & TOPICS[topic][1] for n in log.notes)


def timeline(question: str, log: NoteLog) -> str | None:
    """For a "when" question: the times of the notes on what it asks about, first to last."""
    if not WHEN.search(question):
        return None
    parts = []
    for topic in topics_of(question):
        if topic not in TIMED:
            continue
        times = sorted({round(n.pts) for n in log.notes if n.tags & TOPICS[topic][1]})
        if times:
            when = ", ".join(str(t) for t in times[:8])
            first = f" (first at {times[0]} seconds)" if len(times) > 1 else ""
            parts.append(f"{TIMED[topic]} at {when} seconds{first}")
    return "; ".join(parts) or None


def grounded_prompt(question: str, log: NoteLog, room: int | None = None,
                    count: Callable[[str], int] | None = None) -> str:
    """The question with the notes it should be answered from, and what was not observed.
    With `room` (tokens, as `count` measures text) the oldest chosen notes are left out
    until the prompt fits, and the bare question goes when nothing else does (it is never
    cut)."""
    notes = join_speech(relevant_notes(question, log))
    topics = topics_of(question)
    missing = [TOPICS[t][2] for t in topics if not noted(t, log)]
    totals = counts(log, topics) if HOW_MANY.search(question) else None
    times = timeline(question, log)
    ask = f"Using only these notes, answer in {_answer_form(question)}: {question}"
    prompt = _layout(ask, notes, missing, totals, times)
    if room is None or count is None:
        return prompt
    while notes and count(prompt) > room:  # the least relevant go first
        notes = notes[1:]
        prompt = _layout(ask, notes, missing, totals, times)
    return prompt if count(prompt) <= room else question


def join_speech(notes: list[LoggedNote], gap_s: float = 4.0) -> list[LoggedNote]:
    """Sentences said one after another (adjacent here, in stream order, at most `gap_s`
    apart) as one quote: asked what was said, a small model quotes one line, not two."""
    joined: list[LoggedNote] = []
    for note in notes:
        before = joined[-1] if joined else None
        first = QUOTE.match(before.shown) if before else None
        second = QUOTE.match(note.shown) if "transcript" in note.tags else None
        if first and second and "transcript" in before.tags and not first.group(2) \
                and 0 <= note.pts - before.pts <= gap_s:
            text = f'said: "{first.group(1)} {second.group(1)}"{second.group(2) or ""}'
            joined[-1] = replace(before, text=text, events=(Event(text, before.tags),))
        else:
            joined.append(note)
    return joined


def _answer_form(question: str) -> str:
    """What the answer should be: a short sentence, quoting the words for what was said,
    with the number for how many."""
    asked = topics_of(question)
    if "speech" in asked and "text" not in asked and not WHEN.search(question):
        return "one short sentence that quotes the words said"  # not a caption's words
    if HOW_MANY.search(question):
        return "one short sentence with the number"
    return "one short sentence"


def _layout(ask: str, notes: list[LoggedNote], missing: list[str],
            totals: str | None, times: str | None = None) -> str:
    lines = ["Notes (time, what was seen or heard):"]
    lines += [note.line() for note in notes] or ["- nothing seen or heard yet"]
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
