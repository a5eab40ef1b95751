"""Stage 1: the tokenizer (trained when the spec asks for one) and the tokenized, packed data.

What the tokenize task wraps: outputs land under `<workdir>/tokenized/<fingerprint>/` (fulltune/data)
and, for a trained tokenizer, `<workdir>/tokenizers/`; the stage's marker records both.
"""

from __future__ import annotations

from typing import Any

from fulltune.stages import TOKENIZE, ResolvedPipeline, record_outputs


def tokenize(p: ResolvedPipeline, key: str) -> tuple[Any, str]:
    """Prepare the tokenizer and tokenize the data; returns (TokenizedData, tokenizer path or hub id)."""
    from fulltune.data import tokenize_dataset
    from fulltune.models import hub_token
    from fulltune.data.tokenizer import prepare_tokenizer

    m = p.spec.model
    tokenizer = prepare_tokenizer(m, p.spec.data, p.workdir)
    from fulltune.stages.budget import resolve_packing

    # `data.packing: auto` becomes true or false here, whichever layout trains faster.
    data = tokenize_dataset(resolve_packing(p, tokenizer), tokenizer, p.workdir, p.spec.train.seed,
                            token=hub_token(m.token_env), trust_remote_code=m.trust_remote_code)
    record_outputs(p.workdir, TOKENIZE, key, [data.path, tokenizer] if tokenizer.startswith("/") else [data.path])
    return data, tokenizer


def summary_row(data: Any) -> dict[str, Any]:
    """What the tokenized data holds, as one row of the stage's table artifact."""
    return {
        "fingerprint": data.fingerprint[:16], "format": data.format, "packing": data.packing,
        "train examples": data.num_train_examples, "eval examples": data.num_eval_examples,
        "train rows": data.num_train_rows, "train tokens": data.train_tokens,
        "trained tokens": data.train_label_tokens, "longest row": data.max_row_length,
        "truncated": data.truncated_examples,
    }
