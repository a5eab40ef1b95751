"""Stage 4: evaluate the base model, the fine-tuned model and the current champion on held-out data."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.evaluate import EvalReport
from fulltune.storage import atomic_write_text
from fulltune.stages import EVALUATE, ResolvedPipeline, record_outputs
from fulltune.registry import Champion
from tasks.common import stage_policy, retry_unless_user_error
from tasks.finetune import TrainedModel


@task(name=EVALUATE, cache_policy=stage_policy(EVALUATE), persist_result=True, retries=2,
      retry_delay_seconds=[5, 20], retry_condition_fn=retry_unless_user_error)
def evaluate_task(p: ResolvedPipeline, key: str, data: TokenizedData, trained: TrainedModel,
                  champion: Champion | None, device: str, mlflow_run_id: str) -> EvalReport:
    """The same held-out examples for every candidate, each tokenized with the candidate's own tokenizer;
    the report says how the champion was compared (fulltune/evaluate.py)."""
    from fulltune.evaluate import evaluate_model, read_eval_rows
    from fulltune.models import hub_token
    from fulltune.registry import log_metrics, set_run_tags

    logger = get_run_logger()
    e, m = p.spec.evaluate, p.spec.model
    rows = read_eval_rows(data.eval_file, e.max_examples)
    load = {"revision": m.revision, "trust_remote_code": m.trust_remote_code,
            "allow_pickle_weights": m.allow_pickle_weights, "attn_implementation": m.attn_implementation,
            "token": hub_token(m.token_env)}
    options = {"batch_size": e.batch_size, "generate_examples": e.max_generate_examples,
               "max_new_tokens": e.max_new_tokens, "device": device}
    candidates = {"base": (trained.base_model, trained.tokenizer, load),
                  "fine_tuned": (trained.model_dir, trained.model_dir, {**load, "revision": None})}
    metrics = {name: evaluate_model(path, tokenizer, rows, load_kwargs=kwargs, **options)
               for name, (path, tokenizer, kwargs) in candidates.items()}
    report = _with_champion(p, rows, trained, champion, metrics, options)
    for name, values in {**report.candidates, "champion_own_tokenizer": report.champion_own_tokens}.items():
        if values is not None:
            logger.info("%s: %s", name, values.as_dict())
            log_metrics(mlflow_run_id, {f"{name}.{k}": v for k, v in values.as_dict().items()})
    if report.champion_version is not None:
        logger.info("champion comparison %s: %s", report.comparison, report.comparison_reason)
        set_run_tags(mlflow_run_id, _comparison_tags(report))
    report_file = Path(p.workdir) / "evals" / key[:24] / "report.md"
    atomic_write_text(report_file, report.markdown())
    record_outputs(p.workdir, EVALUATE, key, [str(report_file), trained.model_dir])
    create_markdown_artifact(key=f"{p.name}-evaluation", markdown=f"## Evaluation of `{p.name}`\n\n"
                             + report.markdown(), description="Base vs fine-tuned vs champion")
    return report


def _with_champion(p: ResolvedPipeline, rows: list, trained: TrainedModel, champion: Champion | None,
                   metrics: dict, options: dict) -> EvalReport:
    """The report, with the champion measured on its own tokens when there is one to compare."""
    from fulltune.evaluate import NOT_COMPARED, measure_champion
    from fulltune.models import hub_token, load_tokenizer
    from fulltune.registry import download_version

    if champion is None:
        return EvalReport(metrics, len(rows))
    if not p.spec.evaluate.compare_champion:
        return EvalReport(metrics, len(rows), champion.version, comparison=NOT_COMPARED, comparison_reason=(
            f"evaluate.compare_champion is false: the champion (version {champion.version}) was not evaluated, so "
            "it keeps its alias; move the alias by hand to promote this version"))
    local = download_version(champion.source, Path(p.workdir) / "champions" / f"{champion.name}-v{champion.version}")
    tuned_tokenizer = load_tokenizer(trained.model_dir, trust_remote_code=p.spec.model.trust_remote_code)
    result = measure_champion(
        rows, metrics["fine_tuned"], tuned_tokenizer, local, p.spec.data, champion.version,
        max_examples=p.spec.evaluate.max_examples, data_token=hub_token(p.spec.model.token_env),
        load_kwargs={"revision": None, "trust_remote_code": False,
                     "allow_pickle_weights": p.spec.model.allow_pickle_weights,
                     "attn_implementation": p.spec.model.attn_implementation},
        **options)
    if result.gate is not None:
        metrics = {**metrics, "champion": result.gate}
    return EvalReport(metrics, len(rows), champion.version, comparison=result.kind, comparison_reason=result.reason,
                      champion_own_tokens=result.own)


def _comparison_tags(report: EvalReport) -> dict[str, str]:
    from fulltune.registry import TAG_COMPARISON, TAG_COMPARISON_REASON

    return {TAG_COMPARISON: report.comparison, TAG_COMPARISON_REASON: report.comparison_reason}
