"""Per-rank peak memory of a tensor-parallel (and FSDP × TP) training step: the planner's estimate against a
measurement in every rank.

Each configuration: torchrun starts 2 or 4 CPU processes (gloo) that split a `from_config` Llama with
`fulltune.runtime.parallel.apply` (the TP plan per block with sequence-parallel norms, then FSDP2 over the
data-parallel processes; gradient checkpointing applied first, as the trainer does) and run two optimizer steps
through the trainer's step (`fulltune/runtime/step.py`: the TargetHead loss, backward, global-norm clip, fused AdamW,
zero_grad) under torch's FSDPMemTracker in every rank. The peak of tracked tensor storage is compared with
`estimate_memory(config, Settings(strategy="fsdp", num_processes=N, tensor_parallel=T, ...)).peak_bytes`, a
tensor-parallel rank's own terms (`fulltune/memory/tensor_parallel.py`); the column "as FSDP over all" is what
the planner counted before it had them (the same run as FSDP over all N processes).

The ranks, the torchrun driver and the tracker's categories are `measuring.rank_memory`'s
(`tensor_parallel`).

The grid (`_grid`): TP 2 on 2 processes and FSDP 2 × TP 2 on 4, fp32 and the bf16 policy, untied and tied
(micro-batch 2, seq 128, vocabulary 8,192: the logits decide the peak), then checkpointing, micro-batch 1,
accumulation, a sequence TP does not divide (padded), and a 1,024-token vocabulary at micro-batch 4 × seq 256
(the activations decide the peak).

Usage:
    python -m benchmarks.tensor_parallel_memory                 # table and summary on stdout (~10-30 s per case)
    python -m benchmarks.tensor_parallel_memory --case tp2-fp32-tied --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.sharded_memory import BASE, summary
from measuring.rank_memory import against_estimate

TIED = {**BASE, "tie_word_embeddings": True}
SMALL_VOCAB = {**BASE, "vocab_size": 1024}


@dataclass(frozen=True)
class Case:
    name: str
    config: dict  # LlamaConfig keyword arguments
    processes: int
    tensor_parallel: int
    settings: dict = field(default_factory=dict)  # Settings fields besides strategy / processes / TP degree


def _grid() -> list[Case]:
    """TP 2 on 2 processes and FSDP 2 × TP 2 on 4, fp32 and the bf16 policy, untied and tied, micro-batch 2;
    then checkpointing, micro-batch 1, accumulation, an odd sequence and an activation-bound shape."""
    two = {"micro_batch_size": 2, "seq_len": 128}
    cases = []
    for processes in (2, 4):
        for precision in ("no", "bf16"):
            for tied, config in (("untied", BASE), ("tied", TIED)):
                layout = "tp2" if processes == 2 else "fsdp2xtp2"
                cases.append(Case(f"{layout}-{'fp32' if precision == 'no' else 'bf16'}-{tied}", config, processes, 2,
                                  {**two, "mixed_precision": precision}))
    bf16 = {**two, "mixed_precision": "bf16"}
    wide = {"micro_batch_size": 4, "seq_len": 256}
    cases += [
        Case("tp2-fp32-untied-ckpt2", BASE, 2, 2, {**two, "gradient_checkpointing": 2}),
        Case("tp2-bf16-tied-ckpt4", TIED, 2, 2, {**bf16, "gradient_checkpointing": 4}),
        Case("fsdp2xtp2-bf16-untied-ckpt2", BASE, 4, 2, {**bf16, "gradient_checkpointing": 2}),
        Case("tp2-fp32-untied-b1", BASE, 2, 2, {**two, "micro_batch_size": 1}),
        Case("tp2-fp32-untied-accumulate2", BASE, 2, 2, {**two, "gradient_accumulation_steps": 2}),
        Case("tp2-fp32-untied-seq127", BASE, 2, 2, {**two, "seq_len": 127}),
        Case("tp2-fp32-untied-v1k-b4-s256", SMALL_VOCAB, 2, 2, wide),
        Case("tp2-bf16-untied-v1k-b4-s256", SMALL_VOCAB, 2, 2, {**wide, "mixed_precision": "bf16"}),
        Case("tp2-fp32-tied-v1k-b4-s256-ckpt2", {**SMALL_VOCAB, "tie_word_embeddings": True}, 2, 2,
             {**wide, "gradient_checkpointing": 2}),
        Case("fsdp2xtp2-fp32-untied-v1k-b4-s256", SMALL_VOCAB, 4, 2, wide),
    ]
    return cases


CASES = _grid()


def settings_of(case: Case, tensor_parallel: int | None = None):
    from fulltune.memory import Settings

    return Settings(strategy="fsdp", num_processes=case.processes,
                    tensor_parallel=case.tensor_parallel if tensor_parallel is None else tensor_parallel,
                    device="cpu", **case.settings)


def run_case(case: Case) -> dict:
    """Measure `case` in every rank (`measuring.rank_memory`, FSDPMemTracker) against the estimate and
    the FSDP-over-all stand-in."""
    from transformers import LlamaConfig

    from fulltune.memory import estimate_memory

    measured = against_estimate("tensor_parallel", case.config, settings_of(case), case.processes)
    as_fsdp = estimate_memory(LlamaConfig(**case.config), settings_of(case, tensor_parallel=1))
    return {"case": case.name, "processes": case.processes, "tensor_parallel": case.tensor_parallel,
            "config": case.config, "settings": settings_of(case).to_dict(), **measured,
            "as_fsdp_peak_bytes": as_fsdp.peak_bytes}


def table(results: list[dict]) -> str:
    """One row per case: the estimate against the rank furthest from it, and the old FSDP-over-all count."""
    mib = 2**20
    lines = ["| case | processes | estimate | measured (every rank) | error | as FSDP over all | peak during (estimate) |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        peaks = sorted({rank["measured_peak_bytes"] for rank in r["ranks"]})
        measured = " / ".join(f"{p / mib:.2f}" for p in peaks) + " MiB" + (" (all)" if len(peaks) == 1 else "")
        worst = max(r["ranks"], key=lambda rank: abs(rank["error"]))
        stand_in = r["as_fsdp_peak_bytes"] / worst["measured_peak_bytes"] - 1
        lines.append(f"| {r['case']} | {r['processes']} | {r['estimate_peak_bytes'] / mib:.2f} MiB | {measured} | "
                     f"{worst['error']:+.2%} | {stand_in:+.1%} | {r['estimate_peak_phase']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES], help="default: all")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = []
    for case in CASES:
        if not args.case or case.name in args.case:
            results.append(run_case(case))
            print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
