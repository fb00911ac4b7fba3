"""Where inductor keeps its compiled graphs, set before torch loads (this module imports no
torch, so a command's process defaults can call it first)."""

from __future__ import annotations

import getpass
import os
import tempfile


def separate_inductor_cache() -> None:
    """Where PyTorch's kernels are told to take another instruction set
    (ATEN_CPU_CAPABILITY), keep inductor's compiled graphs in a cache of their own
    (TORCHINDUCTOR_CACHE_DIR, unless set): its cache key does not include the capability, and
    a later default process that loaded such graphs aborted in them. Call before torch
    compiles anything."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if capability and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{capability}")
