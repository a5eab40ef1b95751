"""Stage 1: the tokenizer (trained when the spec asks for one) and the tokenized, packed data.

Outputs land under `<workdir>/tokenized/<fingerprint>/` (fulltune/data) and, for a trained tokenizer,
`<workdir>/tokenizers/`; the stage's marker records both. The key sees the data by content (local files) or
commit (hub datasets), the tokenizer likewise, every `data:` option and the seed (the held-out split and the
packing order); with `data.packing: auto` also what decides the layout (fulltune/stages/budget.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from fulltune.data import TokenizedData
from fulltune.planning.inputs import ResolvedPipeline
from fulltune.spec import PipelineSpec
from fulltune.stages import TOKENIZE, source_key
from fulltune.stages.runner import Inputs, Stage, StageLog

CODE = ("stages/tokenize.py", "data", "storage.py", "hub.py", "models.py", "attention.py")


@dataclass(frozen=True)
class Tokenized:
    """The tokenized data and the tokenizer it was made with (a directory, or a hub id)."""

    data: TokenizedData
    tokenizer: str


def code(p: ResolvedPipeline) -> tuple[str, ...]:
    """With `data.packing: auto`, the layout is the budget stage's planning's choice: its code too."""
    from fulltune.stages import budget

    return CODE + (budget.CODE if p.spec.data.packing == "auto" else ())


def key(inputs: Inputs) -> dict[str, Any]:
    from fulltune.data.tokenizer import tokenizer_revision

    p = inputs.pipeline
    spec = p.spec
    tokenizer = spec.model.tokenizer if spec.model.tokenizer is not None else spec.model.name_or_path
    field = "model.tokenizer" if spec.model.tokenizer is not None else "model.name_or_path"
    return {
        "workdir": p.workdir,
        "data": spec.data.model_dump(mode="json", exclude={"num_workers"}),  # the output is the same for any
        **{split: _data_key(p, split) for split in ("train", "eval")},
        "tokenizer": tokenizer if not isinstance(tokenizer, str)
        else source_key(p, tokenizer, field, revision=tokenizer_revision(spec.model)),
        "seed": spec.train.seed,
        "packing_choice": _packing_choice_key(p) if spec.data.packing == "auto" else None,
    }


def _data_key(p: ResolvedPipeline, split: Literal["train", "eval"]) -> Any:
    """What the key sees of data.train or data.eval: `source_key` of the reference, or of each source in a list."""
    from fulltune.data.sources import sources

    value = getattr(p.spec.data, split)
    if not isinstance(value, list):
        return source_key(p, value, f"data.{split}", "dataset")
    return [source_key(p, s.reference, s.what, "dataset") for s in sources(p.spec.data, split)]


def _packing_choice_key(p: ResolvedPipeline) -> dict[str, Any]:
    """What `data.packing: auto` is decided by (fulltune/planning/autotune.py `choose_packing`)."""
    from fulltune.stages.budget import packing_choice_key

    return packing_choice_key(p)


def run(inputs: Inputs, key: str, log: StageLog) -> Tokenized:
    """Prepare the tokenizer and tokenize the data."""
    from fulltune.data import tokenize_dataset
    from fulltune.data.tokenizer import prepare_tokenizer
    from fulltune.models import hub_token
    from fulltune.stages.budget import resolve_packing

    p = inputs.pipeline
    m = p.spec.model
    tokenizer = prepare_tokenizer(m, p.spec.data, p.workdir)
    # `data.packing: auto` becomes true or false here, whichever layout trains faster.
    data = tokenize_dataset(resolve_packing(p, tokenizer), tokenizer, p.workdir, p.spec.train.seed,
                            token=hub_token(m.token_env), trust_remote_code=m.trust_remote_code)
    return Tokenized(data, tokenizer)


def writes(inputs: Inputs, key: str, record: Tokenized) -> list[str]:
    """The tokenized data, and the tokenizer when this machine holds it (a trained one, a local directory)."""
    return [record.data.path, record.tokenizer] if record.tokenizer.startswith("/") else [record.data.path]


def track(inputs: Inputs, record: Tokenized) -> None:
    """The data's fingerprint as a tag of the pipeline's MLflow run, the training and held-out data as its dataset
    inputs."""
    from fulltune.tracking import log_tokenized_data, registry

    p = inputs.pipeline
    registry.set_run_tags(inputs.mlflow_run_id, {registry.TAG_DATA: record.data.fingerprint})
    log_tokenized_data(inputs.mlflow_run_id, p.name, p.spec, record.data)


def data_summary(data: TokenizedData, spec: PipelineSpec) -> dict[str, Any]:
    """What the tokenized data holds, for the stage's table artifact: its fingerprint with what it covers (the seed
    only where it shapes the rows), counts of examples, rows and tokens."""
    from fulltune.data.store import fingerprint_covers

    return {
        "fingerprint": data.fingerprint[:16], "fingerprint covers": fingerprint_covers(spec.data), "format": data.format,
        "packing": data.packing, "train examples": data.num_train_examples, "eval examples": data.num_eval_examples,
        "train rows": data.num_train_rows, "train tokens": data.train_tokens,
        "trained tokens": data.train_label_tokens, "longest row": data.max_row_length,
        "truncated": data.truncated_examples,
    }


STAGE = Stage(TOKENIZE, code, key, run, writes, rerun_after="it tokenizes again", retry_delays=(2, 10), track=track)
