"""Load a pipeline definition from a Python file, by path (no directory scanning).

A pipeline file defines `build_pipeline(options: dict) -> Pipeline`; `options` holds the
command line's `--set key=value` pairs, or the server's options plus the `session.start`
options a client may set (the pipeline's `client_options` allow-list).
"""

from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Any

from streamgrok.errors import StreamgrokError
from streamgrok.pipeline.pipeline import Pipeline
from streamgrok.pipeline.resources import PipelineOptions, SharedResources


class PipelineLoadError(StreamgrokError):
    """A pipeline file is missing, broken, or defines no pipeline."""


def load_pipeline(path: str | Path, options: dict[str, Any] | None = None,
                  resources: SharedResources | None = None) -> Pipeline:
    """Import the file at `path` and build its pipeline with `options`; encoders it asks
    for through `frame_encoders` come from `resources` when given (loaded once)."""
    path = Path(path)
    if not path.is_file():
        raise PipelineLoadError(f"pipeline file not found: {path}")
    name = f"streamgrok_pipeline_{abs(hash(path.resolve()))}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PipelineLoadError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise PipelineLoadError(f"{path}:{exc.lineno}: syntax error: {exc.msg}") from exc
    except Exception as exc:
        where = traceback.extract_tb(exc.__traceback__)[-1]
        raise PipelineLoadError(
            f"{path}: importing it failed at line {where.lineno}: {type(exc).__name__}: {exc}"
        ) from exc
    finally:
        sys.modules.pop(name, None)
    build = getattr(module, "build_pipeline", None)
    if not callable(build):
        raise PipelineLoadError(
            f"{path} defines no pipeline: add `def build_pipeline(options) -> Pipeline`"
        )
    pipeline = build(PipelineOptions(options, resources))
    if not isinstance(pipeline, Pipeline):
        raise PipelineLoadError(
            f"{path}: build_pipeline returned {type(pipeline).__name__}, not a Pipeline"
        )
    return pipeline
