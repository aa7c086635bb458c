"""The repository passes its linter (ruff, configured in pyproject.toml), installs as a package, and its import
graph has no circle and no arrow back up a declared floor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_package_is_installed_from_this_checkout_not_found_through_sys_path_edits():
    # A fresh interpreter outside the repository finds the package through the editable install alone.
    code = "import eagle_pipeline, patches, bench; print(eagle_pipeline.__file__)"
    result = subprocess.run([sys.executable, "-c", code], cwd="/", capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()).resolve().parent.parent == REPO


def test_no_code_edits_the_import_path():
    offenders = [str(p.relative_to(REPO)) for p in REPO.rglob("*.py")
                 if ".venv" not in p.parts and "runs" not in p.parts and "sys.path.insert" in p.read_text(errors="replace")
                 and p.name != "test_lint.py"]
    assert not offenders, f"sys.path edits in {offenders}; the editable install (pyproject.toml) makes them unnecessary"


# -- the import graph ------------------------------------------------------------------------------
# The product's modules: the packages, the stage scripts and scripts/*.py (named by file, e.g. "02_extract_hidden").
PACKAGES = ("eagle_pipeline", "patches", "bench")
ENTRY_POINTS = ("0[1-9]_*.py", "scripts/*.py")
# Floors already declared, each (who, what it must not import): an arrow from `who` into `what` points back up.
# The stage scripts, scripts/ and bench/ sit on top. The drafter folder package (and released_drafter, which stage
# 03 imports) imports no stage module, none of stage 05's checks and not the conversion: what a drafter folder is
# must not depend on who uses it.
STAGE_SCRIPTS_AND_TOOLS = ("bench", "scripts", *(f"0{n}_" for n in range(1, 10)))
FLOORS = (
    (("eagle_pipeline", "patches"), STAGE_SCRIPTS_AND_TOOLS),
    (("eagle_pipeline.drafter", "eagle_pipeline.released_drafter"),
     ("eagle_pipeline.drafter_checks", "eagle_pipeline.convert", "eagle_pipeline.stage", "eagle_pipeline.serve",
      "eagle_pipeline.train", "eagle_pipeline.predict", "eagle_pipeline.online")),
)


def _module_files(repo: Path) -> dict[str, Path]:
    files = [p for package in PACKAGES for p in (repo / package).rglob("*.py")]
    files += [p for pattern in ENTRY_POINTS for p in repo.glob(pattern)]
    modules = {}
    for path in files:
        parts = list(path.relative_to(repo).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def import_graph(repo: Path = REPO) -> dict[str, set[str]]:
    """Module -> the product modules it imports, from every import statement in its file: module level, inside
    functions and under TYPE_CHECKING alike (an import deferred into a function still closes a circle)."""
    import ast

    modules = _module_files(repo)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                names = [f"{base}.{alias.name}" for alias in node.names]  # `from a import b`: module a.b, or a's b
            else:
                continue
            for dotted in names:  # the longest prefix of each that is a product module
                parts = dotted.split(".")
                found = next((".".join(parts[:n]) for n in range(len(parts), 0, -1) if ".".join(parts[:n]) in modules),
                             None)
                if found is not None and found != name:
                    imported.add(found)
        graph[name] = imported
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p if p.endswith("_") else p + ".") for p in prefixes)


def test_the_import_graph_has_no_circle():
    """A circle means no module of it can be understood or tested without the others; move the shared piece down
    to the lower module (or a new small one) rather than deferring an import into a function."""
    graph = import_graph()
    assert len(graph) > 100 and "eagle_pipeline.stage" in graph["02_extract_hidden"]
    circles = import_circles(graph)
    arrows = [f"{a} -> {b}" for part in circles for a in part for b in sorted(graph[a]) if b in part]
    assert not circles, f"import circles {circles}: {arrows}"


def test_no_import_points_back_up_a_declared_floor():
    graph = import_graph()
    back_up = [f"{module} -> {target}" for lower, upper in FLOORS for module, targets in graph.items()
               if _within(module, lower) for target in sorted(targets) if _within(target, upper)]
    assert not back_up, f"imports back up the declared floors (tests/test_lint.py FLOORS): {back_up}"


def _part(module: str) -> str:
    """The part of the package a module belongs to: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    return parts[1] if parts[0] == "eagle_pipeline" and len(parts) > 2 else module


def test_no_two_parts_of_the_package_import_each_other():
    """A knot of folders (online/ -> serve/ -> predict/ -> engine.py -> online/) is a circle one level up: none of
    them can be read without the others. The stage's plan (plan/) and stage.py sit above what they plan and run."""
    graph = {name: targets for name, targets in import_graph().items() if name.startswith("eagle_pipeline")}
    parts: dict[str, set[str]] = {}
    for name, targets in graph.items():
        parts.setdefault(_part(name), set()).update(_part(t) for t in targets if _part(t) != _part(name))
    knots = import_circles({part: {t for t in targets if t in parts} for part, targets in parts.items()})
    assert not knots, f"parts of the package that import each other: {knots}"
    below_the_plan = [f"{name} -> {target}" for name, targets in graph.items() for target in targets
                      if _part(target) in ("plan", "eagle_pipeline.stage")
                      and _part(name) not in ("plan", "eagle_pipeline.stage")]
    assert not below_the_plan, f"imports of the plan or the stage from below them: {below_the_plan}"


def test_project_imports_inside_functions_are_few_and_defer_something_heavy():
    """An import of the project's own modules inside a function hides a dependency from the reader; it is kept
    only where it defers a heavy import (torch, vLLM) that a light caller need not pay for."""
    import ast

    inside = []
    for name, path in _module_files(REPO).items():
        tree = ast.parse(path.read_text())
        for function in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
                    inside.append(f"{name}: {node.module}")
    assert 0 < len(inside) <= 60, inside


# -- line length ------------------------------------------------------------------------------------
MAX_COLUMNS = 120
PRODUCT_FILES = ("eagle_pipeline/**/*.py", "0[1-9]_*.py", "patches/*.py")


def test_product_lines_fit_in_120_columns():
    files = sorted({p for pattern in PRODUCT_FILES for p in REPO.glob(pattern)})
    assert len(files) > 100
    too_long = [f"{p.relative_to(REPO)}:{n}" for p in files
                for n, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_COLUMNS]
    assert not too_long, f"lines over {MAX_COLUMNS} columns (wrap them): {too_long}"
