"""The package graph is acyclic: kernels (installed as streamgrok_kernels) <- model <- cache <-
engine <- pipeline <- server, with cli and bench on top. Checked on the import statements of
every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
LAYERS = ["streamgrok_kernels", "streamgrok.model", "streamgrok.cache", "streamgrok.engine",
          "streamgrok.media", "streamgrok.pipeline", "streamgrok.server", "streamgrok.bench"]
ANYWHERE = ("streamgrok.errors", "streamgrok.modality", "streamgrok.stream_tokens",
            "streamgrok.channel", "streamgrok.runtime")


def layer_of(module: str) -> int | None:
    matches = [i for i, name in enumerate(LAYERS) if module == name or
               module.startswith(name + ".")]
    return matches[-1] if matches else None


def imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(node.module)
        elif isinstance(node, ast.Import):
            found.extend(alias.name for alias in node.names)
    return found


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for path in [*ROOT.glob("kernels/*.py"), *ROOT.glob("streamgrok/**/*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        module = ".".join(("streamgrok_kernels", *parts[1:]) if parts[0] == "kernels" else parts)
        own = layer_of(module)
        if own is None:
            continue
        for target in imports(path):
            if target.startswith(ANYWHERE):
                if own == 0:
                    wrong.append(f"{module} -> {target} (kernels need nothing of streamgrok)")
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > own:
                wrong.append(f"{module} -> {target}")
    assert wrong == []
