"""Stage 5: register the fine-tuned model in MLflow; promote it to `champion` only when it wins."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.evaluate import EvalReport
from fulltune.stages import REGISTER, ResolvedPipeline, record_outputs
from fulltune.registry import Registration
from tasks.common import stage_policy, retry_unless_user_error
from tasks.finetune import TrainedModel


@task(name=REGISTER, cache_policy=stage_policy(REGISTER), persist_result=True, retries=2,
      retry_delay_seconds=[5, 20], retry_condition_fn=retry_unless_user_error)
def register_task(p: ResolvedPipeline, key: str, data: TokenizedData, trained: TrainedModel, report: EvalReport,
                  mlflow_run_id: str, flow_run_id: str) -> Registration:
    """Log the checkpoint from its directory, tag the version, set `challenger`, and gate `champion`."""
    from fulltune.storage import code_version
    from fulltune.evaluate import PER_BYTE
    from fulltune.registry import (TAG_COMPARISON, TAG_COMPARISON_REASON, TAG_CONFIG, TAG_DATA, TAG_FLOW_RUN,
                                   TAG_PIPELINE, TAG_TRAIN_KEY, TAG_VERSION, GateDecision, aliases_of,
                                   decide_promotion, find_version, register_model)

    logger = get_run_logger()
    existing = find_version(p.model_name, trained.key)
    if existing is not None:
        # Same weights as a registered version (only evaluation settings changed): no new version.
        aliases = aliases_of(p.model_name, existing)
        logger.info("%s version %s already holds these weights; nothing new to register", p.model_name, existing)
        record_outputs(p.workdir, REGISTER, key, [], {"name": p.model_name, "version": existing,
                                                         "train_key": trained.key})
        return Registration(p.model_name, existing, aliases, "champion" in aliases,
                            "same weights as an existing version", mlflow_run_id)

    gate = p.spec.registration.promote_if
    tuned = report.candidates["fine_tuned"].as_dict()
    champion = report.candidates.get("champion")
    decision = decide_promotion(
        tuned, champion.as_dict() if champion else None, report.candidates["base"].as_dict(),
        gate.metric, gate.mode, gate.min_delta, p.spec.registration.require_better_than_base,
        keep_champion=report.comparison_reason if report.keeps_champion else None)
    if champion is not None and report.comparison == PER_BYTE:
        decision = GateDecision(decision.promote, f"{decision.reason}; {report.comparison_reason}")
    tags = {TAG_PIPELINE: p.name, TAG_DATA: data.fingerprint, TAG_CONFIG: p.spec.config_hash(),
            TAG_VERSION: code_version(), TAG_TRAIN_KEY: trained.key, TAG_FLOW_RUN: flow_run_id,
            TAG_COMPARISON: report.comparison, TAG_COMPARISON_REASON: report.comparison_reason}
    registration = register_model(trained.model_dir, p.model_name, mlflow_run_id, tags, tuned, decision)
    logger.info("registered %s version %s %s: %s", registration.name, registration.version,
                          list(registration.aliases), decision.reason)
    record_outputs(p.workdir, REGISTER, key, [], {"name": registration.name, "version": registration.version,
                                                     "train_key": trained.key})
    create_markdown_artifact(
        key=f"{p.name}-registration",
        markdown=(f"## Registered `{registration.name}` version {registration.version}\n\n"
                  f"aliases: {', '.join(registration.aliases)}\n\ngate: {decision.reason}\n\n"
                  f"```python\nmlflow.transformers.load_model(\"models:/{registration.name}@champion\")\n```"),
        description="MLflow registration")
    return registration
