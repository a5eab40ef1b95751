"""The engine's import graph: the engine never imports Prefect, and a stage's cache key hashes the source of
every engine module the stage runs (its `code`, fulltune/stages/runner.py).

The second is read from the source, not from a run: a stage runs its `run` function and its task's artifacts
(tasks/artifacts.py), and those run what they reference, transitively, down to single functions and classes; a
string naming an engine module (`python -m fulltune.runtime.train`, the fine-tune stage's child) runs that module.
Imports inside functions count as much as those at the top of a module — most of the engine imports lazily,
so that `fulltune validate` stays light — and a module counts only when something the stage runs is in it.
The stages are read from the engine's registry (fulltune/stages/runner.py `registry`), none named here.
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from pipelines_fixture import tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "fulltune"
ORCHESTRATION = ("prefect", "flows", "tasks")  # Prefect, and the repository's flow and task packages over it

# Engine modules a stage may run without its key hashing them, and why.
NOT_HASHED = {
    "fulltune": "the package's version, which every key already holds (storage.code_version)",
    "fulltune.errors": "exception types: which message a failure prints, not what a stage computes",
    "fulltune.memory.errors": "exception types: which message a failure prints, not what a stage computes",
    "fulltune.spec": "the pipelines file's schema: a stage reads the validated values, which its key hashes",
    "fulltune.spec_gates": "the schema's evaluate and register sections: read as validated values, which keys hash",
    "fulltune.logs": "which library log lines are dropped: what a stage prints, not what it computes",
}
# Engine functions a stage calls beside computing its result: they word it for people (log lines, MLflow tags,
# metrics and version descriptions, what a stage's record puts into the pipeline's MLflow run: its `track`, which
# version `@champion` loads now, for the registration's artifact),
# record it for the cache (the stage's marker), write a file atomically or time steps for autotune (the trainer's
# probe, which a pipeline's own training run does not turn on).
BESIDE_THE_RESULT = {"describe_settings", "describe_version", "comparison_tags", "log_metrics", "set_run_tags",
                     "record_outputs", "code_version", "atomic_write_text", "StepProbe", "track", "current_champion"}


def module_name(path: Path) -> str:
    """The dotted name of the module at `path` in this repository."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def engine_modules() -> list[str]:
    """Every module of the engine package, by dotted name."""
    return [module_name(path) for path in sorted(PACKAGE.rglob("*.py"))]


def module_path(name: str) -> Path | None:
    """The source file of module `name` in this repository, or None if it is not one of its modules."""
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", name):
        return None
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


def test_the_engine_imports_neither_the_measuring_harness_nor_the_tests() -> None:
    # measuring/ (the memory tests' and benchmarks' harness), benchmarks/ and tests/ sit beside the engine.
    found = [f"{path.relative_to(ROOT)}:{line}: {target}" for path in sorted(PACKAGE.rglob("*.py"))
             for line, target in imported_names(path) if target.split(".")[0] in ("measuring", "benchmarks", "tests")]
    assert found == []


def test_the_trainer_imports_neither_mlflow_nor_matplotlib_even_inside_a_function() -> None:
    # The trainer writes metrics.jsonl; the launcher forwards it to MLflow and draws the loss curve
    # (fulltune/runtime/run_tracking.py, which imports them only in the launching process's functions).
    found = [f"{path.relative_to(ROOT)}:{line}: {target}"
             for path in sorted((PACKAGE / "runtime").rglob("*.py")) if path.name != "run_tracking.py"
             for line, target in imported_names(path) if target.split(".")[0] in ("mlflow", "matplotlib")]
    assert found == []
    probe = "import sys, fulltune.runtime.train; print(sorted({m.split('.')[0] for m in sys.modules} & {'mlflow', 'matplotlib'}))"
    ran = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert ran.stdout.strip() == "[]"


def test_validate_imports_neither_prefect_nor_mlflow() -> None:
    # `fulltune validate` is the pre-commit check of a pipelines file: it must not pay for the servers' clients.
    heavy = {*ORCHESTRATION, "mlflow"}
    probe = ("import json, sys\n"
             "from fulltune.cli import main\n"
             f"code = main(['validate', '-f', {str(ROOT / 'pipelines.yaml')!r}])\n"
             f"print(json.dumps([code, sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r})]))")
    ran = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(ran.stdout.splitlines()[-1]) == [0, []]


# ---------------------------------------------------------------------------------------------------
# No import runs up the floors (docs/architecture.md, "The engine's folders")

# From the bottom up; a module of the package's root is on the foundations floor.
FLOORS = ("", "data", "memory", "runtime", "planning", "evaluation", "tracking", "stages", "cli")
# Imports that still run up, each one line to delete once its module moves: (importing module, imported module).
UP_FLOOR_ALLOWED: dict[tuple[str, str], str] = {}  # (importer, imported): why; none today


def floor(module: str) -> int:
    """The floor of engine module `module` (dotted)."""
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else 0


def test_no_engine_import_runs_up_the_floors() -> None:
    # Every import counts, inside functions and under TYPE_CHECKING too: a lazy import still ties the floors.
    found = sorted({(module_name(path), target) for path in sorted(PACKAGE.rglob("*.py"))
                    for _, target in imported_names(path)
                    if target.split(".")[0] == "fulltune" and floor(target) > floor(module_name(path))})
    assert [pair for pair in found if pair not in UP_FLOOR_ALLOWED] == []
    assert [pair for pair in UP_FLOOR_ALLOWED if pair not in found] == [], "an allowed import is gone: delete its line"


# Import circles inside one floor that remain, each one entry to delete once it is broken: (its modules): why.
CIRCLES_ALLOWED: dict[frozenset[str], str] = {
    frozenset({"fulltune.evaluation.champion", "fulltune.evaluation.evaluate", "fulltune.evaluation.sharded"}):
        "the evaluate stage compares with the champion and runs sharded candidates, both reusing its metrics",
    frozenset({"fulltune.stages.budget", "fulltune.stages.tokenize"}):
        "`data.packing: auto` is decided by the budget stage's planning while tokenizing",
    frozenset({"fulltune.runtime.async_checkpoints", "fulltune.runtime.step_checkpoints", "fulltune.runtime.train",
               "fulltune.runtime.train_metrics"}):
        "annotations only: the checkpoints, their background writer and the metrics read the trainer's `TrainingRun`",
}


def engine_import_graph() -> dict[str, set[str]]:
    """Engine module → the engine modules it imports (anywhere in it; `from package import module` counts as
    the module)."""
    modules = set(engine_modules())
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = module_name(path)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = absolute(node, package)
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {target for target in targets if target in modules and target != name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = set()

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = {stack.pop()}
            while v not in component:
                component.add(stack.pop())
            if len(component) > 1:
                circles.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return circles


def test_no_engine_import_circle_but_the_known_ones() -> None:
    # Every import counts, inside functions and under TYPE_CHECKING too. The memory model has none: it is read
    # bottom up (shapes → activations → timeline → walk → layouts → estimate).
    found = import_circles(engine_import_graph())
    assert sorted(map(sorted, found - set(CIRCLES_ALLOWED))) == []
    assert sorted(map(sorted, set(CIRCLES_ALLOWED) - found)) == [], "an allowed circle is gone: delete its entry"


def test_the_pipeline_flow_imports_tasks_only() -> None:
    # The flow orders the stages; their keys, the champion and the MLflow run are the tasks' (tasks/run.py).
    flow = ROOT / "flows" / "pipeline.py"
    assert [f"{line}: {target}" for line, target in imported_names(flow) if target.split(".")[0] == "fulltune"] == []


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


# ---------------------------------------------------------------------------------------------------
# Every engine module a stage runs is hashed into its cache key


@dataclass
class Source:
    """One module's top level: what each of its names is bound to, and what it imports under which name."""

    name: str
    tree: ast.Module
    bindings: dict[str, list[ast.AST]] = field(default_factory=dict)  # name → the def, class or assignment
    imports: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # name → (module, attribute)


@cache
def source(name: str) -> Source | None:
    """Module `name` parsed, or None when it is not one of this repository's modules."""
    path = module_path(name)
    if path is None:
        return None
    parsed = Source(name, ast.parse(path.read_text(), str(path)))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in parsed.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            parsed.bindings.setdefault(node.name, []).append(node)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for bound in ast.walk(target):
                    if isinstance(bound, ast.Name):
                        parsed.bindings.setdefault(bound.id, []).append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            parsed.imports.update(bound_imports(node, package))
    return parsed


def bound_imports(node: ast.Import | ast.ImportFrom, package: str) -> dict[str, tuple[str, str | None]]:
    """What an import statement binds: name → (module, None) for a module, (module, attribute) otherwise."""
    if isinstance(node, ast.Import):
        # `import a.b` binds `a`; `import a.b as c` binds `c` to a.b.
        return {alias.asname or alias.name.split(".")[0]: (alias.name if alias.asname else alias.name.split(".")[0],
                                                           None) for alias in node.names}
    module = absolute(node, package)
    return {alias.asname or alias.name: (f"{module}.{alias.name}", None) if module_path(f"{module}.{alias.name}")
            else (module, alias.name) for alias in node.names}


Unit = tuple[str, str | None]  # (module, top-level name), or (module, None) for the whole module


def references(module: Source, node: ast.AST) -> set[Unit]:
    """The engine units `node` (a top-level statement of `module`) uses when it runs.

    Annotations are skipped: under `from __future__ import annotations` they never run.
    """
    imports = dict(module.imports)
    for inner in ast.walk(node):  # imports inside functions, approximately scoped to the whole statement
        if isinstance(inner, (ast.Import, ast.ImportFrom)):
            path = module_path(module.name)
            imports.update(bound_imports(inner, module.name if path and path.name == "__init__.py"
                                         else module.name.rpartition(".")[0]))
    used: set[Unit] = set()
    for inner in walk_runtime(node):
        if (isinstance(inner, ast.Constant) and isinstance(inner.value, str) and inner.value.startswith("fulltune.")
                and module_path(inner.value)):
            used.add((inner.value, None))  # a module run by name: `python -m fulltune.runtime.train`
        elif isinstance(inner, (ast.Name, ast.Attribute)):
            chain = dotted(inner)
            if not chain:
                continue
            head, *rest = chain
            if head in imports:
                used.add(resolve(imports[head], rest))
            elif head in module.bindings:
                used.add((module.name, head))
    return {unit for unit in used if unit[0].split(".")[0] == "fulltune" and module_path(unit[0])}


def walk_runtime(node: ast.AST):
    """ast.walk, minus annotations, and without the parts of a name chain (`a.b.c` is one reference, not three)."""
    todo = [node]
    while todo:
        current = todo.pop()
        yield current
        if isinstance(current, ast.Attribute) and dotted(current):
            continue
        for name, value in ast.iter_fields(current):
            if name in ("annotation", "returns"):
                continue
            todo += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, ast.AST)]


def dotted(node: ast.AST) -> list[str]:
    """`a.b.c` as ["a", "b", "c"]; [] for an attribute of anything but a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else []


def resolve(target: tuple[str, str | None], attributes: list[str]) -> Unit:
    """The unit an imported name followed by `.attributes` denotes."""
    module, name = target
    if name is not None:
        return module, name
    for attribute in attributes:  # descend through submodules: `fulltune.planning.planner.plan`
        if not module_path(f"{module}.{attribute}"):
            return module, attribute
        module = f"{module}.{attribute}"
    return module, None


def reachable(entries: set[Unit]) -> dict[str, list[Unit]]:
    """The engine modules whose code runs when `entries` run, each with a chain of units that reaches it."""
    modules: dict[str, list[Unit]] = {}
    came_from: dict[Unit, Unit | None] = {unit: None for unit in entries}
    todo = list(entries)
    while todo:
        unit = todo.pop()
        module_name_, name = unit
        module = source(module_name_)
        if module is None or name in BESIDE_THE_RESULT or unit in stage_names():
            continue
        if name is not None and name not in module.bindings and name in module.imports:
            # A re-export (`from fulltune.memory import Settings`): the unit is where the name comes from.
            follow = [resolve(module.imports[name], [])]
        else:
            modules.setdefault(module_name_, chain(came_from, unit))
            statements = module.tree.body if name is None else module.bindings.get(name, [])
            follow = [used for statement in statements for used in references(module, statement)]
        for used in follow:
            if used not in came_from:
                came_from[used] = unit
                todo.append(used)
    return modules


def chain(came_from: dict[Unit, Unit | None], unit: Unit) -> list[Unit]:
    """The units from an entry to `unit`."""
    path = [unit]
    while came_from[path[-1]] is not None:
        path.append(came_from[path[-1]])
    return path[::-1]


def stage_entries(stage: Any) -> set[Unit]:
    """The engine units a stage runs: its `run`, and what its task's artifacts reference."""
    from tasks.artifacts import ARTIFACTS, WATCHES

    entries: set[Unit] = {(stage.run.__module__, stage.run.__name__)}
    for shown in (ARTIFACTS.get(stage.name), WATCHES.get(stage.name)):
        if shown is not None:
            module = source(shown.__module__)
            entries |= {unit for node in module.bindings[shown.__name__] for unit in references(module, node)}
    return entries


@cache
def stage_names() -> set[Unit]:
    """The stage-name constants of fulltune/stages (`FINE_TUNE`, ...): a stage reads another's record by its name,
    which runs no code (and every key holds its own stage's name)."""
    from fulltune import stages
    from fulltune.stages.runner import registry

    return {("fulltune.stages", name) for name, value in vars(stages).items()
            if isinstance(value, str) and value in registry()}


def registered_stages() -> list[str]:
    from fulltune.stages.runner import registry

    return sorted(registry())


@pytest.fixture(scope="module")
def hashed_by_key(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    """Stage → the engine modules its cache key hashes (`code(p)`), on a pipeline with `data.packing: auto` (the
    tokenize stage then also runs, and hashes, what the choice runs; a pipeline that packs or does not runs none
    of it)."""
    from fulltune import stages
    from fulltune.stages.runner import registry

    p = stages.resolve_pipeline(str(tiny_pipeline(tmp_path_factory.mktemp("keys"), data={"packing": "auto"})), "tiny")
    return {name: hashed_modules(stage.code(p)) for name, stage in registry().items()}


def hashed_modules(entries: tuple[str, ...]) -> set[str]:
    """The modules `code_version(*entries)` hashes: each entry a `.py` path or a sub-package directory."""
    modules = set()
    for entry in entries:
        target = PACKAGE / entry
        paths = sorted(target.rglob("*.py")) if target.is_dir() else [target]
        modules |= {module_name(path) for path in paths}
    return modules


@pytest.mark.parametrize("stage", registered_stages())
def test_a_stages_key_hashes_every_engine_module_it_runs(stage: str, hashed_by_key: dict[str, set[str]]) -> None:
    from fulltune.stages.runner import registry

    runs = reachable(stage_entries(registry()[stage]))
    missing = sorted(set(runs) - hashed_by_key[stage] - set(NOT_HASHED))
    how = "\n".join(f"  {name}: " + " -> ".join(f"{m}.{n}" if n else m for m, n in runs[name]) for name in missing)
    assert not missing, (f"stage {stage!r} runs {', '.join(missing)}, which its cache key does not hash (list them "
                         f"in its module's CODE): a change there would not re-run the stage. Reached by\n{how}")


def test_the_flow_runs_every_registered_stage_once() -> None:
    # A stage module the flow does not name would never run; a name without a module fails every run.
    from flows.pipeline import ORDER

    assert sorted(ORDER) == registered_stages() and len(set(ORDER)) == len(ORDER)


def test_the_trainers_row_reader_reads_a_tokenized_file_without_pandas(tmp_path: Path) -> None:
    # pyarrow's `to_numpy` imports pandas (~0.3 s and ~40 MiB in every training process); the reader takes
    # numpy views of the Arrow buffers itself, and they hold what the file holds.
    import pyarrow as pa

    from fulltune.data.mapped import TOKEN_COLUMNS, MappedRowsWriter

    rows = [[5, 6, 7], [8], [9, 10]]
    column = pa.array(rows, pa.list_(pa.int32()))
    table = pa.table({name: column for name in TOKEN_COLUMNS})
    path = tmp_path / "train.arrow"
    with MappedRowsWriter(path, table.schema) as writer:
        writer.write(table.slice(0, 1))
        writer.write(table.slice(1))  # two record batches, the second at a non-zero offset
    probe = ("import json, sys\n"
             "from fulltune.data.mapped import RowColumns\n"
             f"columns = RowColumns({str(path)!r})\n"
             "print(json.dumps(['pandas' in sys.modules, [columns.row(i)['input_ids'] for i in range(3)],"
             " columns.lengths.tolist(), columns.targets.tolist()]))")
    ran = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    pandas, got, lengths, targets = json.loads(ran.stdout.splitlines()[-1])
    assert pandas is False
    assert got == rows and lengths == [3, 1, 2]
    assert targets == [2, 0, 1]  # each row's labels shifted by one: its first token is never a target
