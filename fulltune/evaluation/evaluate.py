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

import math
from pathlib import Path
from dataclasses import dataclass, field, replace
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from fulltune.data import IGNORE_INDEX
from fulltune.degrees import CONTEXT
from fulltune.errors import ConfigError, DataError

if TYPE_CHECKING:
    from fulltune.evaluation.champion import Champion
    from fulltune.evaluation.harness import Benchmarks
    from fulltune.spec import PipelineSpec
    from fulltune.spec_gates import PromoteIf

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

    def markdown(self, gates: Sequence[PromoteIf] = ()) -> str:
        """The metrics side by side; the metrics `gates` (register.promote_if) read, named with each candidate's
        value; whether there is a champion and how it was measured; the first generations."""
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
        for gate in gates:
            values = ", ".join(f"{name.replace('_', '-')} " + ("—" if (v := self.candidates[name].as_dict().get(
                gate.metric)) is None else f"{v:.4f}") for name in self.candidates)
            lines += ["", f"**The gate reads {gate.metric}** (`register.promote_if`, "
                          f"{'higher' if gate.mode == 'max' else 'lower'} is better): {values}."]
        if self.champion_version is None:
            lines += ["", "**No champion yet**: the fine-tuned model is compared with the base model only."]
        else:
            title = COMPARISON_TITLES.get(self.comparison, self.comparison)
            reason = self.comparison_reason[:1].upper() + self.comparison_reason[1:]
            lines += ["", f"**Champion version {self.champion_version}, measured {title}.** {reason}"]
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
    SAME_TOKENS: "on the same tokens (its losses per token compare directly)",
    PER_BYTE: "on its own tokens (different tokenizers: loss per byte of target text compared)",
    REFUSED: "not at all: refused, the champion keeps its alias",
    NOT_COMPARED: "not at all: not compared, the champion keeps its alias",
}


def read_eval_rows(eval_file: str, max_examples: int | None,
                   sources: Sequence[tuple[str, int]] = ()) -> Sequence[dict[str, Any]]:
    """The eval rows, read a row group at a time as they are used: of each data.eval source (`sources`, its name
    and rows in the file, `eval_sources`; none: the file is one source) the first `max_examples` (None: all)."""
    from fulltune.data.eval_rows import EvalRows

    return EvalRows(eval_file, max_examples, [count for _, count in sources] or None)


def kept_sources(sources: Sequence[tuple[str, int]], max_examples: int | None) -> tuple[tuple[str, int], ...]:
    """(name, rows evaluated) of each source once `evaluate.max_examples` keeps its first rows."""
    return tuple((name, count if max_examples is None else min(count, max_examples)) for name, count in sources)


@dataclass(frozen=True)
class EvalOptions:
    """How each candidate is evaluated: the loss batch, generation's batch (None: the loss batch), how many
    examples generate and how many new tokens, the device, and the processes each candidate is sharded over
    (1: one process holds the model; more: the training's launch path starts them, fulltune/evaluation/sharded.py;
    its job, rows and result go in a temporary directory under `work_dir`)."""

    batch_size: int
    generate_examples: int
    max_new_tokens: int
    device: str = "cpu"
    generation_batch_size: int | None = None
    processes: int = 1
    work_dir: str | None = None
    # (name, rows) of each data.eval source, in the rows' order: metrics per source beside the total, and each
    # source's first `generate_examples` rows with a completion generated
    sources: tuple[tuple[str, int], ...] = ()
    # The plan's held-out loss for long rows (memory/evaluation.py EvalPlan): in (rows × vocabulary) tiles, and
    # with each row's positions split over this many of the processes (context parallel, sharded runs only).
    chunked_loss: bool = False
    row_split: int = 1

    @property
    def generation_batch(self) -> int:
        return self.generation_batch_size or self.batch_size


def evaluate_model(model_path: str, tokenizer_path: str, rows: list[dict[str, Any]], options: EvalOptions, *,
                   load_kwargs: dict[str, Any], benchmarks: Benchmarks | None = None, progress: Progress | None = None,
                   name: str = "model") -> ModelMetrics:
    """Token-weighted mean loss over every labelled token, perplexity = exp(loss), bits per byte of target
    text, exact match, and the benchmarks (lm-evaluation-harness tasks, metric functions) with the same
    loaded model. `rows` must be tokenized with the tokenizer at `tokenizer_path`, which the harness also
    uses. `load_kwargs` are `models.load_model`'s (the dtype, a `max_memory` device map). `progress` gets a line
    at most every PROGRESS_SECONDS while a phase runs; `name` labels it. The model is freed before this returns.
    With `options.processes` > 1 the model is sharded over that many child processes (`sharded.evaluate_sharded`),
    with the same metrics."""
    from fulltune.models import Placement, load_model, load_tokenizer, release_memory

    if options.processes > 1:
        from fulltune.evaluation.sharded import evaluate_sharded

        return evaluate_sharded(model_path, tokenizer_path, rows, options, load_kwargs=load_kwargs,
                                benchmarks=benchmarks, progress=progress, name=name)
    tokenizer = load_tokenizer(tokenizer_path, revision=load_kwargs.get("revision"),
                               trust_remote_code=load_kwargs.get("trust_remote_code", False),
                               token=load_kwargs.get("token"))
    device = options.device
    model = load_model(model_path, **{"placement": Placement(device), **load_kwargs}).eval()
    try:
        check_ids_fit(model, rows, model_path, tokenizer_path)
        report = Reporter(progress, name)
        sums = _held_out_loss(model, tokenizer, rows, options, report)
        samples: tuple[tuple[str, str, str], ...] = ()
        chosen = [rows[i] for group in generation_rows(rows, options) for i in group]
        if chosen:
            _, samples = _exact_match(model, tokenizer, chosen, options.max_new_tokens, device,
                                      options.generation_batch, report)
        extra: dict[str, float] = {}
        if benchmarks is not None and benchmarks.tasks:
            if progress is not None:
                progress(f"{name}: lm-evaluation-harness tasks {', '.join(t.name for t in benchmarks.tasks)}")
            extra.update(benchmarks.on_model(model, tokenizer, device))
    finally:
        del model  # freed before the next candidate loads: nothing here keeps a reference
        release_memory()
    return metrics_of(tokenizer, rows, options, sums, samples, extra, benchmarks=benchmarks, progress=progress,
                      name=name)


def metrics_of(tokenizer: Any, rows: list[dict[str, Any]], options: EvalOptions, sums: list[tuple[float, int]],
               samples: tuple[tuple[str, str, str], ...], extra: dict[str, float], **scoring: Any) -> ModelMetrics:
    """The metrics of one candidate from its summed loss and target tokens per source (`sums`, as
    `source_groups` cuts the rows), its generations and its lm-evaluation-harness values (`extra`): the totals,
    each source's (`eval_loss/<source>` …), and the metric functions on the generations (`scoring`:
    `benchmarks`, `progress`, `name` as `Benchmarks.on_generations` takes them)."""
    eval_loss, tokens = mean_loss(sum(loss for loss, _ in sums), sum(n for _, n in sums))
    generated = [len(group) for group in generation_rows(rows, options)]
    extra = {**extra, **_per_source(tokenizer, rows, source_groups(rows, options), sums, samples, generated)}
    benchmarks = scoring.get("benchmarks")
    if samples and benchmarks is not None:
        extra.update(benchmarks.on_generations([s[2] for s in samples], [s[1] for s in samples],
                                               scoring.get("progress"), scoring.get("name", "model")))
    return ModelMetrics(eval_loss, math.exp(min(eval_loss, 700.0)), tokens, exact_match(samples) if samples else None,
                        len(samples), samples, target_bytes(tokenizer, rows), extra)


def source_groups(rows: list[dict[str, Any]], options: EvalOptions) -> list[tuple[str | None, int]]:
    """(source name, rows) in the rows' order: each data.eval source's rows (`options.sources`: evaluate.max_examples
    keeps the first of each; as many as `rows` holds of them), or one unnamed group for a single source."""
    groups: list[tuple[str | None, int]] = []
    left = len(rows)
    for name, count in options.sources:
        if min(count, left) > 0:
            groups.append((name, min(count, left)))
            left -= min(count, left)
    return groups + [(None, left)] if left or not groups else groups


def loss_batches(rows: list[dict[str, Any]], options: EvalOptions) -> list[tuple[int, list[dict[str, Any]]]]:
    """(source group, rows) of every held-out-loss batch: up to `options.batch_size` rows of one source."""
    batches, start = [], 0
    for index, (_, count) in enumerate(source_groups(rows, options)):
        for first in range(start, start + count, options.batch_size):
            batches.append((index, rows[first:min(first + options.batch_size, start + count)]))
        start += count
    return batches


def _per_source(tokenizer: Any, rows: list[dict[str, Any]], groups: list[tuple[str | None, int]],
                sums: list[tuple[float, int]], samples: tuple[tuple[str, str, str], ...],
                generated: list[int]) -> dict[str, float]:
    """`<metric>/<source>` of the built-in metrics, for each named source with a target token; exact match for
    each source with generations (`generated`: how many of `samples`, in order, are each source's)."""
    values: dict[str, float] = {}
    start = first_sample = 0
    for (name, count), (loss, tokens), made in zip(groups, sums, generated):
        if name is not None and tokens:
            values[f"eval_loss/{name}"] = loss / tokens
            values[f"perplexity/{name}"] = math.exp(min(loss / tokens, 700.0))
            text_bytes = target_bytes(tokenizer, rows[start:start + count])
            if text_bytes:
                values[f"bits_per_byte/{name}"] = loss / (text_bytes * math.log(2))
            if made:
                values[f"exact_match/{name}"] = exact_match(samples[first_sample:first_sample + made])
        start += count
        first_sample += made
    return values


def generation_rows(rows: Sequence[dict[str, Any]], options: EvalOptions) -> list[list[int]]:
    """For each source group (`source_groups`), the rows generated for: its first `options.generate_examples`
    rows with a completion to compare (prompt_completion rows; chat and text rows have none), in order."""
    from fulltune.data.eval_rows import has_completion

    chosen, start = [], 0
    for _, count in source_groups(rows, options):
        found: list[int] = []
        for first in range(start, start + count, GENERATION_SCAN_ROWS):
            if len(found) >= options.generate_examples:
                break
            stop = min(first + GENERATION_SCAN_ROWS, start + count)
            found += [first + i for i, present in enumerate(has_completion(rows, first, stop)) if present]
        chosen.append(found[:options.generate_examples])
        start += count
    return chosen


# Rows whose completion column is read at a time while looking for the rows to generate for.
GENERATION_SCAN_ROWS = 4096


def _held_out_loss(model: Any, tokenizer: Any, rows: list[dict[str, Any]], options: EvalOptions,
                   report: Callable[[str, int, int], None]) -> list[tuple[float, int]]:
    """(summed loss, target tokens) of each source group (`source_groups`): the loss as training computes it,
    logits only where there is a target (TargetHead)."""
    import torch

    from fulltune.runtime.loss import TargetHead

    head = TargetHead(model, chunked=options.chunked_loss)  # chunked: no (positions × vocabulary) logits
    groups = source_groups(rows, options)
    sums = [torch.zeros((), dtype=torch.float64) for _ in groups]
    tokens = [0] * len(groups)
    done = 0
    try:
        with torch.inference_mode():
            for index, batch in loss_batches(rows, options):
                loss, count = batch_loss(model, head, tokenizer, batch, options.device)
                sums[index] += loss
                tokens[index] += count
                done += len(batch)
                report("loss", done, len(rows))
    finally:
        head.remove()
    return [(float(total), count) for total, count in zip(sums, tokens)]


def batch_loss(model: Any, head: Any, tokenizer: Any, rows: list[dict[str, Any]], device: str,
               context: Any = None) -> tuple[Any, int]:
    """(the summed fp32 cross-entropy of one batch's target tokens as a float64 CPU tensor, its target tokens);
    with `context` (fulltune/runtime/context_parallel.py) this process's share of the rows' positions only."""
    from fulltune.data import collate
    from fulltune.runtime.loss import Targets

    batch = collate(rows, tokenizer.pad_token_id)
    targets = Targets.from_labels(batch.pop("labels")).to(device)
    inputs = {key: tensor.to(device) for key, tensor in batch.items()}
    if context is not None:
        inputs.pop("attention_mask", None)  # right padding: causal positions never attend to it (as training)
        inputs, targets = context.shard(inputs, targets)
    return head.loss_sum(model, inputs, targets).double().cpu(), len(targets)


def mean_loss(total_loss: float, total_tokens: int) -> tuple[float, int]:
    """(loss per target token, target tokens); a DataError when no row has a target."""
    if total_tokens == 0:
        raise DataError("data.eval: the eval examples have no labelled tokens; check the eval data and data.max_length")
    return total_loss / total_tokens, total_tokens


# A phase of evaluation that runs longer than this logs how far it got, so a long one is visibly alive.
PROGRESS_SECONDS = 10.0


class Reporter:
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


def check_ids_fit(model: Any, rows: list[dict[str, Any]], model_path: str, tokenizer_path: str) -> None:
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
    samples: list[tuple[str, str, str]] = []
    for start in range(0, len(rows), batch_size):
        samples += generate_batch(model, tokenizer, rows[start:start + batch_size], max_new_tokens, device)
        if report is not None:
            report("generation", len(samples), len(rows))
    return exact_match(samples), tuple(samples)


def exact_match(samples: list[tuple[str, str, str]] | tuple[tuple[str, str, str], ...]) -> float:
    """The share of (prompt, expected, generated) samples whose generated text is the expected one."""
    return sum(int(generated == expected) for _, expected, generated in samples) / len(samples)


def generate_batch(model: Any, tokenizer: Any, chunk: list[dict[str, Any]], max_new_tokens: int, device: str,
                   synced: bool = False) -> list[tuple[str, str, str]]:
    """(prompt, expected, generated) of greedy generation for one batch of rows, left-padded so every prompt
    ends where generation starts. `synced`: every process of a sharded model runs the same number of forwards
    (transformers' `synced_gpus`), whichever finishes first."""
    import torch

    pad = tokenizer.pad_token_id
    prompts = [_prompt_ids(row) for row in chunk]
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
    attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        output = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id,
                                synced_gpus=synced)
    samples = []
    for row, sequence in zip(chunk, output[:, width:].tolist()):
        text = tokenizer.decode(sequence, skip_special_tokens=True).strip()
        samples.append((str(row.get("prompt", "")), str(row["completion"]).strip(), text))
    return samples


def _prompt_ids(row: dict[str, Any]) -> list[int]:
    labels = row["labels"]
    first = next((i for i, label in enumerate(labels) if label != IGNORE_INDEX), len(labels))
    return list(row["input_ids"][:first])


# ---------------------------------------------------------------------------------------------------
# The stage: every candidate on the same examples, the champion compared fairly


@dataclass(frozen=True)
class Candidates:
    """What the evaluate stage reads and where it writes: the held-out rows, the base model with the run's
    tokenizer, the fine-tuned checkpoint (its own tokenizer), the workdir and the pipelines file's directory."""

    eval_file: str
    base_model: str
    model_dir: str
    tokenizer: str
    workdir: str
    base_dir: str


def evaluate_candidates(spec: PipelineSpec, candidates: Candidates, champion: Champion | None, device: str, *,
                        progress: Progress | None = None, evaluation: dict[str, Any] | None = None) -> EvalReport:
    """Stage 4: the base model (with the run's tokenizer), the fine-tuned model and the current champion
    (each with its own tokenizer) on the same held-out examples and the same benchmarks, one after another,
    each freed before the next loads.

    `evaluation` is the plan's evaluate stage (memory/evaluation.py `EvalPlan.to_dict`): every candidate loads
    in its dtype (the trained precision), placed as it says (sharded over its `processes` when the training
    was), and runs its fitted batches. None: fp32, one process and the `evaluate.*` batches. Task YAMLs and metric
    modules are found from `candidates.base_dir`; the champion's checkpoint is downloaded under
    `<workdir>/champions/`.
    """
    from fulltune.evaluation.champion import compare_with_champion
    from fulltune.evaluation.harness import Benchmarks
    from fulltune.models import hub_token

    e, m, c = spec.evaluate, spec.model, candidates
    workdir, model_dir, tokenizer = c.workdir, c.model_dir, c.tokenizer
    sources = eval_sources(spec.data, c.eval_file)
    rows = read_eval_rows(c.eval_file, e.max_examples, sources)
    benchmarks = Benchmarks.from_spec(spec, c.base_dir)
    if benchmarks is not None and evaluation is not None and evaluation.get("harness_batch"):
        benchmarks = replace(benchmarks, batch_size=evaluation["harness_batch"])
    load = {"revision": m.revision, "trust_remote_code": m.trust_remote_code,
            "allow_pickle_weights": m.allow_pickle_weights, "attn_implementation": m.attn_implementation,
            "token": hub_token(m.token_env),
            **planned_loading(evaluation, device, str(Path(workdir) / "evals" / "offload"))}
    options = {"options": EvalOptions(
        evaluation["loss_batch"] if evaluation else e.batch_size, e.max_generate_examples, e.max_new_tokens, device,
        (evaluation["generation_batch"] or None) if evaluation else None,
        evaluation.get("processes", 1) if evaluation else 1, str(Path(workdir) / "evals"),
        kept_sources(sources, e.max_examples),
        bool(evaluation.get("chunked_loss")) if evaluation else False,
        int(evaluation.get(CONTEXT.name, 1)) if evaluation else 1),
        "benchmarks": benchmarks, "progress": progress}
    models = {"base": (c.base_model, tokenizer, load), "fine_tuned": (model_dir, model_dir, {**load, "revision": None})}
    if options["options"].processes > 1:  # one launch of the processes for both
        from fulltune.evaluation.sharded import Candidate, evaluate_sharded_candidates

        metrics = evaluate_sharded_candidates([Candidate(name, *candidate) for name, candidate in models.items()],
                                              rows, options["options"], benchmarks, progress)
    else:
        metrics = {name: evaluate_model(path, tokenizer_path, rows, load_kwargs=kwargs, name=name, **options)
                   for name, (path, tokenizer_path, kwargs) in models.items()}

    return compare_with_champion(spec, rows, metrics, champion, model_dir=model_dir, workdir=workdir,
                                 options=options, load=load)


def eval_sources(data: Any, eval_file: str) -> tuple[tuple[str, int], ...]:
    """(name, rows) of each data.eval source in eval.parquet's order (its meta.json counts them); () for a single
    source (fulltune/data/sources.py `eval_source_names`)."""
    import json

    from fulltune.data.sources import eval_source_names

    names = eval_source_names(data)
    if not names:
        return ()
    counted = json.loads((Path(eval_file).parent / "meta.json").read_text()).get("sources", {}).get("eval", [])
    if len(counted) != len(names):
        return ()
    return tuple((name, int(source["examples"])) for name, source in zip(names, counted))


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
