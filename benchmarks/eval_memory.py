"""Resident memory of the evaluate stage on CPU against its planned phase (memory/evaluation.py).

A 19M-parameter Llama with a 32k vocabulary, trained in pure bf16 (its export is bf16; the base checkpoint
fp32), is evaluated as the evaluate stage does (`fulltune.evaluation.evaluate.evaluate_model` for the base and the
fine-tuned model, one after another, loaded with `planned_loading`) on 64 held-out rows of 128 tokens with a
target at every completion position, and 16 greedy generations. Two ways, each in a fresh process that
imports what the flow process holds (Prefect, MLflow, torch, transformers):

- `planned`: the plan for the budget: bf16 weights, every phase's batch fitted to the budget;
- `fp32`: the evaluate stage before it was planned: fp32 copies of both models, `evaluate.batch_size` as
  configured (32, a generous batch).

The process's peak resident set (VmHWM, and a 5 ms sampler) is printed beside the plan's evaluation phase
(`device_bytes`, the runtime overhead included) and the budget. The models, rows and the measured process are
measuring/memory_runs.py's (`measure_evaluation`), which tests/test_process_memory.py runs too.

Usage:
    python -m benchmarks.eval_memory                     # both ways, ~1 min on 2 cores
    python -m benchmarks.eval_memory --budget 1.25GiB --json eval.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from measuring.memory_runs import BUDGET, eval_assets as make_assets, measure_evaluation as measure


# The GPU case (benchmarks/device_check.py): the 8B-on-24 GiB plan's evaluate stage at a reduced layer count.
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                vocab_size=128256, tie_word_embeddings=False)


def device_case(dry_run: bool, layers: int = 4) -> dict[str, Any]:
    """The evaluate stage at the settings the Llama-3.1-8B plan on one 24 GiB GPU chose (bf16, the loss and
    generation batches fitted for seq 2048 and evaluate.*'s defaults), run with `evaluate_model` on the 8B shape
    cut to `layers` decoder layers: the device's peak allocated against the memory model's peak for that shape
    at those batches, and against the budget. --dry-run: a tiny Llama on CPU, the code path only."""
    import torch
    import transformers

    from fulltune.evaluation.evaluate import EvalOptions, evaluate_model, planned_loading
    from fulltune.memory import PlanRequest
    from fulltune.planning import plan_memory
    from fulltune.memory.evaluation import EvalRequest, eval_memory
    from fulltune.memory.shapes import model_shape
    from tests.tiny import word_level_tokenizer

    shape = dict(LLAMA_8B, hidden_size=64, intermediate_size=176, num_attention_heads=8, num_key_value_heads=2,
                 vocab_size=300) if dry_run else LLAMA_8B
    seq, budget, device = (64, 2**30, "cpu") if dry_run else (2048, 24 * 2**30, "cuda")
    request = PlanRequest(effective_batch_size=8, seq_len=seq, device=device, bf16_supported=True,
                          budget_bytes=budget, attention_mask=False, host_memory_bytes=256 * 2**30,
                          evaluation=EvalRequest())
    full = transformers.LlamaConfig(**shape, num_hidden_layers=32 if not dry_run else 3)
    plan = plan_memory(full, request).evaluation
    config = transformers.LlamaConfig(**shape, num_hidden_layers=layers, pad_token_id=0, eos_token_id=1)
    with tempfile.TemporaryDirectory(prefix="fulltune-eval-device-") as tmp:
        root = Path(tmp)
        word_level_tokenizer(root / "model", config.vocab_size)
        transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(root / "model")
        generator = torch.Generator().manual_seed(0)
        rows = []
        for _ in range(2 * plan["loss_batch"]):
            ids = torch.randint(2, config.vocab_size, (seq,), generator=generator).tolist()
            rows.append({"input_ids": ids, "labels": [-100] * 16 + ids[16:], "position_ids": list(range(seq)),
                         "prompt": "", "completion": "t2"})
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        options = EvalOptions(plan["loss_batch"], plan["generation_batch"], EvalRequest().max_new_tokens, device,
                              plan["generation_batch"])
        evaluate_model(str(root / "model"), str(root / "model"), rows, options,
                       load_kwargs=planned_loading(plan, device, str(root / "offload")), name="8B shape")
    batches = (plan["loss_batch"], plan["generation_batch"], 0)
    modelled = eval_memory(model_shape(config), weight_bytes=2, batches=batches, seq_len=seq,
                           max_new_tokens=EvalRequest().max_new_tokens)
    measured = int(torch.cuda.max_memory_allocated()) if device == "cuda" else None
    return {"layers": layers, "plan": plan, "modelled_peak": modelled.peak_bytes, "measured_allocated": measured,
            "error": None if measured is None else modelled.peak_bytes / measured - 1,
            "within_budget": None if measured is None else measured <= 0.95 * budget}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", default=BUDGET)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from fulltune.memory.units import format_bytes, parse_bytes

    with tempfile.TemporaryDirectory(prefix="fulltune-eval-memory-") as tmp:
        assets = make_assets(Path(tmp))
        results = {"planned": measure(assets, args.budget), "fp32": measure(assets, None)}
    budget = parse_bytes(args.budget)
    print(f"budget {format_bytes(budget)} (usable {format_bytes(int(budget * 0.95))})")
    print("| evaluate stage | dtype | loss / generation batch | planned | peak RSS | peak vs plan |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        e = r["evaluation"]
        print(f"| {name} | {e['dtype']} | {e['loss_batch']} / {e['generation_batch']} | "
              f"{format_bytes(e['device_bytes'])} | {format_bytes(r['peak_rss'])} | "
              f"{r['peak_rss'] / e['device_bytes']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
