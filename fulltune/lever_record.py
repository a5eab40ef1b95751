"""What a memory lever's record is made of (fulltune/levers.py `TABLE` holds the records): the `Lever` itself, the
options and conditions it declares beside its `train:` key (`Option`, `Condition`), the cost of a lever that adds
no step time (`NoAddedTime`), and a function named on a floor above (`Elsewhere`).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class NoAddedTime:
    """A lever's cost where it adds no step time of its own, and why: the step-time model then counts nothing
    for it (never by omission)."""

    why: str

    def __call__(self, settings: Any, step: Any) -> float:
        return 0.0


@dataclass(frozen=True)
class Elsewhere:
    """A lever's function that lives on a floor above this one (beside the model's code it reads), named
    "module:function" and imported when called: the record can name it without importing upward."""

    ref: str

    def __call__(self, *args: Any) -> Any:
        module, function = self.ref.split(":")
        return getattr(importlib.import_module(module), function)(*args)


@dataclass(frozen=True)
class Option:
    """A `train:` key that says how its lever runs, not whether: one of `choices`, `default` unless set. The spec's
    field (described by `description`), `Settings`' and `PlanRequest`'s (each checked against `choices`), the plan
    request's copy from the spec, the settings' copy from the request and the job's plan are made from it.
    `off_refusal`: why the spec refuses it set (away from its default) while its lever is false (None: it is then
    ignored)."""

    name: str
    choices: tuple[str, ...]
    default: str
    description: str
    off_refusal: str | None = None


@dataclass(frozen=True)
class Condition:
    """A fact of the machine or of the pipeline that a lever's `auto` reads beside the request's settings: a bool
    field `name` of `PlanRequest` (False unless read), which the plan request reads as `read(train, budget)` (the
    spec's `train:` section, the resolved `fulltune.memory.budget.Budget`)."""

    name: str
    read: Callable[[Any, Any], bool]


@dataclass(frozen=True)
class Lever:
    """One memory lever: the `train.<name>` key and what the engine says and does about it.

    `sentence(settings)`: what the plan says it does, for the settings that run it. `cost(settings, step)`: the
    seconds it adds to one optimizer step (negative for a lever that saves time), from the step-time model's terms
    (`step`: fulltune/planning/step_time.py `StepCosts`: throughputs, link speeds, the model's shape), or
    `NoAddedTime(why)`. `slow`: it moves tensors between host and device every step, so on a CPU device (host RAM is
    the device's memory) it saves nothing and the planner never chooses it there, and a plan that fits only with it
    hears what pipeline stages would do instead. `pipeline_refusal`: why pipeline stages do not run it (None: they
    do). `apply`: the runtime function ("module:function", called as function(model, settings)) that changes the
    model for it, or None when its code path is the optimizer's or the loss's. `auto`: for a lever that saves no
    memory, what `auto` means, a function of the plan request (`fulltune.memory.PlanRequest`) saying whether it is
    on (`decided`); None: the planner turns it on only when memory requires it, cheapest first.

    `options`: the `train:` keys that say how it runs (`Option`); `conditions`: what its `auto` reads of the machine
    and the pipeline (`Condition`). `for_model(shape, request)`: the request as this lever can run on the model
    (`auto` turned off where it converts nothing, a MemoryConfigError naming its field where it is on), before
    anything is planned; `reasons(shape, request, settings)`: the plan's lines about it beyond its sentence. Each
    None where there is nothing to say; a function above this floor is named with `Elsewhere`. `started`: what the
    trainer's first line says of it when it is on (after the precision, `str.format`ted with the job's planned
    settings), or nothing. For a lever that changes what a decoder layer holds, its terms in the memory walk:
    `layer_terms(shape, settings, c, attn_core, attn_work)`, what it adds to one layer's counts
    (fulltune/memory/activations.py `layer_bytes`: its forward transient, its MLP's and attention's backward
    peaks, and the weights autocast no longer copies to 16 bit), and `gathered_numel(shape, settings)`, the
    elements of a layer's weights FSDP gathers in one byte each instead of the gathered dtype
    (fulltune/memory/fsdp.py).
    """

    name: str
    description: str
    sentence: Callable[[Any], str]
    cost: Callable[[Any, Any], float]
    slow: bool = False
    pipeline_refusal: str | None = None
    apply: str | None = None
    auto: Callable[[Any], bool] | None = None
    options: tuple[Option, ...] = ()
    conditions: tuple[Condition, ...] = ()
    for_model: Callable[[Any, Any], Any] | None = None
    reasons: Callable[[Any, Any, Any], list[str]] | None = None
    started: str = ""
    layer_terms: Callable[[Any, Any, int, int, int], Any] | None = None
    gathered_numel: Callable[[Any, Any], int] | None = None
