"""Stage 2: check the memory budget before any training time is spent, and plan settings that fit."""

from __future__ import annotations

from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.pipeline import BudgetDecision, ResolvedPipeline, plan_budget, planned_rows, record_outputs
from tasks.common import stage_policy


@task(name="memory-budget", cache_policy=stage_policy("budget"), persist_result=True)
def memory_budget_task(p: ResolvedPipeline, key: str, data: TokenizedData, tokenizer: str) -> BudgetDecision:
    """Estimate the peak for the configured settings; pick the fastest settings within the budget."""
    from fulltune.models import load_tokenizer

    vocab = len(load_tokenizer(tokenizer)) if p.spec.model.from_config is not None else None
    seq_len, target_fraction = planned_rows(p, data)
    picture = Path(p.workdir) / "plans" / f"{key[:16]}.png"
    decision = plan_budget(p, seq_len, vocab, picture, target_fraction)
    get_run_logger().info("memory plan:\n%s", decision.table)
    record_outputs(p.workdir, "budget", key, [str(picture)])
    create_markdown_artifact(
        key=f"{p.name}-memory-plan",
        markdown=f"## Memory plan for `{p.name}`\n\n```\n{decision.table}\n```\n\n![breakdown]({picture.as_uri()})",
        description="Estimated peak memory against the budget",
    )
    return decision
