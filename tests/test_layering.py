"""The package map holds: kernels (installed as streamgrok_kernels) <- model <- vision <-
loading <- cache <- engine <- media <- pipeline <- server <- bench <- the command line <- the
unshipped research harnesses (benchmarks/), every module in one of them; and no file-level
import cycle, whether the imports run or only serve type checking, except the few
`TYPE_CHECKING` handles listed below. Checked on the import statements of every module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).parents[1]
LAYERS = [
    ("streamgrok_kernels",),
    ("streamgrok.model",),
    ("streamgrok.vision",),
    ("streamgrok.loading",),
    ("streamgrok.cache",),
    ("streamgrok.engine",),
    ("streamgrok.media",),
    ("streamgrok.pipeline",),
    ("streamgrok.server",),
    ("streamgrok.bench",),
    ("streamgrok.cli", "streamgrok.logs", "streamgrok.inductor_cache", "streamgrok.__main__"),
    ("benchmarks",),  # the research harnesses of the checkout, not shipped
]
# small leaf modules any layer above the kernels may use (errors, shared value types, process
# settings); the package itself (`__version__`, and lazy exports it resolves on first use)
ANYWHERE = ("streamgrok.errors", "streamgrok.modality", "streamgrok.stream_tokens",
            "streamgrok.channel", "streamgrok.runtime", "streamgrok.openmp_wait", "streamgrok")
# imports made only for type checking that close a cycle: an owned object's handle on its
# owner (the import runs the other way). Each is one file importing one file.
TYPE_HANDLES = {
    # the step runners annotate the model they run; the model picks its runner
    ("streamgrok.model.compiled_decode", "streamgrok.model.llama"),
    ("streamgrok.model.native_decode", "streamgrok.model.llama"),
    ("streamgrok.model.native_decode", "streamgrok.model.compiled_decode"),
    # a session's handle on its engine
    ("streamgrok.engine.session", "streamgrok.engine.engine"),
    # the ingest stages annotate the ingest that builds them
    ("streamgrok.pipeline.ingest_stages", "streamgrok.pipeline.ingest"),
    # the package's lazy exports, typed for editors
    ("streamgrok", "streamgrok.server.app"),
    # the HTTP routes annotate the server that builds them
    ("streamgrok.server.http_app", "streamgrok.server.app"),
    ("streamgrok.server.openai_api", "streamgrok.server.app"),
    # a connection's resumable part, and the context it is given, name the connection
    ("streamgrok.server.resumable", "streamgrok.server.connection"),
    ("streamgrok.server.session_context", "streamgrok.server.connection"),
    ("streamgrok.server.answer_stream", "streamgrok.server.connection"),
}


def module_files() -> dict[str, Path]:
    """Every module of the package, the kernels and the research harnesses, by import name."""
    found = {}
    for path in [*ROOT.glob("kernels/*.py"), *ROOT.glob("streamgrok/**/*.py"),
                 *ROOT.glob("benchmarks/*.py")]:
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(("streamgrok_kernels", *parts[1:]) if parts[0] == "kernels"
                       else parts)] = path
    return found


MODULES = module_files()


def layer_of(module: str) -> int | None:
    matches = [i for i, names in enumerate(LAYERS) for name in names
               if module == name or module.startswith(name + ".")]
    return matches[-1] if matches else None


def imports(path: Path) -> list[tuple[str, bool]]:
    """(imported name, whether only under `if TYPE_CHECKING:`) for every import in a file,
    `from a import b` giving both `a.b` and `a`."""
    tree = ast.parse(path.read_text())
    typing_only = {id(sub) for node in ast.walk(tree)
                   if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                   for sub in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found += [(name, id(node) in typing_only) for name in names]
    return found


def module_named(name: str) -> str | None:
    """The module an imported name lives in (its longest prefix that is a module)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, dict[str, bool]]:
    """module -> {module it imports: whether only for type checking}."""
    graph: dict[str, dict[str, bool]] = {}
    for module, path in MODULES.items():
        edges: dict[str, bool] = {}
        for name, typing_only in imports(path):
            target = module_named(name)
            if target is not None and target != module:
                edges[target] = edges.get(target, True) and typing_only
        graph[module] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_every_module_has_a_layer():
    assert [m for m in MODULES if layer_of(m) is None and m not in ANYWHERE] == []


def test_no_module_imports_a_layer_above_its_own():
    wrong = []
    for module, edges in import_graph().items():
        own = layer_of(module)
        if own is None:
            continue
        for target, typing_only in edges.items():
            if target in ANYWHERE:
                if own == 0:
                    wrong.append(f"{module} -> {target} (kernels need nothing of streamgrok)")
                continue
            theirs = layer_of(target)
            if theirs is not None and theirs > own and (module, target) not in TYPE_HANDLES:
                wrong.append(f"{module} -> {target}" + (" (type checking)" if typing_only
                                                        else ""))
    assert wrong == []


def test_no_file_level_import_cycle():
    graph = {module: {t for t in edges if (module, t) not in TYPE_HANDLES}
             for module, edges in import_graph().items()}
    assert cycles(graph) == []


def test_the_type_handles_are_still_there_and_only_for_type_checking():
    graph = import_graph()
    assert [(a, b) for a, b in sorted(TYPE_HANDLES) if graph[a].get(b) is not True] == []
