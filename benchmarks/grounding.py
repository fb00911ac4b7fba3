"""`python -m benchmarks grounding`: does the assistant report truthfully what it heard and saw?

Clips with known events (`grounding_clips`: espeak-ng speech in several voices, a person
entering and leaving, hard cuts, coloured objects crossing, captions) are streamed through
the default pipeline, and questions with expected facts are asked when each ends. Four sets
of questions: the five hand-written clips ("existing"), and clips drawn from `--seed` with
questions in the notes' own words ("direct"), in other words ("paraphrase") and about things
that never happened ("absent": the share that says so, and the share that invents).

The configurations run in the same process on the same clips; by default the current
pipeline and the baseline, today's defaults with grounding's old note selection (`note_selection`
"words": notes chosen by shared word stems and topic words). `--configs` adds older ones:
"stream" (grounded questions answered over the session's stream) and "pocketsphinx" (the old
recogniser, questions asked bare over the stream under the old system prompt).
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

from benchmarks.grounding_clips import fixed_clips, generated_clips
from benchmarks.grounding_questions import Clip, Question, invented, invented_names
from streamgrok.cache.config import CacheConfig
from streamgrok.cli.options import DEFAULTS, add_model_options, load_from_args
from streamgrok.engine import Engine
from streamgrok.loading.loader import LoadedModel
from streamgrok.media.native_pool import NativeMediaPool
from streamgrok.media.samples import write_clip
from streamgrok.pipeline.events import DoneEvent, NoteEvent
from streamgrok.pipeline.loader import load_pipeline
from streamgrok.pipeline.pipeline import PipelineRunner
from streamgrok.pipeline.resources import SharedResources
from streamgrok.pipeline.triggers import At

OLD_SYSTEM = (
    "You are a helpful assistant watching a live video. Notes about what the camera sees and "
    "hears arrive with timestamps [mm:ss]. Answer briefly, from the notes."
)
CATEGORIES = ("speech", "presence", "change", "colour/motion", "text", "counting", "absent")
SETS = ("existing", "direct", "paraphrase", "absent")


@dataclass
class Outcome:
    clip: str
    question: Question
    answer: str
    correct: bool
    invented: list[str] = field(default_factory=list)  # names (presence questions)
    made_up: bool = False  # an absent fact answered as if it were there


@dataclass(frozen=True)
class Config:
    label: str
    speech_model: str = "base"
    grounded: bool = True
    system_prompt: str | None = None  # None: the pipeline's own
    answer_context: str | None = None  # None: the pipeline's own
    note_selection: str | None = None  # None: the pipeline's own


CONFIGS = {
    "current": Config("current"),
    "words": Config("words (old note selection)", note_selection="words"),
    "stream": Config("stream (answered over the stream)", answer_context="stream"),
    "pocketsphinx": Config("pocketsphinx (bare questions, old prompt)", "pocketsphinx",
                           False, OLD_SYSTEM),
}


def run_grounding_bench(loaded: LoadedModel, pipeline_path: str = "pipelines/live_qa.py",
                        cache: CacheConfig | None = None, out: str = "bench-results",
                        only: str | None = None, seed: int = 0, generated: int = 5,
                        configs: str = "words,current") -> dict:
    """Streams the clips through each configuration, prints the scores per set and per
    category and every answer, and plots them; returns {config label: {row: share}}."""
    chosen_configs = [CONFIGS[name] for name in configs.split(",")]
    chosen = fixed_clips() + generated_clips(seed, generated)
    chosen = [c for c in chosen if only is None or c.name in only.split(",")]
    print(f"clips: {len(chosen)} ({generated} drawn from seed {seed}), "
          f"{sum(len(c.questions) for c in chosen)} questions")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {c.name: write_clip(Path(tmp) / f"{c.name}.mp4", c.scenes, fps=10)
                 for c in chosen}
        for config in chosen_configs:
            started = time.perf_counter()
            outcomes = asyncio.run(_run_config(loaded, pipeline_path, config, chosen, paths,
                                               cache or CacheConfig()))
            results[config.label] = outcomes
            print(f"{config.label}: {len(outcomes)} questions in "
                  f"{time.perf_counter() - started:.0f} s", flush=True)
    _print_answers(results)
    summary = _print_table(results)
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
                pipeline = replace(
                    pipeline, grounded=config.grounded,
                    system_prompt=config.system_prompt or pipeline.system_prompt,
                    answer_context=config.answer_context or pipeline.answer_context,
                    note_selection=config.note_selection or pipeline.note_selection)
                sink = _Collect()
                runner = PipelineRunner(pipeline, engine, [sink], resources=resources)
                asks = [At(q.text, seconds=float("inf")) for q in clip.questions]
                await runner.run(str(paths[clip.name]), asks)
                for question in clip.questions:
                    answer = sink.answers.get(question.text, "")
                    names = (invented_names(answer, question.text, sink.notes)
                             if question.category == "presence" else [])
                    made_up = question.absent and invented(answer, question.text, sink.notes)
                    outcomes.append(Outcome(clip.name, question, answer,
                                            question.score(answer) and not names, names,
                                            made_up))
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


def _print_table(results: dict[str, list[Outcome]]) -> dict:
    """Per set (and per category of the existing set): right answers of each
    configuration; for the absent set, the share that says so and the share that invents."""
    summary: dict[str, dict[str, float]] = {}
    rows = [(f"set {name}", lambda o, name=name: o.question.set == name) for name in SETS]
    rows += [(f"  {category}", lambda o, category=category: o.question.set == "existing"
              and o.question.category == category) for category in CATEGORIES[:-1]]
    header = f"{'questions':<22}" + "".join(f"{label.split(' (')[0]:>14}" for label in results)
    print("\n" + header)
    for name, member in rows:
        row = f"{name:<22}"
        for label, outcomes in results.items():
            chosen = [o for o in outcomes if member(o)]
            right = sum(o.correct for o in chosen)
            share = right / max(1, len(chosen))
            summary.setdefault(label, {})[name.strip()] = share
            row += f"{f'{right}/{len(chosen)} {share:.0%}':>14}"
        if any(member(o) for o in next(iter(results.values()))):
            print(row)
    row = f"{'  absent, invented':<22}"
    for label, outcomes in results.items():
        absent = [o for o in outcomes if o.question.set == "absent"]
        made_up = sum(o.made_up for o in absent)
        summary[label]["absent invented"] = made_up / max(1, len(absent))
        row += f"{f'{made_up}/{len(absent)} {made_up / max(1, len(absent)):.0%}':>14}"
    print(row)
    for label, outcomes in results.items():
        names = sum(bool(o.invented) for o in outcomes)
        presence = sum(o.question.category == "presence" for o in outcomes)
        print(f"{label}: invented names in {names} of {presence} presence answers; "
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
    rows = [f"set {name}" for name in SETS] + ["absent invented"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / max(1, len(summary))
    for i, (label, shares) in enumerate(summary.items()):
        xs = [j + i * width for j in range(len(rows))]
        ax.bar(xs, [shares.get(r, 0.0) * 100 for r in rows], width, label=label)
    ax.set_xticks([j + width * (len(summary) - 1) / 2 for j in range(len(rows))],
                  [r.removeprefix("set ") for r in rows])
    ax.set_ylabel("answers (%)")
    ax.axhline(80, color="grey", linestyle=":")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "grounding.png", dpi=120)
    plt.close(fig)
    print(f"\nplot: {out / 'grounding.png'}")


def register(benches: argparse._SubParsersAction) -> None:
    """Add `grounding` and its arguments to the `python -m benchmarks` commands."""
    grounding = benches.add_parser(
        "grounding", formatter_class=DEFAULTS,
        help="questions with known answers on generated clips: as the notes word them, "
             "in other words, and about what never happened")
    grounding.add_argument("--pipeline", default="pipelines/live_qa.py", help="pipeline file")
    grounding.add_argument("--clips", default=None, help="comma-separated clip names")
    grounding.add_argument("--seed", type=int, default=0,
                           help="seed the generated clips are drawn from")
    grounding.add_argument("--generated", type=int, default=5,
                           help="how many clips to draw from --seed")
    grounding.add_argument("--configs", default="words,current",
                           help="comma-separated: current, words (the old note selection), "
                                "stream, pocketsphinx")
    grounding.add_argument("--out", default="bench-results", help="folder for the plot")
    add_model_options(grounding)
    grounding.set_defaults(run=run_from_args)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the bench with the parsed command-line arguments."""
    run_grounding_bench(load_from_args(args), args.pipeline, out=args.out, only=args.clips,
                        seed=args.seed, generated=args.generated, configs=args.configs)
    return 0
