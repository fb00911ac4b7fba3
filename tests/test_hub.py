"""Models by Hub name, from a pre-seeded Hugging Face cache with HF_HUB_OFFLINE=1 (nothing is
downloaded), through the command line."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vlm_helpers import smolvlm_folder

from streamgrok.errors import ModelLoadError
from streamgrok.loading.hub import is_hub_name, resolve

pytest.importorskip("transformers")
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def seed_cache(cache: Path, repo: str, files: Path) -> Path:
    """The layout huggingface_hub keeps: refs/main names a snapshot holding the files."""
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(COMMIT)
    shutil.copytree(files, root / "snapshots" / COMMIT)
    return root / "snapshots" / COMMIT


def cli(*args: str, cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "streamgrok", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vlm")
    smolvlm_folder(folder)
    cache = tmp_path_factory.mktemp("hub")
    seed_cache(cache, "test-org/tiny-smolvlm", folder)
    return cache


def test_names_and_paths_are_told_apart(tmp_path, monkeypatch):
    assert is_hub_name("HuggingFaceTB/SmolVLM2-256M-Video-Instruct")
    assert is_hub_name("ggml-org/SmolVLM2-256M-Video-Instruct-GGUF:mmproj-f16.gguf")
    assert not is_hub_name("model.gguf") and not is_hub_name("/abs/path")
    (tmp_path / "org").mkdir()
    (tmp_path / "org" / "name").mkdir()
    monkeypatch.chdir(tmp_path)
    assert not is_hub_name("org/name")  # a local folder of that name wins
    assert resolve(None) is None


def test_a_cached_vision_model_loads_by_name_offline(hub_cache):
    done = cli("info", "--model", "test-org/tiny-smolvlm", "--offline", cache=hub_cache)
    assert done.returncode == 0, done.stderr
    assert "vision" in done.stdout and "idefics3" in done.stdout
    assert "16 tokens a frame" in done.stdout
    assert "test-org/tiny-smolvlm" in done.stdout  # named as asked, not by its snapshot


def test_an_uncached_name_offline_says_how_to_fix_it(hub_cache):
    done = cli("info", "--model", "test-org/absent-model", cache=hub_cache)
    assert done.returncode != 0
    assert "not in the Hugging Face cache" in done.stderr and "offline" in done.stderr
    assert "hf download test-org/absent-model" in done.stderr


def test_resolve_in_process_names_the_fix(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="not in the Hugging Face cache"):
        resolve("test-org/never-cached-model:model.gguf")
