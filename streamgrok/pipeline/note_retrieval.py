"""Which notes a question sees, by the kind of note it asks about, BM25 and recency.

Each event of each note is a document of its stemmed content words; a question's BM25 score
against them (`bm25s`, Lucene's weighting: a word in every note still counts a little) finds
the notes that share its rarer words, and the question's kinds (`question_kinds`) find the
notes that answer it in other words. Where its words reach nothing of the first kind it asks
about that the log has, the latest notes of that kind go in; where they reach nothing at all
and no note is of a kind it asks about, the latest note of every kind, so a question whose
words and form both miss its note ("what is going on?") still sees what was last said,
read, seen come and go, and moving.
"""

from __future__ import annotations

from dataclasses import replace

import bm25s

from streamgrok.pipeline.note_log import Event, LoggedNote, NoteLog
from streamgrok.pipeline.question_kinds import asks_what_to_do, instruction

KIND_TAGS = {"speech": frozenset({"transcript", "speech"}),
             "people": frozenset({"person", "face"}), "cat": frozenset({"cat"}),
             "text": frozenset({"text"}), "colour": frozenset({"colour", "motion"}),
             "motion": frozenset({"motion"}), "change": frozenset({"cut"})}
LATEST_PER_KIND = 2  # of an asked kind: the latest notes, even with no word in common
ON_KIND = 2.0  # an event of an asked kind scores this, plus its BM25 score scaled to 0-2
QUOTED = 1.0  # what a quote adds, where the words are asked for
INSTRUCTED = 1.0  # what an instruction adds for a question asking what to do
NEAR = 0.5  # notes scoring within this of the best are shown (a shorter note's BM25 is higher)


def retrieve(question: str, kinds: list[str], log: NoteLog, limit: int = 6,
             story_told: bool = False, pick: str | None = None,
             quotes_first: bool = False) -> list[LoggedNote]:
    """The notes `question` is answered from, the most relevant last (a small model answers
    from what is nearest the question), equally relevant ones in stream order.

    - The best `limit` by kind and BM25 that score within `NEAR` of the best, each showing
      only its best events among those of the asked kinds.
    - Where the question's words reach no note of the first kind it asks about that the
      log has, the latest `LATEST_PER_KIND` notes of that kind (those that quote what was
      said or read, where the kind has them).
    - Where they reach no note at all and no note is of an asked kind, the latest note of
      every kind (each showing its events of that kind).
    - With no kind asked and no word found (or "what happened", unless `story_told`: the
      times are given), the recent story.

    With `quotes_first` an event that quotes what was said or read outranks one of the same
    kind that does not ("the text on screen is gone"). With `pick` "first" or "last" ("when
    was the first cut?") only the first (last) note of each asked kind is kept among those
    of that kind: a small model asked for the first of several answers with the nearest."""
    notes = list(log.notes)
    if not notes:
        return []
    wanted = frozenset().union(*(KIND_TAGS[k] for k in kinds))
    scored = _score_events(question, wanted, log, quotes_first)
    by_note: dict[int, list[tuple[Event, float]]] = {}
    for index, event, value, _ in scored:
        if value > 0:
            by_note.setdefault(index, []).append((event, value))
    score = {i: max(v for _, v in events) for i, events in by_note.items()}
    shown = {i: _best_events(events, wanted) for i, events in by_note.items()}
    top = max(score.values(), default=0.0)
    chosen = [i for i in sorted(score, key=lambda i: (-score[i], -i))[:limit]
              if score[i] >= top - NEAR]
    reached = {tag for _, event, _, hit in scored if hit for tag in event.tags}
    recent: dict[int, frozenset[str]] = {}
    for kind in kinds:  # the first asked kind the log has: "said or posted" is said first
        on_kind = [i for i, n in enumerate(notes) if n.tags & KIND_TAGS[kind]]
        if not on_kind:
            continue
        if not reached & KIND_TAGS[kind]:
            quoting = [i for i in on_kind if '"' in notes[i].text]  # what was said or read
            for i in (quoting or on_kind)[-LATEST_PER_KIND:]:
                recent[i] = KIND_TAGS[kind]
        break
    if not reached and not recent:  # nothing found by word or kind: the latest of each
        for tags in KIND_TAGS.values():
            last = [i for i, n in enumerate(notes) if n.tags & tags][-1:]
            for i in last:
                recent[i] = recent.get(i, frozenset()) | tags
    for i, tags in recent.items():
        if i not in shown:
            shown[i] = tuple(e for e in notes[i].events if e.tags & tags) or notes[i].events
    chosen = set(chosen) | set(recent)
    if (not kinds and not reached) or ("change" in kinds and not story_told):  # "what happened?"
        chosen |= set(range(max(0, len(notes) - limit), len(notes)))
    if pick is not None:
        for kind in kinds:
            of_kind = [i for i, n in enumerate(notes) if n.tags & KIND_TAGS[kind]]
            if of_kind:
                keep = of_kind[0] if pick == "first" else of_kind[-1]
                chosen = (chosen - set(of_kind)) | {keep}
    kept = sorted(chosen, key=lambda i: (score.get(i, 0.0), i))[-limit * 2:]
    return [replace(notes[i], events=shown[i]) if i in shown else notes[i] for i in kept]


def _best_events(events: list[tuple[Event, float]], wanted: frozenset[str]) -> tuple[Event, ...]:
    """A note's events that answer best: of its events of the asked kinds, those that score
    its best among them ("which way did the blue object move": the blue object's motion,
    not the yellow one's in the same note); with none of those, its best events of all."""
    on_kind = [(e, v) for e, v in events if e.tags & wanted] or events
    top = max(v for _, v in on_kind)
    return tuple(e for e, v in on_kind if v >= top)


def _score_events(question: str, wanted: frozenset[str], log: NoteLog,
                  quotes_first: bool = False) -> list[tuple[int, Event, float, bool]]:
    """(note index, event, score, whether the question's words reach it) for every event:
    `ON_KIND` for an asked kind plus its BM25 score against the question, scaled so the best
    event's is 2, plus `INSTRUCTED` for a sentence that says what to do where the question
    asks it ("where should visitors go?": "please take the stairs on the left"), plus
    `QUOTED` for an event of an asked kind that quotes words, with `quotes_first`."""
    events = [(i, event) for i, note in enumerate(log.notes) for event in note.events]
    asked = sorted(log.words(question))
    bm25 = [0.0] * len(events)
    if asked and events:
        index = bm25s.BM25(method="lucene")
        index.index([sorted(event.words) or ["-"] for _, event in events], show_progress=False)
        bm25 = [float(v) for v in index.get_scores(asked)]
    top = max(bm25, default=0.0)
    to_do = asks_what_to_do(question)
    return [(i, event, ON_KIND * bool(event.tags & wanted) + (2.0 * b / top if top > 0 else 0)
             + INSTRUCTED * (to_do and "transcript" in event.tags and instruction(event.text))
             + QUOTED * (quotes_first and bool(event.tags & wanted) and '"' in event.text),
             b > 0) for (i, event), b in zip(events, bm25)]
