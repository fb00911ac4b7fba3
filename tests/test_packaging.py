"""The wheel: what `pip install` gets must serve without the checkout (page, sample
pipelines, license, typing marker, the console script)."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # built from a copy without the checkout's build outputs: setuptools would otherwise
    # reuse build/lib, and a module missing from pyproject's list would still ship
    source = tmp_path_factory.mktemp("source") / "streamgrok"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".hypothesis", "test-artifacts"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", str(source), "-w", str(out)], check=True,
                   capture_output=True, timeout=600)
    return next(out.glob("streamgrok-*.whl"))


def test_the_wheel_carries_the_page_the_pipelines_and_the_metadata(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = next(n for n in names if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(info))
        entry_points = archive.read(info.replace("METADATA", "entry_points.txt")).decode()
    for shipped in ("streamgrok/server/static/index.html", "streamgrok/server/static/"
                    "assistant.js", "streamgrok/pipelines/live_qa.py",
                    "streamgrok/pipelines/alert.py", "streamgrok/py.typed",
                    "streamgrok_kernels/ops.py", "streamgrok_kernels/cpu/decode_attention.cpp",
                    "streamgrok_kernels/cpu/paged_attention.cpp",
                    "streamgrok_kernels/cpu/attention_math.h", "streamgrok/vision/mmproj.py"):
        assert shipped in names, shipped
    assert not any(n.startswith("kernels/") for n in names)  # not another project's name
    assert not any(n.startswith("benchmarks/") for n in names)  # research harnesses stay home
    assert "streamgrok/bench/live.py" in names  # the load generators users run ship
    modules = {str(p.relative_to(ROOT)) for p in (ROOT / "streamgrok").rglob("*.py")}
    assert modules - names == set(), "packages missing from pyproject's list"
    assert any(n.endswith("licenses/LICENSE") for n in names)
    assert metadata["License-Expression"] == "Apache-2.0"
    requires = metadata.get_all("Requires-Dist")
    assert any(r.startswith("uvloop") and "sys_platform" in r for r in requires)
    assert not any("==" in r.split(";")[0] for r in requires), "ranges, not pins"
    assert set(metadata.get_all("Provides-Extra")) >= {"clip", "bench", "dev"}
    assert "streamgrok = streamgrok.cli:main" in entry_points


def test_the_installed_package_finds_its_files_without_the_checkout(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                    str(target), str(wheel)], check=True, capture_output=True, timeout=300)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    probe = "\n".join([
        "from streamgrok.cli.options import resolve_pipeline",
        "from streamgrok.server.config import STATIC_DIR",
        "from streamgrok.pipeline.loader import load_pipeline",
        "path = resolve_pipeline('live_qa')",
        f"assert path.startswith({str(target)!r}), path",
        f"assert str(STATIC_DIR).startswith({str(target)!r})",
        "assert (STATIC_DIR / 'index.html').is_file()",
        "from streamgrok_kernels.cpu_native import HEADERS, SOURCES",
        "for source in SOURCES + HEADERS:",
        f"    assert str(source).startswith({str(target)!r}) and source.is_file(), source",
        "pipeline = load_pipeline(path, {'hidden_size': 64, 'transcribe': 'false'})",
        "print(pipeline.name)",
    ])
    result = subprocess.run([sys.executable, "-c", probe], cwd=elsewhere, capture_output=True,
                            text=True, timeout=300, env={"PYTHONPATH": str(target),
                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "live_qa"
