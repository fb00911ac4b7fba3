"""What a streamed token came from (torch-free, so media worker processes can use it)."""

from __future__ import annotations

from enum import IntEnum


class Modality(IntEnum):
    """What a cached token came from."""

    TEXT = 0
    FRAME = 1
    AUDIO = 2
    NOTE = 3
