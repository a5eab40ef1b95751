"""Held-out evaluation: loss, perplexity, bits per byte and exact match of greedy generations.

Every candidate (base model, fine-tuned model, current champion) is measured on the same held-out
examples, each tokenized with the candidate's own tokenizer: a model is never fed ids from another
vocabulary. The base and fine-tuned models share the run's tokenizer and its tokenized eval rows. The
champion may have been trained with another tokenizer (a tokenizer trained on the data changes when the
data does), which decides what can be compared:

- `same_tokens`: the champion's tokenizer turns the eval examples into the same tokens; the eval loss
  per token is compared directly.
- `per_byte`: the tokens differ, so loss per token is not comparable (a tokenizer with longer tokens has
  fewer, harder-to-predict tokens). The champion is measured on the same raw examples re-formatted and
  tokenized with its own tokenizer (the tokenize stage's own formatting code), and compared on the
  summed negative log-likelihood per UTF-8 byte of the target text, which does not depend on the
  tokenization. Its gate metrics are that loss per byte expressed in the fine-tuned model's tokens
  (`eval_loss` = nats per byte × the fine-tuned model's target bytes per token), so
  `registration.promote_if` and its `min_delta` keep their meaning. Exact match compares decoded text
  and needs no conversion.
- `refused`: the champion cannot be measured on these examples (their raw text is not at hand, or none
  fits `data.max_length` with its tokenizer); it keeps its alias and the new version stays challenger.
- `not_compared`: `evaluate.compare_champion` is false; the champion is not evaluated and keeps its
  alias (a new version only takes `champion` when there is none yet).

The kind and its reason go into the report, the MLflow run and the registered version's tags.
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
from pathlib import Path
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from fulltune.data import IGNORE_INDEX
from fulltune.errors import ConfigError, DataError, UserError
from fulltune.spec import DataSpec

if TYPE_CHECKING:
    from fulltune.evaluation.harness import Benchmarks
    from fulltune.tracking.registry import Champion
    from fulltune.spec import PipelineSpec

Progress = Callable[[str], None]

NO_CHAMPION = "no_champion"
SAME_TOKENS = "same_tokens"
PER_BYTE = "per_byte"
REFUSED = "refused"
NOT_COMPARED = "not_compared"


@dataclass(frozen=True)
class ModelMetrics:
    eval_loss: float  # nats per target token
    perplexity: float
    eval_tokens: int  # target tokens the loss is averaged over
    exact_match: float | None = None
    generated_examples: int = 0
    samples: tuple[tuple[str, str, str], ...] = ()  # (prompt, expected, generated) for the report
    target_bytes: int = 0  # UTF-8 bytes of the text the target tokens decode to
    # lm-evaluation-harness (`<task>/<metric>`) and evaluate.metrics values (fulltune/evaluation/harness.py)
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def bits_per_byte(self) -> float | None:
        """Summed loss per byte of target text, in bits: comparable across tokenizers."""
        if self.target_bytes <= 0:
            return None
        return self.eval_loss * self.eval_tokens / (self.target_bytes * math.log(2))

    def as_dict(self) -> dict[str, float]:
        values = {"eval_loss": self.eval_loss, "perplexity": self.perplexity}
        if self.bits_per_byte is not None:
            values["bits_per_byte"] = self.bits_per_byte
        if self.exact_match is not None:
            values["exact_match"] = self.exact_match
        return {**values, **self.extra}


@dataclass(frozen=True)
class EvalReport:
    """Metrics per candidate: `base`, `fine_tuned`, and `champion` when one was compared.

    `candidates["champion"]` holds the values the gate compares, in the fine-tuned model's token units;
    with a `per_byte` comparison the champion's measurement on its own tokens is `champion_own_tokens`.
    """

    candidates: dict[str, ModelMetrics]
    num_examples: int
    champion_version: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    comparison: str = NO_CHAMPION  # one of the kinds in the module docstring
    comparison_reason: str = "no champion yet"
    champion_own_tokens: ModelMetrics | None = None

    @property
    def keeps_champion(self) -> bool:
        """Whether the champion keeps its alias whatever the new version's metrics (nothing to compare)."""
        return self.comparison in (REFUSED, NOT_COMPARED)

    def markdown(self) -> str:
        columns = dict(self.candidates)
        if self.champion_own_tokens is not None:
            columns["champion (own tokenizer)"] = self.champion_own_tokens
        names = list(columns)
        lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        for metric in metric_names(columns.values()):
            cells = []
            for name in names:
                value = columns[name].as_dict().get(metric)
                cells.append("—" if value is None else f"{value:.4f}")
            lines.append(f"| {metric} | " + " | ".join(cells) + " |")
        if self.champion_version is not None:
            title = COMPARISON_TITLES.get(self.comparison, self.comparison)
            reason = self.comparison_reason[:1].upper() + self.comparison_reason[1:]
            lines += ["", f"**Champion comparison: {title}.** {reason}"]
        tuned = self.candidates.get("fine_tuned")
        if tuned and tuned.samples:
            lines += ["", "| prompt | expected | fine-tuned output |", "|---|---|---|"]
            lines += [f"| `{p!r}` | `{e!r}` | `{g!r}` |" for p, e, g in tuned.samples[:5]]
        return "\n".join(lines)


def metric_names(candidates: Iterable[ModelMetrics]) -> list[str]:
    """The built-in metrics in their fixed order, then every benchmark metric any candidate has, sorted."""
    extra = sorted({name for metrics in candidates for name in metrics.extra})
    return ["eval_loss", "perplexity", "bits_per_byte", "exact_match", *extra]


COMPARISON_TITLES = {
    SAME_TOKENS: "same tokens, loss per token",
    PER_BYTE: "different tokenizers, loss per byte of target text",
    REFUSED: "refused, the champion keeps its alias",
    NOT_COMPARED: "not compared, the champion keeps its alias",
}


def read_eval_rows(eval_file: str, max_examples: int | None) -> Sequence[dict[str, Any]]:
    """The first `max_examples` eval rows (None: all), read a row group at a time as they are used."""
    from fulltune.data.eval_rows import EvalRows

    return EvalRows(eval_file, max_examples)


def evaluate_model(model_path: str, tokenizer_path: str, rows: list[dict[str, Any]], *, batch_size: int,
                   generate_examples: int, max_new_tokens: int, device: str, load_kwargs: dict[str, Any],
                   benchmarks: Benchmarks | None = None, progress: Progress | None = None,
                   name: str = "model", generation_batch_size: int | None = None) -> ModelMetrics:
    """Token-weighted mean loss over every labelled token, perplexity = exp(loss), bits per byte of target
    text, exact match, and the benchmarks (lm-evaluation-harness tasks, metric functions) with the same
    loaded model. `rows` must be tokenized with the tokenizer at `tokenizer_path`, which the harness also
    uses. `batch_size` is the loss batch, `generation_batch_size` generation's (None: `batch_size`);
    `load_kwargs` are `models.load_model`'s (the dtype, a `max_memory` device map). `progress` gets a line at
    most every PROGRESS_SECONDS while a phase runs; `name` labels it. The model is freed before this returns."""
    from fulltune.models import Placement, load_model, load_tokenizer, release_memory

    tokenizer = load_tokenizer(tokenizer_path, revision=load_kwargs.get("revision"),
                               trust_remote_code=load_kwargs.get("trust_remote_code", False),
                               token=load_kwargs.get("token"))
    model = load_model(model_path, **{"placement": Placement(device), **load_kwargs}).eval()
    try:
        _check_ids_fit(model, rows, model_path, tokenizer_path)
        report = _Reporter(progress, name)
        eval_loss, total_tokens = _held_out_loss(model, tokenizer, rows, batch_size, device, report)
        exact, samples, generated = None, (), 0
        extra: dict[str, float] = {}
        if generate_examples > 0 and rows and rows[0].get("completion") is not None:
            exact, samples = _exact_match(model, tokenizer, rows[:generate_examples], max_new_tokens, device,
                                          generation_batch_size or batch_size, report)
            generated = min(generate_examples, len(rows))
            if benchmarks is not None:
                extra.update(benchmarks.on_generations([s[2] for s in samples], [s[1] for s in samples],
                                                        progress, name))
        if benchmarks is not None and benchmarks.tasks:
            if progress is not None:
                progress(f"{name}: lm-evaluation-harness tasks {', '.join(t.name for t in benchmarks.tasks)}")
            extra.update(benchmarks.on_model(model, tokenizer, device))
    finally:
        del model  # freed before the next candidate loads: nothing here keeps a reference
        release_memory()
    return ModelMetrics(eval_loss, math.exp(min(eval_loss, 700.0)), total_tokens, exact, generated, samples,
                        target_bytes(tokenizer, rows), extra)


def _held_out_loss(model: Any, tokenizer: Any, rows: list[dict[str, Any]], batch_size: int, device: str,
                   report: Callable[[str, int, int], None]) -> tuple[float, int]:
    """(mean loss per target token, target tokens): the loss as training computes it, logits only where
    there is a target (TargetHead)."""
    import torch

    from fulltune.data import collate
    from fulltune.runtime.loss import TargetHead, Targets

    head = TargetHead(model)
    total_loss = torch.zeros((), dtype=torch.float64)
    total_tokens = 0
    try:
        with torch.inference_mode():
            for start in range(0, len(rows), batch_size):
                batch = collate(rows[start:start + batch_size], tokenizer.pad_token_id)
                targets = Targets.from_labels(batch.pop("labels"))
                inputs = {key: tensor.to(device) for key, tensor in batch.items()}
                total_loss += head.loss_sum(model, inputs, targets.to(device)).double().cpu()
                total_tokens += len(targets)
                report("loss", min(start + batch_size, len(rows)), len(rows))
    finally:
        head.remove()
    if total_tokens == 0:
        raise DataError("data.eval: the eval examples have no labelled tokens; check the eval data and data.max_length")
    return float(total_loss) / total_tokens, total_tokens


# A phase of evaluation that runs longer than this logs how far it got, so a long one is visibly alive.
PROGRESS_SECONDS = 10.0


class _Reporter:
    """Calls `progress` with `<name>: <phase> <done>/<total>` at most every PROGRESS_SECONDS."""

    def __init__(self, progress: Progress | None, name: str) -> None:
        import time

        self.progress, self.name, self.clock = progress, name, time.monotonic
        self.last = self.clock()

    def __call__(self, phase: str, done: int, total: int) -> None:
        if self.progress is None or done >= total or self.clock() - self.last < PROGRESS_SECONDS:
            return
        self.last = self.clock()
        self.progress(f"{self.name}: {phase} {done}/{total} examples")


def _check_ids_fit(model: Any, rows: list[dict[str, Any]], model_path: str, tokenizer_path: str) -> None:
    """A token id beyond the embedding would crash deep inside the model (IndexError); say what is wrong."""
    rows_in_embedding = model.get_input_embeddings().num_embeddings
    largest = max((max(row["input_ids"], default=0) for row in rows), default=0)
    if largest >= rows_in_embedding:
        raise ConfigError(
            f"model.tokenizer: the tokenizer {tokenizer_path!r} produces token id {largest}, but the model "
            f"{model_path!r} has {rows_in_embedding} token embeddings; use the tokenizer the model was trained with"
        )


def target_bytes(tokenizer: Any, rows: list[dict[str, Any]]) -> int:
    """UTF-8 bytes of the text the target tokens stand for (special tokens such as eos count 0).

    Each run of consecutive targets is decoded as one piece, so a character split over several byte-level
    tokens counts once.
    """
    pieces = []
    for row in rows:
        span: list[int] = []
        for token, label in zip(row["input_ids"], row["labels"]):
            if label != IGNORE_INDEX:
                span.append(token)
            elif span:
                pieces.append(span)
                span = []
        if span:
            pieces.append(span)
    texts = tokenizer.batch_decode(pieces, skip_special_tokens=True) if pieces else []
    return sum(len(text.encode("utf-8")) for text in texts)


def _exact_match(model: Any, tokenizer: Any, rows: list[dict[str, Any]], max_new_tokens: int, device: str,
                 batch_size: int, report: Callable[[str, int, int], None] | None = None,
                 ) -> tuple[float, tuple[tuple[str, str, str], ...]]:
    """Greedy generation from the prompt tokens (the unlabelled prefix of each row)."""
    import torch

    hits, samples = 0, []
    pad = tokenizer.pad_token_id
    for start in range(0, len(rows), batch_size):
        chunk = rows[start:start + batch_size]
        prompts = [_prompt_ids(row) for row in chunk]
        width = max(len(p) for p in prompts)
        # Left padding so every prompt ends where generation starts.
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        with torch.inference_mode():
            output = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                    do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        for row, sequence in zip(chunk, output[:, width:].tolist()):
            text = tokenizer.decode(sequence, skip_special_tokens=True).strip()
            expected = str(row["completion"]).strip()
            hits += int(text == expected)
            samples.append((str(row.get("prompt", "")), expected, text))
        if report is not None:
            report("generation", len(samples), len(rows))
    return hits / len(rows), tuple(samples)


def _prompt_ids(row: dict[str, Any]) -> list[int]:
    labels = row["labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    return list(row["input_ids"][:first])


# ---------------------------------------------------------------------------------------------------
# The champion: its own tokens, and what can be compared


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


# ---------------------------------------------------------------------------------------------------
# The stage: every candidate on the same examples, the champion compared fairly


def evaluate_candidates(spec: PipelineSpec, *, eval_file: str, base_model: str, model_dir: str, tokenizer: str,
                        champion: Champion | None, workdir: str, base_dir: str, device: str,
                        progress: Progress | None = None, evaluation: dict[str, Any] | None = None) -> EvalReport:
    """Stage 4: the base model (with the run's tokenizer), the fine-tuned model and the current champion
    (each with its own tokenizer) on the same held-out examples and the same benchmarks, one after another,
    each freed before the next loads.

    `evaluation` is the plan's evaluate stage (memory/evaluation.py `EvalPlan.to_dict`): every candidate loads
    in its dtype (the trained precision), placed as it says, and runs its fitted batches. None: fp32 and the
    `evaluate.*` batches. `base_dir` is the pipelines file's directory (task YAMLs and metric modules are
    found from there); the champion's checkpoint is downloaded under `<workdir>/champions/`.
    """
    from fulltune.evaluation.harness import Benchmarks
    from fulltune.models import hub_token

    e, m = spec.evaluate, spec.model
    rows = read_eval_rows(eval_file, e.max_examples)
    benchmarks = Benchmarks.from_spec(spec, base_dir)
    if benchmarks is not None and evaluation is not None and evaluation.get("harness_batch"):
        benchmarks = replace(benchmarks, batch_size=evaluation["harness_batch"])
    load = {"revision": m.revision, "trust_remote_code": m.trust_remote_code,
            "allow_pickle_weights": m.allow_pickle_weights, "attn_implementation": m.attn_implementation,
            "token": hub_token(m.token_env),
            **planned_loading(evaluation, device, str(Path(workdir) / "evals" / "offload"))}
    options = {"batch_size": evaluation["loss_batch"] if evaluation else e.batch_size,
               "generation_batch_size": (evaluation["generation_batch"] or None) if evaluation else None,
               "generate_examples": e.max_generate_examples,
               "max_new_tokens": e.max_new_tokens, "device": device, "benchmarks": benchmarks, "progress": progress}
    candidates = {"base": (base_model, tokenizer, load),
                  "fine_tuned": (model_dir, model_dir, {**load, "revision": None})}
    metrics = {name: evaluate_model(path, tokenizer_path, rows, load_kwargs=kwargs, name=name, **options)
               for name, (path, tokenizer_path, kwargs) in candidates.items()}
    return compare_with_champion(spec, rows, metrics, champion, model_dir=model_dir, workdir=workdir,
                                 options=options, load=load)


def compare_with_champion(spec: PipelineSpec, rows: list[dict[str, Any]], metrics: dict[str, ModelMetrics],
                          champion: Champion | None, *, model_dir: str, workdir: str,
                          options: dict[str, Any], load: dict[str, Any]) -> EvalReport:
    """The report of `metrics` (base and fine-tuned), with the champion measured on its own tokens when
    there is one to compare; `options` are evaluate_model's keyword arguments, `load` the base model's
    `load_kwargs` (the champion loads in the same dtype and placement, without the base's hub revision)."""
    from fulltune.models import hub_token, load_tokenizer
    from fulltune.tracking.registry import download_version

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


def planned_loading(evaluation: dict[str, Any] | None, device: str, offload_folder: str) -> dict[str, Any]:
    """`load_model`'s dtype and placement as the plan's evaluation says: its dtype on `device`, or where the plan
    layer-offloads (a GPU that cannot hold the weights), accelerate's device map over the GPU's planned bytes
    and host RAM (on disk under `offload_folder` what a layer's granularity leaves over). None: fp32."""
    from fulltune.models import Placement

    if evaluation is None:
        return {"dtype": "fp32", "placement": Placement(device)}
    offload = evaluation.get("offload")
    if offload is None:
        return {"dtype": evaluation["dtype"], "placement": Placement(device)}
    memory = {0: offload["device_bytes"], "cpu": offload["host_bytes"]}
    return {"dtype": evaluation["dtype"], "placement": Placement(device, memory, offload_folder)}
