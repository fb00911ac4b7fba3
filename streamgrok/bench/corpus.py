"""Long real text available offline: the Python standard library's own source files."""

from __future__ import annotations

import sysconfig
from pathlib import Path


def stdlib_text(min_chars: int, skip_chars: int = 0) -> str:
    """At least `min_chars` of Python source, files in sorted order (deterministic)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if skip_chars > 0:
            skip_chars -= len(text)
            continue
        parts.append(f"# file: {path.name}\n{text}\n")
        total += len(parts[-1])
        if total >= min_chars:
            break
    if total < min_chars:
        raise RuntimeError(f"the standard library holds only {total} characters of source")
    return "".join(parts)
