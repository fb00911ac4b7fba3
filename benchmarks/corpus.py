"""Long real text available offline: the Python standard library's own source files and the
Python documentation's topics (English prose)."""

from __future__ import annotations

import sysconfig
from collections.abc import Callable
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


def prose_text(min_chars: int, skip_chars: int = 0) -> str:
    """`min_chars` of English prose from `skip_chars` on: the Python documentation's topics
    (repeated when more is asked for than they hold)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    while len(text) < skip_chars + min_chars:
        text += "\n\n" + text
    return text[skip_chars : skip_chars + min_chars]


def long_ids(tokenizer, text: Callable[..., str], tokens: int, piece: int = 400_000
             ) -> list[int]:
    """`tokens` token ids of `text(min_chars, skip_chars=...)`, encoded `piece` characters at
    a time."""
    ids: list[int] = []
    skip = 0
    while len(ids) < tokens:
        ids += tokenizer.encode(text(piece, skip_chars=skip))
        skip += piece
    return ids[:tokens]
