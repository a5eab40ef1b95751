"""Training throughput: fulltune's loop against transformers' Trainer on the same data, model and settings.

    python -m benchmarks.train_throughput              # CPU: ~1M-parameter Llama, seq ≤ 256, fp32 (~6 min; --runs 5: ~9 min)
    python -m benchmarks.train_throughput --size zipf  # CPU: 4-layer Llama h256 V8192, Zipf lengths, micro-batch 8
                                                       # (also prints what `data.packing: auto` chooses there)
    python -m benchmarks.train_throughput --gpu        # CUDA: ~1.1B Llama from a config, bf16, seq ≤ 2048
    python -m benchmarks.train_throughput --baseline DIR   # also fulltune from another checkout (A/B)

Contenders, each in a fresh process, interleaved run by run (`--runs`, default 3):

    trainer            Trainer defaults: random order, each micro-batch padded to its longest row
    trainer_grouped    Trainer with train_sampling_strategy="group_by_length" (transformers 5's name)
    fulltune           fulltune's loop on one example per row (length-grouped steps, padded micro-batches;
                       like every fulltune run, the output head only at positions with a target)
    fulltune_packed    fulltune's loop on packed rows (data.packing: true; no padding)
    baseline           with `--baseline DIR`: fulltune's loop from the checkout at DIR (e.g. an earlier release,
    baseline_packed    `git worktree add DIR <commit>`), on the same rows, interleaved with the others

All use the same variable-length prompt/completion data tokenized by `fulltune.data.tokenize_dataset`,
the same model weights, micro-batch, gradient accumulation, optimizer steps, precision and fused AdamW
(Trainer's default optimizer in transformers 5 with torch ≥ 2.8).

Metric: non-padding tokens per second of the training loop (model loading and saving excluded; the
Trainer's time runs from on_train_begin to on_train_end), median over runs; and MFU = model FLOPs
(fulltune/memory/flops.py: 6 per multiplying parameter and token + 12·L·h per attended (query, key) pair, PaLM
appendix B) per second ÷ peak. On CPU the peak is this machine's measured fp32 GEMM rate (a practical
ceiling, not a datasheet number); on GPU the datasheet dense bf16 peak (fulltune.memory.flops.GPU_PEAK_FLOPS).

On CPU every process runs one thread (`--threads`), and the loop's process CPU time is measured next to
its wall time: on a shared machine, other processes' load changes wall time from run to run, while
tokens per CPU-second stays comparable (with several OpenMP threads, an oversubscribed machine stalls
each parallel region by up to a scheduler tick, which punishes whichever contender runs at a busy moment).
Each run's whole process (start, model loading, training, saving) is measured too: its CPU time and the
tokens per whole-process CPU-second, which count what the loop's clock leaves out.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

CONTENDERS = ("trainer", "trainer_grouped", "fulltune", "fulltune_packed")
BASELINES = ("baseline", "baseline_packed")  # fulltune from another checkout (--baseline)


@dataclass(frozen=True)
class Size:
    """One benchmark configuration."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int  # model vocabulary (the BPE tokenizer uses the first `tokenizer_vocab` ids)
    tokenizer_vocab: int
    max_length: int
    examples: int
    micro_batch_size: int
    gradient_accumulation_steps: int
    steps: int | None  # optimizer steps per run; None: one epoch of the unpacked rows (every contender then
    # trains on the same length distribution, which short runs of differently ordered samplers do not)
    precision: str  # fulltune's mixed_precision; Trainer gets bf16=True for "bf16"
    lengths: str = "lognormal"  # word counts of prompts and completions: "lognormal" or "zipf" (heavier tail)
    packed_epoch: bool = False  # with steps None: the packed contenders train one epoch of the packed rows (the
    # same tokens as the others) instead of the unpacked contenders' step count on packed rows


CPU = Size(hidden=128, intermediate=352, layers=4, heads=4, kv_heads=4, vocab=1024, tokenizer_vocab=1024,
           max_length=256, examples=1200, micro_batch_size=4, gradient_accumulation_steps=2, steps=None,
           precision="no")
# A wider model with a larger vocabulary (the head is 40% of the matmul FLOPs per position) on short, Zipf-
# distributed rows (median 14 tokens, 1% over 140): small steps, where per-step costs and padding weigh most.
ZIPF = Size(hidden=256, intermediate=688, layers=4, heads=4, kv_heads=4, vocab=8192, tokenizer_vocab=1024,
            max_length=256, examples=1400, micro_batch_size=8, gradient_accumulation_steps=1, steps=None,
            precision="no", lengths="zipf", packed_epoch=True)
# TinyLlama-1.1B's shape (22 layers, hidden 2048, GQA 32/4) with a Llama-2 size vocabulary.
GPU = Size(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000, tokenizer_vocab=4096,
           max_length=2048, examples=6000, micro_batch_size=8, gradient_accumulation_steps=2, steps=40,
           precision="bf16")
SIZES = {"cpu": CPU, "zipf": ZIPF, "gpu": GPU}


# ---------------------------------------------------------------------------------------------------
# Inputs: data, tokenizer, model


def write_prompt_completion_data(path: Path, examples: int, max_length: int, seed: int = 0,
                                  lengths: str = "lognormal") -> None:
    """Synthetic prompt/completion records with long-tailed lengths: log-normal word counts, or
    3 + Zipf(1.6) words per prompt and per completion (`lengths="zipf"`), both capped at max_length / 2."""
    import numpy as np

    rng = np.random.default_rng(seed)
    syllables = ["ka", "lo", "mi", "ren", "tu", "sa", "vel", "dor", "ni", "pex", "qua", "zo", "bri", "ul", "fen"]
    words = ["".join(rng.choice(syllables, size=rng.integers(1, 4))) for _ in range(600)]
    cap = max_length // 2
    with path.open("w") as handle:
        for _ in range(examples):
            if lengths == "zipf":
                n_prompt, n_completion = (int(min(cap, 3 + rng.zipf(1.6))) for _ in range(2))
            else:
                n_prompt = int(min(cap, max(4, rng.lognormal(np.log(max_length / 8), 0.8))))
                n_completion = int(min(cap, max(4, rng.lognormal(np.log(max_length / 10), 0.9))))
            prompt = " ".join(rng.choice(words, size=n_prompt))
            completion = " ".join(rng.choice(words, size=n_completion))
            handle.write(json.dumps({"prompt": prompt, "completion": " " + completion}) + "\n")


def prepare_inputs(size: Size, workdir: Path) -> dict[str, Any]:
    """Tokenizer (fulltune's BPE), model from a config (seeded), tokenized data unpacked and packed."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from fulltune.data import tokenize_dataset
    from fulltune.spec import DataSpec, TrainTokenizer
    from fulltune.data.tokenizer import build_tokenizer

    workdir.mkdir(parents=True, exist_ok=True)
    records = workdir / "records.jsonl"
    if not records.is_file():
        write_prompt_completion_data(records, size.examples, size.max_length, lengths=size.lengths)
    model_dir = workdir / "model"
    if not (model_dir / "config.json").is_file():
        texts = (json.loads(line)["prompt"] + json.loads(line)["completion"] for line in records.open())
        tokenizer = build_tokenizer(texts, TrainTokenizer(vocab_size=size.tokenizer_vocab))
        config = LlamaConfig(vocab_size=size.vocab, hidden_size=size.hidden, intermediate_size=size.intermediate,
                             num_hidden_layers=size.layers, num_attention_heads=size.heads,
                             num_key_value_heads=size.kv_heads, max_position_embeddings=size.max_length,
                             pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                             eos_token_id=tokenizer.eos_token_id)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    tokenized = {}
    for packing in (False, True):
        spec = DataSpec(train=str(records), format="prompt_completion", max_length=size.max_length,
                        packing=packing, eval_split=0.05)
        tokenized[packing] = tokenize_dataset(spec, str(model_dir), workdir, seed=0)
    return {"model": str(model_dir), "unpacked": tokenized[False], "packed": tokenized[True]}


def auto_packing(size: Size, workdir: Path, model_dir: str, device: str) -> str:
    """What `data.packing: auto` chooses for this workload (fulltune/stages/budget.py `choose_packing`: the
    planner's predicted epoch of each layout), as a pipeline of the same data, model and batch on CPU would."""
    import yaml

    from fulltune.stages import budget, resolve_pipeline

    pipeline = {"model": {"name_or_path": model_dir},
                "data": {"train": str(workdir / "records.jsonl"), "format": "prompt_completion",
                         "max_length": size.max_length, "packing": "auto", "eval_split": 0.05},
                "train": {"effective_batch_size": size.micro_batch_size * size.gradient_accumulation_steps,
                          "micro_batch_size": size.micro_batch_size, "mixed_precision": size.precision,
                          "optimizer": "adamw"},
                "budget": {"device": device}}
    path = workdir / "auto-packing" / "pipelines.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"workdir": str(path.parent / "work"), "pipelines": {"bench": pipeline}}))
    pack, why = budget.choose_packing(resolve_pipeline(str(path), "bench"), model_dir)
    return f"data.packing: auto chooses {'packing' if pack else 'one example per row'} ({why})"


def flop_coefficients(model_dir: str) -> tuple[float, float]:
    """(FLOPs per token, FLOPs per attended pair) of fulltune/memory/flops.py, with the output head at every position,
    as a full-logits loss runs it: both loops are credited the same work."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from fulltune.memory import flops

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    coefficients = flops.from_model(model)
    return coefficients.per_token + coefficients.per_target, coefficients.per_pair


def measured_gemm_peak(seconds: float = 3.0) -> float:
    """fp32 FLOP per CPU-second of a large square matmul in this process (one thread on CPU runs)."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    torch.mm(a, b)
    rates = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        start = time.process_time()
        for _ in range(4):
            torch.mm(a, b)
        rates.append(4 * 2 * 1024**3 / max(time.process_time() - start, 1e-9))
    return statistics.median(rates)


class LoopClock:
    """Stands in for the `time` module inside fulltune.runtime.train and records process CPU time at every
    perf_counter() call: the loop's first and last calls bracket it (`started` … `seconds`)."""

    def __init__(self) -> None:
        self.cpu: list[float] = []

    def perf_counter(self) -> float:
        self.cpu.append(time.process_time())
        return time.perf_counter()

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def fulltune_worker(args: argparse.Namespace) -> None:
    """Runs inside its own process, as `python -m fulltune.runtime.train` would: prints one JSON line.

    With `--tree DIR` the engine comes from the checkout at DIR (the baseline contenders); the job is
    built here with that checkout's own API, so an earlier release's trainer runs unchanged.
    """
    if args.tree:
        sys.path.insert(0, str(Path(args.tree).resolve()))  # ahead of this checkout
    try:
        from fulltune.runtime import launch, train
    except ImportError:  # releases before the engine's folders (7e7b1f8 and earlier): fulltune/train.py
        from fulltune import launch, train  # type: ignore[no-redef]
    # The module whose clock times the loop: train_metrics since the loop's counters left train.py.
    timed = sys.modules.get("fulltune.runtime.train_metrics", train)

    if args.tree:
        assert Path(train.__file__).resolve().is_relative_to(Path(args.tree).resolve()), train.__file__
    size = dataclasses.replace(SIZES[args.size], steps=args.steps)
    settings = {"micro_batch_size": size.micro_batch_size, "gradient_accumulation_steps": size.gradient_accumulation_steps,
                "max_steps": size.steps, "learning_rate": 1e-4, "warmup_ratio": 0.0, "mixed_precision": size.precision,
                "checkpoint_every_steps": 0, "log_every_steps": 10, "device": "cuda" if args.gpu else "cpu"}
    if hasattr(launch, "job_with"):
        job = launch.job_with(args.model, args.train_file, args.out, **settings)
        seed = job.train.seed
    else:  # releases before the sectioned TrainJob (fd45365 and earlier) take its flat fields
        job = launch.TrainJob(model_path=args.model, tokenizer_path=args.model, train_file=args.train_file,
                              output_dir=args.out, **settings)
        seed = job.seed
    clock = LoopClock()
    timed.time = clock  # measurement only: the loop's code is unchanged
    result = train.train(job)
    rows = train.TokenizedRows(args.train_file)
    schedule = train.StepSchedule(rows.lengths, size.micro_batch_size * size.gradient_accumulation_steps, seed)
    pairs = sum(float(rows.attention_pairs[schedule.step_rows(s)].sum()) for s in range(result.steps))
    print(json.dumps({"tokens": result.tokens, "seconds": result.seconds, "cpu_seconds": clock.cpu[-1] - clock.cpu[0],
                      "pairs": pairs}))


def trainer_worker(args: argparse.Namespace) -> None:
    """Runs inside its own process: Trainer on the unpacked rows; prints one JSON line."""
    import datasets
    import torch
    from transformers import (AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, Trainer, TrainerCallback,
                              TrainingArguments)

    size = dataclasses.replace(SIZES[args.size], steps=args.steps)
    table = datasets.Dataset.from_parquet(args.train_file).remove_columns(["position_ids"])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa")
    pad_collate = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    seen = {"tokens": 0, "pairs": 0.0}

    def collate(features: list[dict[str, Any]]) -> dict[str, Any]:
        batch = pad_collate(features)
        lengths = batch["attention_mask"].sum(dim=1).double()
        seen["tokens"] += int(lengths.sum())
        seen["pairs"] += float((lengths**2).sum())
        return batch

    clock: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_train_begin(self, *_: Any, **__: Any) -> None:
            clock["start"], clock["cpu_start"] = time.perf_counter(), time.process_time()

        def on_train_end(self, *_: Any, **__: Any) -> None:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            clock["end"], clock["cpu_end"] = time.perf_counter(), time.process_time()

    training_args = TrainingArguments(
        output_dir=args.out, per_device_train_batch_size=size.micro_batch_size,
        gradient_accumulation_steps=size.gradient_accumulation_steps, max_steps=size.steps, learning_rate=1e-4,
        train_sampling_strategy=args.sampling, bf16=size.precision == "bf16", use_cpu=not args.gpu,
        save_strategy="no", eval_strategy="no", report_to="none", seed=0, disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=training_args, train_dataset=table, data_collator=collate, callbacks=[Clock()])
    trainer.train()
    print(json.dumps({"tokens": seen["tokens"], "seconds": clock["end"] - clock["start"],
                      "cpu_seconds": clock["cpu_end"] - clock["cpu_start"], "pairs": seen["pairs"]}))


def run_contender(name: str, inputs: dict[str, Any], size: Size, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """One run of one contender in a fresh process; returns its JSON line, plus the whole process's wall and
    CPU time (start, imports, model loading, training, saving)."""
    env = dict(os.environ)
    if not args.gpu:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    steps = size.steps
    if name.endswith("_packed") and size.packed_epoch and args.steps is None:
        steps = inputs["packed"].num_train_rows // (size.micro_batch_size * size.gradient_accumulation_steps)
    common = ["--size", args.size, "--model", inputs["model"], "--out", str(out), "--steps", str(steps)]
    if name.startswith("trainer"):
        command = ["--worker", "trainer", "--train-file", inputs["unpacked"].train_file,
                   "--sampling", "group_by_length" if name == "trainer_grouped" else "random", *common]
    else:
        data = inputs["packed" if name.endswith("_packed") else "unpacked"]
        command = ["--worker", "fulltune", "--train-file", data.train_file, *common,
                   *(["--tree", str(Path(args.baseline).resolve())] if name in BASELINES else [])]
    command = [sys.executable, "-m", "benchmarks.train_throughput", *command, *(["--gpu"] if args.gpu else [])]
    before, started = os.times(), time.perf_counter()
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, check=False, env=env)
    after = os.times()
    if done.returncode != 0:
        raise RuntimeError(f"{name} failed:\n{done.stderr[-3000:]}")
    numbers = json.loads(done.stdout.strip().splitlines()[-1])
    numbers["process_seconds"] = time.perf_counter() - started
    numbers["process_cpu_seconds"] = (after.children_user - before.children_user
                                      + after.children_system - before.children_system)
    return numbers


# ---------------------------------------------------------------------------------------------------
# Main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the ~1.1B bf16 variant on CUDA (same as --size gpu)")
    parser.add_argument("--size", choices=SIZES, default=None, help="model and data (default: cpu, or gpu with --gpu)")
    parser.add_argument("--baseline", default=None, metavar="DIR",
                        help="also run fulltune from the checkout at DIR (contenders baseline, baseline_packed)")
    parser.add_argument("--runs", type=int, default=3, help="runs per contender (interleaved)")
    parser.add_argument("--workdir", default=None, help="where data, model and runs go (default: a temp dir)")
    parser.add_argument("--contenders", nargs="*", default=None, choices=CONTENDERS + BASELINES,
                        help="default: all four, and both baselines with --baseline")
    parser.add_argument("--json", default=None, help="also write every run's numbers to this file")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default: the size's)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads per training process (CPU only)")
    parser.add_argument("--worker", choices=("trainer", "fulltune"), help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--train-file", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--sampling", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.size = args.size or ("gpu" if args.gpu else "cpu")
    args.gpu = args.size == "gpu"
    if args.worker:
        (trainer_worker if args.worker == "trainer" else fulltune_worker)(args)
        return

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.contenders is None:
        args.contenders = list(CONTENDERS) + (list(BASELINES) if args.baseline else [])
    if args.baseline is None and set(args.contenders) & set(BASELINES):
        parser.error("the baseline contenders need --baseline DIR")
    size = SIZES[args.size]
    if args.steps:
        size = dataclasses.replace(size, steps=args.steps)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="fulltune-bench-")).resolve()  # the runs start in REPO
    inputs = prepare_inputs(size, workdir)
    if size.steps is None:
        rows_per_step = size.micro_batch_size * size.gradient_accumulation_steps
        size = dataclasses.replace(size, steps=inputs["unpacked"].num_train_rows // rows_per_step)
    per_token, per_pair = flop_coefficients(inputs["model"])
    if args.gpu:
        import torch

        from fulltune.memory.flops import peak_flops

        name = torch.cuda.get_device_name()
        peak, peak_label = peak_flops(name), f"{name} dense bf16 datasheet"
    else:
        import torch

        torch.set_num_threads(args.threads)
        peak, peak_label = measured_gemm_peak(), f"measured fp32 GEMM FLOP per CPU-second, {args.threads} thread(s)"
    unpacked = inputs["unpacked"]
    packed_steps = ""
    if size.packed_epoch and args.steps is None:
        packed_steps = (f" ({inputs['packed'].num_train_rows // (size.micro_batch_size * size.gradient_accumulation_steps)}"
                        " on the packed rows)")
    print(auto_packing(size, workdir, inputs["model"], "cuda" if args.gpu else "cpu"), flush=True)
    print(f"workdir {workdir}; {unpacked.num_train_rows} unpacked rows ({unpacked.train_label_tokens / unpacked.train_tokens:.0%} "
          f"of their tokens have a target), {inputs['packed'].num_train_rows} packed rows; {size.steps} steps of {size.micro_batch_size} × {size.gradient_accumulation_steps} rows{packed_steps}; peak {peak / 1e9 if peak else float('nan'):.1f} GFLOP/s ({peak_label}); "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in args.contenders}
    for attempt in range(args.runs):
        for name in args.contenders:
            numbers = run_contender(name, inputs, size, args, workdir / "runs" / f"{name}-{attempt}")
            numbers["tokens_per_second"] = numbers["tokens"] / numbers["seconds"]
            numbers["tokens_per_cpu_second"] = numbers["tokens"] / numbers["cpu_seconds"]
            numbers["tokens_per_process_cpu_second"] = numbers["tokens"] / numbers["process_cpu_seconds"]
            flops = per_token * numbers["tokens"] + per_pair * numbers["pairs"]
            # MFU against CPU time on CPU (the peak is per CPU-second too), against wall time on GPU.
            numbers["mfu"] = flops / numbers["seconds" if args.gpu else "cpu_seconds"] / peak if peak else float("nan")
            runs[name].append(numbers)
            print(f"run {attempt + 1} {name:16s} {numbers['tokens_per_second']:8.0f} tokens/s "
                  f"{numbers['tokens_per_cpu_second']:8.0f} tokens/CPU-s  {numbers['tokens']:7d} tokens in "
                  f"{numbers['seconds']:6.1f} s ({numbers['cpu_seconds']:6.1f} CPU-s)  MFU {numbers['mfu']:.1%}  "
                  f"whole process {numbers['process_seconds']:6.1f} s ({numbers['process_cpu_seconds']:6.1f} CPU-s)",
                  flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    print(f"\nload average after: {os.getloadavg()[0]:.1f}\n")
    print("| contender | tokens/s (median) | min – max | × Trainer default | × Trainer group_by_length | "
          "tokens/CPU-s (median) | × Trainer default | × Trainer group_by_length | "
          "tokens per whole-process CPU-s | × Trainer default | × Trainer group_by_length | MFU (median) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, results in runs.items():
        cells = []
        for key in ("tokens_per_second", "tokens_per_cpu_second", "tokens_per_process_cpu_second"):
            rates = [r[key] for r in results]
            cells.append(f"{median(name, key):,.0f} | {min(rates):,.0f} – {max(rates):,.0f}" if key == "tokens_per_second"
                         else f"{median(name, key):,.0f}")
            cells += [f"{median(name, key) / median(base, key):.2f}×" if base in runs else "–"
                      for base in ("trainer", "trainer_grouped")]
        print(f"| {name} | {' | '.join(cells)} | {median(name, 'mfu'):.1%} |")
    # A/B against the baseline checkout: run by run (the runs of a round are minutes apart, not hours).
    for new, old in (("fulltune", "baseline"), ("fulltune_packed", "baseline_packed")):
        if new in runs and old in runs:
            for key in ("tokens_per_cpu_second", "tokens_per_process_cpu_second"):
                ratios = [a[key] / b[key] for a, b in zip(runs[new], runs[old])]
                print(f"{new} / {old}, {key}: median {statistics.median(ratios):.3f} "
                      f"(runs {', '.join(f'{r:.3f}' for r in ratios)})")
    if args.json:
        Path(args.json).write_text(json.dumps({"size": size.__dict__, "peak": peak, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
