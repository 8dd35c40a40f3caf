"""The package's import graph: no circle between modules (imports inside functions count too: a circle hidden in a
function is still a circle), and no upward arrow between the layers docs/layout.md describes.

Layers, lowest first; a module may import from its own layer and the ones below:
foundations (options, records, ...) < data and models < training and privacy < run outputs (results, figures,
tracking) < the strategy registry < the run-config value (settings) < the contract < the methods (strategies/) < the
run-config assembly (config) < entry points and tools (server_app, site_app, predict, ...).
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "medflower"

LAYERS: tuple[tuple[str, ...], ...] = (
    ("options", "records", "run_folder", "engine", "profiling", "site_errors"),
    ("data", "models"),
    ("training", "privacy"),
    ("results", "figures", "tracking"),
    ("contract.registry",),
    ("settings",),
    ("contract",),
    ("strategies",),
    ("config",),
)  # every other module: entry points and tools, the top layer


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, modules: set[str]) -> set[str]:
    """The package modules ``path`` imports, anywhere in the file (``from . import x`` names module x)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name.removeprefix("medflower.") for a in node.names if a.name.startswith("medflower.")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                base_parts = parts[: len(parts) - (node.level - 1)] + ([node.module] if node.module else [])
                base = ".".join(p for p in base_parts if p)
            elif node.module and node.module.startswith("medflower"):
                base = node.module.removeprefix("medflower").lstrip(".")
            else:
                continue
            targets = [
                f"{base}.{a.name}".lstrip(".") if f"{base}.{a.name}".lstrip(".") in modules else base
                for a in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def layer_of(module: str) -> int:
    best, depth = len(LAYERS), -1
    for index, names in enumerate(LAYERS):
        for prefix in names:
            if (module == prefix or module.startswith(prefix + ".")) and prefix.count(".") > depth:
                best, depth = index, prefix.count(".")
    return best


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    files.pop("", None)
    return {name: imports(path, set(files)) for name, path in files.items()}


def test_no_module_imports_itself_back_through_others(graph):
    try:
        tuple(TopologicalSorter(graph).static_order())
    except CycleError as err:
        pytest.fail(f"import circle: {' -> '.join(err.args[1])}")


def test_no_layer_imports_a_layer_above_it(graph):
    upward = [
        f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if layer_of(b) > layer_of(a)
    ]
    assert not upward, "\n".join(upward)


def test_the_contract_imports_no_method(graph):
    assert not {b for a, t in graph.items() if a.startswith("contract") for b in t if b.startswith("strategies")}


def test_the_checker_sees_an_upward_arrow_and_a_circle(tmp_path):
    """The checks can fail: a lower module importing the contract, and two modules importing each other."""
    assert layer_of("data.sources") < layer_of("contract.server") < layer_of("strategies.sgca")
    assert layer_of("contract.registry") < layer_of("settings") < layer_of("contract.client")
    with pytest.raises(CycleError):
        tuple(TopologicalSorter({"a": {"b"}, "b": {"a"}}).static_order())
    (tmp_path / "x.py").write_text("from .contract.server import FederatedStrategy\nimport medflower.strategies\n")
    original = PACKAGE
    try:
        globals()["PACKAGE"] = tmp_path
        assert imports(tmp_path / "x.py", {"contract.server", "strategies"}) == {"contract.server", "strategies"}
    finally:
        globals()["PACKAGE"] = original
