"""The layout's dependency rule, read from the source with ast (no module is imported).

    app/, bench/  ->  deployments/  ->  pipeline/ subpackages (api, engine, speculative, vision,
    models, prepare, capacity, router, synthetic_checkpoints) and modules (config, metrics)
    ->  kernels/

A layer imports only from the layers to its right; kernels import nothing of the project but
moonserve.kernels; pipeline/api (the pure HTTP edge) imports neither ray, torch nor vllm, not even
through the project modules it imports; every import is absolute under `moonserve.`; no module
imports itself back through others. Imports inside functions count like module-level ones.
The checker takes the repository root, so the tests at the end run it over small trees in
tmp_path with a forbidden edge to show that it reports them.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Source folder -> import name, as in pyproject.toml's [tool.setuptools] package-dir.
ROOTS = {"pipeline": "moonserve.pipeline", "deployments": "moonserve.deployments",
         "kernels": "moonserve.kernels"}
TOP_LAYER = ("moonserve.pipeline.app", "moonserve.pipeline.bench")
HEAVY = {"ray", "torch", "vllm"}  # what the pure HTTP edge must not import


@dataclass(frozen=True)
class Import:
    file: str  # relative to the root, e.g. "pipeline/api/errors.py"
    line: int
    importer: str  # e.g. "moonserve.pipeline.api.errors"
    target: str  # absolute, the most specific module named ("" for a relative import)
    written: str  # as in the source, e.g. "from ..errors import bad_request"

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: `{self.written}`"


def module_name(relative: Path) -> str:
    """pipeline/api/errors.py -> moonserve.pipeline.api.errors (an __init__.py: its package)."""
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([ROOTS[parts[0]], *parts[1:]])


def source_files(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py under the three source folders."""
    files = {}
    for folder in ROOTS:
        for path in sorted((root / folder).rglob("*.py")):
            if "__pycache__" not in path.parts:
                files[module_name(path.relative_to(root))] = path
    return files


def imports_of(tree: ast.AST, known: set[str]) -> Iterator[tuple[int, str, str]]:
    """(line, target, written) for every import statement anywhere in `tree`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, f"import {alias.name}"
        elif isinstance(node, ast.ImportFrom):
            written = f"from {'.' * node.level}{node.module or ''} import " + \
                ", ".join(alias.name for alias in node.names)
            if node.level:
                yield node.lineno, "", written
                continue
            # `from pkg import module` names the module itself; else pkg, once per statement
            targets = {f"{node.module}.{alias.name}" for alias in node.names} & known
            for target in sorted(targets or {node.module}):
                yield node.lineno, target, written


def collect_imports(root: Path) -> list[Import]:
    files = source_files(root)
    found = []
    for importer, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        relative = path.relative_to(root).as_posix()
        found += [Import(relative, line, importer, target, written)
                  for line, target, written in imports_of(tree, set(files))]
    return found


def within(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def absolute_under_moonserve(imports: list[Import]) -> list[str]:
    relative = [f"{i}: relative import; write it absolute under moonserve."
                for i in imports if not i.target]
    bare = [f"{i}: bare `{i.target.split('.')[0]}`; import it as moonserve.{i.target}"
            for i in imports if i.target.split(".")[0] in ROOTS]
    return relative + bare


def kernels_import_only_kernels(imports: list[Import]) -> list[str]:
    return [f"{i}: kernels import nothing of the project but moonserve.kernels" for i in imports
            if within(i.importer, "moonserve.kernels") and within(i.target, "moonserve")
            and not within(i.target, "moonserve.kernels")]


def top_layer_imported_only_by_itself(imports: list[Import]) -> list[str]:
    return [f"{i}: only pipeline/app and pipeline/bench may import {i.target}" for i in imports
            if within(i.target, *TOP_LAYER) and not within(i.importer, *TOP_LAYER)]


def pipeline_does_not_import_deployments(imports: list[Import]) -> list[str]:
    return [f"{i}: pipeline/ (but app/ and bench/) sits below deployments/" for i in imports
            if within(i.importer, "moonserve.pipeline") and not within(i.importer, *TOP_LAYER)
            and within(i.target, "moonserve.deployments")]


def api_is_pure(imports: list[Import]) -> list[str]:
    """pipeline/api and the project modules it reaches import no ray, torch or vllm."""
    by_importer: dict[str, list[Import]] = {}
    for i in imports:
        by_importer.setdefault(i.importer, []).append(i)
    api = sorted(m for m in by_importer if within(m, "moonserve.pipeline.api"))
    parent: dict[str, str | None] = dict.fromkeys(api)  # module -> who imports it, from api on
    stack = list(api)
    while stack:
        for i in by_importer.get(stack.pop(), []):
            if within(i.target, "moonserve") and i.target not in parent:
                parent[i.target] = i.importer
                stack.append(i.target)
    return [f"{i}: pipeline/api must not reach {i.target.split('.')[0]}" + reached_by(m, parent)
            for m in sorted(parent) for i in by_importer.get(m, [])
            if i.target.split(".")[0] in HEAVY]


def reached_by(module: str, parent: dict[str, str | None]) -> str:
    """'' for an api module; else ' (a -> b -> module)' from the api module that reaches it."""
    chain = [module]
    while parent[chain[-1]] is not None:
        chain.append(parent[chain[-1]])
    return "" if len(chain) == 1 else f" ({' -> '.join(reversed(chain))})"


RULES: list[Callable[[list[Import]], list[str]]] = [
    absolute_under_moonserve, kernels_import_only_kernels, top_layer_imported_only_by_itself,
    pipeline_does_not_import_deployments, api_is_pure,
]


def import_cycles(imports: list[Import], known: set[str]) -> list[str]:
    """One cycle per strongly connected group of modules, each edge named by file and line."""
    edges: dict[str, dict[str, Import]] = {m: {} for m in known}
    for i in imports:
        if i.target in known and i.target != i.importer:
            edges[i.importer].setdefault(i.target, i)
    cycles = [cycle_in(group, edges) for group in strongly_connected(edges)]
    return [" -> ".join(str(edges[a][b]) for a, b in zip(cycle, cycle[1:])) for cycle in cycles]


def strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm; only the groups of two or more modules (those hold a cycle)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in edges[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            group = {stack.pop()}
            while node not in group:
                group.add(stack.pop())
            if len(group) > 1:
                groups.append(group)

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def cycle_in(group: set[str], edges: dict[str, dict[str, Import]]) -> list[str]:
    """The shortest cycle through the group's first module: [m0, m1, ..., m0] (breadth-first)."""
    start = min(group)
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for succ in sorted(edges[node]):
                if succ == start:
                    return [*path_back(node, start, parent)[::-1], start]
                if succ in group and succ not in parent:
                    parent[succ] = node
                    following.append(succ)
        frontier = following
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def path_back(node: str, start: str, parent: dict[str, str]) -> list[str]:
    path = [node]
    while path[-1] != start:
        path.append(parent[path[-1]])
    return path


def package_folders(root: Path) -> set[str]:
    return {module_name(init.relative_to(root)) for folder in ROOTS
            for init in (root / folder).rglob("__init__.py") if "__pycache__" not in init.parts}


def setuptools_mismatch(root: Path) -> list[str]:
    """What differs between [tool.setuptools] in pyproject.toml and the package folders."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed, folders = set(setuptools["packages"]), package_folders(root)
    problems = [f"pyproject.toml [tool.setuptools] packages lacks {p} (a folder with __init__.py)"
                for p in sorted(folders - listed)]
    problems += [f"pyproject.toml [tool.setuptools] packages lists {p}, which has no __init__.py"
                 for p in sorted(listed - folders)]
    if setuptools["package-dir"] != {name: folder for folder, name in ROOTS.items()}:
        problems.append(f"pyproject.toml package-dir is {setuptools['package-dir']}, not {ROOTS}")
    return problems


@pytest.fixture(scope="module")
def repo_imports() -> list[Import]:
    return collect_imports(REPO)


@pytest.mark.parametrize("rule", RULES, ids=lambda rule: rule.__name__)
def test_repository_follows_the_rule(repo_imports, rule):
    violations = rule(repo_imports)
    assert not violations, "\n".join(violations)


def test_repository_has_no_import_cycles(repo_imports):
    cycles = import_cycles(repo_imports, set(source_files(REPO)))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_setuptools_packages_are_the_package_folders():
    problems = setuptools_mismatch(REPO)
    assert not problems, "\n".join(problems)


def write_tree(root: Path, files: dict[str, str]) -> None:
    for relative, text in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


CLEAN_TREE = {
    "pipeline/__init__.py": "",
    "pipeline/config.py": "import pydantic\n",
    "pipeline/api/__init__.py": "",
    "pipeline/api/errors.py": "from moonserve.pipeline import config\n",
    "pipeline/vision/__init__.py": "from moonserve.pipeline.vision.errors import ImageError\n",
    "pipeline/vision/errors.py": "class ImageError(ValueError): ...\n",
    "pipeline/vision/preprocess.py": "import torch\nfrom moonserve.kernels.patchify import naive\n",
    "pipeline/app/__init__.py": "",
    "pipeline/app/cli.py": "from moonserve.deployments.builder import build_app\n",
    "pipeline/bench/__init__.py": "",
    "pipeline/bench/lanes.py": "import time\n",
    "deployments/__init__.py": "",
    "deployments/builder.py": "import ray\nfrom moonserve.pipeline.api import errors\n",
    "kernels/__init__.py": "",
    "kernels/patchify/__init__.py": "",
    "kernels/patchify/naive.py": "import torch\n",
}

# (file, source added to it, words the report must contain besides the file and the import)
FORBIDDEN_EDGES = [
    ("kernels/patchify/naive.py", "from moonserve.pipeline.config import X\n",
     "kernels import nothing"),
    ("pipeline/vision/preprocess.py", "def f():\n    from moonserve.deployments import builder\n",
     "sits below deployments"),
    ("deployments/builder.py", "import moonserve.pipeline.bench.lanes\n",
     "only pipeline/app and pipeline/bench"),
    ("pipeline/api/errors.py", "def f():\n    import ray.exceptions\n", "must not reach ray"),
    ("pipeline/config.py", "import torch\n",
     "must not reach torch (moonserve.pipeline.api.errors -> moonserve.pipeline.config)"),
    ("pipeline/api/errors.py", "from pipeline.vision import errors\n", "bare `pipeline`"),
    ("pipeline/vision/errors.py", "from .preprocess import f\n", "relative import"),
]


def violations_in(root: Path) -> list[str]:
    imports = collect_imports(root)
    cycles = import_cycles(imports, set(source_files(root)))
    return [v for rule in RULES for v in rule(imports)] + cycles


def test_checker_passes_a_clean_tree(tmp_path):
    write_tree(tmp_path, CLEAN_TREE)
    assert violations_in(tmp_path) == []


@pytest.mark.parametrize("file, added, words", FORBIDDEN_EDGES)
def test_checker_reports_a_forbidden_edge(tmp_path, file, added, words):
    write_tree(tmp_path, {**CLEAN_TREE, file: CLEAN_TREE[file] + added})
    line = CLEAN_TREE[file].count("\n") + added.count("\n")
    written = added.strip().splitlines()[-1].strip()
    (violation,) = violations_in(tmp_path)
    assert violation.startswith(f"{file}:{line}: `{written}`: ") and words in violation


def test_checker_reports_an_import_cycle_with_its_edges(tmp_path):
    lazy = "from moonserve.pipeline.vision import preprocess"
    back = "from moonserve.pipeline.vision.errors import ImageError"
    write_tree(tmp_path, {**CLEAN_TREE, "pipeline/vision/errors.py": f"def f():\n    {lazy}\n",
                          "pipeline/vision/preprocess.py": f"{back}\n"})
    (cycle,) = violations_in(tmp_path)
    assert cycle == (f"pipeline/vision/errors.py:2: `{lazy}`"
                     f" -> pipeline/vision/preprocess.py:1: `{back}`")


def test_checker_reports_setuptools_packages_that_differ_from_the_folders(tmp_path):
    write_tree(tmp_path, CLEAN_TREE)
    package_dir = ", ".join(f'"{name}" = "{folder}"' for folder, name in ROOTS.items())
    listed = sorted(package_folders(tmp_path) - {"moonserve.pipeline.vision"})
    listed.append("moonserve.pipeline.gone")
    packages = ", ".join(f'"{p}"' for p in listed)
    (tmp_path / "pyproject.toml").write_text(
        f"[tool.setuptools]\npackage-dir = {{ {package_dir} }}\npackages = [{packages}]\n")
    assert setuptools_mismatch(tmp_path) == [
        "pyproject.toml [tool.setuptools] packages lacks moonserve.pipeline.vision "
        "(a folder with __init__.py)",
        "pyproject.toml [tool.setuptools] packages lists moonserve.pipeline.gone, "
        "which has no __init__.py",
    ]
