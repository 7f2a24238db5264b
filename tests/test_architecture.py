"""The package's import graph, read with `ast` from the source: no cycles, core's layers in order.

Every import counts, function-local and `if TYPE_CHECKING:` ones included: a cycle or an upward
import hidden in a function is still one. docs/architecture.md explains the layers.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "salience"
# core's subpackages, lowest first: each may import those before it, never one after it.
LAYERS = ("models", "features", "probes", "engine", "serving")
# What core may import from the rest of Salience: the one error taxonomy.
CORE_MAY_IMPORT = {"salience.errors"}
# Libraries that mean sockets or a wire: frontends own them.
WIRE_LIBRARIES = {"aiohttp", "grpc", "websockets", "socket", "prometheus_client"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {
        _module_name(path): path
        for path in PACKAGE.rglob("*.py")
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))
    }


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module `name` imports: Salience's own by module name, other libraries by their top name."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:  # `from salience.lmtp import streams` imports a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {target if target.startswith("salience") else target.split(".")[0] for target in found}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["salience", "core"] else None


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among Salience's modules, as the path around it, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in graph:
                continue
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (found := visit(target)):
                return found
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (found := visit(module)):
            return found
    return None


def test_the_graph_is_read(graph: dict[str, set[str]]) -> None:
    # The checks below mean something only if the graph holds what the package is made of.
    assert {f"salience.core.{layer}" for layer in LAYERS} <= set(graph)
    assert "salience.core.engine.engine" in graph["salience.core.serving.sessions"]
    assert "salience.lmtp.streams" in graph["salience.lmtp.running"]  # `from salience.lmtp import streams`
    assert "salience.core.engine.start.launch" in graph["salience.core.engine.start.startup"]


def test_no_import_cycles(graph: dict[str, set[str]]) -> None:
    assert _cycle(graph) is None, " -> ".join(_cycle(graph) or [])


def test_the_cycle_finder_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_core_layers_import_downwards(graph: dict[str, set[str]]) -> None:
    upward = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if (layer := _layer(module))
        for target in targets
        if (other := _layer(target)) and LAYERS.index(other) > LAYERS.index(layer)
    ]
    assert not upward, upward


def test_every_core_module_is_in_a_layer(graph: dict[str, set[str]]) -> None:
    loose = [m for m in graph if m.startswith("salience.core.") and _layer(m) not in LAYERS]
    assert not loose, loose


def test_core_imports_no_frontend_and_no_wire(graph: dict[str, set[str]]) -> None:
    outside = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if module.startswith("salience.core")
        for target in targets
        if (target.startswith("salience") and not target.startswith("salience.core") and target not in CORE_MAY_IMPORT)
        or target in WIRE_LIBRARIES
    ]
    assert not outside, outside


def test_the_inspect_provider_imports_no_server_code(graph: dict[str, set[str]]) -> None:
    # salience.evals is part of the client-only install (`salience[inspect]`): nothing it reaches
    # may be core, vLLM or the model libraries.
    reached, todo = set(), [m for m in graph if m.startswith("salience.evals")]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo.extend(graph.get(module, ()))
    server = sorted(m for m in reached if m.startswith("salience.core") or m in {"vllm", "torch", "transformers"})
    assert "salience.evals.provider" in reached and not server, server


FRONTENDS = ("salience.lmtp", "salience.openai", "salience.grpc_frontend")


def test_frontends_import_no_other_frontend(graph: dict[str, set[str]]) -> None:
    # Each frontend is a translation onto the core; what composes them (salience.http_app,
    # salience.server) sits above all of them.
    def frontend(module: str) -> str | None:
        return next((f for f in FRONTENDS if module == f or module.startswith(f + ".")), None)

    crossing = [
        f"{module} imports {target}"
        for module, targets in graph.items()
        if (mine := frontend(module)) is not None
        for target in targets
        if (theirs := frontend(target)) is not None and theirs != mine
    ]
    assert not crossing, crossing
    assert "salience.openai.app" in graph["salience.http_app"]  # the check sees the composition's imports


# What a request asks of the engine besides its prompt and sampling: requests.Probes holds them.
REQUEST_OPTIONS = {"readout_ranges", "readout_view", "steer", "monitors", "residual", "features"}


def _loose_options(tree: ast.AST) -> list[tuple[str, list[str]]]:
    """Functions that take three or more request options one by one, by name, with the options
    they take. (Outputs such as TokenEvent carry monitors' events and rows: not options.)"""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        arguments = node.args
        names = [a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]]
        taken = sorted(REQUEST_OPTIONS.intersection(names))
        if len(taken) >= 3:
            found.append((node.name, taken))
    return found


def test_core_takes_request_options_as_one_value() -> None:
    # Issue 49: a new option is one field of Probes, not a parameter threaded through every call.
    loose = [
        f"{path.relative_to(PACKAGE.parent)}: {name} takes {', '.join(taken)}"
        for path in sorted((PACKAGE / "core").rglob("*.py"))
        for name, taken in _loose_options(ast.parse(path.read_text(), str(path)))
    ]
    assert not loose, loose


def test_the_options_check_finds_loose_ones() -> None:
    source = (
        "def f(prompt, *, steer=(), monitors=(), residual=None): ...\nclass T:\n    steer: int\n    features: int\n"
    )
    assert _loose_options(ast.parse(source)) == [("f", ["monitors", "residual", "steer"])]
