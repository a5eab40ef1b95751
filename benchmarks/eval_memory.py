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
(`device_bytes`, the runtime overhead included) and the budget.

Usage:
    python -m benchmarks.eval_memory                     # both ways, ~1 min on 2 cores
    python -m benchmarks.eval_memory --budget 1.25GiB --json eval.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

VOCAB, HIDDEN, LAYERS, ROWS, LENGTH, PROMPT = 32000, 256, 4, 64, 128, 8
BATCH, GENERATE, NEW_TOKENS = 32, 16, 8
BUDGET = "1.25GiB"
# The run that made the fine-tuned model: pure bf16 (its export is bf16), planned on a CPU device.
TRAINED = {"micro_batch_size": 1, "seq_len": LENGTH, "gradient_checkpointing": 0, "mixed_precision": "bf16",
           "optimizer": "adamw", "pure_bf16": True, "device": "cpu"}


def config() -> Any:
    from tests.tiny import tiny_config

    return tiny_config("llama", VOCAB, hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=LAYERS,
                       num_attention_heads=4, max_position_embeddings=2 * LENGTH, pad_token_id=0, eos_token_id=1)


def make_assets(root: Path) -> dict[str, Any]:
    """The base model (fp32), the fine-tuned model (its bf16 export), a word-level tokenizer and the rows."""
    import random

    import torch
    from transformers import LlamaForCausalLM

    from tests.tiny import word_level_tokenizer

    tokenizer = root / "tokenizer"
    word_level_tokenizer(tokenizer, VOCAB)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    model.save_pretrained(root / "base", safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(root / "tuned", safe_serialization=True)
    for name in ("base", "tuned"):
        for item in tokenizer.iterdir():
            (root / name / item.name).write_bytes(item.read_bytes())
    rng = random.Random(0)
    rows = []
    for _ in range(ROWS):
        ids = [rng.randrange(2, VOCAB) for _ in range(LENGTH)]
        rows.append({"input_ids": ids, "labels": [-100] * PROMPT + ids[PROMPT:], "position_ids": list(range(LENGTH)),
                     "prompt": " ".join(f"t{i}" for i in ids[:PROMPT]),
                     "completion": " ".join(f"t{i}" for i in ids[PROMPT:PROMPT + NEW_TOKENS])})
    (root / "rows.json").write_text(json.dumps(rows))
    return {"root": str(root), "rows": str(root / "rows.json")}


def evaluation_plan(budget: str | None) -> dict[str, Any]:
    """The plan's evaluate stage for the trained run (memory/evaluation.py), fitted to `budget` (None: as
    configured)."""
    from fulltune.memory import Settings
    from fulltune.memory.budget import usable_bytes
    from fulltune.memory.evaluation import EvalRequest, plan_evaluation
    from fulltune.memory.shapes import model_shape
    from fulltune.memory.units import parse_bytes

    usable = usable_bytes(parse_bytes(budget), 0.05) if budget else None
    request = EvalRequest(batch_size=BATCH, seq_len=LENGTH, max_new_tokens=NEW_TOKENS,
                          precision="trained" if budget else "fp32")
    return plan_evaluation(model_shape(config()), Settings(**TRAINED), request, usable).to_dict()


def _child(job_file: str) -> int:
    """Evaluate both candidates as the evaluate stage does; print one JSON line of the peak RSS."""
    from benchmarks.process_memory import _hwm, _rss

    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            stop.wait(0.005)

    threading.Thread(target=sample, daemon=True).start()
    import mlflow  # noqa: F401  (the flow process holds Prefect and MLflow: the evaluate stage runs in it)
    import prefect  # noqa: F401

    from fulltune.evaluation.evaluate import EvalOptions, evaluate_model, planned_loading

    job = json.loads(Path(job_file).read_text())
    evaluation, root = job["evaluation"], Path(job["root"])
    rows = json.loads(Path(job["rows"]).read_text())
    load = planned_loading(evaluation if job["planned"] else None, "cpu", str(root / "offload"))
    metrics = {}
    for name in ("base", "tuned"):
        options = EvalOptions(evaluation["loss_batch"], GENERATE, NEW_TOKENS, "cpu",
                              evaluation["generation_batch"] or None)
        metrics[name] = evaluate_model(str(root / name), str(root / name), rows, options, load_kwargs=load,
                                       name=name).eval_loss
    stop.set()
    print(json.dumps({"peak_rss": max(peak[0], _hwm()), "hwm": _hwm(), "eval_loss": metrics}))
    return 0


def measure(assets: dict[str, Any], budget: str | None) -> dict[str, Any]:
    """Peak RSS of the evaluate stage in a fresh process: planned for `budget`, or fp32 as configured (None)."""
    evaluation = evaluation_plan(budget)
    job = Path(assets["root"]) / f"job-{'planned' if budget else 'fp32'}.json"
    job.write_text(json.dumps({**assets, "evaluation": evaluation, "planned": budget is not None}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "benchmarks.eval_memory", "--child", str(job)], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return {"evaluation": evaluation, **json.loads(done.stdout.strip().splitlines()[-1])}


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
    parser.add_argument("--child")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
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
