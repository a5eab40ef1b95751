"""The memory runs the CPU memory tests and benchmarks share: the models, rows and jobs they train, and the
evaluate stage they measure. What is measured, and how, is `measuring.measure`'s.

The evaluate stage's measured process is `python -m measuring.memory_runs eval JOB.json`, run from the root.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulltune.runtime.launch import TrainJob, job_with  # imports neither torch nor transformers

ROOT = Path(__file__).resolve().parents[1]

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
# Rows as the tokenize stage writes them, at a scale (benchmarks/data_memory.py, tests/test_data_memory.py)

ROWS_SEQ_LEN = 128
ROWS_STEPS = 2
TINY = Case("tiny-fp32", "llama", 32, 2, 4, 64, 128, 2, intermediate=64, kv_heads=2)


def write_train_files(root: Path, tokens: int, seq_len: int = ROWS_SEQ_LEN, vocab: int = 64,
                      seed: int = 0) -> dict[str, Path]:
    """train.parquet and train.arrow of about `tokens` tokens, as the tokenize stage writes them (packed rows
    of at most `seq_len`; documents of 16–64 tokens, the first token of each without a label)."""
    import numpy as np
    import pyarrow as pa

    from fulltune.data.store import _write_rows

    rng = np.random.default_rng(seed)
    lengths = rng.integers(16, 65, size=max(1, tokens // 40))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    ids = rng.integers(2, vocab, size=int(offsets[-1]), dtype=np.int32)
    labels = ids.copy()
    labels[offsets[:-1]] = -100
    examples = pa.table({"input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
                         "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels))})
    root.mkdir(parents=True, exist_ok=True)
    files = {"parquet": root / "train.parquet", "arrow": root / "train.arrow"}
    _write_rows(files["parquet"], examples, np.arange(len(lengths)), packing=True, max_length=seq_len,
                with_text=False, mapped=files["arrow"])
    return files


def build_tiny_model(root: Path) -> Path:
    """The tiny Llama (`TINY`, benchmarks/cpu_rss.py's `tiny-fp32`) and its tokenizer under `root`."""
    model_dir = root / "model"
    if not model_dir.is_dir():
        build_model(model_dir, TINY)
    return model_dir


def rows_job(model_dir: Path, train_file: Path, output_dir: Path, ranks: int = 1) -> TrainJob:
    """`ROWS_STEPS` steps of micro-batch 2 on `train_file`, over `ranks` DDP processes."""
    fields: dict[str, Any] = {"num_processes": ranks, "strategy": "ddp"} if ranks > 1 else {}
    return job_with(str(model_dir), str(train_file), str(output_dir), micro_batch_size=2, seq_len=ROWS_SEQ_LEN,
                    learning_rate=1e-4, warmup_ratio=0.0, max_steps=ROWS_STEPS, checkpoint_every_steps=0,
                    log_every_steps=1, **fields)


# ---------------------------------------------------------------------------------------------------
# The whole process, phase by phase (benchmarks/process_memory.py, tests/test_process_memory.py)

# The frontier case of the memory levers on CPU: a 76M-parameter Llama planned under `budget.memory: 1GiB`
# (effective batch 4, seq 128): pure bf16 + Adafactor + optimizer step in backward + 11 of 12 layers
# checkpointed. The 6.5M cases are the same family with 4 layers and hidden 384, for quick checks.
PROCESS_CASES = {
    "llama-76m-frontier": Case("llama-76m-frontier", "llama", 768, 12, 12, 512, 128, 4, intermediate=2048,
                               kv_heads=4, tied=True, gradient_checkpointing=11, mixed_precision="bf16",
                               optimizer="adafactor", pure_bf16=True, optimizer_in_backward=True),
    "llama-76m-fp32-adafactor": Case("llama-76m-fp32-adafactor", "llama", 768, 12, 12, 512, 128, 4,
                                     intermediate=2048, kv_heads=4, tied=True, gradient_checkpointing=11,
                                     optimizer="adafactor", optimizer_in_backward=True),
    "llama-76m-amp-adafactor": Case("llama-76m-amp-adafactor", "llama", 768, 12, 12, 512, 128, 4,
                                    intermediate=2048, kv_heads=4, tied=True, gradient_checkpointing=11,
                                    mixed_precision="bf16", optimizer="adafactor", optimizer_in_backward=True),
    "llama-6m-frontier": Case("llama-6m-frontier", "llama", 384, 4, 6, 512, 128, 4, intermediate=1024,
                              kv_heads=2, tied=True, gradient_checkpointing=3, mixed_precision="bf16",
                              optimizer="adafactor", pure_bf16=True, optimizer_in_backward=True),
    "llama-6m-fp32": Case("llama-6m-fp32", "llama", 384, 4, 6, 512, 128, 4, intermediate=1024,
                          kv_heads=2, tied=True),
}


def measure_phases(case: Case, root: Path, omp_threads: int = 1) -> dict[str, Any]:
    """The case's assets, its job (2 steps, a checkpoint after the first, MLflow on) and its per-phase peaks
    (`measuring.measure`'s `phases`), with the rows' target fraction."""
    from measuring import measure

    model_dir, data, fraction = build_assets(root, case, steps=2)
    job = make_job(case, model_dir, data, root / "run", mlflow_run(root), steps=2)
    measured = measure.training_memory("phases", job.replace(checkpoint_every_steps=1), omp_threads)
    measured["target_fraction"] = fraction
    return measured


def estimated_phases(case: Case, target_fraction: float) -> dict[str, Any]:
    """The memory model's whole-process estimate of `case`: its peak, the steady step's and every phase."""
    from fulltune.memory import estimate_memory

    estimate = estimate_memory(model_config(case), settings_of(case, target_fraction))
    return {"device_bytes": estimate.device_bytes, "step_device_bytes": estimate.step_device_bytes,
            "phases": dict(estimate.phases), "peak_phase": estimate.process_peak_phase}


# ---------------------------------------------------------------------------------------------------
# The evaluate stage (benchmarks/eval_memory.py, tests/test_process_memory.py)

VOCAB, HIDDEN, LAYERS, ROWS, LENGTH, PROMPT = 32000, 256, 4, 64, 128, 8
BATCH, GENERATE, NEW_TOKENS = 32, 16, 8
BUDGET = "1.25GiB"
# The run that made the fine-tuned model: pure bf16 (its export is bf16), planned on a CPU device.
TRAINED = {"micro_batch_size": 1, "seq_len": LENGTH, "gradient_checkpointing": 0, "mixed_precision": "bf16",
           "optimizer": "adamw", "pure_bf16": True, "device": "cpu"}


def eval_config() -> Any:
    """The evaluated model's config: a 19M Llama with a 32k vocabulary."""
    from tests.tiny import tiny_config

    return tiny_config("llama", VOCAB, hidden_size=HIDDEN, intermediate_size=688, num_hidden_layers=LAYERS,
                       num_attention_heads=4, max_position_embeddings=2 * LENGTH, pad_token_id=0, eos_token_id=1)


def eval_assets(root: Path, rows: int = ROWS) -> dict[str, Any]:
    """The base model (fp32), the fine-tuned model (its bf16 export), a word-level tokenizer and `rows` rows
    (the configured fp32 batch of 32 needs `ROWS`; a planned batch needs only a full batch or two)."""
    import random

    import torch
    from transformers import LlamaForCausalLM

    from tests.tiny import word_level_tokenizer

    tokenizer = root / "tokenizer"
    word_level_tokenizer(tokenizer, VOCAB)
    torch.manual_seed(0)
    model = LlamaForCausalLM(eval_config())
    model.save_pretrained(root / "base", safe_serialization=True)
    model.to(torch.bfloat16).save_pretrained(root / "tuned", safe_serialization=True)
    for name in ("base", "tuned"):
        for item in tokenizer.iterdir():
            (root / name / item.name).write_bytes(item.read_bytes())
    rng = random.Random(0)
    made = []
    for _ in range(rows):
        ids = [rng.randrange(2, VOCAB) for _ in range(LENGTH)]
        made.append({"input_ids": ids, "labels": [-100] * PROMPT + ids[PROMPT:], "position_ids": list(range(LENGTH)),
                     "prompt": " ".join(f"t{i}" for i in ids[:PROMPT]),
                     "completion": " ".join(f"t{i}" for i in ids[PROMPT:PROMPT + NEW_TOKENS])})
    (root / "rows.json").write_text(json.dumps(made))
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
    return plan_evaluation(model_shape(eval_config()), Settings(**TRAINED), request, usable).to_dict()


def measure_evaluation(assets: dict[str, Any], budget: str | None) -> dict[str, Any]:
    """Peak RSS of the evaluate stage in a fresh process: planned for `budget`, or fp32 as configured (None)."""
    evaluation = evaluation_plan(budget)
    job = Path(assets["root"]) / f"job-{'planned' if budget else 'fp32'}.json"
    job.write_text(json.dumps({**assets, "evaluation": evaluation, "planned": budget is not None}))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "measuring.memory_runs", "eval", str(job)], env=env, cwd=ROOT,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-4000:])
    return {"evaluation": evaluation, **json.loads(done.stdout.strip().splitlines()[-1])}


def _evaluate(job_file: str) -> int:
    """Evaluate both candidates as the evaluate stage does; print one JSON line of the peak RSS."""
    from measuring.measure import Sampler, high_water_bytes, resident_bytes

    peak = [0]

    def sample() -> None:
        peak[0] = max(peak[0], resident_bytes())

    sampler = Sampler(sample, 0.005).start()
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
    sampler.stop()
    print(json.dumps({"peak_rss": max(peak[0], high_water_bytes()), "hwm": high_water_bytes(), "eval_loss": metrics}))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "eval":
        sys.exit("usage: python -m measuring.memory_runs eval JOB.json")
    sys.exit(_evaluate(sys.argv[2]))
