"""Stage 4: evaluate the base model, the fine-tuned model and the current champion on held-out data."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.evaluate import EvalReport
from fulltune.fingerprint import atomic_write_text
from fulltune.pipeline import ResolvedPipeline, record_outputs
from fulltune.registry import Champion
from tasks.common import stage_policy, retry_unless_user_error
from tasks.finetune import TrainedModel


@task(name="evaluate", cache_policy=stage_policy("evaluate"), persist_result=True, retries=2,
      retry_delay_seconds=[5, 20], retry_condition_fn=retry_unless_user_error)
def evaluate_task(p: ResolvedPipeline, key: str, data: TokenizedData, trained: TrainedModel,
                  champion: Champion | None, device: str, mlflow_run_id: str) -> EvalReport:
    """Same rows, same measurement for every candidate, so the registry gate compares like with like."""
    from fulltune.evaluate import evaluate_model, read_eval_rows
    from fulltune.models import hub_token
    from fulltune.registry import download_version, log_metrics

    e, m = p.spec.evaluate, p.spec.model
    rows = read_eval_rows(data.eval_file, e.max_examples)
    load = {"revision": m.revision, "trust_remote_code": m.trust_remote_code,
            "allow_pickle_weights": m.allow_pickle_weights, "attn_implementation": m.attn_implementation,
            "token": hub_token(m.token_env)}
    candidates = {"base": (trained.base_model, load), "fine_tuned": (trained.model_dir, {**load, "revision": None})}
    if champion is not None and e.compare_champion:
        local = download_version(champion.source, Path(p.workdir) / "champions" / f"{champion.name}-v{champion.version}")
        candidates["champion"] = (local, {**load, "revision": None, "trust_remote_code": False})
    metrics = {}
    for name, (path, kwargs) in candidates.items():
        metrics[name] = evaluate_model(
            path, trained.tokenizer if name == "base" else path, rows, batch_size=e.batch_size,
            generate_examples=e.max_generate_examples, max_new_tokens=e.max_new_tokens, device=device,
            load_kwargs=kwargs)
        get_run_logger().info("%s: %s", name, metrics[name].as_dict())
        log_metrics(mlflow_run_id, {f"{name}.{k}": v for k, v in metrics[name].as_dict().items()})
    report = EvalReport(metrics, len(rows), champion.version if champion else None)
    report_file = Path(p.workdir) / "evals" / key[:24] / "report.md"
    atomic_write_text(report_file, report.markdown())
    record_outputs(p.workdir, "evaluate", key, [str(report_file), trained.model_dir])
    create_markdown_artifact(key=f"{p.name}-evaluation", markdown=f"## Evaluation of `{p.name}`\n\n"
                             + report.markdown(), description="Base vs fine-tuned vs champion")
    return report
