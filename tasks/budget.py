"""Stage 2: check the memory budget before any training time is spent, and plan settings that fit."""

from __future__ import annotations

import base64
from pathlib import Path

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from fulltune.data import TokenizedData
from fulltune.stages import MEMORY_BUDGET, BudgetDecision, ResolvedPipeline, record_outputs
# The stage's cache key, which the flow computes before it runs the task (fulltune/stages: content and code).
from fulltune.stages import budget_key  # noqa: F401
from tasks.common import stage_policy


@task(name=MEMORY_BUDGET, cache_policy=stage_policy(MEMORY_BUDGET), persist_result=True)
def memory_budget_task(p: ResolvedPipeline, key: str, data: TokenizedData, tokenizer: str) -> BudgetDecision:
    """Estimate the peak for the configured settings; pick the fastest settings within the budget, measured
    on this machine when `budget.autotune` says so (fulltune/planning/autotune.py)."""
    from fulltune.stages.budget import plan_and_tune

    picture = Path(p.workdir) / "plans" / f"{key[:16]}.png"
    logger = get_run_logger()
    decision = plan_and_tune(p, data, tokenizer, picture=picture, on_progress=logger.info)
    logger.info("memory plan:\n%s", decision.table)
    tuned = decision.plan["autotune"].get("picture")
    record_outputs(p.workdir, MEMORY_BUDGET, key, [str(picture)] + ([tuned] if tuned else []))
    markdown = plan_markdown(p.name, decision.table, picture)
    if tuned:  # measured step time against measured peak memory, the budget as a line
        encoded = base64.b64encode(Path(tuned).read_bytes()).decode("ascii")
        markdown += f"\n\n![autotune](data:image/png;base64,{encoded})"
    create_markdown_artifact(key=f"{p.name}-memory-plan", markdown=markdown,
                             description="Estimated peak memory against the budget")
    return decision


def plan_markdown(name: str, table: str, picture: Path) -> str:
    """The plan table and the breakdown picture, embedded as a data URI: the Prefect UI renders it from
    the artifact itself, on any machine (a file:// link only resolves where the run wrote the file)."""
    encoded = base64.b64encode(picture.read_bytes()).decode("ascii")
    return (f"## Memory plan for `{name}`\n\n```\n{table}\n```\n\n"
            f"![memory breakdown](data:image/png;base64,{encoded})\n\n"
            f"The picture is also at `{picture}` on the machine that ran the plan.")
