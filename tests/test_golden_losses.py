"""Pinned losses: a few optimizer steps of a seeded tiny model per family, against numbers written here.

Every other training test is differential (levers against the plain step, resumed against uninterrupted,
the trainer against a hand-written step); a change that shifts every run the same way — the loss
normalisation, the learning-rate schedule, clipping, the data order, how targets are masked — passes
them all. These runs go through the engine's real loop (`fulltune.runtime.train.train` on a `TrainJob`), on CPU,
and compare, per step, what a user reads of the run — the mean token loss (result.json) and the gradient
norm and learning rate (the MLflow metrics) — and how far the weights moved with the numbers pinned below.

Nothing here depends on transformers' initialisation or numpy's random streams: the weights are set from
one seeded torch generator, the rows are written by formula. What the numbers do depend on is the engine
and the numerics of torch's CPU kernels. A deliberate change of behaviour (another data order, schedule or
normalisation) changes them: print the new ones with `.venv/bin/python tests/test_golden_losses.py`, and
say in the commit why they moved.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest

from tiny import tiny_config, word_level_tokenizer

VOCAB = 64
ROWS = 16
# micro 2 × accumulation 1, 5 steps: 2 of linear warmup (the first at learning rate 0), then cosine decay;
# every step's gradient norm is above max_grad_norm, so clipping acts on each update.
STEPS = 5
JOB = dict(micro_batch_size=2, gradient_accumulation_steps=1, learning_rate=1e-2, warmup_ratio=0.4,
           lr_scheduler="cosine", max_grad_norm=1.0, weight_decay=0.01, max_steps=STEPS, checkpoint_every_steps=0,
           log_every_steps=1, seed=0)


@dataclass(frozen=True)
class Golden:
    """What one run is pinned to."""

    losses: list[float]  # result.json's loss_history: each step's mean token loss
    grad_norms: list[float]  # MLflow `grad_norm`: each step's gradient norm before clipping
    learning_rates: list[float]  # MLflow `learning_rate` logged after each step: the next step's rate
    moved: float  # L2 norm of (exported weights − initial weights), all parameters


GOLDEN: dict[str, Golden] = {
    "llama": Golden(losses=[4.1191673, 4.058394, 4.1179881, 4.1016943, 4.1296487],
                    grad_norms=[2.9152083, 5.5637202, 6.0937529, 5.4007015, 4.7546482],
                    learning_rates=[0.005, 0.01, 0.0075, 0.0025, 0.0], moved=1.9891815),
    "gpt2": Golden(losses=[4.3500394, 4.1429744, 4.6005993, 4.5327537, 4.4663305],
                   grad_norms=[3.2213554, 4.8901072, 4.3682976, 1.8607296, 3.0561249],
                   learning_rates=[0.005, 0.01, 0.0075, 0.0025, 0.0], moved=2.2520727),
    "gpt_neox": Golden(losses=[4.3356431, 4.1861982, 4.4351945, 4.1546052, 3.882766],
                       grad_norms=[2.7061338, 5.0193176, 5.0414476, 2.6501904, 4.0385599],
                       learning_rates=[0.005, 0.01, 0.0075, 0.0025, 0.0], moved=1.9329594),
    "qwen2_tied": Golden(losses=[4.3583423, 4.2656837, 4.27597, 4.2647639, 4.4553375],
                         grad_norms=[3.2874925, 4.848341, 4.1097813, 3.4674428, 5.9832516],
                         learning_rates=[0.005, 0.01, 0.0075, 0.0025, 0.0], moved=1.9338383),
    "llama_bf16": Golden(losses=[4.1189769, 4.0596924, 4.117435, 4.1034733, 4.1291666],
                         grad_norms=[2.9164774, 5.5642047, 6.0576835, 5.4031115, 4.7744641],
                         learning_rates=[0.005, 0.01, 0.0075, 0.0025, 0.0], moved=1.989049),
    # The same rows per step as "llama", one per micro-batch: the same numbers, to fp32 rounding.
    "llama_accumulation_2": Golden(losses=[4.119167, 4.058394, 4.1179881, 4.1016943, 4.1296492],
                                   grad_norms=[2.9152083, 5.5637207, 6.0937524, 5.400702, 4.7546492],
                                   learning_rates=[0.005, 0.01, 0.0075, 0.0025, 0.0], moved=1.9891815),
}


# The model families pinned here, as tests/tiny.py's tiny configs: the family and its fields beyond the shape.
FAMILY: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "qwen2_tied": ("qwen2", {"tie_word_embeddings": True}),  # the output head is the input embedding
}


def model_config(family: str) -> Any:
    """A 2-layer, hidden-32 config of `family`, dropout off (the numbers then do not depend on RNG order)."""
    base, fields = FAMILY[family]
    return tiny_config(base, VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=None, **fields)


def build_model(directory: Path, family: str) -> None:
    """Save a `family` checkpoint whose matrices come from one seeded generator, in parameter-name order.

    Vectors (norm weights, biases) keep their constant initial values (ones, zeros).
    """
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(model_config(family))
    generator = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for _, parameter in sorted(model.named_parameters()):  # tied weights are listed once
            if parameter.dim() >= 2:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    model.save_pretrained(directory)
    word_level_tokenizer(directory, VOCAB)


def write_rows(path: Path) -> None:
    """ROWS tokenized rows of 1–2 packed documents `s, s+1, …` (as fulltune.data writes them: the first
    token of each document is not a target, positions restart), lengths 5–22, so micro-batches pad."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "position_ids": []}
    for row in range(ROWS):
        ids: list[int] = []
        labels: list[int] = []
        positions: list[int] = []
        for doc in range(1 + row % 2):
            n, start = 5 + (7 * row + 3 * doc) % 7, 2 + (13 * row + 29 * doc) % (VOCAB - 2)
            tokens = [2 + (start - 2 + k) % (VOCAB - 2) for k in range(n)]
            ids += tokens
            labels += [-100] + tokens[1:]
            positions += list(range(n))
        columns["input_ids"].append(ids)
        columns["labels"].append(labels)
        columns["position_ids"].append(positions)
    pq.write_table(pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in columns.items()}), path)


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "gpt2": ("gpt2", {}),
    "gpt_neox": ("gpt_neox", {}),
    "qwen2_tied": ("qwen2_tied", {}),
    "llama_bf16": ("llama", {"mixed_precision": "bf16"}),
    "llama_accumulation_2": ("llama", {"micro_batch_size": 1, "gradient_accumulation_steps": 2}),
}


def train_case(case: str, root: Path) -> Golden:
    """Train `case` in this process on one CPU thread; returns what the run measured."""
    import torch
    from accelerate.state import AcceleratorState
    from safetensors.torch import load_file

    from fulltune.runtime import train as trainer
    from fulltune.runtime import train_metrics
    from fulltune.runtime.launch import job_with

    family, fields = CASES[case]
    model_dir, data = root / family, root / "train.parquet"
    if not model_dir.exists():
        build_model(model_dir, family)
    if not data.exists():
        write_rows(data)
    job = job_with(str(model_dir), str(data), str(root / "runs" / case), **{**JOB, **fields})
    logged: list[dict[str, float]] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the numbers must not depend on how many cores the machine has
    # The metrics the trainer writes for MLflow (metrics.jsonl), taken at the sink.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(train_metrics.MetricsFile, "log", lambda self, step, values: logged.append({"step": step, **values}))
        try:
            result = trainer.train(job)
        finally:
            torch.set_num_threads(threads)
            AcceleratorState._reset_state(reset_partial_state=True)
    before, after = load_file(str(model_dir / "model.safetensors")), load_file(f"{result.model_dir}/model.safetensors")
    assert before.keys() == after.keys()
    assert [step for step, _ in result.loss_history] == [m["step"] for m in logged] == list(range(1, STEPS + 1))
    return Golden(losses=[loss for _, loss in result.loss_history],
                  grad_norms=[m["grad_norm"] for m in logged],
                  learning_rates=[m["learning_rate"] for m in logged],
                  moved=sum(float((after[k].double() - before[k].double()).pow(2).sum()) for k in before) ** 0.5)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("golden")


@pytest.mark.parametrize("case", list(CASES))
def test_a_seeded_run_reproduces_its_pinned_numbers(case: str, root: Path) -> None:
    import torch

    got, want = train_case(case, root), GOLDEN[case]
    # fp32 runs agree to 2e-6 across CPU kernels (avx512, avx2 and sse4.1 builds of the same torch, one or two
    # threads). bf16 autocast rounds each matmul's inputs and output, and the kernels round differently: 1.3e-3
    # apart at most, against 6e-3 between the bf16 and the fp32 run's third gradient norm.
    rtol = 3e-3 if "bf16" in case else 1e-5
    for name, expected in asdict(want).items():
        actual = getattr(got, name)
        torch.testing.assert_close(torch.tensor(actual, dtype=torch.float64),
                                   torch.tensor(expected, dtype=torch.float64), rtol=rtol, atol=0,
                                   msg=lambda m: f"{case}: {name} {actual} are not the pinned {expected}\n{m}")


if __name__ == "__main__":
    # Print GOLDEN as measured by this checkout.
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        for name in (sys.argv[1:] or CASES):
            run = train_case(name, Path(scratch))
            fields = ", ".join(f"{k}={[round(x, 7) for x in v] if isinstance(v, list) else round(v, 7)}"
                               for k, v in asdict(run).items())
            print(f"    {name!r}: Golden({fields}),", flush=True)
