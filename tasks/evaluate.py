"""Stage 4: evaluate the base model, the fine-tuned model and the current champion on held-out data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.evaluation.evaluate import EvalReport
from fulltune.storage import atomic_write_text
from fulltune.stages import EVALUATE, ResolvedPipeline, record_outputs
# The stage's cache key, which the flow computes before it runs the task (fulltune/stages: content and code).
from fulltune.stages import evaluate_key  # noqa: F401
from fulltune.evaluation.champion import Champion
from tasks.common import stage_policy, retry_unless_user_error
from tasks.finetune import TrainedModel


@task(name=EVALUATE, cache_policy=stage_policy(EVALUATE), persist_result=True, retries=2,
      retry_delay_seconds=[5, 20], retry_condition_fn=retry_unless_user_error)
def evaluate_task(p: ResolvedPipeline, key: str, data: TokenizedData, trained: TrainedModel,
                  champion: Champion | None, device: str, mlflow_run_id: str,
                  evaluation: dict[str, Any] | None = None) -> EvalReport:
    """fulltune.evaluation.evaluate.evaluate_candidates in the plan's `evaluation` (dtype, fitted batches, placement), with
    its metrics in MLflow, the report on disk and as an artifact."""
    from fulltune.evaluation.evaluate import Candidates, evaluate_candidates
    from fulltune.tracking.gates import comparison_tags
    from fulltune.tracking.registry import log_metrics, set_run_tags

    logger = get_run_logger()
    candidates = Candidates(eval_file=data.eval_file, base_model=trained.base_model, model_dir=trained.model_dir,
                            tokenizer=trained.tokenizer, workdir=p.workdir, base_dir=str(Path(p.pipelines_file).parent))
    report = evaluate_candidates(p.spec, candidates, champion, device, progress=logger.info, evaluation=evaluation)
    for name, values in {**report.candidates, "champion_own_tokenizer": report.champion_own_tokens}.items():
        if values is not None:
            logger.info("%s: %s", name, values.as_dict())
            log_metrics(mlflow_run_id, {f"{name}.{k}": v for k, v in values.as_dict().items()})
    if report.champion_version is not None:
        logger.info("champion comparison %s: %s", report.comparison, report.comparison_reason)
        set_run_tags(mlflow_run_id, comparison_tags(report))
    report_file = Path(p.workdir) / "evals" / key[:24] / "report.md"
    atomic_write_text(report_file, report.markdown())
    record_outputs(p.workdir, EVALUATE, key, [str(report_file), trained.model_dir])
    create_markdown_artifact(key=f"{p.name}-evaluation", markdown=f"## Evaluation of `{p.name}`\n\n"
                             + report.markdown(), description="Base vs fine-tuned vs champion")
    return report
