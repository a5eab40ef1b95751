"""The champion: the version that holds the `champion` alias, its checkpoint, and what can be compared with it.

The champion may have been trained with another tokenizer than the fine-tuned model; it is measured on the
eval examples tokenized with its own (fulltune/evaluation/evaluate.py's module docstring says which comparison
is made when). The registry finds the champion (fulltune/tracking/registry.py `current_champion`); its
checkpoint is downloaded here, when the evaluate stage compares with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.errors import ConfigError, UserError
from fulltune.evaluation.evaluate import (NOT_COMPARED, PER_BYTE, REFUSED, SAME_TOKENS, EvalReport, ModelMetrics,
                                          evaluate_model)
from fulltune.spec import DataSpec

if TYPE_CHECKING:
    from fulltune.spec import PipelineSpec


@dataclass(frozen=True)
class Champion:
    """The version that currently holds the `champion` alias."""

    name: str
    version: str
    source: str  # models:/name/version
    train_key: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def download_version(source: str, destination: str | Path) -> str:
    """Download a registered version's transformers checkpoint (the `model` directory of the flavor)."""
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(destination)))
    for candidate in (local / "model", local):
        if (candidate / "config.json").is_file():
            return str(candidate)
    # Retrying cannot help: the registered version itself holds no checkpoint.
    raise ConfigError(f"register.model_name: {source} holds no transformers checkpoint (looked in {local}); move "
                      "the champion alias to a version fulltune registered, or set evaluate.compare_champion: false")



@dataclass(frozen=True)
class ChampionRows:
    """The eval examples as the champion's tokenizer makes them, or None with the reason it cannot."""

    rows: list[dict[str, Any]] | None
    kind: str  # SAME_TOKENS, PER_BYTE or REFUSED
    reason: str


def tokenizer_signature(tokenizer: Any) -> str:
    """sha256 of everything that decides how a tokenizer turns text into ids (not where it was saved)."""
    from fulltune.data import adds_bos

    backend = getattr(tokenizer, "backend_tokenizer", None)
    vocabulary = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    parts = [type(tokenizer).__name__, vocabulary, str(tokenizer.chat_template),
             json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str), str(adds_bos(tokenizer))]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()


def champion_rows(rows: list[dict[str, Any]], tuned_tokenizer: Any, champion_tokenizer: Any, data: DataSpec,
                  max_examples: int | None, version: str, token: str | None = None) -> ChampionRows:
    """Tokenize the eval examples for the champion with its own tokenizer, and say what is comparable.

    `token` reads a private hub dataset in `data.eval`."""
    if tokenizer_signature(champion_tokenizer) == tokenizer_signature(tuned_tokenizer):
        return ChampionRows(rows, SAME_TOKENS, f"the champion (version {version}) uses the same tokenizer, so the "
                                                "eval loss per token is compared directly")
    sizes = f"vocabulary of {len(champion_tokenizer)} tokens, this model's {len(tuned_tokenizer)}"
    records = raw_eval_records(data, rows, max_examples, token)
    if records is None:
        return ChampionRows(None, REFUSED, (
            f"the champion (version {version}) has another tokenizer ({sizes}) and the eval examples of format "
            f"{data.format} held out of data.train are kept only as this model's tokens, so the champion cannot "
            "be measured on them; set data.eval to compare across tokenizers"))
    try:
        own = tokenize_records(records, champion_tokenizer, data)
    except UserError as exc:
        return ChampionRows(None, REFUSED, f"the champion's tokenizer cannot format the eval examples: {exc}")
    own = own[:max_examples] if max_examples is not None else own
    if not own:
        return ChampionRows(None, REFUSED, (
            f"no eval example keeps a target token within data.max_length ({data.max_length}) with the "
            f"champion's tokenizer ({sizes})"))
    if _same_tokens(own, rows):
        return ChampionRows(own, SAME_TOKENS, f"the champion (version {version}) has another tokenizer that turns "
                                               "the eval examples into the same tokens; loss per token compared")
    left_out = len(rows) - len(own)
    note = (f" {left_out} example(s) keep no target within data.max_length with its tokenizer and were left out "
            "of its measurement." if left_out > 0 else "")
    return ChampionRows(own, PER_BYTE, (
        f"the champion (version {version}) has another tokenizer ({sizes}), so loss per token is not comparable: "
        "it was evaluated on the same eval examples tokenized with its own tokenizer and compared by loss per "
        "byte of target text, shown in this model's tokens." + note))


def _same_tokens(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return len(a) == len(b) and all(
        list(x["input_ids"]) == list(y["input_ids"]) and list(x["labels"]) == list(y["labels"]) for x, y in zip(a, b))


def raw_eval_records(data: DataSpec, rows: list[dict[str, Any]], max_examples: int | None,
                     token: str | None = None) -> list[dict[str, Any]] | None:
    """The eval examples as records of the training data (the columns `data.format` reads), or None.

    prompt_completion rows carry their prompt and completion strings. For the other formats only
    `data.eval` has the raw examples; examples held out of `data.train` are kept as tokens only. Sources
    given as lists may each have their own format and fields: None (fulltune/data/sources.py).
    """
    from fulltune.data.sources import is_single

    if not (is_single(data.train) and is_single(data.eval)):
        return None
    if data.format == "prompt_completion":
        return [{data.prompt_field: row["prompt"], data.completion_field: row["completion"]} for row in rows]
    if data.eval is None:
        return None
    from fulltune.data import load_records

    with tempfile.TemporaryDirectory(prefix="fulltune-eval-") as cache:
        records = load_records(data.eval, what="data.eval", cache_dir=cache, token=token)
        if max_examples is not None:
            # Only the first max_examples usable ones are measured; examples left with no target after
            # truncation are dropped, so read a margin rather than every record of a large eval set.
            records = records.select(range(min(len(records), 2 * max_examples)))
        return records.to_list()


def tokenize_records(records: list[dict[str, Any]], tokenizer: Any, data: DataSpec) -> list[dict[str, Any]]:
    """Format and tokenize raw records exactly as the tokenize stage builds eval.parquet (never packed)."""
    from fulltune.data import tokenize_split

    table, _, _ = tokenize_split(records, tokenizer, data, source="the eval examples", what="data.eval",
                                 reference=getattr(tokenizer, "name_or_path", "champion"))
    out = []
    for row in table.select(["input_ids", "labels", "prompt", "completion"]).to_pylist():
        row["position_ids"] = list(range(len(row["input_ids"])))
        out.append(row)
    return out


@dataclass(frozen=True)
class ChampionResult:
    """What the gate compares (`gate`, in the fine-tuned model's token units), the champion's measurement
    on its own tokens (`own`), and which comparison was made and why."""

    gate: ModelMetrics | None
    own: ModelMetrics | None
    kind: str
    reason: str


def measure_champion(rows: list[dict[str, Any]], tuned: ModelMetrics, tuned_tokenizer: Any, champion_dir: str,
                     data: DataSpec, version: str, *, max_examples: int | None, data_token: str | None = None,
                     **evaluate_kwargs: Any) -> ChampionResult:
    """Evaluate the champion on the eval examples tokenized with its own tokenizer (see the module docstring).

    `rows` and `tuned` are the fine-tuned model's eval rows and metrics, `tuned_tokenizer` the tokenizer
    that made the rows; `data_token` reads a private hub `data.eval`; `evaluate_kwargs` are
    `evaluate_model`'s keyword arguments.
    """
    from fulltune.models import load_tokenizer

    plan = champion_rows(rows, tuned_tokenizer, load_tokenizer(champion_dir), data, max_examples, version,
                         data_token)
    if plan.rows is None:
        return ChampionResult(None, None, plan.kind, plan.reason)
    own = evaluate_model(champion_dir, champion_dir, plan.rows, **evaluate_kwargs)
    if plan.kind == SAME_TOKENS:
        return ChampionResult(own, None, plan.kind, plan.reason)
    if not (tuned.target_bytes and own.target_bytes):
        return ChampionResult(None, own, REFUSED, (
            f"the champion (version {version}) has another tokenizer and the eval targets decode to no text, "
            "so there is no per-byte loss to compare"))
    return ChampionResult(comparable_champion(tuned, own), own, plan.kind, plan.reason)


def comparable_champion(tuned: ModelMetrics, own: ModelMetrics) -> ModelMetrics:
    """The champion's loss per byte of target text expressed in the fine-tuned model's tokens.

    eval_loss = (champion nats / champion target bytes) × (fine-tuned target bytes / fine-tuned target
    tokens): on identical target text this is the champion's summed loss over the fine-tuned model's
    token count, so it compares with the fine-tuned model's eval_loss as the total code length of the
    same text. bits_per_byte is unchanged by the conversion.
    """
    nats_per_byte = own.eval_loss * own.eval_tokens / own.target_bytes
    eval_loss = nats_per_byte * tuned.target_bytes / tuned.eval_tokens
    # Exact match and the benchmarks compare text or run on the champion's own tokens: no conversion.
    return ModelMetrics(eval_loss, math.exp(min(eval_loss, 700.0)), tuned.eval_tokens, own.exact_match,
                        own.generated_examples, own.samples, tuned.target_bytes, dict(own.extra))



def compare_with_champion(spec: PipelineSpec, rows: list[dict[str, Any]], metrics: dict[str, ModelMetrics],
                          champion: Champion | None, *, model_dir: str, workdir: str,
                          options: dict[str, Any], load: dict[str, Any]) -> EvalReport:
    """The report of `metrics` (base and fine-tuned), with the champion measured on its own tokens when
    there is one to compare; `options` are evaluate_model's keyword arguments (`options`, `benchmarks`,
    `progress`), `load` the base model's
    `load_kwargs` (the champion loads in the same dtype and placement, without the base's hub revision)."""
    from fulltune.models import hub_token, load_tokenizer

    if champion is None:
        return EvalReport(metrics, len(rows))
    if not spec.evaluate.compare_champion:
        return EvalReport(metrics, len(rows), champion.version, comparison=NOT_COMPARED, comparison_reason=(
            f"evaluate.compare_champion is false: the champion (version {champion.version}) was not evaluated, so "
            "it keeps its alias; move the alias by hand to promote this version"))
    local = download_version(champion.source, Path(workdir) / "champions" / f"{champion.name}-v{champion.version}")
    tuned_tokenizer = load_tokenizer(model_dir, trust_remote_code=spec.model.trust_remote_code)
    result = measure_champion(
        rows, metrics["fine_tuned"], tuned_tokenizer, local, spec.data, champion.version,
        max_examples=spec.evaluate.max_examples, data_token=hub_token(spec.model.token_env),
        load_kwargs={**load, "revision": None, "trust_remote_code": False, "token": None},
        name=f"champion v{champion.version}", **options)
    if result.gate is not None:
        metrics = {**metrics, "champion": result.gate}
    return EvalReport(metrics, len(rows), champion.version, comparison=result.kind, comparison_reason=result.reason,
                      champion_own_tokens=result.own)
