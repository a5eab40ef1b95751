"""Stage 2, the memory budget: plan settings that fit, and measure the top candidates where autotune says so.

`plan_budget` plans on the tokenized data's rows (`plan_inputs`: their length, the share of positions with a
target, the vocabulary of a model built from a config); `plan_and_tune` is what the stage's `run` and
`fulltune plan` call: the plan with this machine's step-time calibration, then autotune's measurements
(fulltune/planning/autotune.py) when `budget.autotune` asks for them. `data.packing: auto` is decided here too
(`choose_packing`, which the tokenize stage calls): by the predicted epoch time of each layout, or by measuring
both under `budget.autotune: true`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from fulltune.errors import BudgetError, ConfigError
from fulltune.memory import format_plan_table, render_breakdown_png
from fulltune.memory.units import format_seconds
from fulltune.planning.autotune import (AUTO_RATIO, AUTOTUNE_DIR, CHILD_START_SECONDS, Options, analytic_step_seconds,
                                        calibrated, calibration_key, candidates, hardware, options, planned_settings,
                                        tune)
from fulltune.planning.autotune_report import format_table, render_png
from fulltune.planning.inputs import BudgetDecision, ResolvedPipeline, evaluation_request, plan_request, resolved_budget
from fulltune.stages import (MEMORY_BUDGET, OUTSIDE_THE_WEIGHTS, TOKENIZE, check_model_builds, check_model_split,
                             check_positions, model_config_key, model_source, read_marker, weights_inputs)
from fulltune.stages.runner import Inputs, Stage, StageLog, key_of, run_stage
from fulltune.stages.tokenize import STAGE as TOKENIZE_STAGE

# The budget stage measures candidates (planning/autotune.py) in child runs of the trainer on the data tokenized
# both ways: the whole runtime and the tokenize stage.
CODE = ("memory", "planning", "runtime", "data", "stages/__init__.py", "stages/runner.py", "stages/budget.py",
        "stages/tokenize.py", "models.py", "attention.py", "levers.py", "lever_record.py", "optimizers.py", "degrees.py",
        "storage.py", "hub.py", "sizes.py", "pipelines_file.py")


def code(p: ResolvedPipeline) -> tuple[str, ...]:
    return CODE


def key(inputs: Inputs) -> dict[str, Any]:
    """Training data (not eval data), the model, every section the plan reads, the budget as resolved on this
    machine, and the step times measured on its kind of device."""
    p = inputs.pipeline
    spec = p.spec
    return {
        "data": inputs.record(TOKENIZE).data.training_fingerprint,
        **weights_inputs(spec), "model_source": model_source(p), "budget": spec.budget.model_dump(mode="json"),
        "distributed": spec.distributed.model_dump(mode="json"),
        "evaluation": asdict(evaluation_request(spec)),  # the evaluate stage is planned here too
        "resolved": asdict(resolved_budget(p)),
        # The kind of device (its name and count), and the step times measured on it, which rerank the
        # candidates and whose measurements a tuning chooses from (fulltune/planning/autotune.py).
        "step_time_calibration": calibration_key(p.workdir, resolved_budget(p).device),
    }


def run(inputs: Inputs, key: str, log: StageLog) -> BudgetDecision:
    """Estimate the peak for the configured settings; pick the fastest settings within the budget, measured on
    this machine when `budget.autotune` says so (fulltune/planning/autotune.py)."""
    p = inputs.pipeline
    tokenized = inputs.record(TOKENIZE)
    picture = Path(p.workdir) / "plans" / key / "memory_plan.png"
    decision = plan_and_tune(p, tokenized.data, tokenized.tokenizer, picture=picture, on_progress=log.logger.info)
    log.logger.info("memory plan:\n%s", decision.table)
    return decision


def writes(inputs: Inputs, key: str, record: BudgetDecision) -> list[str]:
    """The breakdown's picture, and autotune's when it measured."""
    tuned = record.plan["autotune"].get("picture")
    return [p for p in (record.picture, tuned) if p]


def track(inputs: Inputs, record: BudgetDecision) -> None:
    """The memory plan in the pipeline's MLflow run: its table, picture and JSON under `memory_plan/`, the settings
    that train as `trains.*` params, and autotune's table and picture when it ran."""
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    from fulltune.planning.autotune_report import log_to_mlflow

    client, run_id = MlflowClient(), inputs.mlflow_run_id
    client.log_text(run_id, record.table, "memory_plan/memory_plan.txt")
    client.log_dict(run_id, record.plan, "memory_plan/memory_plan.json")
    if record.picture and Path(record.picture).is_file():
        client.log_artifact(run_id, record.picture, "memory_plan")
    settings = record.settings if isinstance(record.settings, dict) else asdict(record.settings)
    client.log_batch(run_id, params=[Param(f"trains.{name}", str(value)) for name, value in sorted(settings.items())])
    log_to_mlflow(run_id, record.plan)


def planned_rows(p: ResolvedPipeline, data: Any) -> tuple[int, float, int]:
    """(seq_len, target_fraction, document_length) to plan for, from the tokenized data: packed rows are padded
    to data.max_length, unpacked micro-batches to their longest row; a row never has more positions with
    a target than the most in the data (the output head's share, fulltune/runtime/loss.py); packed rows'
    documents attend alone, Σ length² / Σ length of them over the train rows (`Settings.document_length`)."""
    seq_len = p.spec.data.max_length if data.packing else data.max_row_length
    documents = _document_length(data, seq_len) if data.packing else 0
    if not data.max_row_targets or seq_len < 2:
        return seq_len, 1.0, documents
    return seq_len, min(1.0, data.max_row_targets / (seq_len - 1)), documents


def _document_length(data: Any, seq_len: int) -> int:
    """Σ length² / Σ length of the documents of `data`'s packed train rows (their recorded attention pairs)."""
    from fulltune.data.batching import TokenizedRows

    rows = TokenizedRows(data.train_rows_file)
    return min(seq_len, max(1, round(float(rows.attention_pairs.sum()) / max(1, int(rows.lengths.sum())))))


def plan_inputs(p: ResolvedPipeline, data: Any = None, tokenizer: str | None = None
                ) -> tuple[int, int | None, float, int]:
    """(seq_len, vocabulary, target fraction, document length) to plan for.

    From `data` (a TokenizedData) and `tokenizer` when given (the budget stage), else from the tokenize
    stage's outputs when they are cached, else the worst case: rows of `data.max_length` with a target
    everywhere, each one document. The vocabulary matters only for a model built from a config (sized to its
    tokenizer; None otherwise).
    """
    if data is None:
        data, tokenizer = cached_tokenized(p)
    seq_len, target_fraction, documents = (planned_rows(p, data) if data is not None
                                           else (p.spec.data.max_length, 1.0, 0))
    return seq_len, _planned_vocab(p, tokenizer), target_fraction, documents


def cached_tokenized(p: ResolvedPipeline) -> tuple[Any, str | None]:
    """(TokenizedData, tokenizer) of the tokenize stage's cached outputs, (None, None) when it has not run."""
    marker = read_marker(p.workdir, TOKENIZE, key_of(TOKENIZE_STAGE, Inputs(p)))
    if not (marker and all(Path(x).exists() for x in marker["paths"])):
        return None, None
    from fulltune.data import load_tokenized

    return load_tokenized(marker["paths"][0]), marker["paths"][1] if len(marker["paths"]) > 1 else None


def _planned_vocab(p: ResolvedPipeline, tokenizer: str | None) -> int | None:
    from fulltune.models import load_tokenizer

    model = p.spec.model
    if model.from_config is None:
        return None
    if tokenizer is None:
        if not isinstance(model.tokenizer, str):  # {vocab_size: N}, trained by the tokenize stage
            return getattr(model.tokenizer, "vocab_size", None)
        from fulltune.data.tokenizer import prepare_tokenizer

        tokenizer = prepare_tokenizer(model, p.spec.data, p.workdir)
    return len(load_tokenizer(tokenizer, trust_remote_code=model.trust_remote_code))


def plan_budget(p: ResolvedPipeline, seq_len: int, tokenizer_vocab: int | None, picture: Path | None = None,
                target_fraction: float = 1.0, trace: bool | None = None, data: Any = None,
                document_length: int = 0) -> BudgetDecision:
    """Stage 2: estimate peak memory for the configured settings and plan settings that fit.

    `data` (default: the tokenize stage's cached output, if any) adds the host RAM per machine its rows cost
    (`data_host`).

    `trace`: True plans for the larger of the analytic estimate and a simulated (FakeTensor) step, False
    keeps the estimate plus its measured margin, None traces only when that is cheap.

    Raises BudgetError (exit 2, with the breakdown) when nothing fits, or when the configured settings
    do not fit and `budget.on_overflow` is `fail`.
    """
    return _plan(p, seq_len, tokenizer_vocab, picture, target_fraction, trace, data, document_length)[0]


def _plan(p: ResolvedPipeline, seq_len: int, tokenizer_vocab: int | None, picture: Path | None,
          target_fraction: float, trace: bool | None, data: Any, document_length: int = 0
          ) -> tuple[BudgetDecision, Any, Any]:
    """`plan_budget`'s decision, with the MemoryPlan and the model config it was made from."""
    from fulltune.planning import plan_memory
    from fulltune.models import read_model_config

    budget = resolved_budget(p)
    config = read_model_config(p.spec.model, tokenizer_vocab)
    check_model_builds(p)  # `plan` and a budget stage run by a deployment: no check before them
    check_positions(p, config)
    check_model_split(p, config)
    try:
        request = plan_request(p, seq_len, target_fraction, document_length, config)
    except ValueError as exc:  # the spec validates these fields; a message naming the setting, not a traceback
        raise ConfigError(f"pipelines.{p.name}: {exc}") from None
    try:
        plan = plan_memory(config, request, trace=trace)
    except ValueError as exc:  # the config lacks what the memory model needs (not a decoder-only LM)
        field = "model.from_config" if p.spec.model.from_config is not None else "model.name_or_path"
        raise ConfigError(f"pipelines.{p.name}.{field}: cannot plan memory for this model: {exc}") from None
    from fulltune.memory.process import tokenized_data_host

    d, data = p.spec.distributed, data if data is not None else cached_tokenized(p)[0]
    plan = replace(plan, data_host=tokenized_data_host(data, d.dims.per_machine(d.num_machines), plan.settings))
    table = format_plan_table(plan)
    as_json = plan.to_dict()
    if picture is not None:
        picture.parent.mkdir(parents=True, exist_ok=True)
        render_breakdown_png(plan, picture)
    if not as_json["fits"]:
        raise BudgetError(f"pipelines.{p.name}.budget.memory: no configuration fits the budget\n{table}", as_json)
    if p.spec.budget.on_overflow == "fail" and plan.configured_estimate.device_bytes > budget.usable_bytes:
        raise BudgetError(f"pipelines.{p.name}.budget.on_overflow is 'fail' and the configured settings do not fit\n"
                          f"{table}", as_json)
    decision = BudgetDecision(plan.settings, as_json, table, seq_len, int(config.num_hidden_layers),
                              str(picture) if picture is not None else None, tokenizer_vocab, target_fraction,
                              document_length)
    return decision, plan, config


def should_tune(opts: Options, decision: BudgetDecision, data: Any, p: ResolvedPipeline,
                force: bool | None = None, auto_tunes: bool = True) -> tuple[bool, str]:
    """(tune?, why). `force` True/False overrides `budget.autotune`; with `auto_tunes` False (`fulltune
    plan` without --autotune) the `auto` mode only says what the run would do."""
    import torch

    device = planned_settings(decision).device
    if force is False or (force is None and opts.mode == "off"):
        return False, "off (budget.autotune: false)"
    if device == "cuda" and not torch.cuda.is_available():
        return False, "not run: the plan is for cuda and no GPU is visible here"
    if force or opts.mode == "on":
        return True, "on request (budget.autotune or --autotune)"
    count = len(candidates(decision, opts.candidates))
    step = decision.plan["plan"].get("estimated_step_seconds") or 0.0
    if data is None:
        return False, "auto: the data is not tokenized yet, so the training time is not known"
    s = planned_settings(decision)
    rows_per_step = s.micro_batch_size * s.gradient_accumulation_steps * s.num_processes
    t = p.spec.train
    steps = t.max_steps or max(1, math.ceil(t.num_epochs * (data.num_train_rows // max(rows_per_step, 1))))
    training = steps * step
    tuning = count * (CHILD_START_SECONDS.get(device, 30.0) + (opts.warmup_steps + opts.steps) * step)
    if count < 2:
        return False, "auto: only one candidate fits, nothing to choose"
    verdict = training >= AUTO_RATIO * tuning
    why = (f"auto: predicted training {training:.0f} s {'≥' if verdict else '<'} {AUTO_RATIO:.0f} × predicted "
           f"tuning {tuning:.0f} s")
    if verdict and not auto_tunes:
        return False, why + " (the run tunes; `fulltune plan --autotune` measures now)"
    return verdict, why


def plan_and_tune(p: ResolvedPipeline, data: Any = None, tokenizer: str | None = None, *,
                  picture: Path | None = None, trace: bool | None = None, force: bool | None = None,
                  auto_tunes: bool = True, on_progress: Any = None) -> BudgetDecision:
    """The memory budget stage: plan with this machine's step-time calibration, then tune when
    `budget.autotune` (or `force`) says so; returns the decision the run uses.

    Its `plan` holds an `autotune` object (`Tuning.to_dict`, or `{"ran": false, "reason"}`), its `table`
    the measured table, and its settings are the tuned choice when one fits. `data`/`tokenizer` default
    to the tokenize stage's cached outputs; tuning without them tokenizes first (the same cached dataset
    the tokenize stage builds).
    """
    opts = options(p.spec.budget.autotune)
    if data is None:
        if force or (force is None and opts.mode == "on"):
            data, tokenizer = tokenized(p)
        else:
            data, tokenizer = _cached_data(p, with_tokenizer=True) or (None, None)
    p = with_packing(p, data)
    seq_len, vocab, target_fraction, documents = plan_inputs(p, data, tokenizer)
    device = resolved_device(p)
    with calibrated(p.workdir, device) as factors:
        decision, memory_plan, config = _plan(p, seq_len, vocab, picture, target_fraction, trace, data, documents)
    if data is None:
        decision = _untokenized(decision, p, vocab)
    run, why = should_tune(opts, decision, data, p, force, auto_tunes)
    calibration_note = {"calibration": {k: round(v, 3) for k, v in factors.items()}} if factors else {}
    if not run:  # said in the plan, so the artifact and the MLflow run say it too
        return replace(decision, table=f"{decision.table}\nautotune: {why}",
                       plan={**decision.plan, "autotune": {"ran": False, "reason": why, **calibration_note}})
    if tokenizer is None:
        data, tokenizer = tokenized(p)
    result = tune(p, decision, data, tokenizer, opts, on_progress)
    result.reason = f"{why}; {result.reason}"
    if result.trials:
        where = picture.with_name(picture.stem + "-autotune.png") if picture is not None else \
            Path(p.workdir) / AUTOTUNE_DIR / f"{p.name}-autotune.png"
        result.picture = str(render_png(result, where))
    settings, plan_table = decision.settings, decision.table
    plan_json = {**decision.plan, "autotune": {**result.to_dict(), **calibration_note}}
    if result.chosen is not None:
        chosen = result.trials[result.chosen].settings
        settings = chosen if not isinstance(decision.settings, dict) else asdict(chosen)
    if result.chosen:  # not the analytic plan's settings: what trains is shown beside them everywhere
        trained = _trained(config, result)
        plan_table = format_plan_table(memory_plan, trained)
        if picture is not None:
            render_breakdown_png(memory_plan, picture, trained)
        plan_json["trains"] = {**trained.settings.choices(), "estimate": trained.estimate.to_dict(), "why": trained.why}
    return replace(decision, settings=settings, table=f"{plan_table}\n\n{format_table(result)}", plan=plan_json)


def _trained(config: Any, result: Any) -> Any:
    """The settings autotune chose over the analytic plan's (trial 0), their estimate and why they won."""
    from fulltune.memory import estimate_memory
    from fulltune.memory.report import Trained

    chosen, analytic = result.trials[result.chosen], result.trials[0]
    against = (f"the analytic plan's {format_seconds(analytic.measured_step_seconds)}"
               if analytic.outcome == "fits" and analytic.measured_step_seconds else
               f"the analytic plan's settings: {analytic.outcome}")
    why = f"autotune measured {format_seconds(chosen.measured_step_seconds)} a step on this machine, {against}"
    return Trained(chosen.settings, estimate_memory(config, chosen.settings), why)


def _untokenized(decision: BudgetDecision, p: ResolvedPipeline, vocab: int | None) -> BudgetDecision:
    """Say that a plan made before the data is tokenized sizes every row at data.max_length with a
    target at every position (the most the logits can take), and a model built from a config at the configured
    vocabulary (a tokenizer trained on the data may hold fewer tokens): the run tokenizes first and plans on the
    real lengths, targets and vocabulary, so its plan can differ. `planned_on` in `plan --json`."""
    note = (f"planned before the data is tokenized: every row at data.max_length ({p.spec.data.max_length}) with "
            "a target at every position, the most the logits can take")
    if vocab is not None and not isinstance(p.spec.model.tokenizer, str):
        note += (f", and the model's vocabulary at model.tokenizer.vocab_size ({vocab}), the most a tokenizer "
                 "trained on the data holds")
    note += "; `fulltune run` tokenizes first and plans on the real data, which can change the plan"
    return replace(decision, table=f"{decision.table}\n{note}", plan={**decision.plan, "planned_on": note})


def resolved_device(p: ResolvedPipeline) -> str:
    """The device `budget.device` means on this machine (`cpu` or `cuda`)."""
    resolved = resolved_budget(p)
    return resolved.device if hasattr(resolved, "device") else resolved[0]


def with_packing(p: ResolvedPipeline, data: Any) -> ResolvedPipeline:
    """`p` with `data.packing: auto` replaced by the layout the tokenized `data` has (unchanged without data)."""
    if data is None or p.spec.data.packing != "auto":
        return p
    return _layout(p, bool(data.packing))


def _layout(p: ResolvedPipeline, packing: bool) -> ResolvedPipeline:
    """`p` with `data.packing` set to `packing`."""
    spec = p.spec.model_copy(update={"data": p.spec.data.model_copy(update={"packing": packing})})
    return replace(p, spec=spec)


def tokenized(p: ResolvedPipeline) -> tuple[Any, str]:
    """(TokenizedData, tokenizer directory): the tokenize stage's cached outputs, else made by the stage (the
    same fingerprinted directory and marker, so the stage finds them done)."""
    cached = _cached_data(p, with_tokenizer=True)
    if cached is not None:
        return cached
    inputs = Inputs(p)
    record = run_stage(TOKENIZE_STAGE, inputs, key_of(TOKENIZE_STAGE, inputs))
    return record.data, record.tokenizer


def _cached_data(p: ResolvedPipeline, with_tokenizer: bool = False) -> Any:
    from fulltune.data import load_tokenized
    from fulltune.errors import DataError

    marker = read_marker(p.workdir, TOKENIZE, key_of(TOKENIZE_STAGE, Inputs(p)))
    if not marker or not all(Path(x).exists() for x in marker["paths"]):
        return None
    try:
        data = load_tokenized(marker["paths"][0])
    except DataError:
        return None
    if not with_tokenizer:
        return data
    tokenizer = marker["paths"][1] if len(marker["paths"]) > 1 else p.spec.model.name_or_path
    return data, tokenizer


# ---------------------------------------------------------------------------------------------------
# `data.packing: auto`: one example per row or packed rows, whichever trains faster


def resolve_packing(p: ResolvedPipeline, tokenizer: str) -> Any:
    """The DataSpec to tokenize with: `data.packing` as given when true/false; for `auto`, the layout
    `choose_packing` picks."""
    data = p.spec.data
    if data.packing != "auto":
        return data
    return data.model_copy(update={"packing": choose_packing(p, tokenizer)[0]})


def packing_choice_key(p: ResolvedPipeline) -> dict[str, Any]:
    """What `data.packing: auto` is decided by, for the tokenize stage's cache key (which hashes this stage's
    code too, fulltune/stages/tokenize.py `code`): the model, the batch,
    precision, optimizer and device (the predicted comparison needs no budget); where autotune measures
    the layouts (`budget.autotune: true`), also the budget and this machine."""
    t, device = p.spec.train, resolved_device(p)
    key: dict[str, Any] = {
        # The model's shape decides the comparison, not its weights: a new checkpoint of the same shape
        # (a retrained model, a new hub commit: the pinned `revision` is model_config's) keeps the tokenized data.
        "model": p.spec.model.model_dump(mode="json", exclude={"revision", *OUTSIDE_THE_WEIGHTS["model"]}),
        "model_config": model_config_key(p), "device": device,
        "train": t.model_dump(mode="json", include={"effective_batch_size", "mixed_precision", "optimizer", "seed"}),
        "distributed": p.spec.distributed.model_dump(mode="json"),
        "autotune": p.spec.budget.model_dump(mode="json")["autotune"]}
    if options(p.spec.budget.autotune).mode == "on":
        key.update(budget=p.spec.budget.model_dump(mode="json"),
                   train_all=t.model_dump(mode="json", exclude=OUTSIDE_THE_WEIGHTS["train"]),
                   hardware=hardware(device))
    return key


def choose_packing(p: ResolvedPipeline, tokenizer: str) -> tuple[bool, str]:
    """(pack?, why) for `data.packing: auto`.

    Examples are tokenized one per row first (a cached dataset). Where no two of them fit in one row of
    `data.max_length`, rows stay one example each. Otherwise the two layouts are compared by the time of an
    epoch: with `budget.autotune: true`, each layout's planned
    settings run on this machine (as `tune` runs a candidate) and the higher measured tokens per second
    wins; else the planner's step time predicts it, for the same settings on both layouts (so a
    calibration factor cancels), × optimizer steps per epoch, with unpacked micro-batches padded to
    their longest row (the trainer groups rows by length) and packed rows without padding, their documents
    attending alone (fulltune/attention.py).
    """
    import numpy as np

    from fulltune.data.batching import TokenizedRows
    from fulltune.data.store import _pack

    spec = p.spec.data
    if p.spec.model.attn_implementation != "sdpa":
        return False, (f"one example per row: packed rows need model.attn_implementation: sdpa "
                       f"({p.spec.model.attn_implementation} attention would mask every row with a dense (s × s) mask)")
    unpacked = _tokenize_layout(p, tokenizer, False)
    lengths = TokenizedRows(unpacked.train_rows_file).lengths
    # The packed rows' count, as the tokenize stage packs them (next fit, in the shuffled order).
    rows = len(_pack(np.random.default_rng(p.spec.train.seed).permutation(lengths), spec.max_length)) - 1
    if rows >= len(lengths):
        return False, "one example per row: no two examples fit in one row of data.max_length"
    opts = options(p.spec.budget.autotune)
    if opts.mode == "on" and _device_present(resolved_device(p)):
        measured = {packing: _measured_tokens_per_second(p, tokenizer, packing, opts) for packing in (False, True)}
        if all(measured.values()):
            pack = measured[True] > measured[False]
            return pack, (f"{'packed rows' if pack else 'one example per row'}: measured {measured[True]:,.0f} "
                          f"tokens/s packed, {measured[False]:,.0f} one example per row")
    labels = unpacked.train_label_tokens
    # Packed, the trainer lays a micro-batch's rows end to end (no padding), and each example is a document that
    # attends to itself only: Σ length² / Σ length keys per token.
    packed_length = min(spec.max_length, math.ceil(int(lengths.sum()) / rows))
    documents = max(1, round(float(np.square(lengths.astype(np.float64)).sum()) / float(lengths.sum())))
    epochs = {False: _epoch_seconds(p, tokenizer, False, len(lengths), _padded_length(lengths, p), labels),
              True: _epoch_seconds(p, tokenizer, True, rows, packed_length, labels, min(documents, packed_length))}
    pack = epochs[True] < epochs[False]
    return pack, (f"{'packed rows' if pack else 'one example per row'}: predicted epoch {format_seconds(epochs[True])} "
                  f"packed, {format_seconds(epochs[False])} one example per row")


def _device_present(device: str) -> bool:
    import torch

    return device != "cuda" or torch.cuda.is_available()


def _tokenize_layout(p: ResolvedPipeline, tokenizer: str, packing: bool) -> Any:
    from fulltune.data import tokenize_dataset
    from fulltune.models import hub_token

    m = p.spec.model
    return tokenize_dataset(p.spec.data.model_copy(update={"packing": packing}), tokenizer, p.workdir,
                            p.spec.train.seed, token=hub_token(m.token_env), trust_remote_code=m.trust_remote_code)


def _measured_tokens_per_second(p: ResolvedPipeline, tokenizer: str, packing: bool, opts: Options) -> float | None:
    """Tokens per second of the planned settings for one layout, run as `tune` runs a candidate (cached
    alike); None when they do not fit or do not run."""
    layout = _layout(p, packing)
    data = _tokenize_layout(p, tokenizer, packing)
    seq_len, vocab, target_fraction, documents = plan_inputs(layout, data, tokenizer)
    try:
        with calibrated(p.workdir, resolved_device(p)):
            decision = plan_budget(layout, seq_len, vocab, None, target_fraction, trace=False,
                                   document_length=documents)
    except BudgetError:
        return None
    result = tune(layout, decision, data, tokenizer, replace(opts, candidates=1, max_seconds=opts.max_seconds / 2))
    trial = result.trials[0]
    return trial.tokens_per_second if trial.outcome == "fits" else None


def _padded_length(lengths: Any, p: ResolvedPipeline) -> int:
    """Mean padded row length of length-grouped micro-batches of the per-process batch (the trainer's
    `iter_length_grouped_batches`, approximately: sorted rows, each group padded to its longest)."""
    import numpy as np

    group = max(1, p.spec.train.effective_batch_size // p.spec.distributed.num_processes)
    ordered = np.sort(lengths)
    maxima = [int(ordered[i:i + group].max()) for i in range(0, len(ordered), group)]
    return max(2, int(round(float(np.mean(maxima)))))


def _epoch_seconds(p: ResolvedPipeline, tokenizer: str, packing: bool, rows: int, seq_len: int,
                   label_tokens: int, document_length: int = 0) -> float:
    """Predicted seconds of an epoch of `rows` rows padded to `seq_len` (packed: of documents of
    `document_length`, Σ length² / Σ length), the whole per-process batch in one micro-batch, the configured
    precision and optimizer (fp32 / bf16 and AdamW where auto)."""
    from fulltune.attention import dense_mask_reason
    from fulltune.memory.shapes import model_shape
    from fulltune.memory.types import Settings
    from fulltune.models import read_model_config
    from fulltune.planning.strategy import choices

    t, d, device = p.spec.train, p.spec.distributed, resolved_device(p)
    processes = d.dims.per_stage().world_size  # the stages of a pipeline share its rows and time (auto: as read)
    config = read_model_config(p.spec.model, _planned_vocab(p, tokenizer))
    shape = model_shape(config)
    dense = packing and dense_mask_reason(config, seq_len) is not None  # a window shorter than the row
    precision = t.mixed_precision if t.mixed_precision != "auto" else ("bf16" if device == "cuda" else "no")
    settings = Settings(
        micro_batch_size=t.effective_batch_size // processes, seq_len=seq_len, mixed_precision=precision,
        optimizer=t.optimizer if t.optimizer != "auto" else "adamw", attn_implementation=p.spec.model.attn_implementation,
        device=device, strategy=choices(d.strategy, processes)[0],  # strategy auto: its naive default
        num_processes=processes, attention_mask=dense, document_length=document_length if packing else 0,
        # the output head runs at the positions with a target: the same tokens in either layout
        target_fraction=min(1.0, label_tokens / max(1, rows * (seq_len - 1))))
    return analytic_step_seconds(shape, settings) * max(1, rows // t.effective_batch_size)


STAGE = Stage(MEMORY_BUDGET, code, key, run, writes, rerun_after="the tokenized data is cached; it plans again",
              track=track)
