"""Per-rank peak memory of a context-parallel training step (Ulysses over FSDP2): the planner's estimate against a
measurement in every rank.

Each configuration: torchrun starts 2 CPU processes (gloo) that build a `from_config` Llama, install Ulysses over
their "cp" group and shard it with FSDP2 over both (`fulltune.runtime.parallelize.apply`, as the trainer does; gradient
checkpointing first), then run two optimizer steps of the trainer's step on each micro-batch's share of its rows
(`ContextParallel.shard`; packed rows of two documents each where `attention_mask`) under torch's FSDPMemTracker in
every rank. The tracked peak is compared with `estimate_memory(config, Settings(strategy="fsdp", num_processes=2,
context_parallel=2, ...)).peak_bytes` (fulltune/memory/context_parallel.py: a rank's s/N positions, the whole row's
attention for H/N heads, the all-to-alls' copies).

The ranks, the torchrun driver and the tracker's categories are `measuring.rank_memory`'s
(`context_parallel`). Every case runs in one torchrun (one start of the ranks).

The grid (`CASES`): vocabulary 8,192 at micro-batch 2 × 128 positions (the head decides the peak), then vocabulary
1,024 at 2 × 512 (the layers decide it): fp32 and the bf16 policy, packed rows (the whole row's mask), checkpointing,
eager attention, one key/value head (repeated to split), an odd length (padded to the zigzag's chunks), accumulation.

Usage:
    python -m benchmarks.context_parallel_memory                 # table and summary on stdout (~1-2 min)
    python -m benchmarks.context_parallel_memory --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.sharded_memory import summary, table
from measuring.rank_memory import against_estimates

BASE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 1024, "tie_word_embeddings": False}
SMALL_VOCAB = {**BASE, "vocab_size": 1024}
LONG = {"micro_batch_size": 2, "seq_len": 512, "attention_mask": False}
CASES = {  # name: (config, Settings fields besides the layout)
    "fp32-v8k-b2-s128": (BASE, {"micro_batch_size": 2, "seq_len": 128, "attention_mask": False}),
    "fp32-b2-s512": (SMALL_VOCAB, LONG),
    "fp32-b2-s512-packed": (SMALL_VOCAB, {**LONG, "attention_mask": True}),
    "bf16-b2-s512": (SMALL_VOCAB, {**LONG, "mixed_precision": "bf16"}),
    "fp32-b2-s512-ckpt2": (SMALL_VOCAB, {**LONG, "gradient_checkpointing": 2}),
    "fp32-b2-s512-eager": (SMALL_VOCAB, {**LONG, "attn_implementation": "eager"}),
    "fp32-kv1-b2-s512": ({**SMALL_VOCAB, "num_key_value_heads": 1}, LONG),
    "bf16-b1-s510-packed-ckpt4": (SMALL_VOCAB, {"micro_batch_size": 1, "seq_len": 510, "attention_mask": True,
                                                "mixed_precision": "bf16", "gradient_checkpointing": 4}),
    "fp32-v8k-b2-s256-accumulate2": (BASE, {"micro_batch_size": 2, "seq_len": 256, "attention_mask": False,
                                           "gradient_accumulation_steps": 2}),
}


def settings_of(fields: dict):
    from fulltune.memory import Settings

    return Settings(strategy="fsdp", num_processes=2, context_parallel=2, device="cpu", **fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", action="append", choices=list(CASES), help="default: all")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    names = [name for name in CASES if not args.case or name in args.case]
    measured = against_estimates("context_parallel", [(CASES[n][0], settings_of(CASES[n][1])) for n in names], 2)
    results = [{"case": name, "processes": 2, "config": CASES[name][0], **r} for name, r in zip(names, measured)]
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(table(results))
    print(summary(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
