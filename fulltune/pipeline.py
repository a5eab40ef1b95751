"""The five stages as plain functions over small records: what the Prefect tasks wrap.

Each stage takes paths, fingerprints and typed specs, writes its outputs atomically under the workdir,
and returns a small frozen record. Cache keys are content hashes of a stage's inputs plus the engine's
code version, so changing data, config or engine code re-runs exactly the stages that depend on it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fulltune.errors import BudgetError, ConfigError
from fulltune.fingerprint import atomic_write_text, code_version, hash_json, hash_path
from fulltune.spec import PipelineSpec, get_pipeline, load_pipelines

# The engine modules each stage runs: their source is part of the stage's cache key.
STAGE_CODE = {
    "tokenize": ("data.py", "tokenizer.py", "fingerprint.py"),
    "budget": ("memory", "loss.py", "models.py", "pipeline.py"),
    "train": ("train.py", "launch.py", "loss.py", "models.py", "data.py", "memory"),
    "evaluate": ("evaluate.py", "loss.py", "data.py", "models.py"),
    "register": ("registry.py",),
}


@dataclass(frozen=True)
class ResolvedPipeline:
    """A validated pipeline with its overrides applied, and where its outputs live."""

    name: str
    spec: PipelineSpec
    workdir: str
    pipelines_file: str

    @property
    def model_name(self) -> str:
        return self.spec.model_name(self.name)


def resolve_pipeline(pipelines_file: str, name: str, overrides: list[str] | dict[str, Any] | None = None) -> ResolvedPipeline:
    """Load the file, apply `--set` overrides to pipeline `name`, validate; the workdir becomes absolute.

    A relative workdir is relative to the pipelines file's directory, as are relative data paths.
    """
    pipelines = load_pipelines(pipelines_file, {name: overrides} if overrides else None)
    spec = get_pipeline(pipelines, name)
    base = Path(pipelines_file).resolve().parent
    workdir = Path(os.environ.get("FULLTUNE_WORKDIR") or pipelines.workdir)
    workdir = workdir if workdir.is_absolute() else base / workdir
    return ResolvedPipeline(name, _absolute_paths(spec, base), str(workdir), str(Path(pipelines_file).resolve()))


def _absolute_paths(spec: PipelineSpec, base: Path) -> PipelineSpec:
    """Make local file references absolute so stages do not depend on the current directory."""

    def local(value: str | None) -> str | None:
        if value is None:
            return None
        candidate = Path(value).expanduser()
        if candidate.is_absolute():
            return str(candidate)
        if (base / candidate).exists() or value.startswith((".", "/")) or Path(value).suffix:
            return str(base / candidate)
        return value  # a hub id

    data = spec.data.model_copy(update={"train": local(spec.data.train), "eval": local(spec.data.eval)})
    model_updates: dict[str, Any] = {}
    if spec.model.name_or_path is not None:
        model_updates["name_or_path"] = local(spec.model.name_or_path)
    if isinstance(spec.model.from_config, str):
        model_updates["from_config"] = local(spec.model.from_config)
    if isinstance(spec.model.tokenizer, str):
        model_updates["tokenizer"] = local(spec.model.tokenizer)
    return spec.model_copy(update={"data": data, "model": spec.model.model_copy(update=model_updates)})


def _source_hash(reference: str | None) -> str | None:
    """Content hash of a local file or directory; a hub id stands for itself."""
    if reference is None:
        return None
    return hash_path(reference) if Path(reference).exists() else reference


# ---------------------------------------------------------------- stage keys


def tokenize_key(p: ResolvedPipeline) -> str:
    spec = p.spec
    tokenizer = spec.model.tokenizer if spec.model.tokenizer is not None else spec.model.name_or_path
    return hash_json({
        "stage": "tokenize", "code": code_version(*STAGE_CODE["tokenize"]), "workdir": p.workdir,
        "data": spec.data.model_dump(mode="json"),
        "train": _source_hash(spec.data.train), "eval": _source_hash(spec.data.eval),
        "tokenizer": tokenizer if not isinstance(tokenizer, str) else _source_hash(tokenizer),
        "seed": spec.train.seed,
    })


def budget_key(p: ResolvedPipeline, data_fingerprint: str) -> str:
    spec = p.spec
    return hash_json({
        "stage": "budget", "code": code_version(*STAGE_CODE["budget"]), "data": data_fingerprint,
        "model": spec.model.model_dump(mode="json"), "model_source": _source_hash(spec.model.name_or_path),
        "budget": spec.budget.model_dump(mode="json"), "train": spec.train.model_dump(mode="json"),
        "distributed": spec.distributed.model_dump(mode="json"),
    })


def train_key(p: ResolvedPipeline, data_fingerprint: str, settings: dict[str, Any]) -> str:
    spec = p.spec
    return hash_json({
        "stage": "train", "code": code_version(*STAGE_CODE["train"]), "data": data_fingerprint,
        "settings": settings,
        "model": spec.model.model_dump(mode="json"), "model_source": _source_hash(spec.model.name_or_path),
        "train": spec.train.model_dump(mode="json", exclude={"log_every_steps", "keep_checkpoints"}),
        "distributed": spec.distributed.model_dump(mode="json"),
    })[:24]


def evaluate_key(p: ResolvedPipeline, trained_key: str, data_fingerprint: str, champion_version: str | None) -> str:
    return hash_json({
        "stage": "evaluate", "code": code_version(*STAGE_CODE["evaluate"]), "train": trained_key,
        "data": data_fingerprint,
        "evaluate": p.spec.evaluate.model_dump(mode="json"), "champion": champion_version,
    })


def register_key(p: ResolvedPipeline, trained_key: str, eval_key: str, uri: str) -> str:
    return hash_json({
        "stage": "register", "code": code_version(*STAGE_CODE["register"]), "train": trained_key,
        "evaluate": eval_key,
        "register": p.spec.registration.model_dump(mode="json"), "name": p.model_name,
        "tracking_uri": uri,
    })


# ---------------------------------------------------------------- markers: "a cache hit whose files are gone re-runs"


def marker_path(workdir: str, stage: str, key: str) -> Path:
    return Path(workdir) / "stages" / stage / f"{key}.json"


def record_outputs(workdir: str, stage: str, key: str, paths: list[str], extra: dict[str, Any] | None = None) -> None:
    atomic_write_text(marker_path(workdir, stage, key), json.dumps({"paths": paths, **(extra or {})}, indent=1))


def outputs_present(workdir: str, stage: str, key: str) -> bool:
    """Whether the outputs a cached result points to are all still on disk."""
    marker = marker_path(workdir, stage, key)
    try:
        recorded = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return all(Path(path).exists() for path in recorded.get("paths", []))


def read_marker(workdir: str, stage: str, key: str) -> dict[str, Any] | None:
    try:
        return json.loads(marker_path(workdir, stage, key).read_text())
    except (OSError, json.JSONDecodeError):
        return None


# ---------------------------------------------------------------- stage 2: memory budget


@dataclass(frozen=True)
class BudgetDecision:
    """The settings the run will use, and the plan that chose them (as the `plan --json` object)."""

    settings: dict[str, Any]
    plan: dict[str, Any]
    table: str
    seq_len: int
    num_layers: int
    picture: str | None = None
    vocab_size: int | None = None  # of the trained tokenizer, for a model built from a config
    target_fraction: float = 1.0  # the most positions with a target in one row ÷ (seq_len - 1)


def planned_rows(p: ResolvedPipeline, data: Any) -> tuple[int, float]:
    """(seq_len, target_fraction) to plan for, from the tokenized data: packed rows are padded to
    data.max_length, unpacked micro-batches to their longest row; a row never has more positions with
    a target than the most in the data (the output head's share, fulltune/loss.py)."""
    seq_len = p.spec.data.max_length if data.packing else data.max_row_length
    if not data.max_row_targets or seq_len < 2:
        return seq_len, 1.0
    return seq_len, min(1.0, data.max_row_targets / (seq_len - 1))


def plan_request(p: ResolvedPipeline, seq_len: int, device: str, budget_bytes: int | None, bf16: bool,
                 target_fraction: float = 1.0) -> Any:
    from fulltune.memory import PlanRequest

    t, d = p.spec.train, p.spec.distributed
    checkpointing = None if t.gradient_checkpointing == "auto" else t.gradient_checkpointing
    return PlanRequest(
        effective_batch_size=t.effective_batch_size,
        seq_len=seq_len,
        micro_batch_size=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        gradient_accumulation_steps=None if t.gradient_accumulation_steps == "auto" else t.gradient_accumulation_steps,
        gradient_checkpointing=checkpointing,
        mixed_precision=None if t.mixed_precision == "auto" else t.mixed_precision,
        optimizer=None if t.optimizer == "auto" else t.optimizer,
        attn_implementation=p.spec.model.attn_implementation,
        device=device,
        budget_bytes=budget_bytes,
        headroom=p.spec.budget.headroom,
        strategy=d.strategy,
        num_processes=d.num_processes,
        bf16_supported=bf16,
        # Packed rows restart position_ids, so transformers builds a block mask per layer; unpacked rows
        # are right-padded and the trainer passes no mask at all (see fulltune/train.py).
        attention_mask=p.spec.data.packing,
        target_fraction=target_fraction,
    )


def plan_budget(p: ResolvedPipeline, seq_len: int, tokenizer_vocab: int | None,
                picture: Path | None = None, target_fraction: float = 1.0) -> BudgetDecision:
    """Stage 2: estimate peak memory for the configured settings and plan settings that fit.

    Raises BudgetError (exit 2, with the breakdown) when nothing fits, or when the configured settings
    do not fit and `budget.on_overflow` is `fail`.
    """
    from fulltune.memory import format_plan_table, plan_memory, render_breakdown_png, resolve_budget
    from fulltune.models import read_model_config

    device, budget_bytes, bf16 = resolve_budget(p.spec.budget.device, p.spec.budget.memory)
    config = read_model_config(p.spec.model, tokenizer_vocab)
    plan = plan_memory(config, plan_request(p, seq_len, device, budget_bytes, bf16, target_fraction))
    table = format_plan_table(plan)
    as_json = plan.to_dict()
    if picture is not None:
        picture.parent.mkdir(parents=True, exist_ok=True)
        render_breakdown_png(plan, picture)
    if not as_json["fits"]:
        raise BudgetError(f"pipelines.{p.name}.budget.memory: no configuration fits the budget\n{table}")
    if p.spec.budget.on_overflow == "fail" and budget_bytes is not None:
        if plan.estimate.device_bytes > plan.usable_bytes:
            raise BudgetError(
                f"pipelines.{p.name}.budget.on_overflow is 'fail' and the configured settings do not fit\n{table}"
            )
    return BudgetDecision(asdict(plan.settings), as_json, table, seq_len, int(config.num_hidden_layers),
                          str(picture) if picture is not None else None, tokenizer_vocab, target_fraction)


def describe_settings(settings: dict[str, Any], num_layers: int) -> str:
    ckpt = settings["gradient_checkpointing"]
    ckpt_text = "off" if ckpt == 0 else ("all layers" if ckpt >= num_layers else f"{ckpt} of {num_layers} layers")
    return (f"micro_batch_size={settings['micro_batch_size']} × gradient_accumulation_steps="
            f"{settings['gradient_accumulation_steps']}, mixed_precision={settings['mixed_precision']}, "
            f"optimizer={settings['optimizer']}, gradient checkpointing {ckpt_text}")


def ensure_local_data(p: ResolvedPipeline) -> None:
    """Fail fast, before any stage runs, on a data path that looks local but does not exist."""
    for field, value in (("data.train", p.spec.data.train), ("data.eval", p.spec.data.eval)):
        if value and Path(value).is_absolute() and not Path(value).exists():
            from fulltune.errors import DataError

            raise DataError(f"pipelines.{p.name}.{field}: file not found: {value}")
    if isinstance(p.spec.model.from_config, str) and not Path(p.spec.model.from_config).is_file():
        raise ConfigError(f"pipelines.{p.name}.model.from_config: file not found: {p.spec.model.from_config}")
