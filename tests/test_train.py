"""The training loop and its launcher, on CPU with a 2-layer Llama (hidden 32, vocab 64).

Every training run goes through `run_training`, i.e. a real child process (`python -m fulltune.runtime.train`
or torchrun), exactly as the flow runs it. Children get OMP_NUM_THREADS=1: on a shared 2-core machine
OpenMP's thread hand-offs stall for ~100 ms per op, and results must not depend on the thread count.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fulltune.errors import ConfigError, DataError, TrainingError
from fulltune.runtime.launch import (OutOfMemory, TrainJob, TrainResult, _outcome, generate_accelerate_config, job_with,
                             run_training, training_command, validate_job)
from tiny import tiny_config, word_level_tokenizer

VOCAB = 64


# ---------------------------------------------------------------------------------------------------
# Fixtures: a tokenizer, two tiny models (with and without dropout) and a learnable tokenized dataset


def build_model(directory: Path, attention_dropout: float) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_config("llama", VOCAB, pad_token_id=0, eos_token_id=1, bos_token_id=None,
                         attention_dropout=attention_dropout)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    word_level_tokenizer(directory, VOCAB)


def write_rows(path: Path, rows: list[tuple[list[int], list[int], list[int]]]) -> None:
    columns = {"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows], "position_ids": [r[2] for r in rows]}
    pq.write_table(pa.table({k: pa.array(v, type=pa.list_(pa.int32())) for k, v in columns.items()}), path)


def counting_rows(count: int, seed: int = 0) -> list[tuple[list[int], list[int], list[int]]]:
    """Rows of 1–3 packed documents `s, s+1, s+2, …` (learnable: the next token is this one + 1).

    As fulltune.data writes them: the first token of each document is not a target, positions restart.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(count):
        ids, labels, positions = [], [], []
        for _ in range(rng.integers(1, 4)):
            n, start = int(rng.integers(4, 11)), int(rng.integers(2, VOCAB))
            doc = [2 + (start - 2 + k) % (VOCAB - 2) for k in range(n)]
            ids += doc
            labels += [-100] + doc[1:]
            positions += list(range(n))
        rows.append((ids, labels, positions))
    return rows


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("train-assets")
    build_model(root / "dropout", attention_dropout=0.1)  # dropout makes RNG restore matter for resume
    build_model(root / "plain", attention_dropout=0.0)  # deterministic forward for equivalence checks
    write_rows(root / "train.parquet", counting_rows(64))
    return {"dropout": root / "dropout", "plain": root / "plain", "data": root / "train.parquet", "root": root}


@pytest.fixture(autouse=True)
def single_thread_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("FULLTUNE_TEST_FAULT", raising=False)


def make_job(assets: dict[str, Path], output_dir: Path, model: str = "plain", **fields) -> TrainJob:
    """A job on the tiny model; `fields` by name, each into the section that declares it (TrainJob.replace)."""
    defaults = dict(micro_batch_size=2, gradient_accumulation_steps=2, learning_rate=3e-3, max_steps=12,
                    warmup_ratio=0.1, checkpoint_every_steps=3, keep_checkpoints=2, log_every_steps=1, seed=3)
    return job_with(str(assets[model]), str(assets["data"]), str(output_dir), **{**defaults, **fields})


def run_with_fault(job: TrainJob, fault: str, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Run `job` with a FULLTUNE_TEST_FAULT that kills the child; the launcher reports a crash. The child's lines."""
    lines: list[str] = []
    with monkeypatch.context() as patch:
        patch.setenv("FULLTUNE_TEST_FAULT", fault)
        with pytest.raises(RuntimeError, match="exited with code -9"):
            run_training(job, on_output=lines.append)
    return lines


def model_tensors(model_dir: str | Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(model_dir) / "model.safetensors"))


def quiet(job: TrainJob) -> TrainResult:
    return run_training(job, on_output=lambda line: None)


@pytest.fixture(scope="module")
def uninterrupted(assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[TrainJob, TrainResult]:
    """12 steps of micro 2 × accumulation 2 on the dropout model, checkpoints every 3 steps."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        job = make_job(assets, tmp_path_factory.mktemp("uninterrupted") / "run", model="dropout")
        return job, quiet(job)


@pytest.fixture(scope="module")
def reference(assets: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> TrainResult:
    """3 steps of micro 4 × accumulation 1, one process, no dropout: what the equivalent runs must match."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        job = make_job(assets, tmp_path_factory.mktemp("reference") / "run", micro_batch_size=4,
                       gradient_accumulation_steps=1, max_steps=3, checkpoint_every_steps=0)
        return quiet(job)


def assert_same_training(result: TrainResult, expected: TrainResult, *, rtol: float, atol: float) -> None:
    import torch

    assert [s for s, _ in result.loss_history] == [s for s, _ in expected.loss_history]
    np.testing.assert_allclose([loss for _, loss in result.loss_history],
                               [loss for _, loss in expected.loss_history], rtol=rtol)
    got, want = model_tensors(result.model_dir), model_tensors(expected.model_dir)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=atol, msg=name)


# ---------------------------------------------------------------------------------------------------
# End to end


@pytest.mark.slow
def test_training_reduces_loss_and_writes_the_run_directory(uninterrupted: tuple[TrainJob, TrainResult]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job, result = uninterrupted
    out = Path(job.paths.output_dir)
    losses = [loss for _, loss in result.loss_history]
    assert [s for s, _ in result.loss_history] == list(range(1, 13))
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.25, losses
    assert result.steps == 12 and result.epochs == pytest.approx(12 / 16) and result.nonfinite_steps == 0
    assert result.tokens > 0 and result.tokens_per_second > 0 and result.resumed_from_step is None
    assert TrainResult.from_json((out / "result.json").read_text()) == result
    assert json.loads((out / "progress.json").read_text()) == {"step": 12, "total_steps": 12, "loss": losses[-1]}
    assert (out / "loss_curve.png").stat().st_size > 1000
    # Newest two checkpoints kept (steps 6 and 9; none at the final step), nothing half-written left.
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-6", "step-9"]
    assert {p.name for p in (out / "checkpoints" / "step-9").iterdir()} >= {
        "model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "trainer_state.json"}
    assert not list(out.glob(".tmp-*"))
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert model.config.use_cache is True  # turned off for training only
    assert AutoTokenizer.from_pretrained(result.model_dir).pad_token == "<pad>"


@pytest.mark.slow
def test_a_run_killed_at_each_point_resumes_bit_exact(assets: dict[str, Path], tmp_path: Path,
                                                      uninterrupted: tuple[TrainJob, TrainResult],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """One run killed three times, each rerun (the same job, as a Prefect retry would) killed at the next point,
    then finished: each rerun resumes where the previous kill left it, and the end is the uninterrupted run."""
    import torch

    base_job, expected = uninterrupted
    job = base_job.replace(output_dir=str(tmp_path / "run"))
    checkpoints = tmp_path / "run" / "checkpoints"
    for fault, resumed_from in [
        ("checkpoint_write:6", None),  # checkpoint 6 half written: it is discarded
        ("after_checkpoint:6", 3),  # right after checkpoint 6 was renamed into place
        ("micro_step:15", 6),  # mid-accumulation: the first micro-batch of step 8
    ]:
        lines = run_with_fault(job, fault, monkeypatch)
        start = f"resumed from step {resumed_from}" if resumed_from else "from the start"
        assert any(start in line for line in lines), (fault, lines[-20:])
        if fault.startswith("checkpoint_write"):
            assert (checkpoints / ".tmp-step-6").is_dir() and not (checkpoints / "step-6").exists()
        assert not (tmp_path / "run" / "model").exists()

    result = quiet(job)
    assert result.resumed_from_step == 6
    assert result.loss_history == expected.loss_history
    assert result.tokens == expected.tokens and result.steps == expected.steps
    got, want = model_tensors(result.model_dir), model_tensors(expected.model_dir)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[name], want[name]) for name in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert not list(checkpoints.glob(".tmp-*"))


# A launcher of its own for a job (JOB.json's path as its argument), as the flow's process launches training.
LAUNCHER = ("import sys; from pathlib import Path; from fulltune.runtime.launch import TrainJob, run_training; "
            "run_training(TrainJob.from_json(Path(sys.argv[1]).read_text()), on_output=lambda line: None)")


def kill_while_a_checkpoint_is_written(job: TrainJob, step: int) -> None:
    """Launch `job` (train.checkpoint_async) from a process of its own with the background write of checkpoint
    `step` held; once the trainer has logged step `step` + 1 (it went on past the checkpoint; the write is still in
    flight: its files under the temporary name, nothing published under its step name), kill -9 the launcher's
    process group, as a preempted node does: the trainers (torchrun's workers have sessions of their own) end with
    their launcher."""
    import os
    import subprocess
    import sys
    import time

    from conftest import ROOT
    from runs import kill_run

    out = Path(job.paths.output_dir)
    out.mkdir(parents=True)
    (out.parent / f"{out.name}.json").write_text(job.to_json())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FULLTUNE_TEST_FAULT": f"stall_checkpoint_write:{step}"}
    run = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(out.parent / f"{out.name}.json")], env=env,
                           start_new_session=True)
    try:
        deadline, progress = time.monotonic() + 600, out / "progress.json"
        while not progress.is_file() or json.loads(progress.read_text())["step"] <= step:
            assert run.poll() is None and time.monotonic() < deadline, run.returncode
            time.sleep(0.1)
        checkpoints = out / "checkpoints"
        assert (checkpoints / f".tmp-step-{step}").is_dir() and not (checkpoints / f"step-{step}").exists()
    finally:
        alive = kill_run(run)
    assert not alive, "a trainer outlived its launcher"


def assert_bit_exact(result: TrainResult, expected: TrainResult) -> None:
    import torch

    assert result.loss_history == expected.loss_history
    got, want = model_tensors(result.model_dir), model_tensors(expected.model_dir)
    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


@pytest.mark.slow
def test_a_run_killed_while_a_checkpoint_is_written_in_the_background_resumes_from_the_one_before(
        assets: dict[str, Path], tmp_path: Path, uninterrupted: tuple[TrainJob, TrainResult]) -> None:
    """train.checkpoint_async, one process: killed while checkpoint 6 is being written (step 7 ran beside the
    write), the rerun resumes from step 3, the checkpoint before, writes 6 and 9 in the background, and ends bit-exact
    with the uninterrupted run, whose checkpoints were written synchronously."""
    base_job, expected = uninterrupted
    job = base_job.replace(output_dir=str(tmp_path / "run"), checkpoint_async=True)
    kill_while_a_checkpoint_is_written(job, 6)
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("step-*")) == ["step-3"]
    result = quiet(job)
    assert result.resumed_from_step == 3
    assert_bit_exact(result, expected)
    # The final export waited for the last background write: both newest checkpoints are published, none half.
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["step-6", "step-9"]


@pytest.mark.slow
def test_two_fsdp_processes_killed_while_writing_a_checkpoint_resume_bit_exact(assets: dict[str, Path],
                                                                               tmp_path: Path) -> None:
    """train.checkpoint_async under FSDP: each process's shards go through DCP's async_save. Killed while checkpoint 2
    is being written, the rerun resumes from checkpoint 1 and ends bit-exact with a run whose checkpoints were
    written synchronously."""
    fsdp = dict(strategy="fsdp", num_processes=2, gradient_accumulation_steps=1, max_steps=5, checkpoint_every_steps=1,
                keep_checkpoints=2)
    expected = quiet(make_job(assets, tmp_path / "sync", model="dropout", **fsdp))
    job = make_job(assets, tmp_path / "async", model="dropout", checkpoint_async=True, **fsdp)
    kill_while_a_checkpoint_is_written(job, 2)
    result = quiet(job)
    assert result.resumed_from_step == 1
    assert_bit_exact(result, expected)
    assert sorted(p.name for p in (tmp_path / "async" / "checkpoints").iterdir()) == ["step-3", "step-4"]


@pytest.mark.slow
def test_gradient_accumulation_matches_a_larger_micro_batch(assets: dict[str, Path], tmp_path: Path,
                                                            reference: TrainResult) -> None:
    # Same rows per optimizer step; the loss is normalised by the step's tokens, not per micro-batch.
    job = make_job(assets, tmp_path / "run", micro_batch_size=2, gradient_accumulation_steps=2, max_steps=3,
                   checkpoint_every_steps=0)
    assert_same_training(quiet(job), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_two_process_ddp_on_cpu_matches_one_process(assets: dict[str, Path], tmp_path: Path,
                                                    reference: TrainResult) -> None:
    # 2 processes × micro 2 (torchrun, gloo) against 1 process × micro 4: only the order of the gradient
    # all-reduce's additions differs; Adam's normalisation lets it grow to ~1e-5 in 3 steps. Its checkpoints are
    # written in the background (train.checkpoint_async: the main process writes the one copy of the weights and
    # states) beside the steps, which they leave as they are.
    from fulltune.runtime.step_checkpoints import checkpoint_problem

    job = make_job(assets, tmp_path / "run", micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3,
                   checkpoint_every_steps=1, checkpoint_async=True, strategy="ddp", num_processes=2)
    assert training_command(job, Path("JOB.json"))[2] == "torch.distributed.run"
    assert_same_training(quiet(job), reference, rtol=1e-5, atol=1e-4)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-1", "step-2"]
    assert [checkpoint_problem(checkpoints / name) for name in ("step-1", "step-2")] == [None, None]
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors", "optimizer.bin"} <= {
        p.name for p in (checkpoints / "step-2").iterdir()}


@pytest.mark.slow
def test_muon_under_two_process_ddp_matches_one_process(assets: dict[str, Path], tmp_path: Path) -> None:
    # DDP averages the gradients before the step, so each process orthogonalises the one process's matrix: only
    # the all-reduce's order of additions differs, rounded by Newton–Schulz's bf16 matmuls.
    one = quiet(make_job(assets, tmp_path / "one", micro_batch_size=4, gradient_accumulation_steps=1, max_steps=3,
                         checkpoint_every_steps=0, optimizer="muon"))
    two = quiet(make_job(assets, tmp_path / "two", micro_batch_size=2, gradient_accumulation_steps=1, max_steps=3,
                         checkpoint_every_steps=0, optimizer="muon", strategy="ddp", num_processes=2))
    assert_same_training(two, one, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("layers", [1])  # partial: 1 of 2 layers (all layers is the same mechanism)
def test_gradient_checkpointing_does_not_change_training(layers: int, assets: dict[str, Path], tmp_path: Path,
                                                         reference: TrainResult) -> None:
    job = make_job(assets, tmp_path / "run", micro_batch_size=4, gradient_accumulation_steps=1, max_steps=3,
                   checkpoint_every_steps=0, gradient_checkpointing=layers)
    lines: list[str] = []
    result = run_training(job, on_output=lines.append)
    assert any(f"gradient checkpointing {layers}/2 layers" in line for line in lines)
    assert_same_training(result, reference, rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_a_nonfinite_step_is_skipped_and_logged_to_mlflow(assets: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import mlflow
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("train-test", artifact_location=str(tmp_path / "artifacts"))
    run_id = client.create_run(experiment).info.run_id
    job = make_job(assets, tmp_path / "run", max_steps=4, checkpoint_every_steps=0, log_every_steps=2,
                   mlflow_tracking_uri=uri, mlflow_run_id=run_id)
    monkeypatch.setenv("FULLTUNE_TEST_FAULT", "nan_loss:2")
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    result = quiet(job)
    assert result.nonfinite_steps == 1 and result.steps == 4
    assert all(np.isfinite(loss) for _, loss in result.loss_history)
    # Every step that trained, from the first, though the run logs every second step: the skipped one is left out.
    assert [step for step, _ in result.loss_history] == [1, 3, 4]
    history = client.get_metric_history(run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(s, pytest.approx(v)) for s, v in result.loss_history]
    logged = set(client.get_run(run_id).data.metrics)
    assert {"learning_rate", "grad_norm", "tokens_per_second", "samples_per_second", "cpu_rss_peak_bytes"} <= logged
    assert "mfu" not in logged  # no defensible peak FLOP/s on CPU
    assert any(name.startswith("system/cpu_utilization") for name in logged), sorted(logged)
    mlflow.set_tracking_uri(uri)
    assert "loss_curve.png" in [a.path for a in client.list_artifacts(run_id)]


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_on_cuda_skips_a_nan_step_and_finishes(assets: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    job = make_job(assets, tmp_path / "run", device="cuda", mixed_precision="fp16", max_steps=4,
                   checkpoint_every_steps=0)
    monkeypatch.setenv("FULLTUNE_TEST_FAULT", "nan_loss:2")
    result = quiet(job)
    assert result.steps == 4 and result.nonfinite_steps >= 1  # the NaN step, and any overflow of the first scale
    assert all(torch.isfinite(t).all() for t in model_tensors(result.model_dir).values())


@pytest.mark.slow
def test_repeated_nonfinite_losses_stop_with_exit_code_2(assets: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # Every loss from step 2 on is NaN, as when the weights have blown up.
    monkeypatch.setenv("FULLTUNE_TEST_FAULT", "nan_losses_from:2")
    job = make_job(assets, tmp_path / "run", max_nonfinite_steps=3, checkpoint_every_steps=0)
    lines: list[str] = []
    with pytest.raises(TrainingError, match=r"3 non-finite losses in a row at step \d+; lower train.learning_rate"):
        run_training(job, on_output=lines.append)
    assert not (Path(job.paths.output_dir) / "model").exists() and not (Path(job.paths.output_dir) / "result.json").exists()
    # The child's last line is its one-line message (exit code 2 → TrainingError: test_child_exit_maps_…).
    assert lines[-1].startswith("fulltune train: error: training stopped: 3 non-finite losses in a row")


@pytest.mark.slow
def test_out_of_memory_exits_3_and_raises_out_of_memory(assets: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from fulltune.runtime import launch

    job = make_job(assets, tmp_path / "run", max_steps=3, checkpoint_every_steps=0)
    monkeypatch.setenv("FULLTUNE_TEST_FAULT", "oom:2")
    codes, lines = [], []  # the child's exit code as the launcher reads it, and its lines
    monkeypatch.setattr(launch, "_outcome", lambda out, code, tail: codes.append(code) or _outcome(out, code, tail))
    with pytest.raises(OutOfMemory) as raised:
        run_training(job, on_output=lines.append)
    assert codes == [3]
    assert raised.value.observed_peak_bytes > 0
    assert not isinstance(raised.value, (ConfigError, DataError, TrainingError))
    out = Path(job.paths.output_dir)
    assert json.loads((out / "oom.json").read_text())["peak_bytes"] == raised.value.observed_peak_bytes
    assert not (out / "model").exists()
    assert lines[-1].startswith("fulltune train: out of memory (peak "), lines[-5:]


@pytest.mark.slow
def test_a_finished_run_is_returned_without_training(uninterrupted: tuple[TrainJob, TrainResult]) -> None:
    job, expected = uninterrupted
    lines: list[str] = []
    assert run_training(job, on_output=lines.append) == expected
    assert lines == []  # no child process ran


# ---------------------------------------------------------------------------------------------------
# Pieces, without training


@pytest.fixture
def fp16_accelerator():
    """An Accelerator whose fp16 path runs on CPU: accelerate makes no grad scaler there, so a CPU
    torch.amp.GradScaler stands in for CUDA's, and the step logic is the one CUDA fp16 runs."""
    import torch
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    accelerator = Accelerator(cpu=True, mixed_precision="fp16")
    accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=1000)
    accelerator.native_amp = True
    yield accelerator
    AcceleratorState._reset_state(reset_partial_state=True)  # the next Accelerator in this process starts clean


def test_fp16_overflow_is_skipped_the_scale_drops_and_training_goes_on(fp16_accelerator) -> None:
    import torch

    from fulltune.runtime.train import OptimizerStep

    accelerator = fp16_accelerator
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    step_optimizer = OptimizerStep(accelerator, model, optimizer, scheduler, max_grad_norm=1.0)
    x, y = torch.randn(16, 8), torch.randn(16, 1)
    # step 2: a NaN loss; step 4: an infinite loss whose gradients are finite; step 5: a finite loss whose
    # scaled gradients overflow (the usual fp16 case)
    faults = {2: lambda loss: loss * float("nan"), 4: lambda loss: loss + float("inf"), 5: lambda loss: loss * 1e37}
    assert step_optimizer.scales_loss
    stepped, scales, losses = [], [], []
    for step in range(1, 8):
        before = [p.detach().clone() for p in model.parameters()]
        loss = (model(x).float() - y).pow(2).mean()
        losses.append(loss.item())
        loss = faults.get(step, lambda loss: loss)(loss)
        accelerator.backward(loss)
        outcome, norm = step_optimizer(loss.detach(), step)
        stepped.append(outcome)
        scales.append(accelerator.scaler.get_scale())
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert unchanged == (not outcome), step
        assert all(p.grad is None for p in model.parameters())
    assert stepped == [True, False, True, False, False, True, True]
    assert scales == [2.0**12, 2.0**11, 2.0**11, 2.0**10, 2.0**9, 2.0**9, 2.0**9]
    assert scheduler.scheduler.last_epoch == 4  # the schedule advances with the optimizer steps only
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_train_step_computes_the_token_mean_loss_and_takes_the_adamw_step(assets: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    # One optimizer step of the real trainer, in this process: micro 2 × accumulation 2 against a plain
    # Hugging Face forward over the same micro-batches and a hand-written AdamW step.
    import torch
    import torch.nn.functional as F
    from accelerate.state import AcceleratorState
    from transformers import AutoModelForCausalLM

    from fulltune.data.batching import StepSchedule
    from fulltune.data import collate
    from fulltune.runtime.train import setup, train_step

    job = make_job(assets, tmp_path / "run", learning_rate=1e-2, warmup_ratio=0.0, lr_scheduler="constant",
                   max_grad_norm=0.5)
    run = setup(job)
    try:
        rows = run.schedule.step_rows(0)
        outcome = train_step(run, rows, step=1)
        trained = {name: p.detach().clone() for name, p in run.accelerator.unwrap_model(run.model).named_parameters()}
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

    # The trainer's attention (packed documents attend alone: fulltune/attention.py, proven equal to the masked SDPA
    # in tests/test_attention.py): AdamW's first step is lr · g / |g|, which turns a rounding difference in a
    # near-zero gradient into a whole step.
    from fulltune.attention import kernel

    reference = AutoModelForCausalLM.from_pretrained(assets["plain"], attn_implementation=kernel("sdpa"))
    targets = int(run.data.targets[rows].sum())
    total = torch.zeros(())
    for index in range(2):
        batch = collate(run.data.rows(StepSchedule.micro_batch(rows, index, 0, 2, 1)), run.pad_token_id)
        # use_cache=False: with a cache transformers would not see the packed documents in position_ids.
        logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        logits = logits.float()
        total = total + F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                        batch["labels"][:, 1:].reshape(-1), ignore_index=-100, reduction="sum")
    (total / targets).backward()
    norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
    torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.0).step()

    assert outcome.stepped and outcome.targets == targets
    torch.testing.assert_close(outcome.loss_sum, total.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outcome.grad_norm, norm, rtol=1e-4, atol=1e-6)
    initial = model_tensors(assets["plain"])
    for name, parameter in reference.named_parameters():
        assert not torch.equal(trained[name], initial[name]), name
        torch.testing.assert_close(trained[name], parameter.detach(), rtol=0, atol=1e-5, msg=name)


def test_step_schedule_is_deterministic_and_independent_of_the_split() -> None:
    from fulltune.runtime.train import StepSchedule

    lengths = np.random.default_rng(0).integers(4, 40, size=50)
    schedule = StepSchedule(lengths, rows_per_step=8, seed=5)
    assert schedule.per_epoch == 6  # 50 // 8; the incomplete last step of each epoch is dropped
    again = StepSchedule(lengths, rows_per_step=8, seed=5)
    steps = [schedule.step_rows(s) for s in range(12)]
    assert all(np.array_equal(a, again.step_rows(s)) for s, a in enumerate(steps))  # a pure function of the step
    assert len(set(np.concatenate(steps[:6]).tolist())) == 48  # no row twice within an epoch
    assert not np.array_equal(np.concatenate(steps[:6]), np.concatenate(steps[6:]))  # a new order each epoch
    rows = steps[0]
    for micro, processes in [(2, 2), (4, 1), (1, 4), (8, 1)]:
        parts = [StepSchedule.micro_batch(rows, i, p, micro, processes)
                 for i in range(8 // (micro * processes)) for p in range(processes)]
        assert np.array_equal(np.concatenate(parts), rows)


def test_tokenized_rows_counts_targets_tokens_and_attention_pairs(tmp_path: Path) -> None:
    from fulltune.runtime.train import TokenizedRows

    write_rows(tmp_path / "t.parquet", [
        ([5, 6, 7, 8, 9], [-100, 6, 7, -100, 9], [0, 1, 2, 0, 1]),  # two documents: 3 + 2 tokens
        ([4, 5, 6], [-100, -100, 6], [0, 1, 2]),
    ])
    rows = TokenizedRows(str(tmp_path / "t.parquet"))
    assert rows.lengths.tolist() == [5, 3]
    assert rows.targets.tolist() == [3, 1]
    assert rows.attention_pairs.tolist() == [3**2 + 2**2, 3**2]
    assert rows.rows(np.array([1])) == [{"input_ids": [4, 5, 6], "labels": [-100, -100, 6], "position_ids": [0, 1, 2]}]


def test_tokenized_rows_reject_bad_files(tmp_path: Path) -> None:
    from fulltune.runtime.train import TokenizedRows

    pq.write_table(pa.table({"input_ids": pa.array([[1, 2]], type=pa.list_(pa.int32()))}), tmp_path / "a.parquet")
    with pytest.raises(DataError, match=r"missing column\(s\) \['labels', 'position_ids'\]"):
        TokenizedRows(str(tmp_path / "a.parquet"))
    write_rows(tmp_path / "b.parquet", [([1, 2, 3], [-100, -100, -100], [0, 1, 2])])
    with pytest.raises(DataError, match="no token has a label"):
        TokenizedRows(str(tmp_path / "b.parquet"))


def test_validate_job_reports_every_problem_at_once(tmp_path: Path) -> None:
    data = tmp_path / "train.parquet"
    data.touch()
    job = job_with("m", str(data), str(tmp_path), mixed_precision="fp16", strategy="ddp", num_processes=2,
                   num_machines=2)
    with pytest.raises(ConfigError) as raised:
        validate_job(job)
    message = str(raised.value)
    for part in ("fp16 needs a CUDA device", "on one machine"):
        assert part in message
    # What one section can tell alone is refused when the job is built or read.
    with pytest.raises(ConfigError) as raised:
        job.replace(micro_batch_size=0, learning_rate=0)
    assert "micro_batch_size must be an integer >= 1" in str(raised.value)
    assert "train.learning_rate: must be > 0" in str(raised.value)
    with pytest.raises(DataError, match="tokenized training data not found"):
        validate_job(job.replace(train_file="/nope.parquet", mixed_precision="no", strategy="none", num_processes=1,
                                 num_machines=1))


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_generated_accelerate_config_is_read_by_accelerate(strategy: str, tmp_path: Path) -> None:
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig

    job = job_with("m", "d", str(tmp_path), device="cuda", strategy=strategy, num_processes=4,
                   gradient_accumulation_steps=3, mixed_precision="bf16")
    config = generate_accelerate_config(job)
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(config))
    loaded = ClusterConfig.from_yaml_file(str(tmp_path / "accelerate.yaml"))
    assert loaded.num_processes == 4 and loaded.mixed_precision == "bf16"
    assert loaded.distributed_type.value == {"ddp": "MULTI_GPU", "fsdp": "FSDP"}[strategy]
    command = training_command(job, tmp_path / "JOB.json")
    # FSDP2 is driven by fulltune itself (fulltune/runtime/sharding.py), so torchrun starts it, not accelerate launch.
    launcher = "torch.distributed.run" if strategy == "fsdp" else "accelerate.commands.launch"
    assert command[1:3] == ["-m", launcher] and "fulltune.runtime.train" in command


def test_multi_machine_config_needs_the_rendezvous_address(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    job = job_with("m", "d", "o", device="cuda", strategy="ddp", num_processes=16, num_machines=2)
    with pytest.raises(ConfigError, match="MASTER_ADDR"):
        generate_accelerate_config(job)


def test_child_exit_maps_to_result_or_exception(tmp_path: Path) -> None:
    with pytest.raises(OutOfMemory):
        _outcome(tmp_path, 3, [])
    with pytest.raises(TrainingError, match="the last line"):
        _outcome(tmp_path, 2, ["noise", "the last line"])
    with pytest.raises(RuntimeError, match="exited with code -9") as crashed:
        _outcome(tmp_path, -9, ["Killed"])
    assert not isinstance(crashed.value, (OutOfMemory, TrainingError))
    # Under torchrun a failed worker surfaces as exit code 1; the marker files still tell what happened.
    (tmp_path / "error.json").write_text(json.dumps({"type": "DataError", "message": "x.parquet: no rows"}))
    with pytest.raises(DataError, match="no rows"):
        _outcome(tmp_path, 1, [])
    (tmp_path / "oom.json").write_text(json.dumps({"peak_bytes": 123}))
    with pytest.raises(OutOfMemory) as raised:
        _outcome(tmp_path, 1, [])
    assert raised.value.observed_peak_bytes == 123


# ---------------------------------------------------------------------------------------------------
# Damaged checkpoints and a full disk


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_gives_way_to_the_newest_intact_one(
        tmp_path: Path, uninterrupted: tuple[TrainJob, TrainResult], monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    base_job, expected = uninterrupted
    job = base_job.replace(output_dir=str(tmp_path / "run"))
    run_with_fault(job, "after_checkpoint:9", monkeypatch)  # step-6 and step-9 on disk
    checkpoints = tmp_path / "run" / "checkpoints"
    assert json.loads((checkpoints / "step-9" / "manifest.json").read_text())["files"]
    (weights,) = (checkpoints / "step-9").glob("*.safetensors")
    with open(weights, "r+b") as handle:  # a copy cut short, a disk error: what a rerun meets
        handle.truncate(weights.stat().st_size // 2)

    lines: list[str] = []
    result = run_training(job, on_output=lines.append)
    damaged = [line for line in lines if "damaged" in line]
    assert len(damaged) == 1 and "step-9" in damaged[0] and "resuming from step-6" in damaged[0], lines[-5:]
    assert result.resumed_from_step == 6
    assert (checkpoints / "damaged-step-9").is_dir()
    assert result.loss_history == expected.loss_history
    got, want = model_tensors(result.model_dir), model_tensors(expected.model_dir)
    assert all(torch.equal(got[name], want[name]) for name in want)


@pytest.mark.slow
@pytest.mark.parametrize("background", [False, True], ids=["synchronous", "checkpoint_async"])
def test_a_full_disk_during_a_checkpoint_is_a_user_error_that_keeps_the_older_checkpoints(
        assets: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, background: bool) -> None:
    # In the background the failed write is raised where the loop waits for it: here the final export's wait.
    job = make_job(assets, tmp_path / "run", max_steps=7, checkpoint_async=background)
    monkeypatch.setenv("FULLTUNE_TEST_FAULT", "disk_full:6")
    with pytest.raises(TrainingError, match=r"disk filled up while writing checkpoint step-6.*resumes from step-3"):
        run_training(job, on_output=lambda line: None)
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-3"]  # nothing half-written is left
    assert not (tmp_path / "run" / "model").exists()
