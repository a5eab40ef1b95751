"""Stage 1: data files → tokenized (and packed) Parquet under `<workdir>/tokenized/<fingerprint>/`."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_table_artifact

from fulltune.data import TokenizedData
from fulltune.stages import TOKENIZE, ResolvedPipeline, record_outputs
from tasks.common import stage_policy, retry_unless_user_error


@task(name=TOKENIZE, cache_policy=stage_policy(TOKENIZE), persist_result=True, retries=2,
      retry_delay_seconds=[2, 10], retry_condition_fn=retry_unless_user_error)
def tokenize_task(p: ResolvedPipeline, key: str) -> tuple[TokenizedData, str]:
    """Prepare the tokenizer (train a BPE one if asked) and tokenize the data; returns (data, tokenizer)."""
    from fulltune.data import tokenize_dataset
    from fulltune.models import hub_token
    from fulltune.tokenizer import prepare_tokenizer

    m = p.spec.model
    tokenizer = prepare_tokenizer(m, p.spec.data, p.workdir)
    from fulltune.autotune import resolve_packing

    # `data.packing: auto` becomes true or false here, whichever layout trains faster.
    data = tokenize_dataset(resolve_packing(p, tokenizer), tokenizer, p.workdir, p.spec.train.seed,
                            token=hub_token(m.token_env), trust_remote_code=m.trust_remote_code)
    record_outputs(p.workdir, TOKENIZE, key, [data.path, tokenizer] if tokenizer.startswith("/") else [data.path])
    create_table_artifact(
        key=f"{p.name}-tokenized",
        table=[{
            "fingerprint": data.fingerprint[:16], "format": data.format, "packing": data.packing,
            "train examples": data.num_train_examples, "eval examples": data.num_eval_examples,
            "train rows": data.num_train_rows, "train tokens": data.train_tokens,
            "trained tokens": data.train_label_tokens, "longest row": data.max_row_length,
            "truncated": data.truncated_examples,
        }],
        description=f"Tokenized data of pipeline {p.name}",
    )
    return data, tokenizer
