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


def parser_vocabulary() -> tuple[set[str], set[str]]:
    """Every command path (`chat`, `bench serve`, and `benchmarks decode` for the research
    harnesses) and every option string the two command line parsers know, over all their
    subcommands."""
    import argparse

    from benchmarks.__main__ import build_parser as build_harness_parser
    from streamgrok.cli import build_parser

    commands, options = set(), set()

    def walk(parser: argparse.ArgumentParser, path: str) -> None:
        for action in parser._actions:
            options.update(s for s in action.option_strings if s.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    commands.add(f"{path} {name}".strip())
                    walk(sub, f"{path} {name}".strip())

    walk(build_parser(), "")
    walk(build_harness_parser(), "benchmarks")
    return commands, options


def test_the_readme_is_short_and_has_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 400, "the README is for users: details go to docs/"
    assert "make demo" in text and "make test" in text
    for heading in ("## Quick start", "## Serving", "## Writing a pipeline", "## Configuration",
                    "## Current numbers", "## Documentation"):
        assert heading in text, heading
    for linked in re.findall(r"`(docs/[A-Za-z_-]+\.md|CHANGELOG\.md)`", text):
        assert (README.parent / linked).is_file(), linked


def test_every_command_and_flag_the_readme_names_exists():
    commands, options = parser_vocabulary()
    text = README.read_text()
    named = set(re.findall(r"streamgrok ((?:bench )?[a-z]+(?:-[a-z]+)*)\b", text)) - {
        "is", "serving", "import"}
    named |= set(re.findall(r"python -m (benchmarks [a-z]+)\b", text))
    assert named and named <= commands, named - commands
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", text))
    assert flags and flags <= options, flags - options
