"""Stage 5: register the fine-tuned model in MLflow; promote it to `champion` only when it wins."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.evaluation.evaluate import EvalReport
from fulltune.stages import REGISTER, ResolvedPipeline, record_outputs
# The stage's cache key, which the flow computes before it runs the task (fulltune/stages: content and code).
from fulltune.stages import register_key  # noqa: F401
from fulltune.tracking.registry import Registration
from tasks.common import stage_policy, retry_unless_user_error
from tasks.finetune import TrainedModel


@task(name=REGISTER, cache_policy=stage_policy(REGISTER), persist_result=True, retries=2,
      retry_delay_seconds=[5, 20], retry_condition_fn=retry_unless_user_error)
def register_task(p: ResolvedPipeline, key: str, data: TokenizedData, trained: TrainedModel, report: EvalReport,
                  mlflow_run_id: str, flow_run_id: str) -> Registration:
    """fulltune.tracking.registry.register_version, with its decision in the log and as an artifact."""
    from fulltune.tracking.registry import TrainedVersion, register_version

    logger = get_run_logger()
    version = TrainedVersion(model_dir=trained.model_dir, train_key=trained.key, settings=trained.settings,
                             train_metrics=trained.metrics, data=data)
    registration = register_version(p.spec, p.name, version, report, mlflow_run_id=mlflow_run_id,
                                    flow_run_id=flow_run_id)
    record_outputs(p.workdir, REGISTER, key, [], {"name": registration.name, "version": registration.version,
                                                     "train_key": trained.key})
    logger.info("%s version %s %s: %s", registration.name, registration.version, list(registration.aliases),
                registration.reason)
    create_markdown_artifact(
        key=f"{p.name}-registration",
        markdown=(f"## `{registration.name}` version {registration.version}\n\n"
                  f"aliases: {', '.join(registration.aliases)}\n\ngate: {registration.reason}\n\n"
                  f"```python\nmlflow.transformers.load_model(\"models:/{registration.name}@champion\")\n```"),
        description="MLflow registration")
    return registration
