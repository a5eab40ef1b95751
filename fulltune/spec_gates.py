"""The schema of pipelines.yaml's `evaluate` and `register` sections: what the evaluate stage measures and the
gate a new version must pass to become `champion` (fulltune/spec.py holds the rest of the file's schema)."""

from __future__ import annotations

import posixpath
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


# Metrics every evaluation computes, with the direction in which they improve. A gate may also name an
# lm-evaluation-harness metric (`<task>/<metric>`) or a metric of `evaluate.metrics`.
BUILTIN_METRICS: dict[str, Literal["min", "max"]] = {
    "eval_loss": "min", "perplexity": "min", "bits_per_byte": "min", "exact_match": "max",
}
DEFAULT_METRIC_TIMEOUT = 600.0  # seconds, evaluate.metric_timeout
CALLABLE_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
METRIC_NAME_PATTERN = re.compile(r"^[A-Za-z_][\w.-]*$")
# What a part of a reported metric name may hold (`eval_loss/<source>`, `<metric>/<key>`): MLflow refuses a
# metric name with other characters (parentheses, commas, ...), and a gate names it as reported.
_NOT_IN_A_METRIC_NAME = re.compile(r"[^\w.-]+")


def metric_part(text: str) -> str:
    """`text` (a file's name, a metric function's key) as a part of a metric name MLflow accepts: each run of
    characters other than letters, digits, `_`, `-` and `.` becomes one `_`, and none is left at either end
    (`held-out (v2)` → `held-out_v2`, `digits (strict)` → `digits_strict`)."""
    return _NOT_IN_A_METRIC_NAME.sub("_", text).strip("_.") or "_"


def lm_eval_installed() -> bool:
    """Whether lm-evaluation-harness can be imported (the `eval` extra); importing its top level is cheap."""
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        return False
    return True


class LmEvalSpec(Strict):
    """lm-evaluation-harness tasks, run with the same settings for the base model, the fine-tuned model
    and the champion, each with its own tokenizer. Needs `pip install fulltune[eval]`."""

    tasks: list[str] = Field(
        min_length=1, description="Registered task names, or paths of task YAML files (relative to the pipelines "
                                  "file) whose `dataset_kwargs.data_files` are local files; nothing is downloaded.")
    limit: int | None = Field(None, ge=1, description="At most this many examples of each task.")
    num_fewshot: int | None = Field(None, ge=0, description="Few-shot examples per prompt (default: the task's own, else 0).")
    batch_size: int | None = Field(None, ge=1, description="Requests per forward pass (default: evaluate.batch_size).")

    @model_validator(mode="after")
    def _installed(self) -> LmEvalSpec:
        if not lm_eval_installed():
            raise ValueError("lm-evaluation-harness is not installed; install it with: pip install 'fulltune[eval]'")
        return self


class EvaluateSpec(Strict):
    """Held-out evaluation of the base model, the fine-tuned model and the current champion."""

    batch_size: int = Field(8, ge=1, description="Sequences per evaluation forward pass.")
    max_examples: int | None = Field(None, ge=1, description="Evaluate on at most this many held-out examples (the "
                                                            "first of each data.eval source).")
    max_generate_examples: int = Field(32, ge=0, description="Greedy generations for exact match: the first examples "
                                                             "with a completion (prompt_completion) of each data.eval "
                                                             "source.")
    max_new_tokens: int = Field(32, ge=1, description="Tokens generated per example.")
    compare_champion: bool = Field(True, description="Also evaluate the current champion on the same data.")
    processes: int | Literal["auto"] = Field(
        "auto", description="Processes each candidate is evaluated on. A run trained sharded (strategy fsdp over "
                            "num_processes, or tensor parallel) may be evaluated sharded the same way, each process "
                            "holding 1/N of the weights. auto: one process when the whole model and the configured "
                            "batches fit one device (no second launch of N processes, no gathers per generated "
                            "token), else sharded like the training. 1: one process. N: sharded over the training's "
                            "N processes (strategy fsdp, N = distributed.num_processes).")
    precision: Literal["trained", "fp32"] = Field(
        "trained", description="The dtype every candidate is evaluated in: `trained`, the one the run's forward "
                               "computed in (bf16 under bf16 autocast or pure bf16), or `fp32`.")
    lm_eval: LmEvalSpec | None = Field(None, description="lm-evaluation-harness tasks; metrics `<task>/<metric>`.")
    metric_timeout: float = Field(
        DEFAULT_METRIC_TIMEOUT, gt=0, description="Seconds each metric function of `metrics` may run on one "
                                                  "model's completions; one that runs longer stops the run, named.")
    metrics: dict[str, str] = Field(
        default_factory=dict,
        description="The team's own metrics: name → `module:function` (a list of `module:function` names each "
                    "metric after its function). The function gets the generated completions and the references "
                    "(two lists of str) and returns a number, or a mapping of numbers named `<name>/<key>`. The "
                    "module is imported with the pipelines file's directory on the path (examples/metrics.py).")

    @field_validator("metrics", mode="before")
    @classmethod
    def _named(cls, value: Any) -> Any:
        if isinstance(value, list):
            named = {}
            for item in value:
                if not isinstance(item, str) or not CALLABLE_PATTERN.match(item):
                    raise ValueError(f"{item!r} is not a `module:function` name")
                named[item.rpartition(":")[2]] = item
            return named
        return value

    @field_validator("metrics")
    @classmethod
    def _callables(cls, value: dict[str, str]) -> dict[str, str]:
        for name, target in value.items():
            if not METRIC_NAME_PATTERN.match(name) or name in BUILTIN_METRICS:
                raise ValueError(f"{name!r}: a metric name uses letters, digits, '_', '-', '.' and is not one of "
                                 f"the built-in metrics ({', '.join(BUILTIN_METRICS)})")
            if not CALLABLE_PATTERN.match(target):
                raise ValueError(f"{name}: {target!r} is not a `module:function` name")
        return value


class PromoteIf(Strict):
    """One condition the new version must meet against the current champion.

    With `min_delta` it must beat the champion by that much; with `max_regression` (a guard) it may not be
    worse than the champion by more than that — against the base model while there is no champion.
    """

    metric: str = Field("eval_loss", description="A built-in metric, one of one data.eval source "
                                                 "(`eval_loss/<source>`), `<task>/<metric>` of evaluate.lm_eval, or "
                                                 "a metric of evaluate.metrics.")
    mode: Literal["min", "max"] | None = Field(
        None, description="Whether lower or higher is better (built-in metrics know theirs; required for others).")
    min_delta: float = Field(0.0, ge=0, description="Required improvement over the champion.")
    max_regression: float | None = Field(
        None, ge=0, description="Guard: the most the metric may get worse than the champion's (then no improvement "
                                "is required).")

    @model_validator(mode="after")
    def _direction(self) -> PromoteIf:
        # `eval_loss/<source>`: a built-in metric of one data.eval source improves as the total does.
        base, _, source = self.metric.partition("/")
        expected = BUILTIN_METRICS.get(base if source else self.metric)
        if self.mode is None:
            if expected is None:
                raise ValueError(f"set mode (min or max) for {self.metric}: only built-in metrics know their direction")
            object.__setattr__(self, "mode", expected)
        elif expected is not None and self.mode != expected:
            raise ValueError(f"{self.metric} improves in mode '{expected}'")
        if self.max_regression is not None and self.min_delta:
            raise ValueError("set min_delta (must improve) or max_regression (must not regress), not both")
        return self


class RegisterSpec(Strict):
    """The MLflow registered model the result lands in."""

    model_name: str | None = Field(None, description="Registered model name (default: fulltune-<pipeline>).")
    promote_if: list[PromoteIf] = Field(
        default_factory=lambda: [PromoteIf()],
        description="Gate for the `champion` alias: one condition, or a list of conditions that must all hold.")
    require_better_than_base: bool = Field(True, description="Never promote a model worse than its base model on a "
                                                             "metric it must improve (guards excepted).")

    @field_validator("model_name")
    @classmethod
    def _registry_name(cls, value: str | None) -> str | None:
        # MLflow's own rule (mlflow.utils.validation._validate_model_name), checked before anything trains:
        # a name MLflow refuses would otherwise fail the register stage after the whole run.
        if value is None:
            return value
        normalized = posixpath.normpath(value)
        if not value.strip() or "/" in value or ":" in value or normalized != value or normalized in (".", ".."):
            raise ValueError(f"{value!r} is not a name MLflow's model registry accepts: no '/' or ':', not empty, "
                             "not '.' or '..'")
        return value

    @field_validator("promote_if", mode="before")
    @classmethod
    def _one_or_all(cls, value: Any) -> Any:
        # The single-condition form `promote_if: {metric, mode, min_delta}` is a list of one.
        return [value] if isinstance(value, (dict, PromoteIf)) else value

    @field_validator("promote_if")
    @classmethod
    def _some(cls, value: list[PromoteIf]) -> list[PromoteIf]:
        if not value:
            raise ValueError("list at least one condition")
        return value

    @property
    def gates(self) -> tuple[PromoteIf, ...]:
        """The conditions of `promote_if`, all of which must hold."""
        return tuple(self.promote_if)
