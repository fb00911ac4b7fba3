"""Pipelines as Python files: stages, bounded channels, triggers, sinks, the runner.

A pipeline file defines `build_pipeline(options) -> Pipeline`; see pipelines/ for examples.
"""

from streamgrok.channel import Channel
from streamgrok.pipeline.events import Event
from streamgrok.pipeline.ingest import IngestConfig
from streamgrok.pipeline.options import ClientOption, frame_encoders, option
from streamgrok.pipeline.pipeline import DEFAULT_SYSTEM, Pipeline, PipelineRunner
from streamgrok.pipeline.stage import Edge, Stage, run_chain
from streamgrok.pipeline.triggers import At, Every, OnNote, Trigger

__all__ = [
    "DEFAULT_SYSTEM", "At", "Channel", "ClientOption", "Edge", "Event", "Every", "IngestConfig",
    "OnNote", "Pipeline", "PipelineRunner", "Stage", "Trigger", "frame_encoders", "option",
    "run_chain",
]
