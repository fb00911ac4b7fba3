"""Where pipeline events go: the terminal, a JSON lines file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from streamgrok.pipeline.events import (
    DeltaEvent,
    DoneEvent,
    NoteEvent,
    PipelineEvent,
    QuestionEvent,
)


class StdoutSink:
    """Prints notes and alerts as lines and streams answers as they are generated.

    One answer streams live at a time; answers running concurrently are buffered and shown
    whole, in order, when the live one ends, so their text never interleaves; notes,
    questions and progress that come meanwhile are printed after the live answer's line.
    """

    def __init__(self, stream: TextIO = sys.stdout, notes: bool = True,
                 progress_stream: TextIO | None = None) -> None:
        self.stream = stream
        self.notes = notes
        self.progress_stream = progress_stream or sys.stderr
        self._live: int | None = None
        self._line_open = False
        self._held_progress: str | None = None
        self._held_lines: list[str] = []  # notes and events that came while an answer streamed
        self._waiting: dict[int, list[DeltaEvent | DoneEvent]] = {}

    async def send(self, event: PipelineEvent) -> None:
        match event:
            case DeltaEvent() | DoneEvent():
                if self._live is None:
                    self._live = event.answer_id
                if event.answer_id != self._live:
                    self._waiting.setdefault(event.answer_id, []).append(event)
                    return
                self._show_answer_event(event)
                if isinstance(event, DoneEvent):
                    self._next_live()
            case QuestionEvent():
                label = "ALERT" if event.purpose == "alert" else "Q"
                line = event.line().replace(f"{event.kind}:", f"{label} #{event.answer_id}:")
                if self._live is not None:  # an answer is streaming: after it
                    self._held_lines.append(line)
                else:
                    self._end_line()
                    self._write(line + "\n")
            case NoteEvent() if not self.notes:
                pass
            case _ if self._live is not None:  # an answer is streaming: after it
                self._held_lines.append(event.line())
            case _:
                self._end_line()
                self._write(event.line() + "\n")
        self.stream.flush()

    def _show_answer_event(self, event: DeltaEvent | DoneEvent) -> None:
        if isinstance(event, DeltaEvent):
            if not self._line_open:
                self._write(f"  > #{event.answer_id} ")
                self._line_open = True
            self._write(event.text)
            return
        self._end_line()
        metrics = event.metrics
        recall = ""
        if metrics.get("kv_hit_rate") is not None:
            recall = (f", recalled {metrics['recalled_tokens']} tokens in "
                      f"{metrics['recall_ms']} ms, KV hit rate ~{metrics['kv_hit_rate']:.2f}")
        self._write(f"  (#{event.answer_id}: {metrics.get('tokens')} tokens, TTFT "
                    f"{metrics.get('ttft_ms')} ms, {metrics.get('tbt_ms_mean')} ms/token"
                    f"{recall})\n")

    def _next_live(self) -> None:
        self._live = None
        for line in self._held_lines:
            self._write(line + "\n")
        self._held_lines.clear()
        while self._waiting:
            answer, events = next(iter(self._waiting.items()))
            del self._waiting[answer]
            self._live = answer
            for event in events:
                self._show_answer_event(event)
            if not isinstance(events[-1], DoneEvent):
                return  # it goes on streaming live
            self._live = None

    def progress(self, line: str) -> None:
        """A progress line; one that comes while an answer streams waits for its line to
        end (only the latest is kept), so it never splits an answer."""
        if self._line_open:
            self._held_progress = line
            return
        self.progress_stream.write(line + "\n")
        self.progress_stream.flush()

    def _end_line(self) -> None:
        if self._line_open:
            self._write("\n")
            self._line_open = False
            self.stream.flush()
            held, self._held_progress = self._held_progress, None
            if held is not None:
                self.progress(held)

    def _write(self, text: str) -> None:
        self.stream.write(text)


class JsonLinesSink:
    """Appends every event as one JSON object per line."""

    def __init__(self, path: str | Path) -> None:
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    async def send(self, event: PipelineEvent) -> None:
        self.file.write(json.dumps(event.as_dict(), default=str) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
