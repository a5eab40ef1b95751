"""How far the analytic estimate can be from a step's real peak: measured, per kind of configuration.

The planner keeps this much free beyond the estimate (`plan_memory`), unless the step has been
traced, in which case it plans for the larger of estimate and trace and the uncertainty is their
difference on that very step.

Each entry is the largest |estimate / truth − 1| of the allocated peak measured for that kind,
where truth is the real step on CPU tensors under MemTracker (`measure_memory`) or its FakeTensor
trace (`simulate_memory`), which agree to the byte on CPU since the trace sees unpacked rows as the
real step does (trace.py, `_rows_known_unpacked`). Measured with torch 2.13 / transformers 5.24 on
CPU: `python -m benchmarks.memory_accuracy --disagreement` (a 4-layer Llama with grouped-query
attention, GPT-2 and GPT-NeoX, micro-batch 2, seq 256, bf16/fp32, accumulation 1/4, with and without
a mask), tests/test_memory_accuracy.py, the 17 configurations of BENCHMARKS.md's memory-accuracy
table and the issue-13 step (TinyLlama-1.1B shape, seq 2048, micro 2 × accumulation 4, 1 of 22
layers checkpointed, bf16, Adafactor: 20.2 GiB traced, 20.2 GiB estimated).

`FLOOR` is kept even where less was measured: what autograd saves can change with a transformers
release (tests/test_memory_accuracy.py fails beyond 2%), and CUDA kernels have not been measured
here at all (benchmarks/device_check.py measures them on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

from fulltune.memory import parallelism
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings

FLOOR = 0.005

# (layout, checkpointing) → (largest measured |estimate/truth − 1|, where it was measured).
MEASURED: dict[tuple[str, str], tuple[float, str]] = {
    ("llama", "none"): (0.0004, "TinyLlama-1.1B shape b=1 s=2048 bf16 mask, traced (BENCHMARKS.md row 10)"),
    ("llama", "partial"): (0.0002, "4-layer GQA Llama, 1 layer checkpointed, mask (--disagreement grid); the issue-13 "
                                   "step traces 20.2 GiB against 20.2 GiB estimated"),
    # With every layer checkpointed, accumulation 4 and bf16, the estimate is off at h=128 by a few
    # hundred KiB on 12–14 MiB steps (not yet pinned down): Llama and GPT-2 read high, GPT-NeoX reads
    # 3.6% LOW. At real sizes, all-checkpointed Llama/GPT-NeoX rows read 0.0–0.4% (BENCHMARKS.md rows
    # 11, 12, 14, 16). The margin keeps the worst as measured.
    ("llama", "all"): (0.0219, "4-layer GQA Llama h=128, all checkpointed, accumulation 4, bf16 (--disagreement grid)"),
    ("gpt2", "none"): (0.0003, "4-layer GPT-2, bf16, accumulation 4 (--disagreement grid)"),
    ("gpt2", "partial"): (0.0002, "4-layer GPT-2, 1 layer checkpointed (--disagreement grid)"),
    ("gpt2", "all"): (0.0287, "4-layer GPT-2 h=128, all checkpointed, accumulation 4, bf16 (--disagreement grid)"),
    ("gpt_neox", "none"): (0.0003, "4-layer GPT-NeoX (--disagreement grid)"),
    ("gpt_neox", "partial"): (0.0003, "4-layer GPT-NeoX, 1 layer checkpointed (--disagreement grid)"),
    ("gpt_neox", "all"): (0.0362, "4-layer GPT-NeoX h=128, all checkpointed, accumulation 4, bf16 (--disagreement grid)"),
}
# The memory levers (pure bf16, step in backward, optimizer / activation offload, chunked loss), each alone
# and combined, traced against the estimate (tests/test_frontier_plan.py at h=128, and the same grid at
# h=256 with 4 layers): all within 0.2% but one combination, which reads low.
LEVERS_MEASURED = (0.0396, "pure bf16 + optimizer offload + chunked loss, all 4 layers checkpointed, h=256, traced "
                           "(the trace keeps one more bf16 embedding gradient at the optimizer step)")
# Each kind of parallelism's own measured margin (FSDP, tensor parallel, pipeline stages) is its object's
# (fulltune/memory/parallelism.py `Parallelism.margin`): a step keeps the largest of its kinds' and this table's.
# Kinds never measured against a real step: a model type modelled as a Llama-like decoder, and the kinds of
# parallelism without a margin of their own (DDP).
UNMEASURED = 0.05


@dataclass(frozen=True)
class Uncertainty:
    """The planner's uncertainty about one step's peak: `bytes` either way, and what it rests on."""

    bytes: int
    fraction: float
    kind: str
    basis: str  # "measured" (the table above), "assumed" (an unmeasured kind) or "trace" (this step traced)
    evidence: str
    traced_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "bytes": int(self.bytes),
            "fraction": round(self.fraction, 6),
            "kind": self.kind,
            "basis": self.basis,
            "evidence": self.evidence,
            "traced_peak_bytes": self.traced_peak_bytes,
        }


def configuration_kind(shape: ModelShape, settings: Settings) -> tuple[str, str]:
    """(layout, checkpointing: none | partial | all) — the kinds the table above is measured for."""
    k = min(settings.gradient_checkpointing, shape.num_layers)
    checkpointing = "none" if k == 0 else "all" if k == shape.num_layers else "partial"
    return shape.layout, checkpointing


def _describe_kind(shape: ModelShape, settings: Settings) -> str:
    layout, checkpointing = configuration_kind(shape, settings)
    name = shape.model_type if shape.approximate else layout
    return f"{name}, checkpointing {checkpointing}{parallelism.words(settings)}"


def estimate_uncertainty(shape: ModelShape, settings: Settings, peak_bytes: int) -> Uncertainty:
    """The headroom to keep for an untraced step: the largest disagreement measured for its kind."""
    kind = _describe_kind(shape, settings)
    levers = any(settings.levers().values())
    parallel, unmeasured = parallelism.margin(settings)
    if shape.approximate or unmeasured:
        why = "model type modelled as Llama-like" if shape.approximate else unmeasured
        return Uncertainty(int(UNMEASURED * peak_bytes), UNMEASURED, kind, "assumed", f"not measured ({why})")
    measured, where = MEASURED[configuration_kind(shape, settings)]
    if levers and LEVERS_MEASURED[0] > measured:
        measured, where = LEVERS_MEASURED
    if parallel is not None and parallel.fraction > measured:
        measured, where = parallel.fraction, parallel.evidence
    fraction = max(measured, FLOOR)
    evidence = f"largest measured {measured:.2%}: {where}"
    if fraction > measured:
        evidence += f"; kept at least {FLOOR:.1%}"
    return Uncertainty(int(fraction * peak_bytes), fraction, kind, "measured", evidence)


def traced_uncertainty(shape: ModelShape, settings: Settings, peak_bytes: int, traced_peak: int) -> Uncertainty:
    """A traced step: the estimate and the trace differ by this much; the plan takes the larger."""
    gap = abs(traced_peak - peak_bytes)
    return Uncertainty(
        gap,
        gap / max(peak_bytes, 1),
        _describe_kind(shape, settings),
        "trace",
        "this step traced under FakeTensorMode (CPU kernels); planned for the larger of estimate and trace",
        traced_peak,
    )
