"""`streamgrok bench grounding`: does the assistant report truthfully what it heard and saw?

Clips with known events are generated here (espeak-ng speech in several voices, a person
entering and leaving, hard cuts, coloured objects crossing, captions), each is streamed
through the default pipeline, and questions with expected facts are asked when it ends. An
answer scores when it contains every expected fact (any of each fact's spellings). Presence
questions are also checked for invented names: a capitalised word in the answer that is in
neither the question nor any note.

Three configurations run in the same process on the same clips: the current default
(Whisper base, grounded questions answered over the system prompt and their notes, the
current system prompt), the same answered over the session's stream (`answer_context`
"stream": what the default was before), and the baseline (the old recogniser, pocketsphinx,
with questions asked bare over the stream under the old system prompt). All use the same
observers, which this benchmark cannot switch back.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from streamgrok.cache.config import CacheConfig
from streamgrok.engine import Engine
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.media.samples import Scene, write_clip
from streamgrok.model.loader import LoadedModel
from streamgrok.pipeline.events import DoneEvent, NoteEvent
from streamgrok.pipeline.loader import load_pipeline
from streamgrok.pipeline.pipeline import PipelineRunner
from streamgrok.pipeline.resources import SharedResources
from streamgrok.pipeline.triggers import At

OLD_SYSTEM = (
    "You are a helpful assistant watching a live video. Notes about what the camera sees and "
    "hears arrive with timestamps [mm:ss]. Answer briefly, from the notes."
)
CATEGORIES = ("speech", "presence", "change", "colour/motion", "text", "counting")
DENIALS = ("did not see", "didn't see", "did not hear", "didn't hear", "not seen", "was not",
           "wasn't", "were not", "weren't", "there was no", "there were no", "no person",
           "no one was", "nobody", "no cat", "no text", "no face", "not shown", "none")


@dataclass(frozen=True)
class Question:
    text: str
    category: str
    facts: tuple[tuple[str, ...], ...] = ()  # every fact must appear, in any spelling
    absent: bool = False  # the right answer is that it was not there

    def score(self, answer: str) -> bool:
        """Every fact is in the answer as whole words ("no" is not in "know"); for what was
        absent the answer must deny it (start with "No", or say it was not seen)."""
        said = f" {normalise(answer)} "
        if self.absent:
            return said.split()[:1] == ["no"] or any(f" {d} " in said for d in DENIALS)
        said = said.replace(" no one ", " nobody ")  # not the number one
        return all(any(f" {normalise(s)} " in said for s in fact) for fact in self.facts)


@dataclass(frozen=True)
class Clip:
    name: str
    scenes: list[Scene]
    questions: list[Question]


def normalise(text: str) -> str:
    """Lower case, words and times only, single spaces ("didn't" stays one word)."""
    return " ".join(re.sub(r"[^a-z0-9:']+", " ", text.lower().replace("\u2019", "'")).split())


def clips() -> list[Clip]:
    """The clips and their questions (the events are known because they are drawn here)."""
    grey = (None,)
    return [
        Clip("announcement", [
            Scene(*grey, 2.0),
            Scene(*grey, 6.0, speech="Attention please. The delivery truck arrives at gate "
                  "seven.", voice="en-us", speed=150),
            Scene("coffee", 4.0, caption="GATE 7"),
        ], [
            Question("What did the announcement say?", "speech",
                     (("truck",), ("gate",))),
            Question("Which gate does the truck arrive at?", "speech", (("7", "seven"),)),
            Question("What text was shown on screen?", "text", (("gate",),)),
            Question("Was there a person on screen?", "presence", absent=True),
            Question("When did the scene change?", "change", (("00:08", "8 s", "8 seconds"),)),
        ]),
        Clip("visitor", [
            Scene("coffee", 4.0),
            Scene(*grey, 8.0, person_from=2.0, person_until=6.0,
                  speech="Good morning. My name is Oliver.", speech_at=2.5, voice="en+m3",
                  speed=140),
        ], [
            Question("Who appeared on screen?", "presence", (("person", "face", "man",
                                                              "someone", "oliver"),)),
            Question("What name did the speaker say?", "speech", (("oliver",),)),
            Question("When did the person appear?", "change",
                     (("00:06", "00:07", "6 seconds", "7 seconds"),)),
            Question("How many people were in view at most?", "counting", (("1", "one"),)),
            Question("Was a cat seen?", "presence", absent=True),
        ]),
        Clip("cuts", [
            Scene("astronaut", 4.0),
            Scene("coffee", 4.0),
            Scene("rocket", 4.0, speech="This is the third scene.", voice="en+f3", speed=170),
        ], [
            Question("How many scene cuts were there?", "counting", (("2", "two"),)),
            Question("When was the first scene cut?", "change", (("00:04", "4 seconds"),)),
            Question("What did the voice say?", "speech", (("third",), ("scene",))),
            Question("What colours were seen?", "colour/motion",
                     (("grey", "brown", "beige", "white", "black", "orange", "blue"),)),
            Question("Was any text shown on screen?", "text", absent=True),
        ]),
        Clip("ball", [
            Scene(*grey, 6.0, moving_square=True, mover_colour=(40, 80, 200),
                  mover_direction="right to left"),
            Scene(*grey, 6.0, moving_square=True, mover_colour=(230, 210, 40),
                  mover_direction="left to right", speech="Watch the yellow one.",
                  voice="en", speed=160),
        ], [
            Question("What colour was the first moving object?", "colour/motion",
                     (("blue",),)),
            Question("Which way did the blue object move?", "colour/motion",
                     (("right to left", "to the left", "leftwards"),)),
            Question("Which way did the yellow object move?", "colour/motion",
                     (("left to right", "to the right", "rightwards"),)),
            Question("How many moving objects appeared?", "counting", (("2", "two"),)),
            Question("What did the speaker say?", "speech", (("yellow",),)),
        ]),
        Clip("shop", [
            Scene("astronaut", 4.0, caption="OPEN 24 HOURS"),
            Scene(*grey, 7.0, speech="The store closes at nine tonight. Please come back "
                  "tomorrow.", voice="en-gb", speed=180),
        ], [
            Question("What did the sign say?", "text", (("open",), ("24", "hours"))),
            Question("When does the store close?", "speech", (("nine", "9"),)),
            Question("Who was on screen at the start?", "presence",
                     (("person", "face", "man", "someone", "astronaut"),)),
            Question("How many faces were seen?", "counting", (("1", "one"),)),
            Question("When did the sign disappear?", "change", (("00:04", "4 seconds"),)),
        ]),
    ]


@dataclass
class Outcome:
    clip: str
    question: Question
    answer: str
    correct: bool
    invented: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Config:
    label: str
    speech_model: str
    grounded: bool
    system_prompt: str | None  # None: the pipeline's own
    answer_context: str | None = None  # None: the pipeline's own


def run_grounding_bench(loaded: LoadedModel, pipeline_path: str = "pipelines/live_qa.py",
                        cache: CacheConfig | None = None, out: str = "bench-results",
                        only: str | None = None) -> dict:
    configs = [Config("baseline (pocketsphinx, bare questions, old prompt)", "pocketsphinx",
                      False, OLD_SYSTEM),
               Config("current (Whisper base, grounded questions)", "base", True, None),
               Config("stream (the same, answered over the stream)", "base", True, None,
                      "stream")]
    chosen = [c for c in clips() if only is None or c.name in only.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {c.name: write_clip(Path(tmp) / f"{c.name}.mp4", c.scenes, fps=10)
                 for c in chosen}
        for config in configs:
            started = time.perf_counter()
            outcomes = asyncio.run(_run_config(loaded, pipeline_path, config, chosen, paths,
                                               cache or CacheConfig()))
            results[config.label] = outcomes
            print(f"{config.label}: {len(outcomes)} questions in "
                  f"{time.perf_counter() - started:.0f} s")
    summary = _print_table(results)
    _print_answers(results)
    _plot(summary, Path(out))
    return summary


async def _run_config(loaded: LoadedModel, pipeline_path: str, config: Config,
                      chosen: list[Clip], paths: dict[str, Path],
                      cache: CacheConfig) -> list[Outcome]:
    outcomes = []
    resources = SharedResources(NativeMediaPool(workers=1))
    try:
        async with Engine(loaded, cache) as engine:
            for clip in chosen:
                options = {"speech_model": config.speech_model,
                           "hidden_size": loaded.config.hidden_size}
                pipeline = load_pipeline(pipeline_path, options, resources)
                pipeline = replace(pipeline, grounded=config.grounded,
                                   system_prompt=config.system_prompt or pipeline.system_prompt,
                                   answer_context=config.answer_context
                                   or pipeline.answer_context)
                sink = _Collect()
                runner = PipelineRunner(pipeline, engine, [sink], resources=resources)
                asks = [At(q.text, seconds=float("inf")) for q in clip.questions]
                await runner.run(str(paths[clip.name]), asks)
                for question in clip.questions:
                    answer = sink.answers.get(question.text, "")
                    invented = (invented_names(answer, question.text, sink.notes)
                                if question.category == "presence" else [])
                    outcomes.append(Outcome(clip.name, question, answer,
                                            question.score(answer) and not invented,
                                            invented))
    finally:
        resources.close()
    return outcomes


class _Collect:
    def __init__(self) -> None:
        self.answers: dict[str, str] = {}
        self.notes: list[str] = []

    async def send(self, event) -> None:
        if isinstance(event, DoneEvent):
            self.answers[event.question] = event.text
        elif isinstance(event, NoteEvent):
            self.notes.append(event.text)


COMMON = frozenset("i the a an no yes there it this that he she they we you in on at "
                   "not none nobody".split())


def invented_names(answer: str, question: str, notes: list[str]) -> list[str]:
    """Capitalised words of the answer found in neither the question nor the notes (the
    first word of a sentence is not a name by its capital alone)."""
    known = set(normalise(question + " " + " ".join(notes)).split())
    names = []
    for sentence in re.split(r"(?<=[.!?])\s+", answer):
        for word in re.findall(r"[A-Za-z][A-Za-z'-]+", sentence)[1:]:
            if word[0].isupper() and word.lower() not in known and word.lower() not in COMMON:
                names.append(word)
    return names


def _print_table(results: dict[str, list[Outcome]]) -> dict:
    summary = {}
    header = f"{'category':<15}" + "".join(f"{label.split(' (')[0]:>12}" for label in results)
    print("\n" + header)
    for category in (*CATEGORIES, "all"):
        row = f"{category:<15}"
        for label, outcomes in results.items():
            chosen = [o for o in outcomes if category in ("all", o.question.category)]
            right = sum(o.correct for o in chosen)
            share = right / max(1, len(chosen))
            summary.setdefault(label, {})[category] = share
            row += f"{f'{right}/{len(chosen)} {share:.0%}':>12}"
        print(row)
    for label, outcomes in results.items():
        invented = sum(bool(o.invented) for o in outcomes)
        presence = sum(o.question.category == "presence" for o in outcomes)
        print(f"{label}: invented names in {invented} of {presence} presence answers; "
              f"{_repeats(outcomes)} answers repeated word for word for another question")
    return summary


def _repeats(outcomes: list[Outcome]) -> int:
    seen = defaultdict(int)
    for o in outcomes:
        if o.answer:
            seen[(o.clip, o.answer.strip())] += 1
    return sum(n for n in seen.values() if n > 1)


def _print_answers(results: dict[str, list[Outcome]]) -> None:
    for label, outcomes in results.items():
        print(f"\n{label}:")
        for o in outcomes:
            mark = "ok " if o.correct else "-- "
            extra = f"  [invented: {', '.join(o.invented)}]" if o.invented else ""
            print(f"  {mark}{o.clip:<12} {o.question.text}\n        -> {o.answer!r}{extra}")


def _plot(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    categories = (*CATEGORIES, "all")
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / max(1, len(summary))
    for i, (label, shares) in enumerate(summary.items()):
        xs = [j + i * width for j in range(len(categories))]
        ax.bar(xs, [shares[c] * 100 for c in categories], width, label=label)
    ax.set_xticks([j + width * (len(summary) - 1) / 2 for j in range(len(categories))],
                  categories)
    ax.set_ylabel("answered with the right fact (%)")
    ax.axhline(80, color="grey", linestyle=":")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "grounding.png", dpi=120)
    plt.close(fig)
    print(f"\nplot: {out / 'grounding.png'}")
