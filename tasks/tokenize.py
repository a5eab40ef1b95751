"""Stage 1: tokenize (fulltune/stages/tokenize.py) as a Prefect task, with a table artifact of what it made."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from fulltune.data import TokenizedData
from fulltune.stages import TOKENIZE, ResolvedPipeline
# The stage's cache key, which the flow computes before it runs the task (fulltune/stages: content and code).
from fulltune.stages import tokenize_key  # noqa: F401
from fulltune.stages.tokenize import summary_row, tokenize
from tasks.common import retry_unless_user_error, stage_policy


@task(name=TOKENIZE, cache_policy=stage_policy(TOKENIZE), persist_result=True, retries=2,
      retry_delay_seconds=[2, 10], retry_condition_fn=retry_unless_user_error)
def tokenize_task(p: ResolvedPipeline, key: str) -> tuple[TokenizedData, str]:
    """Prepare the tokenizer (train a BPE one if asked) and tokenize the data; returns (data, tokenizer)."""
    data, tokenizer = tokenize(p, key)
    create_table_artifact(key=f"{p.name}-tokenized", table=[summary_row(data)],
                          description=f"Tokenized data of pipeline {p.name}")
    return data, tokenizer
