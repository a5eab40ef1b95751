"""Peak resident memory of real CPU training runs against the memory plan's estimate.

On a CPU device the memory budget is RAM, and what must fit is the whole training process: the
Python interpreter, torch, transformers, accelerate and MLflow as imported, the model as loaded, one
training step's tensors, the checkpoints and the final save. The estimate (`estimate_memory`) counts
the step's tensors (`peak_bytes`) and adds a runtime overhead for the rest (`device_bytes`); this
script measures the rest.

For each configuration below (tiny to ~150M parameters, Llama and GPT-2 shapes built from configs,
fp32 and bf16 autocast, with and without gradient checkpointing, micro-batch 1–8, sequence 128–512)
it runs the real trainer the way fulltune does: a `TrainJob` given to `fulltune.runtime.launch.run_training`,
which starts `python -m fulltune.runtime.train` as a child process. Each run is started from a fresh wrapper
process, whose `getrusage(RUSAGE_CHILDREN).ru_maxrss` is then exactly the trainer's peak resident set
size (the wrapper itself imports neither torch nor transformers and is not counted). A run is short but
complete: 3 optimizer steps (steady state from the second: optimizer states exist), a checkpoint after
step 2, the final model save, and metrics logged into an MLflow run as a flow's training does.

The runtime overhead is then RSS − peak_bytes; it is fitted as `constant + fraction · peak_bytes` with
the estimate never below the measured RSS, and the fraction chosen so that the largest over-estimate is
smallest. The constant is checked against the import footprint measured on its own.

Usage:
    python -m benchmarks.cpu_rss --json cpu_rss.json              # all configurations (~30 min, 2 cores)
    python -m benchmarks.cpu_rss --quick                          # the three smallest (~3 min)
    python -m benchmarks.cpu_rss --only llama-7m-fp32 --json cpu_rss.json   # re-measure one, keep the rest
    python -m benchmarks.cpu_rss --no-mlflow                      # the trainer without an MLflow run
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fulltune.runtime.launch import TrainJob, job_with, run_training  # imports neither torch nor transformers

ROOT = Path(__file__).resolve().parents[1]

MIB = 2**20
# The requirement the fit is held to: the estimate's device_bytes within this of the measured peak RSS.
TOLERANCE = 0.15
STEPS = 3
CHECKPOINT_EVERY = 2


@dataclass(frozen=True)
class Case:
    """One training run: a model shape built from a config, and the settings it trains with."""

    name: str
    layout: str  # "llama" | "gpt2"
    hidden: int
    layers: int
    heads: int
    vocab: int
    seq_len: int
    micro_batch_size: int
    intermediate: int = 0  # llama only
    kv_heads: int = 0  # llama only (0: as many as heads)
    gradient_accumulation_steps: int = 1
    gradient_checkpointing: int = 0
    mixed_precision: str = "no"
    optimizer: str = "adamw"
    tied: bool = False  # llama only: the output head shares the embedding
    pure_bf16: bool = False
    optimizer_in_backward: bool = False


CASES = (
    Case("tiny-fp32", "llama", 32, 2, 4, 64, 128, 2, intermediate=64, kv_heads=2),
    Case("llama-7m-fp32", "llama", 256, 4, 4, 8192, 256, 4, intermediate=688, kv_heads=2),
    Case("llama-7m-bf16-ckpt", "llama", 256, 4, 4, 8192, 256, 4, intermediate=688, kv_heads=2,
         gradient_checkpointing=4, mixed_precision="bf16"),
    Case("llama-40m-fp32-mb8", "llama", 512, 8, 8, 16384, 256, 8, intermediate=1376, kv_heads=4),
    Case("llama-40m-fp32-ckpt-acc2", "llama", 512, 8, 8, 16384, 512, 2, intermediate=1376, kv_heads=4,
         gradient_accumulation_steps=2, gradient_checkpointing=8),
    Case("llama-40m-bf16", "llama", 512, 8, 8, 16384, 512, 2, intermediate=1376, kv_heads=4,
         mixed_precision="bf16"),  # ~9 min: bf16 autocast is slow on CPUs without AMX
    Case("gpt2-124m-fp32-mb1", "gpt2", 768, 12, 12, 50257, 128, 1),
    Case("gpt2-124m-bf16-ckpt", "gpt2", 768, 12, 12, 50257, 128, 1, gradient_checkpointing=12,
         mixed_precision="bf16"),
    Case("llama-150m-fp32-ckpt8", "llama", 768, 16, 12, 32000, 512, 4, intermediate=2048, kv_heads=4,
         gradient_checkpointing=8),
)
QUICK = ("tiny-fp32", "llama-7m-fp32", "llama-7m-bf16-ckpt")


# ---------------------------------------------------------------------------------------------------
# Assets: tokenizer, model checkpoint and packed tokenized rows, as the tokenize stage writes them


def model_config(case: Case) -> Any:
    """The transformers config of `case` (pad 0, eos 1, as the tokenizer below numbers them)."""
    import transformers

    if case.layout == "gpt2":
        return transformers.GPT2Config(n_embd=case.hidden, n_layer=case.layers, n_head=case.heads,
                                       vocab_size=case.vocab, n_positions=max(case.seq_len, 128),
                                       pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return transformers.LlamaConfig(
        vocab_size=case.vocab, hidden_size=case.hidden, intermediate_size=case.intermediate,
        num_hidden_layers=case.layers, num_attention_heads=case.heads,
        num_key_value_heads=case.kv_heads or case.heads, max_position_embeddings=max(case.seq_len, 128),
        tie_word_embeddings=case.tied, pad_token_id=0, eos_token_id=1, bos_token_id=None)


def build_tokenizer(directory: Path, vocab: int) -> None:
    """A word-level tokenizer with `vocab` entries: <pad>=0, <eos>=1, t2…"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(directory)


def build_model(directory: Path, case: Case) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(model_config(case)).save_pretrained(directory)
    build_tokenizer(directory, case.vocab)


def write_packed_rows(path: Path, rows: int, seq_len: int, vocab: int, seed: int = 0) -> float:
    """`rows` packed rows of exactly `seq_len` tokens (documents of 16..seq_len/2 tokens, positions restart
    per document, the first token of each document without a target), as fulltune.data writes them.

    Returns the planner's target fraction: the most targets in one row ÷ (seq_len − 1).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    columns: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    most = 0
    for _ in range(rows):
        ids, labels, positions = [], [], []
        while len(ids) < seq_len:
            n = min(int(rng.integers(16, max(17, seq_len // 2))), seq_len - len(ids))
            doc = rng.integers(2, vocab, size=n).tolist()
            ids += doc
            labels += [-100] + doc[1:]
            positions += list(range(n))
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns["position_ids"].append(positions)
        most = max(most, sum(1 for label in labels[1:] if label != -100))
    table = pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in columns.items()})
    pq.write_table(table, path)
    return min(1.0, most / (seq_len - 1))


def build_assets(root: Path, case: Case, steps: int = STEPS) -> tuple[Path, Path, float]:
    """(model directory, train.parquet, target fraction) for `case` under `root`."""
    model_dir, data = root / "model", root / "train.parquet"
    build_model(model_dir, case)
    rows = case.micro_batch_size * case.gradient_accumulation_steps * steps
    fraction = write_packed_rows(data, rows, case.seq_len, case.vocab)
    return model_dir, data, fraction


def settings_of(case: Case, target_fraction: float) -> Any:
    """The memory model's settings for `case` on CPU (packed rows: transformers builds a block mask)."""
    from fulltune.memory import Settings

    return Settings(micro_batch_size=case.micro_batch_size, seq_len=case.seq_len,
                    gradient_accumulation_steps=case.gradient_accumulation_steps,
                    gradient_checkpointing=case.gradient_checkpointing, mixed_precision=case.mixed_precision,
                    optimizer=case.optimizer, device="cpu", attention_mask=True, target_fraction=target_fraction,
                    pure_bf16=case.pure_bf16, optimizer_in_backward=case.optimizer_in_backward)


def make_job(case: Case, model_dir: Path, data: Path, output_dir: Path, mlflow_run: tuple[str, str] | None,
             steps: int = STEPS) -> TrainJob:
    uri, run_id = mlflow_run if mlflow_run else (None, None)
    return job_with(str(model_dir), str(data), str(output_dir), micro_batch_size=case.micro_batch_size,
                    gradient_accumulation_steps=case.gradient_accumulation_steps,
                    gradient_checkpointing=case.gradient_checkpointing, mixed_precision=case.mixed_precision,
                    optimizer=case.optimizer, pure_bf16=case.pure_bf16,
                    optimizer_in_backward=case.optimizer_in_backward, seq_len=case.seq_len, learning_rate=1e-4,
                    warmup_ratio=0.0,
                    max_steps=steps, checkpoint_every_steps=CHECKPOINT_EVERY, keep_checkpoints=1, log_every_steps=1,
                    mlflow_tracking_uri=uri, mlflow_run_id=run_id)


def mlflow_run(directory: Path) -> tuple[str, str]:
    """(tracking URI, run id) of a new run in a local SQLite store, as the flow's training logs into."""
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{directory / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    names = {e.name for e in client.search_experiments()}
    experiment = client.get_experiment_by_name("cpu-rss").experiment_id if "cpu-rss" in names else \
        client.create_experiment("cpu-rss", artifact_location=(directory / "artifacts").as_uri())
    return uri, client.create_run(experiment).info.run_id


# ---------------------------------------------------------------------------------------------------
# Measuring: a fresh wrapper process per run, so RUSAGE_CHILDREN is the trainer alone


def measure_peak_rss(job: TrainJob, omp_threads: int | None = 1) -> dict[str, Any]:
    """Run `job` through `run_training` in a fresh wrapper process; the trainer's peak RSS and more.

    Returns {"peak_rss_bytes", "setup_rss_bytes" (sampled peak before the training loop: imports and
    model loading), "seconds"}. Raises RuntimeError with the wrapper's output when training failed.
    """
    job_file = Path(job.paths.output_dir).with_suffix(".job.json")
    job_file.parent.mkdir(parents=True, exist_ok=True)
    job_file.write_text(job.to_json())
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    if omp_threads is not None:
        env["OMP_NUM_THREADS"] = str(omp_threads)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "benchmarks.cpu_rss", "--child", str(job_file)],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"training {job.paths.output_dir} failed (exit {done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def _child(job_file: str) -> int:
    """The wrapper: run the job, then print the finished trainer's peak RSS and sampled per-phase peaks."""
    import psutil

    job = TrainJob.from_json(Path(job_file).read_text())
    out = Path(job.paths.output_dir)
    samples: list[tuple[str, int]] = []
    loop_started = threading.Event()
    stop = threading.Event()

    def phase() -> str:
        """Where the trainer is, from what it has written: set-up, steps, a checkpoint, the final save."""
        if not loop_started.is_set():
            return "setup"
        if (out / "model").exists() or any(out.glob(".tmp-*")):
            return "final"
        checkpoints = out / "checkpoints"
        if checkpoints.is_dir() and any(p.name.startswith(".tmp-") for p in checkpoints.iterdir()):
            return "checkpoint"
        return "steps"

    def sample() -> None:
        me = psutil.Process()
        while not stop.is_set():
            for child in me.children(recursive=True):
                try:
                    samples.append((phase(), child.memory_info().rss))
                except (psutil.Error, OSError):
                    pass
            stop.wait(0.02)

    def on_output(line: str) -> None:
        if line.startswith("fulltune train:"):
            loop_started.set()  # the trainer prints this line just before its first step

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run_training(job, on_output=on_output)
    finally:
        stop.set()
        sampler.join()
    # The kernel's high-water mark (kilobytes on Linux). It is updated when memory is unmapped, not when
    # glibc hands pages back with madvise, so a peak released that way can be missed: the sampled RSS
    # (every 20 ms) is the other lower bound, and the peak is the larger of the two.
    maxrss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    phases = {name: max((rss for p, rss in samples if p == name), default=0)
              for name in ("setup", "steps", "checkpoint", "final")}
    print(json.dumps({"peak_rss_bytes": max(maxrss, *phases.values()), "ru_maxrss_bytes": maxrss,
                      "setup_rss_bytes": phases["setup"], "sampled_rss_bytes": phases}))
    return 0


def import_footprint(mlflow: bool) -> int:
    """Peak RSS of a process that only imports what the trainer imports (and MLflow's client and monitor)."""
    code = ("import fulltune.runtime.train\n"
            + ("import mlflow\nfrom mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor\n"
               "from mlflow.tracking import MlflowClient\n" if mlflow else "")
            + "import resource; print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                              check=True).stdout.split()[-1])


# ---------------------------------------------------------------------------------------------------
# Fitting the runtime overhead


def fit_overhead(rows: list[dict[str, Any]], tolerance: float = TOLERANCE) -> dict[str, Any]:
    """`constant + fraction · peak_bytes` ≥ RSS − peak_bytes for every row, with the largest over-estimate
    (device_bytes / RSS − 1) as small as it can be; the constant rounded up to a whole MiB.

    A grid over the fraction (0 to 50% in 0.5% steps); for each, the smallest constant that keeps every
    row's estimate at or above its RSS.
    """
    best: dict[str, Any] | None = None
    for step in range(0, 101):
        fraction = step / 200
        need = max(r["peak_rss_bytes"] - (1 + fraction) * r["peak_bytes"] for r in rows)
        constant = int(-(-need // MIB)) * MIB
        worst = max((constant + (1 + fraction) * r["peak_bytes"]) / r["peak_rss_bytes"] - 1 for r in rows)
        if best is None or worst < best["max_over"] - 1e-9:
            best = {"constant_bytes": constant, "fraction": fraction, "max_over": worst}
    assert best is not None
    best["within_tolerance"] = best["max_over"] <= tolerance
    return best


def apply_overhead(row: dict[str, Any], constant: int, fraction: float) -> int:
    return int(row["peak_bytes"] + constant + fraction * row["peak_bytes"])


# ---------------------------------------------------------------------------------------------------


def run_case(case: Case, root: Path, use_mlflow: bool, omp_threads: int | None) -> dict[str, Any]:
    from fulltune.memory import estimate_memory

    work = root / case.name
    model_dir, data, fraction = build_assets(work, case)
    settings = settings_of(case, fraction)
    estimate = estimate_memory(model_config(case), settings)
    job = make_job(case, model_dir, data, work / "run", mlflow_run(root) if use_mlflow else None)
    measured = measure_peak_rss(job, omp_threads)
    from fulltune.memory import num_parameters

    return {
        "case": case.name, **asdict(case), "params": num_parameters(model_config(case)),
        "target_fraction": round(fraction, 4),
        "peak_bytes": estimate.peak_bytes, "device_bytes": estimate.device_bytes, "peak_phase": estimate.peak_phase,
        **measured,
    }


def table(rows: list[dict[str, Any]], constant: int, fraction: float) -> str:
    head = ("| configuration | params | est. tensors | set-up RSS | peak RSS | RSS − tensors | today's estimate "
            "| vs RSS | fitted estimate | vs RSS |")
    lines = [head, "|" + "---|" * 10]
    for r in rows:
        fitted = apply_overhead(r, constant, fraction)
        lines.append(
            f"| {r['case']} | {r['params'] / 1e6:.1f}M | {r['peak_bytes'] / MIB:.0f} MiB | "
            f"{r['setup_rss_bytes'] / MIB:.0f} MiB | {r['peak_rss_bytes'] / MIB:.0f} MiB | "
            f"{(r['peak_rss_bytes'] - r['peak_bytes']) / MIB:.0f} MiB | {r['device_bytes'] / MIB:.0f} MiB | "
            f"{r['device_bytes'] / r['peak_rss_bytes'] - 1:+.1%} | {fitted / MIB:.0f} MiB | "
            f"{fitted / r['peak_rss_bytes'] - 1:+.1%} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)}")
    parser.add_argument("--only", nargs="+", help="these configurations by name")
    parser.add_argument("--no-mlflow", action="store_true", help="train without an MLflow run")
    parser.add_argument("--omp-threads", type=int, default=1, help="OMP_NUM_THREADS of the trainer (default 1)")
    parser.add_argument("--json", type=Path, help="write the rows and the fit here after every run; rows of "
                        "configurations in the file that are not measured again are kept and fitted too")
    args = parser.parse_args(argv)
    if args.child:
        return _child(args.child)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cases = [c for c in CASES if (not args.quick or c.name in QUICK) and (not args.only or c.name in args.only)]
    use_mlflow = not args.no_mlflow
    footprint = import_footprint(use_mlflow)
    rows = _earlier_rows(args.json, {c.name for c in cases})
    with tempfile.TemporaryDirectory(prefix="fulltune-cpu-rss-") as tmp:
        for case in cases:
            row = run_case(case, Path(tmp), use_mlflow, args.omp_threads)
            rows.append(row)
            print(f"{case.name}: peak RSS {row['peak_rss_bytes'] / MIB:.0f} MiB, estimated tensors "
                  f"{row['peak_bytes'] / MIB:.0f} MiB, device {row['device_bytes'] / MIB:.0f} MiB "
                  f"({row['seconds']} s)", file=sys.stderr, flush=True)
            if args.json:
                _write(args.json, rows, footprint, use_mlflow, args.omp_threads)
    order = [c.name for c in CASES]
    rows.sort(key=lambda r: order.index(r["case"]) if r["case"] in order else len(order))
    fit = fit_overhead(rows)
    print(table(rows, fit["constant_bytes"], fit["fraction"]))
    print(f"\nimport footprint (torch, transformers, accelerate, fulltune{', mlflow' if use_mlflow else ''}): "
          f"{footprint / MIB:.0f} MiB")
    print(f"fitted CPU runtime overhead: {fit['constant_bytes'] / MIB:.0f} MiB + {fit['fraction']:.1%} of the "
          f"tensor peak; largest over-estimate {fit['max_over']:.1%} (never under); "
          f"{'within' if fit['within_tolerance'] else 'NOT within'} {TOLERANCE:.0%}")
    if args.json:
        _write(args.json, rows, footprint, use_mlflow, args.omp_threads)
    return 0


def _earlier_rows(path: Path | None, measuring: set[str]) -> list[dict[str, Any]]:
    if path is None or not path.is_file():
        return []
    return [r for r in json.loads(path.read_text())["rows"] if r["case"] not in measuring]


def _write(path: Path, rows: list[dict[str, Any]], footprint: int, use_mlflow: bool, omp_threads: int) -> None:
    """The rows so far and their fit, rewritten whole (a killed run keeps what it measured)."""
    payload = {"rows": rows, "fit": fit_overhead(rows), "import_footprint_bytes": footprint, "mlflow": use_mlflow,
               "omp_threads": omp_threads}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=1))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
