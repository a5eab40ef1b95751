"""How often does the analytic planner's pick lose to a measured one, what does that cost, and what does
autotune cost to fix it?

For each planner-choice case (benchmarks/planner_choice.py: a small model built from its config, an
effective batch and a CPU budget leaving 40–90% of the naive step's tensors) this script

1. plans with `plan_memory` (the analytic ranking, no calibration) and takes the candidate set of the
   planner-choice benchmark: every configuration the planner could have picked that fits its estimate;
2. runs every candidate the way autotune does (`fulltune.planning.autotune.measure`): a TrainJob through
   `launch.run_training` in its own child process, the trainer's own step on real rows, 1 warm-up and
   `--steps` timed optimizer steps, the child's peak resident memory;
3. reports whether the analytic pick is the measured-fastest candidate that fits (within 5% counts), the
   time it loses, which candidate autotune picks (the fastest fitting one among the plan and its next
   `--candidates` − 1 alternatives), the time that pick loses, and autotune's cost: the wall time of its
   children (each child's start included);
4. reports the step-time model's error before and after calibration: each case's predictions scaled by
   the per-kind factors (`autotune.calibration`) of the *other* cases' measurements (leave one out), and
   which candidate the calibrated ranking would pick without tuning.

`--device cuda` runs GPU-sized cases on one GPU (benchmarks/device_check.py calls `gpu_check`); `--dry-run`
runs that path's code on CPU with tiny shapes.

Usage:
    python -m benchmarks.autotune                       # the 12 CPU cases (~25 min on 2 shared cores)
    python -m benchmarks.autotune --cases 1,10 --no-write
    python -m benchmarks.autotune --big                 # one case with 3–16 s steps: the tuning's wall time
    python -m benchmarks.autotune --device cuda --json gpu_autotune.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from fulltune.planning import autotune
from fulltune.runtime.launch import job_with
from fulltune.memory import Settings, estimate_memory
from fulltune.planning import configured_settings, plan_memory
from fulltune.memory.shapes import model_shape
from fulltune.memory.units import format_bytes

ROOT = Path(__file__).resolve().parents[1]

SECTION = "## Autotune"
TIE = 0.05


# --- assets: a model directory, a tokenizer and train.parquet per case ---------------------------------


def build_assets(root: Path, config: Any, rows: int, seq_len: int, mask: bool) -> tuple[str, str]:
    """(model directory with its tokenizer, train.parquet): `rows` rows of exactly `seq_len` tokens,
    packed documents (positions restart: a mask) or one document per row (no mask)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    vocab = config.vocab_size
    model_dir = root / "model"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    words = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(model_dir)
    rng = np.random.default_rng(0)
    columns: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for _ in range(rows):
        ids = rng.integers(2, vocab, size=seq_len).tolist()
        if mask:
            cut = seq_len // 2
            positions = list(range(cut)) + list(range(seq_len - cut))
            labels = [-100] + ids[1:cut] + [-100] + ids[cut + 1:]
        else:
            positions, labels = list(range(seq_len)), [-100] + ids[1:]
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns["position_ids"].append(positions)
    train = root / "train.parquet"
    pq.write_table(pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in columns.items()}), train)
    return str(model_dir), str(train)


def run_candidate(settings: Settings, model_dir: str, train_file: str, scratch: Path, opts: autotune.Options,
                  timeout: float) -> dict[str, Any]:
    """One candidate as autotune runs it: its own child, the real launch path and step."""
    job = job_with(model_dir, train_file, str(scratch / f"run-{time.time_ns()}"), **settings.to_dict())
    rows = settings.micro_batch_size * settings.gradient_accumulation_steps * settings.num_processes
    tokens = autotune._step_tokens(train_file, rows, 0, opts.warmup_steps, opts.steps)
    started = time.perf_counter()
    result = autotune.measure(job, opts, timeout, tokens)
    return {"status": result.status, "step_seconds": result.step_seconds, "peak_bytes": result.peak_bytes,
            "tokens_per_second": result.tokens_per_second, "detail": result.detail,
            "cpu_step_seconds": result.cpu_step_seconds, "child_seconds": time.perf_counter() - started}


# --- one case -----------------------------------------------------------------------------------------


def top_candidates(plan: Any, count: int) -> list[Settings]:
    """What autotune measures: the plan and its next-fastest alternatives that fit (autotune.candidates)."""
    out = [plan.settings]
    for a in plan.alternatives:
        if len(out) >= count:
            break
        if str(a["rejected_because"]).startswith("slower"):
            s = replace(plan.settings, **{k: a[k] for k in plan.settings.choices()})
            if s not in out:
                out.append(s)
    return out


def evaluate(name: str, config: Any, request: Any, all_candidates: list[Settings], opts: autotune.Options,
             count: int, timeout: float) -> dict[str, Any]:
    shape = model_shape(config)
    plan = plan_memory(config, request)
    usable = int(request.budget_bytes * (1.0 - request.headroom))
    top = top_candidates(plan, count)
    cands = list(dict.fromkeys([*top, *all_candidates]))
    rows = request.effective_batch_size * (opts.warmup_steps + opts.steps + 2)
    with tempfile.TemporaryDirectory(prefix="fulltune-autotune-bench-") as tmp:
        model_dir, train = build_assets(Path(tmp), config, rows, request.seq_len, request.attention_mask)
        measured = []
        for s in cands:
            r = run_candidate(s, model_dir, train, Path(tmp) / "scratch", opts, timeout)
            r.update(settings=s, describe=autotune.describe(s), predicted=autotune.analytic_step_seconds(shape, s),
                     estimate=estimate_memory(config, s).device_bytes, kind=autotune.step_kind(s),
                     chosen=s == plan.settings, top=s in top)
            r["fits"] = r["status"] == "measured" and r["peak_bytes"] <= usable
            measured.append(r)
            print(f"  {r['describe']:<40} {r['status']:<8} measured {r['step_seconds'] or 0:.3f} s predicted "
                  f"{r['predicted']:.4f} s peak {format_bytes(r['peak_bytes'])} child {r['child_seconds']:.0f} s"
                  + ("  <- plan" if r["chosen"] else ""), file=sys.stderr, flush=True)
    fitting = [r for r in measured if r["fits"]]
    row: dict[str, Any] = {"case": name, "params": shape.num_params, "budget": request.budget_bytes, "usable": usable,
                           "candidates": measured, "analytic": autotune.describe(plan.settings)}
    if not fitting:
        row["fastest"] = None
        return row
    fastest = min(fitting, key=lambda r: r["step_seconds"])
    chosen = next(r for r in measured if r["chosen"])
    tuned_pool = [r for r in fitting if r["top"]]
    tuned = min(tuned_pool, key=lambda r: r["step_seconds"]) if tuned_pool else chosen
    # The same by the children's CPU time: on cores shared with other jobs the steadier figure.
    cpu_fitting = [r for r in fitting if r.get("cpu_step_seconds")]
    if cpu_fitting and chosen["fits"] and chosen.get("cpu_step_seconds"):
        fastest_cpu = min(cpu_fitting, key=lambda r: r["cpu_step_seconds"])
        row["analytic_loss_cpu"] = chosen["cpu_step_seconds"] / fastest_cpu["cpu_step_seconds"] - 1
        tuned_cpu = [r for r in cpu_fitting if r["top"]]
        if tuned_cpu:
            pick = min(tuned_cpu, key=lambda r: r["cpu_step_seconds"])
            row["tuned_loss_cpu"] = pick["cpu_step_seconds"] / fastest_cpu["cpu_step_seconds"] - 1
    row.update(fastest=fastest["describe"], fastest_s=fastest["step_seconds"],
               analytic_s=chosen["step_seconds"] if chosen["fits"] else None,
               analytic_fits=chosen["fits"],
               analytic_loss=(chosen["step_seconds"] / fastest["step_seconds"] - 1) if chosen["fits"] else None,
               tuned=tuned["describe"], tuned_s=tuned["step_seconds"],
               tuned_loss=tuned["step_seconds"] / fastest["step_seconds"] - 1,
               tuning_seconds=sum(r["child_seconds"] for r in measured if r["top"]),
               tuning_candidates=len(top))
    return row


# --- calibration, leave one case out ------------------------------------------------------------------


def calibration_report(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The step-time model's error per candidate before and after calibrating on the other cases."""
    before, after, picks = [], [], []
    for i, row in enumerate(rows):
        others = [c for j, r in enumerate(rows) if j != i for c in r["candidates"]
                  if c["status"] == "measured" and c["step_seconds"]]
        ratios: dict[str, list[float]] = {}
        for c in others:
            ratios.setdefault(c["kind"], []).append(c["step_seconds"] / c["predicted"])
        factors = {k: statistics.median(v) for k, v in ratios.items()}
        every = statistics.median([c["step_seconds"] / c["predicted"] for c in others]) if others else 1.0
        measured = [c for c in row["candidates"] if c["status"] == "measured" and c["step_seconds"]]
        for c in measured:
            before.append(abs(c["predicted"] / c["step_seconds"] - 1))
            after.append(abs(c["predicted"] * factors.get(c["kind"], every) / c["step_seconds"] - 1))
        fitting = [c for c in measured if c["fits"]]
        if fitting and row.get("fastest_s"):
            pick = min(fitting, key=lambda c: c["predicted"] * factors.get(c["kind"], every))
            picks.append(pick["step_seconds"] / row["fastest_s"] - 1)
    return {"median_error_before": statistics.median(before) if before else None,
            "median_error_after": statistics.median(after) if after else None,
            "worst_error_before": max(before) if before else None, "worst_error_after": max(after) if after else None,
            "calibrated_pick_fastest": sum(p <= TIE for p in picks), "calibrated_cases": len(picks),
            "calibrated_pick_worst_loss": max(picks) if picks else None}


# --- the grid ----------------------------------------------------------------------------------------


def cpu_cases() -> list[tuple[str, Any, Any, list[Settings]]]:
    """The planner-choice cases with their budgets and candidate sets (benchmarks/planner_choice.py)."""
    import planner_choice as pc

    out = []
    for case in pc.grid():
        naive = configured_settings(case.config, pc.request_for(case, None))
        budget = pc.budget_for(case.fraction * estimate_memory(case.config, naive).peak_bytes)
        request = pc.request_for(case, budget)
        plan = plan_memory(case.config, request)
        usable = int(budget * (1.0 - pc.HEADROOM))
        out.append((case.name, case.config, request, pc.candidates(case, usable, plan.settings, plan.alternatives)))
    return out


def big_case() -> tuple[str, Any, Any, list[Settings]]:
    """A CPU case whose steps take 3–16 s here: autotune's wall time on it is the ≤ 10 minute target."""
    import transformers

    from fulltune.memory import PlanRequest

    config = transformers.LlamaConfig(hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, vocab_size=8000)
    request = PlanRequest(effective_batch_size=8, seq_len=512, mixed_precision=None, optimizer=None, device="cpu",
                          budget_bytes=4 * 2**30, attention_mask=False)
    return "llama 8L h512 V8k, 8×512, 4 GiB", config, request, []


def gpu_cases(dry_run: bool) -> list[tuple[str, Any, Any, list[Settings]]]:
    """GPU-sized cases on one device (TinyLlama-1.1B and Qwen2-0.5B shapes under a 24 GiB budget); tiny
    shapes on CPU for --dry-run."""
    import transformers

    from fulltune.memory import PlanRequest

    if dry_run:
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
        return [("dry-run llama 2L h64", config, PlanRequest(effective_batch_size=4, seq_len=32, device="cpu",
                                                             budget_bytes=2 * 2**30, attention_mask=False), [])]
    llama = transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                     num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    qwen = transformers.Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                    tie_word_embeddings=True)
    return [
        ("TinyLlama-1.1B shape, 16×2048, 24 GiB", llama,
         PlanRequest(effective_batch_size=16, seq_len=2048, device="cuda", budget_bytes=24 * 2**30,
                     bf16_supported=True, mixed_precision=None, optimizer=None, attention_mask=False), []),
        ("Qwen2-0.5B shape, 16×1024, 24 GiB", qwen,
         PlanRequest(effective_batch_size=16, seq_len=1024, device="cuda", budget_bytes=24 * 2**30,
                     bf16_supported=True, mixed_precision=None, optimizer=None, attention_mask=False), []),
    ]


def gpu_check(dry_run: bool = False, steps: int = 3, candidates: int = 3) -> dict[str, Any]:
    """The autotune check benchmarks/device_check.py runs: plan, then measure the plan's top candidates on the
    device (each in its own training child) and report the analytic pick against the measured-fastest."""
    opts = autotune.Options(mode="on", candidates=candidates, steps=steps)
    rows = [evaluate(name, config, request, extra, opts, candidates, timeout=240.0)
            for name, config, request, extra in gpu_cases(dry_run)]
    return {"rows": _plain(rows), "calibration": calibration_report(rows)}


# --- report --------------------------------------------------------------------------------------------


def _plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for row in rows:
        row = dict(row)
        row["candidates"] = [{**c, "settings": c["settings"].to_dict()} for c in row["candidates"]]
        out.append(row)
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.1%}"


def section(rows: list[dict[str, Any]], calibration: dict[str, Any], command: str, seconds: float,
            opts: autotune.Options) -> str:
    import torch
    import transformers

    done = [r for r in rows if r.get("fastest")]
    misses = [r for r in done if not (r["analytic_fits"] and r["analytic_loss"] <= TIE)]
    tuned_hits = sum(r["tuned_loss"] <= TIE for r in done)
    lines = [SECTION, "",
             "Does the analytic planner's pick run fastest on this machine, and what does autotune cost to make",
             "sure? Every candidate of the planner-choice cases (the configurations the planner could have picked",
             "that fit its estimate) runs as autotune runs it: a TrainJob through `launch.run_training` in its own",
             f"child, the trainer's own step on real rows, {opts.warmup_steps} warm-up + {opts.steps} timed optimizer "
             "steps (median), the child's peak resident memory against the usable budget. Autotune's pick is the",
             f"fastest fitting one among the plan and its next {opts.candidates - 1} alternatives; its cost is the wall "
             "time of those children, each child's start (imports, model load) included.", "",
             f"Reproduce: `{command}` (took {seconds / 60:.1f} min: {platform.machine()}, torch {torch.__version__}, "
             f"transformers {transformers.__version__}; measured {time.strftime('%Y-%m-%d')} on the 2-vCPU "
             f"development VM, shared with other jobs: load average {os.getloadavg()[0]:.1f} at the end; one OpenMP "
             "thread per child).", "",
             f"**Analytic pick not the measured-fastest fitting candidate (beyond 5%): {len(misses)} of {len(done)} "
             f"cases; autotune's pick within 5% of the fastest in {tuned_hits} of {len(done)}.**", "",
             "| case | candidates | analytic pick | its step | measured-fastest | its step | time lost (by CPU time) | "
             "autotune's pick | time lost (by CPU time) | tuning cost |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r.get("fastest"):
            lines.append(f"| {r['case']} | {len(r['candidates'])} | {r['analytic']} | - | none fits | - | - | - | - | - |")
            continue
        analytic = f"{r['analytic_s']:.3g} s" if r["analytic_s"] else "over budget"
        lines.append(f"| {r['case']} | {len(r['candidates'])} | {r['analytic']} | {analytic} | {r['fastest']} | "
                     f"{r['fastest_s']:.3g} s | {_pct(r['analytic_loss'])} ({_pct(r.get('analytic_loss_cpu'))}) | "
                     f"{r['tuned']} | {_pct(r['tuned_loss'])} ({_pct(r.get('tuned_loss_cpu'))}) | "
                     f"{r['tuning_seconds']:.0f} s ({r['tuning_candidates']} children) |")
    c = calibration
    if c["median_error_before"] is not None:
        lines += ["", "The step-time model against these measurements (|predicted / measured − 1| per candidate; "
                  "\"after\": scaled by the per-kind factors of the other cases' measurements, leave one case out, "
                  "as `autotune.calibrated` scales the planner's ranking):", "",
                  f"- before calibration: median {c['median_error_before']:.0%}, worst {c['worst_error_before']:.0%}",
                  f"- after calibration: median {c['median_error_after']:.0%}, worst {c['worst_error_after']:.0%}",
                  f"- the calibrated ranking, without tuning, picks a candidate within 5% of the measured-fastest in "
                  f"{c['calibrated_pick_fastest']} of {c['calibrated_cases']} cases (worst "
                  f"{_pct(c['calibrated_pick_worst_loss'])})"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=autotune.DEFAULT_STEPS, help="timed steps per candidate")
    parser.add_argument("--candidates", type=int, default=autotune.DEFAULT_CANDIDATES, help="autotune's candidates")
    parser.add_argument("--cases", type=str, default=None, help="comma-separated 1-based case numbers")
    parser.add_argument("--big", action="store_true", help="only the case with 3–16 s steps")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--dry-run", action="store_true", help="with --device cuda: the GPU path on CPU, tiny shapes")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per candidate")
    parser.add_argument("--threads", type=int, default=1, help="OpenMP threads per training child (1: steadier "
                        "on a shared machine)")
    parser.add_argument("--no-write", action="store_true", help="leave BENCHMARKS.md alone")
    parser.add_argument("--json", type=str, default=None, help="write every measurement here")
    args = parser.parse_args()
    opts = autotune.Options(mode="on", candidates=args.candidates, steps=args.steps)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the training children inherit it
    started = time.perf_counter()
    if args.device == "cuda":
        report = gpu_check(args.dry_run, args.steps, args.candidates)
        print(json.dumps(report, indent=1, default=str))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        return 0
    cases = [big_case()] if args.big else cpu_cases()
    if args.cases:
        cases = [cases[int(i) - 1] for i in args.cases.split(",")]
    rows = []
    for i, (name, config, request, extra) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {name}", file=sys.stderr, flush=True)
        rows.append(evaluate(name, config, request, extra, opts, args.candidates, args.timeout))
        if args.json:
            Path(args.json).write_text(json.dumps(_plain(rows), indent=1, default=str))
    seconds = time.perf_counter() - started
    command = "python -m benchmarks.autotune" + (" --big" if args.big else "")
    text = section(rows, calibration_report(rows), command, seconds, opts)
    print(text)
    if not args.no_write and not args.cases and not args.big:
        from sections import write_section

        write_section(ROOT / "BENCHMARKS.md", SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
