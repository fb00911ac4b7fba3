"""Pipelines as Python files: loading, the stage harness, and the sample pipelines."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamgrok.cache.config import CacheConfig
from streamgrok.cli.run_pipeline import parse_time
from streamgrok.engine import Engine, EngineConfig
from streamgrok.media.items import Note
from streamgrok.media.samples import Scene, write_clip
from streamgrok.pipeline import Edge, IngestConfig, Stage, run_chain
from streamgrok.pipeline.loader import PipelineLoadError, load_pipeline
from streamgrok.pipeline.pipeline import PipelineRunner
from streamgrok.pipeline.triggers import At

PIPELINES = Path(__file__).parent.parent / "pipelines"


class Collect:
    def __init__(self):
        self.events = []

    async def send(self, event):
        self.events.append(event)

    def kinds(self):
        return {e.kind for e in self.events}


@pytest.fixture(scope="module")
def clip(tmp_path_factory):
    return write_clip(tmp_path_factory.mktemp("clip") / "clip.mp4",
                      [Scene("astronaut", 2.0, speech="Hello, is anybody there?"),
                       Scene("coffee", 2.0), Scene(None, 2.0, moving_square=True)])


async def run_file(loaded, name, clip, options=None, asks=()):
    pipeline = load_pipeline(PIPELINES / name, {"transcribe": "false", **(options or {})})
    sink = Collect()
    cache = CacheConfig(budget_tokens=1024, memory_gib=0.05)
    async with Engine(loaded, cache, EngineConfig(merge_window_s=0)) as engine:
        stats = await PipelineRunner(pipeline, engine, [sink]).run(str(clip), list(asks))
        await_pages = engine.cache.pool.used_pages
    return sink, stats, await_pages


async def test_live_qa_answers_questions_at_times(tiny_loaded, clip):
    sink, stats, pages = await run_file(tiny_loaded, "live_qa.py", clip,
                                        asks=[At("who is there?", seconds=1.0),
                                              At("and at the end?", seconds=float("inf"))])
    assert {"note", "answer.question", "answer.delta", "answer.done"} <= sink.kinds()
    assert len(stats.answers) == 2 and stats.notes > 0
    assert any("face" in e.text for e in sink.events if e.kind == "note")
    assert pages == 0  # the session's pages were all returned


async def test_commentary_narrates_on_schedule(tiny_loaded, clip):
    sink, stats, _ = await run_file(tiny_loaded, "commentary.py", clip, {"every": "2"})
    done = [e for e in sink.events if e.kind == "commentary.done"]
    assert len(done) >= 2


async def test_alert_fires_on_observed_condition(tiny_loaded, clip):
    sink, _, _ = await run_file(tiny_loaded, "alert.py", clip, {"watch": "face,cut"})
    questions = [e for e in sink.events if e.kind == "alert.question"]
    assert questions and any("face" in q.text or "CUT" in q.text for q in questions)
    assert "alert.done" in sink.kinds()


class Upper(Stage):
    name = "upper"

    async def process(self, item):
        if isinstance(item, str) and item.startswith("drop"):
            return []
        if isinstance(item, str):
            return [item.upper()]
        return None  # anything else passes through


class Forgetful(Stage):
    name = "forgetful"

    async def process(self, item):
        item.tags.add("seen")  # no return: the item still passes on


class Broken(Stage):
    name = "broken"

    async def process(self, item):
        if item == "boom":
            raise RuntimeError("cannot handle boom")
        return None


async def test_stage_harness_pass_through_and_errors():
    note = Note("hello", 1.0)
    out, events = await run_chain([Upper(), Forgetful()], [note])
    assert out == [note] and "seen" in note.tags
    out, _ = await run_chain([Upper()], ["a", "drop me", 3])
    assert out == ["A", 3]
    out, events = await run_chain([Broken(), Upper()], ["x", "boom", "y"])
    assert out == ["X", "BOOM", "Y"]  # the failing item went on, the stream did not stop
    assert [e.kind for e in events] == ["error"] and "cannot handle boom" in events[0].text


class Slow(Stage):
    name = "slow"
    edge = Edge(capacity=2, policy="drop_oldest")

    async def process(self, item):
        import asyncio

        await asyncio.sleep(0.01)
        return None


async def test_stage_edge_policy_drops_oldest():
    from streamgrok.channel import Channel

    source = Channel(2, "drop_oldest", "frames")
    import asyncio

    async def produce():
        for i in range(50):
            await source.put(i)
            await asyncio.sleep(0)
        source.close()

    producer = asyncio.create_task(produce())
    out, _ = await run_chain([Slow()], source=source)
    await producer
    assert source.stats.dropped > 0 and len(out) + source.stats.dropped == 50
    assert out == sorted(out) and out[-1] == 49


def test_loading_errors_are_named(tmp_path):
    with pytest.raises(PipelineLoadError, match="not found"):
        load_pipeline(tmp_path / "missing.py")
    broken = tmp_path / "broken.py"
    broken.write_text("def build_pipeline(options)\n    return 1\n")
    with pytest.raises(PipelineLoadError, match="broken.py:1: syntax error"):
        load_pipeline(broken)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(PipelineLoadError, match="defines no pipeline"):
        load_pipeline(empty)
    wrong = tmp_path / "wrong.py"
    wrong.write_text("def build_pipeline(options):\n    return 'a string'\n")
    with pytest.raises(PipelineLoadError, match="returned str, not a Pipeline"):
        load_pipeline(wrong)
    failing = tmp_path / "failing.py"
    failing.write_text("import json\nraise RuntimeError('no camera')\n")
    with pytest.raises(PipelineLoadError, match="line 2: RuntimeError: no camera"):
        load_pipeline(failing)


def test_what_questions_are_answered_over_is_server_configuration():
    chosen = load_pipeline(PIPELINES / "live_qa.py", {"answer_context": "stream"})
    assert chosen.answer_context == "stream"
    assert load_pipeline(PIPELINES / "live_qa.py", {}).answer_context is None  # auto
    with pytest.raises(ValueError, match="answer_context"):
        load_pipeline(PIPELINES / "live_qa.py", {"answer_context": "everything"})


def test_parse_time():
    assert parse_time("10s") == 10 and parse_time("1:30") == 90 and parse_time("1m30s") == 90
    assert parse_time("2.5") == 2.5
    with pytest.raises(ValueError, match="not a time"):
        parse_time("soon")


class Pairs(Stage):
    """Holds items and emits them in pairs; what is left goes out at flush()."""

    name = "pairs"

    def __init__(self) -> None:
        super().__init__()
        self.held = []

    async def process(self, item):
        self.held.append(item)
        if len(self.held) < 2:
            return []
        pair, self.held = tuple(self.held), []
        return [pair]

    async def flush(self):
        return [tuple(self.held)] if self.held else []


async def test_a_stage_flushes_what_it_holds_when_the_stream_ends():
    out, _ = await run_chain([Pairs()], [1, 2, 3, 4, 5])
    assert out == [(1, 2), (3, 4), (5,)]


class RedFrames(Stage):
    """A user stage on the video branch: sees every kept frame (and the watermarks)."""

    name = "red-frames"

    def __init__(self) -> None:
        super().__init__()
        self.frames = 0

    async def process(self, item):
        from streamgrok.media.items import VideoFrame

        if isinstance(item, VideoFrame):
            self.frames += 1
            red = float(item.image[..., 0].mean()) > 120
            return [Note("mostly red" if red else "not red", item.pts, tags={"red"}), item]
        return None


async def test_user_video_stages_see_frames_and_their_notes_reach_the_session(tiny_loaded,
                                                                               clip):
    from streamgrok.pipeline.pipeline import Pipeline

    stage = RedFrames()
    pipeline = Pipeline("video-stage", ingest=IngestConfig(fps=2, transcribe=False),
                        video_stages=[stage])
    sink = Collect()
    async with Engine(tiny_loaded, CacheConfig(budget_tokens=1024, memory_gib=0.05),
                      EngineConfig(merge_window_s=0)) as engine:
        stats = await PipelineRunner(pipeline, engine, [sink]).run(str(clip))
    notes = [e for e in sink.events if e.kind == "note" and "red" in e.tags]
    assert stage.frames > 0 and len(notes) == stage.frames
    assert stats.notes > len(notes)  # the observers' notes came too
    pts = [e.pts for e in sink.events if e.kind == "note"]
    assert pts == sorted(pts)  # the merge keeps them in stream order


def test_frame_encoders_are_loaded_once_per_process_not_per_session(monkeypatch):
    """Every session's pipeline asks for CLIP + projector; with the server's shared
    resources they load once (each CLIP load cost ~475 MB)."""
    from streamgrok.pipeline import options as options_module
    from streamgrok.pipeline.resources import PipelineOptions, SharedResources

    loads = []
    monkeypatch.setattr(options_module, "ClipEncoder",
                        lambda model, pretrained: loads.append(("clip", pretrained)) or object())
    monkeypatch.setattr(options_module.Projector, "load",
                        staticmethod(lambda path, hidden=None: loads.append(("proj", path))
                                     or object()))
    shared = SharedResources()
    server_options = {"clip_weights": "w.pt", "projector": "p.safetensors", "hidden_size": 64}
    first = [options_module.frame_encoders(PipelineOptions(server_options, shared))
             for _ in range(5)]
    assert loads == [("clip", "w.pt"), ("proj", "p.safetensors")]
    assert all(pair == first[0] for pair in first)
    options_module.frame_encoders(dict(server_options))  # no resources: a load of its own
    assert len(loads) == 4


async def test_run_output_labels_questions_and_keeps_progress_out_of_answer_lines():
    import io

    from streamgrok.cli.run_pipeline import progress_line
    from streamgrok.pipeline.events import DeltaEvent, DoneEvent, NoteEvent, QuestionEvent
    from streamgrok.pipeline.sinks import StdoutSink

    out = io.StringIO()
    sink = StdoutSink(out, progress_stream=out)
    await sink.send(QuestionEvent("answer", 3, "who?", 1.0))
    await sink.send(DeltaEvent("answer", 3, "A pers", None))
    sink.progress("  .. progress")  # mid-answer: held until the answer's line ends
    await sink.send(NoteEvent("a cut", 2.0))  # so is a note
    await sink.send(DeltaEvent("answer", 3, "on.", None))
    await sink.send(DoneEvent("answer", 3, "A person.", None, metrics={"tokens": 2}))
    lines = out.getvalue().splitlines()
    assert "Q #3: who?" in lines[0]
    assert lines[1] == "  > #3 A person."
    assert lines[2] == "  .. progress" and lines[3].startswith("  (#3: 2 tokens")
    assert "a cut" in lines[4]
    info = {"stream_time": 4.2, "frames_sampled": 8, "frames_dropped": 5, "notes": 2,
            "frame_drops": {"duplicate": 4, "stale": 1, "queue": 0}, "kv_pages_used": 3,
            "kv_pages_total": 100, "evicted_tokens": 0}
    line = progress_line(info)
    assert "8 frames sampled: 3 used, 5 dropped (4 duplicates, 1 too late)" in line
