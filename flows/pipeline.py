"""The pipeline flow: tokenize → memory budget → fine-tune → evaluate → register. Wiring only."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

from fulltune import autotune, stages
from fulltune import registry
from tasks.budget import memory_budget_task
from tasks.common import clear_stale_locks, results_dir, stage_policy
from tasks.evaluate import evaluate_task
from tasks.finetune import finetune_task
from tasks.register import register_task
from tasks.tokenize import tokenize_task


class Overrides(BaseModel):
    """Changes to the pipeline for one run. The Prefect UI shows this as a form and the server validates
    it; `extra` takes any other field as `dotted.key: value` (what `--set` does on the command line)."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | None = Field(None, gt=0, description="train.learning_rate")
    max_steps: int | None = Field(None, ge=1, description="train.max_steps")
    num_epochs: float | None = Field(None, gt=0, description="train.num_epochs")
    effective_batch_size: int | None = Field(None, ge=1, description="train.effective_batch_size")
    seed: int | None = Field(None, ge=0, description="train.seed")
    max_length: int | None = Field(None, ge=8, description="data.max_length")
    budget_memory: str | None = Field(None, description="budget.memory, e.g. '24GiB'")
    extra: dict[str, Any] = Field(default_factory=dict, description="Any other field, as dotted.key: value")

    def dotted(self) -> dict[str, Any]:
        """The overrides as `dotted.key: value` (what `--set` takes); `extra` wins over a typed field."""
        typed = {OVERRIDE_KEYS[name]: value
                 for name, value in self.model_dump(exclude={"extra"}).items() if value is not None}
        return {**typed, **self.extra}


# The YAML key each typed field of Overrides sets.
OVERRIDE_KEYS = {
    "learning_rate": "train.learning_rate",
    "max_steps": "train.max_steps",
    "num_epochs": "train.num_epochs",
    "effective_batch_size": "train.effective_batch_size",
    "seed": "train.seed",
    "max_length": "data.max_length",
    "budget_memory": "budget.memory",
}


@dataclass(frozen=True)
class PipelineSummary:
    """What a pipeline run did: each stage ran or was cached, the numbers, and what was registered."""

    pipeline: str
    stages: dict[str, str]
    settings: str
    train_metrics: dict[str, float]
    evaluation: dict[str, dict[str, float]]
    model_name: str
    version: str
    aliases: tuple[str, ...]
    promoted: bool
    gate: str
    tracking_uri: str
    mlflow_run_id: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    example_prompt: str = "Hello"

    def lines(self) -> list[str]:
        out = [f"pipeline {self.pipeline}: " + ", ".join(f"{k} {v}" for k, v in self.stages.items())]
        out.append(f"  settings: {self.settings}")
        if "train_loss" in self.train_metrics:
            out.append(f"  train loss {self.train_metrics['train_loss']:.4f} after "
                       f"{int(self.train_metrics.get('steps', 0))} steps "
                       f"({self.train_metrics.get('tokens_per_second', 0):.0f} tokens/s)")
        names = list(self.evaluation)
        benchmarks = sorted({m for values in self.evaluation.values() for m in values} - {"bits_per_byte"})
        for metric in dict.fromkeys(("eval_loss", "perplexity", "exact_match", *benchmarks)):
            values = [self.evaluation[n].get(metric) for n in names]
            if any(v is not None for v in values):
                cells = ", ".join(f"{n} {v:.4f}" for n, v in zip(names, values) if v is not None)
                out.append(f"  {metric}: {cells}")
        out.append(f"  registered {self.model_name} version {self.version}, aliases: {', '.join(self.aliases)}"
                   f" ({self.gate})")
        out.append(f"  load it: MLFLOW_TRACKING_URI={registry.redact(self.tracking_uri)} python -c \"import mlflow; "
                   f"print(mlflow.transformers.load_model('models:/{self.model_name}@champion')({self.example_prompt!r}))\"")
        return out


def _stage(task: Any, p: stages.ResolvedPipeline, name: str, key: str, present: bool | None = None) -> Any:
    """The task with results beside the outputs; a cache hit whose files are gone is refreshed."""
    if present is None:
        present = stages.outputs_present(p.workdir, name, key)
    return task.with_options(cache_policy=stage_policy(name, p.workdir), result_storage=results_dir(p.workdir),
                             refresh_cache=not present)


def _example_prompt(report: Any) -> str:
    samples = report.candidates["fine_tuned"].samples
    return samples[0][0] if samples and samples[0][0] else "Hello"


def _state_word(state: Any) -> str:
    return "cached" if state.name == "Cached" else "ran"


@flow(name="fulltune-pipeline", log_prints=True)
def finetune_pipeline(pipeline: str = "demo", overrides: Overrides | None = None,
                      pipelines_file: str = "pipelines.yaml") -> PipelineSummary:
    """Run one pipeline of `pipelines_file`: tokenize, check the memory budget, fine-tune, evaluate, register."""
    logger = get_run_logger()
    p = stages.resolve_pipeline(pipelines_file, pipeline, overrides.dotted() if overrides else None)
    stages.ensure_local_data(p)
    # One commit for the whole run: every stage loads, and every key names, the same hub weights.
    p = stages.with_budget(stages.pin_hub_revisions(p))  # `budget:` on this machine, resolved once per run
    for lock in clear_stale_locks(p.workdir):
        logger.warning("removed the stale lock %s of a run that no longer exists", lock.name)
    done: dict[str, str] = {}

    key = stages.tokenize_key(p)
    state = _stage(tokenize_task, p, stages.TOKENIZE, key)(p, key, return_state=True)
    data, tokenizer = state.result()
    done[stages.TOKENIZE] = _state_word(state)

    # Budget and training see the training data only; evaluation and registration the held-out data too.
    key = stages.budget_key(p, data.training_fingerprint)
    state = _stage(memory_budget_task, p, stages.MEMORY_BUDGET, key)(p, key, data, tokenizer, return_state=True)
    decision = state.result()
    done[stages.MEMORY_BUDGET] = _state_word(state)

    uri = registry.configure(p.workdir)
    run_id = registry.start_pipeline_run(
        p.name, p.spec.model_dump(mode="json", by_alias=True),
        {registry.TAG_FLOW_RUN: str(flow_run.id or "local"), registry.TAG_DATA: data.fingerprint,
         registry.TAG_CONFIG: p.spec.config_hash()}, p.workdir)
    try:
        autotune.log_to_mlflow(run_id, decision.plan)  # the measured candidates' table and picture, when tuned
        train_key = stages.train_key(p, data.training_fingerprint, decision.settings)
        state = _stage(finetune_task, p, stages.FINE_TUNE, train_key)(
            p, train_key, data, tokenizer, decision, uri, run_id, return_state=True)
        trained = state.result()
        done[stages.FINE_TUNE] = _state_word(state)

        # The champion is compared only when it is another model: re-running an unchanged pipeline whose
        # own model is champion keeps the evaluation cached.
        champion = registry.current_champion(p.model_name)
        if champion is not None and champion.train_key == trained.key:
            champion = None
        key = stages.evaluate_key(p, trained.key, data.fingerprint, champion.version if champion else None)
        state = _stage(evaluate_task, p, stages.EVALUATE, key)(
            p, key, data, trained, champion, decision.settings.device, run_id, return_state=True)
        report = state.result()
        done[stages.EVALUATE] = _state_word(state)

        key = stages.register_key(p, trained.key, key, uri)
        marker = stages.read_marker(p.workdir, stages.REGISTER, key)
        present = bool(marker) and registry.version_exists(marker["name"], marker["version"], trained.key)
        state = _stage(register_task, p, stages.REGISTER, key, present)(
            p, key, data, trained, report, run_id, str(flow_run.id or "local"), return_state=True)
        registration = state.result()
        done[stages.REGISTER] = _state_word(state)
    except BaseException:
        registry.end_pipeline_run(run_id, "FAILED")
        raise
    registry.set_run_tags(run_id, {f"fulltune.stage.{k}": v for k, v in done.items()})
    registry.end_pipeline_run(run_id)
    summary = PipelineSummary(
        p.name, done, stages.describe_settings(decision.settings, decision.num_layers), trained.metrics,
        {name: m.as_dict() for name, m in report.candidates.items()}, registration.name, registration.version,
        registry.aliases_of(registration.name, registration.version), registration.promoted, registration.reason,
        uri, run_id, trained.replans, _example_prompt(report))
    for line in summary.lines():
        logger.info(line)
    return summary
