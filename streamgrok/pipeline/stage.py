"""Stages: small async units with one contract, joined by bounded channels.

A stage's `process(item)` returns None to pass the item on unchanged (the default, so a
forgotten return never drops data), or a list of items to emit instead (an empty list drops
the item on purpose). A stage that raises produces an error event and the pipeline goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from streamgrok.channel import Channel, EdgePolicy
from streamgrok.pipeline.events import ErrorEvent, PipelineEvent

log = logging.getLogger(__name__)


@dataclass
class Edge:
    """The channel in front of a stage: its capacity and what happens when it is full."""

    capacity: int = 64
    policy: EdgePolicy | str = EdgePolicy.BLOCK  # or its name, e.g. "drop_oldest"


class Stage:
    """Base class: override `process`; `events` lets a stage report to the sinks."""

    name = "stage"
    edge = Edge()
    report: Callable[[PipelineEvent], Awaitable[None]] | None = None  # set by the runner

    async def process(self, item: Any) -> list[Any] | None:
        """Handle one item; None passes it on."""
        return None

    async def start(self) -> None:
        """Called once before the first item."""

    async def flush(self) -> list[Any]:
        """Called once after the last item: what the stage still holds (a speech segment in
        progress, a batch) goes on downstream."""
        return []

    async def stop(self) -> None:
        """Called once after the last item."""

    async def emit_event(self, event: PipelineEvent) -> None:
        if self.report is not None:
            await self.report(event)


async def run_stage(stage: Stage, inbox: Channel, outbox: Channel,
                    report: Callable[[PipelineEvent], Awaitable[None]]) -> None:
    """Move items from inbox through `stage` to outbox until the inbox closes."""
    stage.report = report
    await stage.start()
    try:
        async for item in inbox:
            try:
                produced = await stage.process(item)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.exception("stage %s failed", stage.name)
                await report(ErrorEvent(f"{stage.name}: {exc}", getattr(item, "pts", None),
                                        stage=stage.name))
                produced = None  # the item goes on; one bad item does not stop the stream
            for out in [item] if produced is None else produced:
                await outbox.put(out)
        for out in await stage.flush():
            await outbox.put(out)
    finally:
        await stage.stop()
        outbox.close()


def start_chain(
    stages: list[Stage], report: Callable[[PipelineEvent], Awaitable[None]], sink: str = "sink",
    source: Channel | None = None,
) -> tuple[list[Channel], list[asyncio.Task]]:
    """Channels (one in front of each stage, its edge; then the sink's) and the running stage
    tasks. Put items into channels[0] (or `source`), read results from channels[-1]."""
    channels = [Channel(s.edge.capacity, s.edge.policy, s.name) for s in stages]
    channels.append(Channel(64, EdgePolicy.BLOCK, sink))
    if source is not None:
        channels[0] = source
    tasks = [asyncio.create_task(run_stage(s, channels[i], channels[i + 1], report))
             for i, s in enumerate(stages)]
    return channels, tasks


async def run_chain(stages: list[Stage], items: list[Any] | None = None,
                    source: Channel | None = None) -> tuple[list[Any], list[PipelineEvent]]:
    """Test harness: run stages between a fake source (items) and a collecting sink."""
    events: list[PipelineEvent] = []

    async def report(event: PipelineEvent) -> None:
        events.append(event)

    channels, tasks = start_chain(stages, report, source=source)

    async def feed() -> None:
        for item in items or []:
            await channels[0].put(item)
        channels[0].close()

    feeder = asyncio.create_task(feed()) if source is None else None
    out = [item async for item in channels[-1]]
    await asyncio.gather(*tasks, *([feeder] if feeder else []))
    return out, events
