"""Stage 4: the base model, the fine-tuned model and the current champion on the same held-out examples.

The work is fulltune/evaluation (`evaluate_candidates`), in the plan's evaluate stage (its dtype, fitted batches
and placement); its report goes to `<workdir>/evals/<key>/`, its metrics into the pipeline's MLflow run (`track`).
The champion is looked up fresh each run (`prepare`): its version is part of the key, so a new champion
re-evaluates, and re-running an unchanged pipeline whose own model is champion keeps the evaluation cached.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from fulltune.evaluation import harness
from fulltune.evaluation.evaluate import EvalReport
from fulltune.evaluation.sharded import RUNTIME_CODE
from fulltune.planning.inputs import ResolvedPipeline
from fulltune.stages import EVALUATE, FINE_TUNE, MEMORY_BUDGET, TOKENIZE
from fulltune.stages.runner import Inputs, Stage, StageLog

# A run trained sharded evaluates sharded, in children the training's launch path starts (evaluation/sharded.py).
CODE = ("stages/evaluate.py", "evaluation", *RUNTIME_CODE, "memory/head.py", "data", "models.py", "attention.py",
        "hub.py", "degrees.py", "storage.py", "tracking/registry.py", "tracking/gates.py")


def code(p: ResolvedPipeline) -> tuple[str, ...]:
    return CODE


def prepare(inputs: Inputs) -> Inputs:
    """The champion to compare with: the registered model's, when it is another model than the one just trained
    (fulltune.tracking `champion_to_compare`)."""
    from fulltune.tracking import champion_to_compare

    p = inputs.pipeline
    return replace(inputs, champion=champion_to_compare(p.model_name, inputs.record(FINE_TUNE).key))


def _evaluation(inputs: Inputs) -> dict[str, Any] | None:
    """The plan's evaluate stage: its dtype, batches and placement (memory/evaluation.py `EvalPlan.to_dict`)."""
    return inputs.record(MEMORY_BUDGET).plan.get("evaluation")


def key(inputs: Inputs) -> dict[str, Any]:
    """The trained weights, the whole data fingerprint (it covers the held-out data) and the sources' names, the plan's
    dtype and batches (they decide the metrics, not its byte counts), the `evaluate:` section, the champion and what
    the benchmarks read."""
    from fulltune.data.sources import eval_source_names

    p = inputs.pipeline
    evaluation = _evaluation(inputs)
    return {
        "evaluation": {name: evaluation[name] for name in ("dtype", "loss_batch", "generation_batch", "harness_batch")}
        if evaluation else None,
        "train": inputs.record(FINE_TUNE).key,
        # the whole data fingerprint covers the held-out data's content; what each data.eval source is called in
        # the metrics is the sources' names (renaming a file renames its metrics)
        "data": inputs.record(TOKENIZE).data.fingerprint, "sources": eval_source_names(p.spec.data),
        # how long a metric function may run does not change what it computes
        "evaluate": p.spec.evaluate.model_dump(mode="json", exclude={"metric_timeout"}),
        "champion": inputs.champion.version if inputs.champion else None,
        # version numbers count per registered model: two pipelines sharing a workdir may both have a "3"
        "champion_of": p.model_name,
        # the content of the lm_eval task files, their data and the metric functions' modules
        "benchmarks": harness.sources_key(p.spec, Path(p.pipelines_file).parent),
    }


def run(inputs: Inputs, key: str, log: StageLog) -> EvalReport:
    """Every candidate evaluated, the report on disk."""
    from fulltune.evaluation.evaluate import Candidates, evaluate_candidates
    from fulltune.storage import atomic_write_text

    p, logger = inputs.pipeline, log.logger
    data, trained = inputs.record(TOKENIZE).data, inputs.record(FINE_TUNE)
    decision = inputs.record(MEMORY_BUDGET)
    candidates = Candidates(eval_file=data.eval_file, base_model=trained.base_model, model_dir=trained.model_dir,
                            tokenizer=trained.tokenizer, workdir=p.workdir, base_dir=str(Path(p.pipelines_file).parent))
    report = evaluate_candidates(p.spec, candidates, inputs.champion, decision.settings.device, progress=logger.info,
                                 evaluation=_evaluation(inputs))
    for name, values in _candidates(report).items():
        logger.info("%s: %s", name, values.as_dict())
    if report.champion_version is not None:
        logger.info("champion comparison %s: %s", report.comparison, report.comparison_reason)
    atomic_write_text(report_file(p, key), report.markdown(p.spec.registration.gates))
    return report


def _candidates(report: EvalReport) -> dict[str, Any]:
    """Each candidate's metrics by name, the champion on its own tokens too when it was measured that way."""
    every = {**report.candidates, "champion_own_tokenizer": report.champion_own_tokens}
    return {name: values for name, values in every.items() if values is not None}


def track(inputs: Inputs, record: EvalReport) -> None:
    """Every candidate's metrics in the pipeline's MLflow run as `eval/<candidate>.<metric>` (their own section of
    the run's charts, apart from the training curves), and how the champion was compared; every run, cached or not."""
    from fulltune.tracking.gates import comparison_tags
    from fulltune.tracking.registry import log_metrics, set_run_tags

    for name, values in _candidates(record).items():
        log_metrics(inputs.mlflow_run_id, {f"eval/{name}.{k}": v for k, v in values.as_dict().items()})
    if record.champion_version is not None:
        set_run_tags(inputs.mlflow_run_id, comparison_tags(record))


def report_file(p: ResolvedPipeline, key: str) -> Path:
    return Path(p.workdir) / "evals" / key / "report.md"


def writes(inputs: Inputs, key: str, record: EvalReport) -> list[str]:
    """The report, and the fine-tuned model it measured (a damaged model re-evaluates)."""
    return [str(report_file(inputs.pipeline, key)), inputs.record(FINE_TUNE).model_dir]


STAGE = Stage(EVALUATE, code, key, run, writes, rerun_after="training is cached; it evaluates again",
              retry_delays=(5, 20), tracked=True, prepare=prepare, track=track)
