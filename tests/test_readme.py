"""The README's Python examples, as written: the engine script runs, the pipeline example loads
as a pipeline file and its stage does what the text says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamgrok import Note, Pipeline, load_pipeline, run_chain

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_blocks() -> dict[str, str]:
    """Python blocks the README marks for this test, by what the marker says to do."""
    pattern = re.compile(r"<!-- tests/test_readme\.py (runs|loads) [^>]*-->\n```python\n(.*?)```",
                         re.S)
    return {verb: code for verb, code in pattern.findall(README.read_text())}


@pytest.mark.integration
def test_the_engine_example_runs_as_written(tmp_path):
    script = tmp_path / "engine_example.py"
    script.write_text(readme_blocks()["runs"])
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip(), "the example printed no answer"


async def test_the_pipeline_example_loads_and_its_stage_works(tmp_path):
    path = tmp_path / "loud.py"
    path.write_text(readme_blocks()["loads"])
    pipeline = load_pipeline(path, {"watch": "cut"})
    assert isinstance(pipeline, Pipeline) and pipeline.name == "alert"
    items, events = await run_chain(pipeline.stages, [Note("scene cut: a different scene",
                                                           3.0, tags={"cut"})])
    assert [n.text for n in items] == ["SCENE CUT: a different scene"] and not events


def test_the_top_level_exports_resolve():
    import streamgrok

    assert set(streamgrok.__all__) == {"__version__", *streamgrok.EXPORTS}
    for name in streamgrok.EXPORTS:
        assert getattr(streamgrok, name).__name__ == name
