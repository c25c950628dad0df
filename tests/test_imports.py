"""The import structure of the package (docs/ARCHITECTURE.md, "The rooms"): no import cycle between its own modules
(counting imports inside functions and under `TYPE_CHECKING`), the model at the ground floor of the remote-code bundle
(`modeling_d3d` and `configuration_d3d` load no engine module when imported; the engine comes in through one lazy
seam), and bundle files of a readable size. Read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# where each part of the installed package `d3d_hf` lives in the checkout (pyproject.toml, `package-dir`)
PACKAGE_DIRS = {
    "d3d_hf": ROOT / "src" / "d3d_hf",
    "d3d_hf.modeling": ROOT / "modeling",
    "d3d_hf.kernels": ROOT / "src" / "d3d_hf" / "kernels",
}
#: issue 36: no file of the bundle or the library over 700 lines
MAX_FILE_LINES = 700
MAX_MODELING_LINES = 650
#: the model's ground floor: the bundle files that importing `modeling_d3d` or `configuration_d3d` may load
MODEL_FLOOR = {
    "configuration_d3d",
    "vocabulary_d3d",
    "runtime_d3d",
    "checkpoint_d3d",
    "drafting_d3d",
    "initialization_d3d",
    "adapters_d3d",
    "fast_paths_d3d",
    "layers_d3d",
    "modeling_d3d",
}
#: the one lazy seam: the engine modules `modeling_d3d` imports inside its methods only (the generation hook when a
#: drafter is created, the candidate generator when a `generate` call asks for one)
LAZY_SEAM = {"d3d_hf.modeling.modeling_d3d": {"d3d_hf.modeling.hooks_d3d", "d3d_hf.modeling.generation_d3d"}}


def _modules() -> dict[str, Path]:
    """Module name -> file, for every Python file of the package (a package's own name for its `__init__.py`)."""
    modules = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool, known) -> set[str]:
    """The package modules one import statement of `module` loads by name (a submodule when the name is one,
    otherwise the module or package it is imported from)."""
    if isinstance(node, ast.Import):
        found = set()
        for alias in node.names:
            parts = alias.name.split(".")
            prefixes = [".".join(parts[:i]) for i in range(len(parts), 0, -1)]
            found |= {next((p for p in prefixes if p in known), None)} - {None}
        return found
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    found = set()
    for alias in node.names:
        if f"{source}.{alias.name}" in known:
            found.add(f"{source}.{alias.name}")
        elif source in known:
            found.add(source)
    return found


def _runs_at_import(tree: ast.Module):
    """The nodes of a module that run when it is imported: all but function bodies and `if TYPE_CHECKING:` blocks."""
    stack = list(tree.body)
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph(module_level: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports anywhere in its file (module level, functions, `TYPE_CHECKING`), or
    with `module_level=True` only those its import runs."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _runs_at_import(tree) if module_level else ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges |= _imported(node, name, is_package, modules)
        graph[name] = edges - {name}
    return graph


def loaded_by(graph: dict[str, set[str]], module: str) -> set[str]:
    """The package modules that importing `module` loads (itself included), following `graph`."""
    seen, stack = set(), [module]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(graph.get(node, ()))
    return seen


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as `[a, b, ..., a]`, or `None`."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_model_imports_no_engine_module_at_module_level():
    """Importing `modeling_d3d` or `configuration_d3d` (what transformers' remote-code loading imports) loads only
    the model's floor, never the generation engine (generate hook, loops, generator, options, policy, planner, ...);
    `modeling_d3d` reaches the engine only through the lazy seam, imports inside its methods."""
    at_import, anywhere = import_graph(module_level=True), import_graph()
    for name in ("modeling_d3d", "configuration_d3d"):
        loaded = {m.rsplit(".", 1)[-1] for m in loaded_by(at_import, f"d3d_hf.modeling.{name}")}
        assert loaded - MODEL_FLOOR == set(), f"importing {name} loads engine modules {sorted(loaded - MODEL_FLOOR)}"
    model = "d3d_hf.modeling.modeling_d3d"
    assert anywhere[model] - at_import[model] == LAZY_SEAM[model]


def test_the_floor_check_sees_only_what_runs_at_import():
    source = "import a\nif TYPE_CHECKING:\n    import b\nclass C:\n    import c\ndef f():\n    import d\n"
    names = {alias.name for node in _runs_at_import(ast.parse(source)) for alias in getattr(node, "names", [])}
    assert names == {"a", "c"}


def test_bundle_and_library_files_stay_readable():
    files = [*(ROOT / "modeling").glob("*.py"), *(ROOT / "src" / "d3d_hf").rglob("*.py")]
    sizes = {str(path.relative_to(ROOT)): len(path.read_text(encoding="utf-8").splitlines()) for path in files}
    assert {name: n for name, n in sizes.items() if n > MAX_FILE_LINES} == {}
    assert sizes["modeling/modeling_d3d.py"] <= MAX_MODELING_LINES


def test_architecture_lists_the_bundle_in_import_order():
    """docs/ARCHITECTURE.md's table of `modeling/` lists every bundle file once, each after the files it imports
    (`modeling_d3d` with the model's floor, after the files it imports but the lazy seam's)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    listed = re.findall(r"^\| `(\w+)\.py` \|", text, flags=re.MULTILINE)
    files = sorted(path.stem for path in (ROOT / "modeling").glob("*.py") if path.stem != "__init__")
    assert sorted(listed) == files, "add or remove rows of the table"
    graph = import_graph()
    for i, name in enumerate(listed):
        edges = graph[f"d3d_hf.modeling.{name}"] - LAZY_SEAM.get(f"d3d_hf.modeling.{name}", set())
        imported = {m.rsplit(".", 1)[-1] for m in edges if m.startswith("d3d_hf.modeling.")}
        assert imported <= set(listed[:i]), f"{name} imports {sorted(imported - set(listed[:i]))} listed below it"
