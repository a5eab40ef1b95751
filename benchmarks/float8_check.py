"""float8 training on one GPU, against bf16 with the same plan: tokens/s, and each step's peak allocated memory
against the memory model's estimate (`train.float8`, fulltune/runtime/float8.py, fulltune/memory/float8.py).

Part of `python -m benchmarks.device_check` (`float8_case`); needs torchao (`pip install 'fulltune[lowbit]'`) and
a GPU with float8 tensor cores (compute capability 8.9 or above) for the float8 variants. The shape is
Llama-3.2-1B's (hidden 2048, 16 layers, GQA 32/8, vocabulary 128,256, tied), micro-batch 2 of 2048 tokens, bf16
autocast, AdamW, no checkpointing (an estimated 30 GiB); each variant builds the model as the trainer does
(`planning.trace.build_model`: the levers, float8's conversion among them), compiles it where the variant says
(torch.compile: how float8 is meant to run, its casts fused), takes `WARMUP` steps (compilation, the optimizer's
states), then `steps` timed steps; the peak is everything allocated from the model's build on, as the memory cases
measure it (`planning.trace.measure_cuda`).

    python -m benchmarks.float8_check --out float8.json
    python -m benchmarks.float8_check --dry-run --out /tmp/float8.json   # CPU, tiny shapes, eager: checks the script
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from fulltune.memory import Settings, estimate_memory
from fulltune.memory.units import format_bytes
from benchmarks.host_params_check import llama, pct, safely

WARMUP = 2
# (name, float8 recipe or None, compiled)
VARIANTS = (("bf16, compiled", None, True), ("float8 tensorwise, compiled", "tensorwise", True),
            ("float8 rowwise, compiled", "rowwise", True), ("bf16, eager", None, False),
            ("float8 tensorwise, eager", "tensorwise", False))


def variant(config: Any, settings: Settings, steps: int, compiled: bool) -> dict[str, Any]:
    """Tokens/s of `steps` optimizer steps after `WARMUP`, and their peak allocated bytes (GPU) against the
    estimate for `settings`."""
    import torch

    from fulltune.planning.trace import build_model, quiet, timed_train_steps
    from fulltune.runtime import optim
    from fulltune.runtime.loss import TargetHead

    device = settings.device
    estimate = estimate_memory(config, settings)
    if device == "cuda":  # as planning.trace.measure_cuda measures: everything allocated from the model's build on
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with quiet():
        model = build_model(config, settings).to(device)
        optimizer = optim.optimizer_for(model, settings)
        if compiled:
            model = TargetHead.compile(model)
        seconds = timed_train_steps(model, optimizer, settings, steps, device, warmup=WARMUP)
    row = {"settings": settings.to_dict(), "compiled": compiled, "steps": steps, "seconds": round(seconds, 3),
           "tokens_per_second": steps * settings.gradient_accumulation_steps * settings.micro_batch_size
           * settings.seq_len / seconds, "estimate_peak": estimate.peak_bytes}
    if device == "cuda":
        row["measured_allocated"] = int(torch.cuda.max_memory_allocated() - start)
        row["estimate_error"] = estimate.peak_bytes / row["measured_allocated"] - 1
    del model, optimizer
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def float8_case(dry_run: bool, steps: int = 5) -> dict[str, Any]:
    """Every variant of `VARIANTS` (on CPU, eager only and pure bf16: CPU autocast is not what torchao follows),
    each failing one reported, not fatal; the speed-up of each float8 variant over bf16 compiled alike."""
    if dry_run:
        config = llama(64, 192, 2, 4, 2, 256)
        settings = Settings(micro_batch_size=2, seq_len=64, mixed_precision="bf16", pure_bf16=True, device="cpu",
                            attention_mask=False)
        variants = [v for v in VARIANTS if not v[2]]
    else:
        config = llama(2048, 8192, 16, 32, 8, 128256, tied=True)
        settings = Settings(micro_batch_size=2, seq_len=2048, mixed_precision="bf16", device="cuda",
                            attention_mask=False)
        variants = list(VARIANTS)
    rows = {}
    for name, recipe, compiled in variants:
        chosen = replace(settings, float8=recipe is not None, float8_recipe=recipe or "tensorwise")
        rows[name] = safely(name, variant, config, chosen, steps, compiled)
        print(f"[float8] {name}: done", file=sys.stderr, flush=True)
    for name, row in rows.items():
        base = rows.get("bf16, compiled" if "compiled" in name else "bf16, eager", {})
        if "tokens_per_second" in row and "tokens_per_second" in base:
            row["speedup_over_bf16"] = row["tokens_per_second"] / base["tokens_per_second"]
    return rows


def float8_lines(rows: dict[str, Any]) -> list[str]:
    """The device check's summary lines for `float8_case`."""
    lines = ["float8 against bf16 (same plan): variant, tokens/s, speed-up, peak allocated, estimate, error"]
    for name, row in rows.items():
        if "error" in row:
            lines.append(f"  {name}: FAILED: {row['error']}")
            continue
        measured = row.get("measured_allocated")
        lines.append(f"  {name}: {row['tokens_per_second']:.0f} tokens/s, {row.get('speedup_over_bf16', 1.0):.2f}×, "
                     f"{format_bytes(measured) if measured else '-'}, {format_bytes(row['estimate_peak'])}, "
                     f"{pct(row.get('estimate_error'))}")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the JSON report")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU: checks the script")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    rows = float8_case(args.dry_run, args.steps)
    print("\n".join(float8_lines(rows)))
    Path(args.out).write_text(json.dumps(rows, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
