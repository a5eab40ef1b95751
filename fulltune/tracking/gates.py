"""The champion gate: whether an evaluated candidate takes the `champion` alias (each condition of
`register.promote_if` against the champion and the base model; a metric that is missing or not finite fails its
condition), and the MLflow tags that record the decision and the comparison it rests on."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fulltune.evaluation.evaluate import EvalReport
    from fulltune.spec import PromoteIf, RegisterSpec

# How the new version was compared with the champion (fulltune/evaluation/evaluate.py), and why.
TAG_COMPARISON = "fulltune.comparison"
TAG_COMPARISON_REASON = "fulltune.comparison_reason"
# Why the version was or was not promoted; `fulltune.gate.<metric>` per condition of register.promote_if.
TAG_GATE = "fulltune.gate"


# The settings a decision can rest on, as a version's label names them.
PROMOTE_IF, BETTER_THAN_BASE = "register.promote_if", "register.require_better_than_base"
COMPARISON = "the champion comparison (evaluate.compare_champion)"


@dataclass(frozen=True)
class GateCheck:
    """One condition of `register.promote_if` and how the new version fared on it; `rule` is the setting that
    decided it (`register.require_better_than_base` when the base model was not beaten)."""

    metric: str
    passed: bool
    reason: str
    rule: str = PROMOTE_IF


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str
    checks: tuple[GateCheck, ...] = ()
    kept_by_comparison: bool = False  # a champion exists but was not compared: it keeps its alias

    @property
    def rules(self) -> str:
        """The settings that decided: those of the failed conditions, else `register.promote_if`."""
        failed = [check.rule for check in self.checks if not check.passed]
        if not failed and self.kept_by_comparison:
            failed = [COMPARISON]
        return ", ".join(f"`{rule}`" for rule in dict.fromkeys(failed or [PROMOTE_IF]))


def decide_promotion(candidate: dict[str, float], champion: dict[str, float] | None, base: dict[str, float] | None,
                     metric: str, mode: str, min_delta: float, require_better_than_base: bool, *,
                     keep_champion: str | None = None) -> GateDecision:
    """The single-condition gate (`promote_if: {metric, mode, min_delta}`); see `decide_gates`."""
    from fulltune.spec import PromoteIf

    return decide_gates(candidate, champion, base, [PromoteIf(metric=metric, mode=mode, min_delta=min_delta)],
                        require_better_than_base, keep_champion=keep_champion)


def decide_gates(candidate: dict[str, float], champion: dict[str, float] | None, base: dict[str, float] | None,
                 gates: Sequence[PromoteIf], require_better_than_base: bool, *,
                 keep_champion: str | None = None) -> GateDecision:
    """The `champion` gate: promote when every condition of `register.promote_if` holds.

    A condition with `min_delta` must beat the champion by that much (there is nothing to beat while
    there is no champion); a guard (`max_regression`) may be worse than the champion by at most that
    much, and is held against the base model while there is no champion. With `require_better_than_base`
    every non-guard metric must also beat the base model.

    All values come from one evaluation on the same held-out examples and benchmarks, the champion's in
    the candidate's units (fulltune/evaluation/evaluate.py), so they are comparable. `keep_champion` is the reason a
    champion exists but was not compared (`evaluate.compare_champion: false`, or no comparable
    measurement): the candidate is then never promoted over it.
    """
    checks = [_check(gate, candidate, champion, base, require_better_than_base) for gate in gates]
    failed = [c for c in checks if not c.passed]
    if failed:
        return GateDecision(False, _joined(c.reason for c in failed), tuple(checks))
    if keep_champion:
        return GateDecision(False, f"the champion keeps its alias: {keep_champion}", tuple(checks), True)
    return GateDecision(True, _joined(c.reason for c in checks), tuple(checks))


def _joined(reasons: Iterable[str]) -> str:
    return "; ".join(dict.fromkeys(reasons))


def _check(gate: PromoteIf, candidate: dict[str, float], champion: dict[str, float] | None,
           base: dict[str, float] | None, require_better_than_base: bool) -> GateCheck:
    """One condition. A value that is missing or not finite on either side fails it: NaN compares False
    with everything, so without this a NaN reference would let any regression through a guard."""
    metric, mode = gate.metric, gate.mode
    value = candidate.get(metric)
    if not _usable(value):
        return GateCheck(metric, False, f"{metric} of the new model is {_unusable(value)}")

    def better(a: float, b: float, delta: float) -> bool:
        return (a <= b - delta if mode == "min" else a >= b + delta) and a != b

    if gate.max_regression is not None:
        return _guard(gate, value, champion, base)
    if require_better_than_base and base is not None:
        reference = base.get(metric)
        if not _usable(reference):
            return GateCheck(metric, False, f"{metric} {value:.4g}: the base model's {metric} is "
                                            f"{_unusable(reference)}, so it cannot be shown to beat it", BETTER_THAN_BASE)
        if not better(value, reference, 0.0):
            return GateCheck(metric, False, f"{metric} {value:.4g} does not beat the base model ({reference:.4g})",
                             BETTER_THAN_BASE)
    if champion is None:
        return GateCheck(metric, True, "no champion yet")
    reference = champion.get(metric)
    if not _usable(reference):
        return GateCheck(metric, False, f"{metric} {value:.4g}: the champion's {metric} is {_unusable(reference)}, "
                                        "so it cannot be shown to beat it")
    if better(value, reference, gate.min_delta):
        return GateCheck(metric, True, f"{metric} {value:.4g} beats the champion's {reference:.4g} "
                                       f"(min_delta {gate.min_delta})")
    return GateCheck(metric, False, f"{metric} {value:.4g} does not beat the champion's {reference:.4g} by "
                                    f"{gate.min_delta}")


def _guard(gate: PromoteIf, value: float, champion: dict[str, float] | None,
           base: dict[str, float] | None) -> GateCheck:
    """A `max_regression` condition: held against the champion, or the base model while there is none."""
    metric, limit = gate.metric, gate.max_regression
    against, scores = ("the champion's", champion) if champion is not None else ("the base model's", base)
    if scores is None:
        return GateCheck(metric, True, f"{metric} {value:.4g}: nothing to hold it against")
    reference = scores.get(metric)
    if not _usable(reference):
        return GateCheck(metric, False, f"{metric} {value:.4g}: {against} {metric} is {_unusable(reference)}, so "
                                        f"a regression within max_regression {limit} cannot be shown")
    regression = (value - reference) if gate.mode == "min" else (reference - value)
    if regression > limit:
        return GateCheck(metric, False, f"{metric} {value:.4g} regresses from {against} {reference:.4g} by "
                                        f"{regression:.4g}, more than max_regression {limit}")
    return GateCheck(metric, True, f"{metric} {value:.4g} within max_regression {limit} of {against} "
                                   f"{reference:.4g}")


def _usable(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def _unusable(value: float | None) -> str:
    return "missing" if value is None else f"not finite ({value})"


def promotion_decision(register: RegisterSpec, report: EvalReport) -> GateDecision:
    """The gate of `register.promote_if` applied to an evaluation report."""
    from fulltune.evaluation.evaluate import PER_BYTE

    champion = report.candidates.get("champion")
    decision = decide_gates(
        report.candidates["fine_tuned"].as_dict(), champion.as_dict() if champion else None,
        report.candidates["base"].as_dict() if "base" in report.candidates else None, register.gates,
        register.require_better_than_base, keep_champion=report.comparison_reason if report.keeps_champion else None)
    if champion is not None and report.comparison == PER_BYTE:
        decision = replace(decision, reason=f"{decision.reason}; {report.comparison_reason}")
    return decision


def comparison_tags(report: EvalReport) -> dict[str, str]:
    """How the new version was compared with the champion, and why (run and version tags)."""
    return {TAG_COMPARISON: report.comparison, TAG_COMPARISON_REASON: report.comparison_reason}


def gate_tags(decision: GateDecision) -> dict[str, str]:
    """The decision and each condition's outcome: `fulltune.gate` and `fulltune.gate.<metric>`."""
    tags = {TAG_GATE: decision.reason}
    for check in decision.checks:
        tags[f"{TAG_GATE}.{check.metric}"] = f"{'passed' if check.passed else 'failed'}: {check.reason}"
    return tags
