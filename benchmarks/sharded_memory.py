"""Per-rank peak memory of an FSDP2 training step: the planner's estimate against a measurement.

For each configuration below, two (or four) processes (torchrun, gloo, CPU) shard a `from_config` model with
`fulltune.runtime.sharding.shard_model` and run two optimizer steps the way the trainer does (TargetHead loss
over the target positions, backward of Σ loss / targets, global-norm clip, fused AdamW, zero_grad). In
every rank torch's FSDPMemTracker (MemTracker plus FSDP2's all-gather / reduce-scatter buffers, sharded
and unsharded parameters and gradients) records the peak of tracked tensor storage (the ranks are
`measuring.rank_memory`'s `fsdp`). That is compared with
`estimate_memory(config, Settings(strategy="fsdp", num_processes=2, ...)).peak_bytes`, the allocated-tensor
peak the planner adds its runtime overhead to.

Measured: every tensor torch allocates in the step on CPU. Not measured (they stay formulas in the
planner): CUDA's context and caching-allocator slack, NCCL's internal buffers and streams, and the
CPU process itself (interpreter, libraries).

The grid (`_grid`): fp32 and bf16 policy, tied and untied embeddings, no / half / every layer checkpointed,
micro-batch 1 and 2, then accumulation, a 32k tied vocabulary, four processes and one. Each row is the
estimate against the rank furthest from it (the ranks measure the same to the byte here). The JSON keeps
FSDPMemTracker's categories per rank; they are for reading only (the tracker files a buffer under the
category of the hook that first sees it), the totals are what is compared.

Usage:
    python -m benchmarks.sharded_memory            # JSON, table and summary on stdout (~15 s per case on 2 cores)
    python -m benchmarks.sharded_memory --case fp32-untied-ckpt0-b2 --json out.json
    python -m benchmarks.sharded_memory --levers   # chunked_loss and optimizer_in_backward under FSDP, on and off
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

from measuring.rank_memory import against_estimate



@dataclass(frozen=True)
class Case:
    name: str
    config: dict  # LlamaConfig keyword arguments
    settings: dict = field(default_factory=dict)  # Settings fields besides strategy / num_processes
    processes: int = 2


BASE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 512,
        "tie_word_embeddings": False}
TIED = {**BASE, "tie_word_embeddings": True}


def _grid() -> list[Case]:
    """fp32 / bf16 policy × untied / tied × checkpointing none / 2 / all 4 layers × micro-batch 1 / 2 on 2
    processes, then accumulation, a 32k tied vocabulary, 4 processes and 1."""
    cases = []
    for precision in ("no", "bf16"):
        for tied, config in (("untied", BASE), ("tied", TIED)):
            for checkpointing in (0, 2, 4):
                for micro in (1, 2):
                    name = f"{'fp32' if precision == 'no' else 'bf16'}-{tied}-ckpt{checkpointing}-b{micro}"
                    cases.append(Case(name, config, {"micro_batch_size": micro, "seq_len": 128,
                                                     "mixed_precision": precision,
                                                     "gradient_checkpointing": checkpointing}))
    two = {"micro_batch_size": 2, "seq_len": 128}
    cases += [
        Case("fp32-untied-accumulate2", BASE, {**two, "gradient_accumulation_steps": 2}),
        Case("bf16-tied-ckpt2-accumulate2", TIED, {**two, "gradient_accumulation_steps": 2, "mixed_precision": "bf16",
                                                   "gradient_checkpointing": 2}),
        Case("fp32-tied-32k", {**BASE, "hidden_size": 128, "intermediate_size": 344, "vocab_size": 32000,
                               "tie_word_embeddings": True}, two),
        Case("fp32-untied-4proc", BASE, two, processes=4),
        Case("bf16-tied-ckpt2-4proc", TIED, {**two, "mixed_precision": "bf16", "gradient_checkpointing": 2},
             processes=4),
        # FSDP2 over one process: a unit's gathered weight is its all-gather buffer, nothing is prefetched.
        Case("fp32-untied-1proc", BASE, two, processes=1),
        Case("fp32-tied-ckpt4-b1-1proc", TIED, {"micro_batch_size": 1, "seq_len": 128, "gradient_checkpointing": 4},
             processes=1),
        Case("bf16-untied-b1-1proc", BASE, {"micro_batch_size": 1, "seq_len": 128, "mixed_precision": "bf16"},
             processes=1),
        Case("bf16-tied-ckpt2-1proc", TIED, {**two, "mixed_precision": "bf16", "gradient_checkpointing": 2},
             processes=1),
    ]
    return cases + _lever_cases()


def _lever_cases() -> list[Case]:
    """The levers under FSDP, each beside the same case without it (`--levers` runs these pairs): the chunked
    head (a 32k vocabulary, where the logits are the peak), the step in backward (no sharded gradients; short
    rows, where the gradients are)."""
    vocab32k = {**BASE, "hidden_size": 128, "intermediate_size": 344, "vocab_size": 32000}
    two = {"micro_batch_size": 2, "seq_len": 128}
    cases = []
    for name, config, settings in (("fp32-untied-32k", vocab32k, two),
                                   ("fp32-tied-32k", {**vocab32k, "tie_word_embeddings": True}, two),
                                   ("bf16-untied-32k-ckpt4", vocab32k,
                                    {**two, "mixed_precision": "bf16", "gradient_checkpointing": 4})):
        cases += [Case(f"levers-{name}", config, settings),
                  Case(f"levers-{name}-chunked", config, {**settings, "chunked_loss": True})]
    # Short rows, every layer checkpointed: the gradients, not the activations, decide the peak.
    small = {"micro_batch_size": 1, "seq_len": 64, "gradient_checkpointing": 4}
    for name, config, settings in (("fp32-untied-b1-ckpt4", BASE, small),
                                   ("bf16-tied-b1-ckpt4", TIED, {**small, "mixed_precision": "bf16"}),
                                   ("fp32-untied-b1-ckpt4-adafactor", BASE, {**small, "optimizer": "adafactor"})):
        cases += [Case(f"levers-{name}", config, settings),
                  Case(f"levers-{name}-in-backward", config, {**settings, "optimizer_in_backward": True})]
    return cases


CASES = _grid()


def settings_of(case: Case, strategy: str = "fsdp", processes: int | None = None):
    from fulltune.memory import Settings

    return Settings(strategy=strategy, num_processes=processes or case.processes, device="cpu", **case.settings)


def config_of(case: Case):
    from transformers import LlamaConfig

    return LlamaConfig(**case.config)


# ----------------------------------------------------------------------------------------- driver


def estimate_parts(estimate) -> dict[str, int]:
    b = estimate.breakdown
    return {"parameters": b["parameters"], "gradients": b["gradients"], "optimizer_states": b["optimizer_states"],
            "activations_logits_temporary": b["activations"] + b["logits"] + b["temporary"]}


def run_case(case: Case) -> dict:
    """Measure `case` in every rank (`measuring.rank_memory`, FSDPMemTracker) against the estimate."""
    from fulltune.memory import estimate_memory

    measured = against_estimate("fsdp", case.config, settings_of(case), case.processes)
    return {"case": case.name, "processes": case.processes, "config": case.config,
            "settings": settings_of(case).to_dict(), **measured,
            "estimate_breakdown": estimate_parts(estimate_memory(config_of(case), settings_of(case)))}


def _worst_rank(result: dict) -> dict:
    return max(result["ranks"], key=lambda rank: abs(rank["error"]))


def summary(results: list[dict]) -> str:
    """Median and worst |error| over the cases (each case at its worst rank)."""
    errors = sorted(abs(_worst_rank(r)["error"]) for r in results)
    median = errors[len(errors) // 2] if len(errors) % 2 else sum(errors[len(errors) // 2 - 1:][:2]) / 2
    worst = max(results, key=lambda r: abs(_worst_rank(r)["error"]))
    return (f"median |error| {median:.2%}, worst {abs(_worst_rank(worst)['error']):.2%} ({worst['case']}) "
            f"over {len(results)} configurations")


def table(results: list[dict]) -> str:
    """One row per case: the estimate against the rank whose measured peak is furthest from it."""
    mib = 2**20
    lines = ["| case | processes | estimate MiB | measured MiB (ranks) | error | peak during (estimate) |",
             "|---|---|---|---|---|---|"]
    for r in results:
        measured = "/".join(f"{rank['measured_peak_bytes'] / mib:.2f}" for rank in r["ranks"])
        if len({rank["measured_peak_bytes"] for rank in r["ranks"]}) == 1:
            measured = f"{r['ranks'][0]['measured_peak_bytes'] / mib:.2f} (all)"
        lines.append(f"| {r['case']} | {r['processes']} | {r['estimate_peak_bytes'] / mib:.2f} | {measured} | "
                     f"{_worst_rank(r)['error']:+.2%} | {r['estimate_peak_phase']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=[c.name for c in CASES],
                        help="default: the grid (not the lever cases)")
    parser.add_argument("--levers", action="store_true",
                        help="the lever cases (each beside its case without it) instead of the grid")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results = []
    for case in CASES:
        if (case.name in args.case) if args.case else case.name.startswith("levers-") == args.levers:
            results.append(run_case(case))
            print(table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    text = json.dumps(results, indent=1)
    if args.json:
        args.json.write_text(text)
    print(text)
    print(table(results))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
