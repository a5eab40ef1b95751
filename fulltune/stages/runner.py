"""A stage's one shape, the one runner that records what a stage wrote, and one pipeline run's stages in order.

A stage is a module of fulltune/stages/ that ends with `STAGE = Stage(...)` (`registry` finds it):

- `code(p)`: the engine files and folders it runs for pipeline `p`; its cache key hashes their source, so a change
  there re-runs it (tests/test_engine_imports.py checks the list against what the stage's code reaches);
- `key(inputs)`: what decides its result besides its code (fingerprints, settings, the keys and records of the
  stages before it), as a JSON-able mapping; `key_of` hashes it with the stage's name and code;
- `run(inputs, key, log)`: the work, its outputs written atomically under the workdir; returns a small frozen
  record (paths, fingerprints, numbers) that Prefect pickles as the task's result;
- `writes(inputs, key, record)`: the files and directories that record points to.

`run_stage` is the one place a stage runs: once `run` returns it writes the stage's marker
(`<workdir>/stages/<stage>/<key>.json`, every written file's size and sha256; fulltune/stages `record_outputs`),
which `cached_result_stands` reads before a cache hit is taken. `run_pipeline` runs the stages in the order the
flow gives, with what each needs around it: the questions asked fresh each run (`prepare`), the pipeline's MLflow
run around the stages that log into it, what a full disk means, and the run's summary.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.planning.inputs import ResolvedPipeline
from fulltune.stages import outputs_present, record_outputs
from fulltune.storage import code_version, hash_json

if TYPE_CHECKING:
    from fulltune.evaluation.champion import Champion
    from fulltune.tracking import PipelineRun
    from fulltune.tracking.summary import PipelineSummary

# A stage's cache key: 96 bits of sha256, short enough to name its directories (runs/<key>, evals/<key>).
KEY_LENGTH = 24


@dataclass(frozen=True)
class Inputs:
    """What a stage of one pipeline run reads: the pipeline, the key and record of each stage before it, what
    the run looked up for it, and the pipeline's MLflow run once it is open.

    A frozen record of plain values: Prefect pickles it as the stage task's argument, and never hashes it (the
    task's cache key is `key_of`)."""

    pipeline: ResolvedPipeline
    records: Mapping[str, Any] = field(default_factory=dict)  # stage name → its record
    keys: Mapping[str, str] = field(default_factory=dict)  # stage name → its cache key
    # The champion to compare with, looked up fresh each run by the evaluate stage's `prepare`.
    champion: Champion | None = None
    mlflow_uri: str | None = None
    mlflow_run_id: str | None = None
    flow_run_id: str = "local"

    def record(self, stage: str) -> Any:
        """The record of `stage`, which ran before this one."""
        if stage not in self.records:
            raise KeyError(f"stage {stage!r} has not run before this one (ran: {', '.join(self.records) or 'none'})")
        return self.records[stage]

    def after(self, stage: str, key: str, record: Any) -> Inputs:
        """These inputs with `stage`'s key and record added."""
        return replace(self, records={**self.records, stage: record}, keys={**self.keys, stage: key})


def _unwatched(output_dir: Path) -> AbstractContextManager[Any]:
    return nullcontext()


@dataclass(frozen=True)
class StageLog:
    """Where a running stage says what it does: `logger` (info and warning, %-style arguments: Prefect's run
    logger in a task, fulltune's logger elsewhere) and `watch(output_dir)`, entered around each training attempt
    (the fine-tune task mirrors its progress into an artifact there)."""

    logger: Any = field(default_factory=lambda: logging.getLogger("fulltune"))
    watch: Callable[[Path], AbstractContextManager[Any]] = _unwatched


@dataclass(frozen=True)
class Stage:
    """One stage of the pipeline (the module docstring says what each function is)."""

    name: str  # its Prefect task, cache key, marker directory, line of the summary, MLflow tag fulltune.stage.<name>
    code: Callable[[ResolvedPipeline], tuple[str, ...]]
    key: Callable[[Inputs], Mapping[str, Any]]
    run: Callable[[Inputs, str, StageLog], Any]
    writes: Callable[[Inputs, str, Any], list[str]]
    rerun_after: str  # what a rerun does after a full disk stopped this stage (the stages before it are cached)
    retry_delays: tuple[float, ...] = ()  # seconds before each retry of a crash (never of a user error)
    tracked: bool = False  # runs inside the pipeline's MLflow run (its id is in the inputs)
    # What is looked up fresh each run, before the key, for the key and the run to share (the champion).
    prepare: Callable[[Inputs], Inputs] | None = None
    # Whether a cached result still stands (default: every file the marker records is there and whole).
    still_valid: Callable[[Inputs, str], bool] | None = None
    marker: Callable[[Any], dict[str, Any]] | None = None  # what the marker records beside the files
    # What the stage's record puts into the pipeline's MLflow run, every run, cached or not.
    track: Callable[[Inputs, Any], None] | None = None


@cache
def registry() -> dict[str, Stage]:
    """Every stage: the `STAGE` of each module of fulltune/stages/, by name."""
    import importlib
    import pkgutil

    import fulltune.stages as package

    found: dict[str, Stage] = {}
    for module in pkgutil.iter_modules(package.__path__):
        stage = getattr(importlib.import_module(f"{package.__name__}.{module.name}"), "STAGE", None)
        if isinstance(stage, Stage):
            found[stage.name] = stage
    return found


def key_of(stage: Stage, inputs: Inputs) -> str:
    """The stage's cache key: its name, the source of the code it runs and what decides its result."""
    p = inputs.pipeline
    return hash_json({"stage": stage.name, "code": code_version(*stage.code(p)), **stage.key(inputs)})[:KEY_LENGTH]


def run_stage(stage: Stage, inputs: Inputs, key: str, log: StageLog | None = None) -> Any:
    """Run `stage` and record what it wrote in its marker; returns its record."""
    record = stage.run(inputs, key, log or StageLog())
    record_outputs(inputs.pipeline.workdir, stage.name, key, stage.writes(inputs, key, record),
                   stage.marker(record) if stage.marker is not None else None)
    return record


def cached_result_stands(stage: Stage, inputs: Inputs, key: str) -> bool:
    """Whether a cached result of `stage` under `key` may be taken: by default its marker's files are all there
    and whole (a damaged one is moved aside: fulltune/stages `outputs_present`)."""
    if stage.still_valid is not None:
        return stage.still_valid(inputs, key)
    return outputs_present(inputs.pipeline.workdir, stage.name, key)


# How a pipeline run has a stage run: (stage, inputs, key, refresh: the cached result does not stand)
# → (record, whether it came from the cache). The flow runs it as the stage's Prefect task (tasks/stage_task.py).
Call = Callable[[Stage, Inputs, str, bool], tuple[Any, bool]]


class PipelineRunner:
    """The stages of one pipeline run, each run when the flow names it; `done` says which ran and which were cached."""

    def __init__(self, p: ResolvedPipeline, flow_run_id: str, call: Call, stack: contextlib.ExitStack) -> None:
        self.inputs = Inputs(p, flow_run_id=flow_run_id)
        self.call = call
        self.stack = stack  # the pipeline's MLflow run, once open, ends with it
        self.done: dict[str, str] = {}  # each stage: "ran" or "cached"
        self.running: Stage | None = None
        self.mlflow: PipelineRun | None = None

    def run(self, name: str) -> Any:
        """Run stage `name` (or take its cached result); returns its record."""
        stage = registry()[name]
        inputs = stage.prepare(self.inputs) if stage.prepare is not None else self.inputs
        if stage.tracked and inputs.mlflow_run_id is None:
            inputs = self._open_mlflow_run(inputs)
        key = key_of(stage, inputs)
        refresh = not cached_result_stands(stage, inputs, key)
        self._running(stage)
        record, cached = self.call(stage, inputs, key, refresh)
        self.done[name] = "cached" if cached else "ran"
        self._running(None)
        self.inputs = inputs.after(name, key, record)
        if self.inputs.mlflow_run_id is not None and stage.track is not None:
            stage.track(self.inputs, record)
        if self.mlflow is not None and self.outcome is not None:  # the run's name and description, once known
            summary = self.summary()
            self.mlflow.outcome, self.mlflow.description = summary.outcome, summary.markdown()
        return record

    def _running(self, stage: Stage | None) -> None:
        self.running = stage
        if self.mlflow is not None:
            self.mlflow.running = stage.name if stage is not None else None

    @property
    def outcome(self) -> str | None:
        """What the run did, once the register stage said it: `v3 · not promoted` (None before)."""
        from fulltune.stages import REGISTER

        registration = self.inputs.records.get(REGISTER)
        return registration.outcome(self.done.get(REGISTER) == "cached") if registration is not None else None

    def _open_mlflow_run(self, inputs: Inputs) -> Inputs:
        """Open the pipeline's MLflow run (fulltune.tracking.pipeline_run); what the stages before it put there."""
        from fulltune.tracking import pipeline_run

        p = inputs.pipeline
        run = self.stack.enter_context(pipeline_run(p.name, p.spec, p.workdir, inputs.flow_run_id, self.done))
        self.mlflow = run
        inputs = replace(inputs, mlflow_uri=run.tracking_uri, mlflow_run_id=run.run_id)
        for name, record in inputs.records.items():
            done = registry()[name]
            if done.track is not None:
                done.track(inputs, record)
        return inputs

    def summary(self) -> PipelineSummary:
        """What the run did, from its stages' records (the lines `fulltune run` ends with)."""
        from fulltune.memory.report import describe_settings
        from fulltune.stages import EVALUATE, FINE_TUNE, MEMORY_BUDGET, REGISTER
        from fulltune.tracking.summary import summarise

        i = self.inputs
        decision = i.record(MEMORY_BUDGET)
        return summarise(i.pipeline.name, self.done, describe_settings(decision.settings, decision.num_layers),
                         i.record(FINE_TUNE), i.record(EVALUATE), i.record(REGISTER), i.mlflow_uri or "",
                         i.mlflow_run_id or "")


@contextlib.contextmanager
def run_pipeline(p: ResolvedPipeline, flow_run_id: str, call: Call) -> Iterator[PipelineRunner]:
    """The runner of pipeline run `flow_run_id` of `p`, each stage run through `call`, library noise quiet (fulltune/logs.py).

    On leaving, the pipeline's MLflow run (if a stage opened it) ends FINISHED with each stage's outcome as a tag,
    KILLED on Ctrl-C, FAILED on any other error. A full disk anywhere in the stages (their outputs, checkpoints,
    the exported model, MLflow's uploads and its SQLite database) ends the run with one line naming the filesystem
    and what a rerun does (fulltune.errors.DiskFull, exit 2); the stage tasks do not retry it (tasks/common.py).
    """
    from fulltune.errors import UserError, disk_full, disk_full_error
    from fulltune.logs import quiet_known_noise

    quiet_known_noise()  # a flow a worker starts has not been through the CLI, which installs it too
    runner: PipelineRunner | None = None
    try:
        with contextlib.ExitStack() as stack:
            runner = PipelineRunner(p, flow_run_id, call, stack)
            yield runner
    except UserError:
        raise
    except Exception as exc:
        if not disk_full(exc):
            raise
        stage = runner.running if runner is not None else None
        raise disk_full_error(exc, p.workdir, stage.rerun_after if stage is not None else
                              "the stages that finished are cached") from None
