"""The engine's import graph: the engine never imports Prefect, and a stage's cache key hashes the source of
every engine module the stage runs (`fulltune.stages.STAGE_CODE`).

The second is read from the source, not from a run: a stage runs the engine names its Prefect task uses
(tasks/*.py), and those run what they reference, transitively, down to single functions and classes; a
string naming an engine module (`python -m fulltune.train`, the fine-tune stage's child) runs that module.
Imports inside functions count as much as those at the top of a module — most of the engine imports lazily,
so that `fulltune validate` stays light — and a module counts only when something the stage runs is in it:
`fulltune/stages.py` holds one stage's planning beside every stage's keys, and tokenizing runs none of it.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fulltune"
ORCHESTRATION = ("prefect", "flows", "tasks")  # Prefect, and the repository's flow and task packages over it

# Engine modules a stage may run without its key hashing them, and why.
NOT_HASHED = {
    "fulltune": "the package's version, which every key already holds (storage.code_version)",
    "fulltune.errors": "exception types: which message a failure prints, not what a stage computes",
}
# Engine names a task uses that report on a stage without deciding what it computes: log lines, MLflow tags
# and metrics, and the cache's own record of a stage's outputs.
REPORTING = {"describe_settings", "log_metrics", "set_run_tags", "record_outputs", "code_version"}


def module_name(path: Path) -> str:
    """The dotted name of the module at `path` in this repository."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_modules() -> list[str]:
    """Every module of the engine package, by dotted name."""
    return [module_name(path) for path in sorted(PACKAGE.rglob("*.py"))]


def module_path(name: str) -> Path | None:
    """The source file of module `name` in this repository, or None if it is not one of its modules."""
    base = ROOT.joinpath(*name.split("."))
    for candidate in (base / "__init__.py", base.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


# ---------------------------------------------------------------------------------------------------
# The engine never imports Prefect


def test_importing_every_engine_module_imports_no_orchestration() -> None:
    # A fresh interpreter: this test process has Prefect loaded by other tests' fixtures.
    probe = ("import importlib, json, sys\n"
             f"for name in {engine_modules()!r}:\n"
             "    importlib.import_module(name)\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {ORCHESTRATION!r})))")
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(loaded.stdout.splitlines()[-1]) == []


def test_no_engine_module_imports_prefect_even_inside_a_function() -> None:
    # Importing every module runs only their top-level imports; the engine imports most things lazily.
    # fulltune/cli.py is the one door from the engine to the flow (`fulltune run`, `fulltune serve`).
    found = [f"{path.relative_to(ROOT)}:{line}: {target}"
             for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "cli.py"
             for line, target in imported_names(path) if target.split(".")[0] in ORCHESTRATION]
    assert found == []


def test_validate_imports_neither_prefect_nor_mlflow() -> None:
    # `fulltune validate` is the pre-commit check of a pipelines file: it must not pay for the servers' clients.
    probe = ("import json, sys\n"
             "from fulltune.cli import main\n"
             f"code = main(['validate', '-f', {str(ROOT / 'pipelines.yaml')!r}])\n"
             f"print(json.dumps([code, sorted({{m.split('.')[0] for m in sys.modules}} & {{*{ORCHESTRATION!r}, 'mlflow'}})]))")
    ran = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(ran.stdout.splitlines()[-1]) == [0, []]


def imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement in `path`, at any depth."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            found.append((node.lineno, absolute(node, package)))
    return found


def absolute(node: ast.ImportFrom, package: str) -> str:
    """The module an ImportFrom names, relative imports resolved against `package`."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))
