"""Step-time cost of each memory lever (fulltune/runtime/optim.py, fulltune/runtime/offload.py, fulltune/runtime/loss.py) on CPU.

    python -m benchmarks.levers                       # ~5 min on 2 busy CPU cores; prints a table
    python -m benchmarks.levers --json levers.json    # and writes the rows as JSON

One small Llama shape (h 256, 4 layers, vocabulary 8192, 2 rows of 128 tokens, every position a target),
the trainer's optimizer step (micro-batches through the target-position head under bf16 autocast or in
pure bf16, backward, clipping, step, zero_grad), one model per lever, the levers interleaved step by step
so that load on the machine hits them alike; median over `--steps` measured steps after two warm-up
steps (the first compiles or allocates). Each lever is compared with the baseline that differs only in
that lever. Bytes are the library's own counts (what the memory model imports), for this model.

On a CPU device the offload levers only add copies (host and device are the same memory), so their
rows are the cost of the code path, not of PCIe traffic; the chunked head's and the in-backward step's
costs carry over.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fulltune.runtime.loss import Targets
from fulltune.memory import Settings
from fulltune.runtime.checkpointing import apply_gradient_checkpointing
from fulltune.runtime.offload import ActivationOffload
from fulltune.runtime.optim import build_optimizer, device_gradient_bytes, device_state_bytes, host_bytes, torchao_available
from fulltune.runtime.step import local_parts, run_step


@dataclass
class Lever:
    name: str
    baseline: str | None  # the row it differs from in one lever
    optimizer: str = "adamw"
    pure_bf16: bool = False
    compensation: str | None = None
    optimizer_in_backward: bool = False
    offload_optimizer: bool = False
    accumulation: int = 1
    checkpoint: bool = False
    offload_activations: bool = False
    chunked: bool = False
    seconds: list[float] = field(default_factory=list)


LEVERS = [
    Lever("AMP bf16, AdamW (baseline)", None),
    Lever("pure bf16 + Kahan (torch-optimi)", "AMP bf16, AdamW (baseline)", pure_bf16=True),
    Lever("pure bf16, no compensation", "AMP bf16, AdamW (baseline)", pure_bf16=True, compensation="none"),
    Lever("step in backward", "AMP bf16, AdamW (baseline)", optimizer_in_backward=True),
    Lever("states offloaded to host", "AMP bf16, AdamW (baseline)", offload_optimizer=True),
    Lever("chunked head", "AMP bf16, AdamW (baseline)", chunked=True),
    Lever("8-bit AdamW (bitsandbytes)", "AMP bf16, AdamW (baseline)", optimizer="adamw_8bit"),
    Lever("4-bit AdamW (torchao)", "AMP bf16, AdamW (baseline)", optimizer="adamw_4bit"),
    Lever("accumulation 2 (baseline)", None, accumulation=2),
    Lever("accumulation 2, states offloaded to host", "accumulation 2 (baseline)", accumulation=2,
          offload_optimizer=True),
    Lever("all layers checkpointed (baseline)", None, checkpoint=True),
    Lever("checkpointed, inputs offloaded", "all layers checkpointed (baseline)", checkpoint=True,
          offload_activations=True),
]


def small_llama() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()


class Run:
    """One lever's model and optimizer, stepped by the trainer's step (fulltune/runtime/step.py)."""

    def __init__(self, lever: Lever, base: torch.nn.Module, batches: list[torch.Tensor]) -> None:
        self.lever, self.batches = lever, batches
        self.settings = Settings(micro_batch_size=batches[0].shape[0], seq_len=batches[0].shape[1],
                                 gradient_accumulation_steps=lever.accumulation,
                                 gradient_checkpointing=4 if lever.checkpoint else 0, mixed_precision="bf16",
                                 optimizer=lever.optimizer, pure_bf16=lever.pure_bf16,
                                 optimizer_in_backward=lever.optimizer_in_backward,
                                 offload_optimizer=lever.offload_optimizer,
                                 offload_activations=lever.offload_activations, chunked_loss=lever.chunked)
        self.model = copy.deepcopy(base).to(torch.bfloat16 if lever.pure_bf16 else torch.float32)
        if lever.checkpoint:
            apply_gradient_checkpointing(self.model, True)
        if lever.offload_activations:
            ActivationOffload().install(self.model)
        # build_optimizer itself (not optimizer_for): the uncompensated pure-bf16 row sets the compensation.
        self.optimizer = build_optimizer(self.model, lever.optimizer, lr=1e-5, pure_bf16=lever.pure_bf16,
                                         compensation=lever.compensation,
                                         optimizer_in_backward=lever.optimizer_in_backward,
                                         offload_optimizer=lever.offload_optimizer,
                                         gradient_accumulation_steps=lever.accumulation, max_grad_norm=1.0)
        self.step_number = 0

    def step(self) -> None:
        micro_batches = [({"input_ids": batch}, Targets.from_labels(batch)) for batch in self.batches[:self.lever.accumulation]]
        self.step_number += 1
        with local_parts(self.model, self.optimizer, self.settings, device="cpu") as parts:
            run_step(parts, iter(micro_batches), self.step_number, sum(len(t) for _, t in micro_batches))


def byte_counts(lever: Lever, shapes: list[tuple[int, ...]]) -> dict[str, int]:
    states, _ = device_state_bytes(lever.optimizer, shapes, lever.pure_bf16, lever.offload_optimizer, lever.compensation)
    return {"weights_bytes": sum(torch.Size(s).numel() for s in shapes) * (2 if lever.pure_bf16 else 4),
            "gradient_bytes": device_gradient_bytes(shapes, lever.pure_bf16, lever.optimizer_in_backward,
                                                    lever.offload_optimizer),
            "state_bytes": states,
            "host_bytes": host_bytes(lever.optimizer, shapes, lever.pure_bf16, lever.optimizer_in_backward,
                                     lever.offload_optimizer, lever.accumulation)}


def measure(steps: int) -> list[dict]:
    base = small_llama()
    generator = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 8192, (2, 128), generator=generator) for _ in range(2)]
    levers = [lever for lever in LEVERS if lever.optimizer != "adamw_4bit" or torchao_available()]
    runs = [Run(lever, base, batches) for lever in levers]
    for _ in range(2):  # warm-up: states allocated, torchao's update compiled
        for run in runs:
            started = time.perf_counter()
            run.step()
            print(f"warm-up {run.lever.name}: {time.perf_counter() - started:.2f} s", file=sys.stderr, flush=True)
    for _ in range(steps):
        for run in runs:
            started = time.perf_counter()
            run.step()
            run.lever.seconds.append(time.perf_counter() - started)
    shapes = [tuple(p.shape) for p in base.parameters()]
    medians = {lever.name: statistics.median(lever.seconds) for lever in levers}
    return [{"lever": lever.name, "baseline": lever.baseline, "median_step_s": medians[lever.name],
             "vs_baseline": medians[lever.name] / medians[lever.baseline] if lever.baseline else 1.0,
             "steps": len(lever.seconds), **byte_counts(lever, shapes)} for lever in levers]


def table(rows: list[dict]) -> str:
    lines = ["| lever | median step (s) | vs its baseline | device weights+grads+states (MiB) | host (MiB) |",
             "|---|---|---|---|---|"]
    for row in rows:
        device = (row["weights_bytes"] + row["gradient_bytes"] + row["state_bytes"]) / 2**20
        lines.append(f"| {row['lever']} | {row['median_step_s']:.3f} | {row['vs_baseline']:.2f}x | {device:.1f} "
                     f"| {row['host_bytes'] / 2**20:.1f} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7, help="measured steps per lever (after 2 warm-up steps)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    started = time.perf_counter()
    rows = measure(args.steps)
    print(table(rows))
    print(f"\n{args.steps} steps per lever, torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
