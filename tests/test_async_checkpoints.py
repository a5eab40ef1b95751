"""`train.checkpoint_async`: what the plan counts for a background checkpoint write (the copy, measured against
the trainer's own), what the spec and the lever table accept, and that it changes neither the weights' key nor
which checkpoints a run may resume from. The kill-and-resume proofs are tests/test_train.py's (one process and two
FSDP processes killed while a write is held, then bit-exact; DDP's background writes in its DDP test).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from fulltune.cli import main
from fulltune.memory import Settings, estimate_memory
from fulltune.memory.process import CHECKPOINT, EXPORT, LOAD, STEP, checkpoint_staging_bytes, node_host_bytes
from fulltune.memory.shapes import model_shape
from pipelines_fixture import tiny_pipeline

LLAMA = transformers.LlamaConfig(vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
                                 num_attention_heads=6, num_key_value_heads=2)


def staged_bytes(staged: dict) -> int:
    """Bytes of every distinct storage in a staged copy (tied weights share one)."""
    import torch

    seen: dict[int, int] = {}

    def visit(value: object) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    visit(staged)
    return sum(seen.values())


@pytest.mark.parametrize("levers", [
    {"optimizer": "adamw", "mixed_precision": "bf16"},
    {"optimizer": "adamw", "mixed_precision": "bf16", "pure_bf16": True},
    {"optimizer": "adafactor", "mixed_precision": "no"},
], ids=["amp_adamw", "pure_bf16_kahan_adamw", "adafactor"])
def test_the_copy_a_background_write_holds_is_what_the_plan_counts(tmp_path: Path, levers: dict) -> None:
    """The trainer's own copy (`async_checkpoints.staged_copy`, after a real step: every optimizer state exists)
    against `checkpoint_staging_bytes` for its plan: within 1% (the optimizer's step counters are not counted)."""
    from accelerate.state import AcceleratorState

    from fulltune.runtime.async_checkpoints import staged_copy
    from fulltune.runtime.train import setup, train_step
    from test_train import build_model, counting_rows, make_job, write_rows

    build_model(tmp_path / "model", attention_dropout=0.0)
    write_rows(tmp_path / "train.parquet", counting_rows(16))
    job = make_job({"plain": tmp_path / "model", "data": tmp_path / "train.parquet"}, tmp_path / "run",
                   checkpoint_async=True, **levers)
    run = setup(job)
    try:
        train_step(run, run.schedule.step_rows(0), step=1)
        staged, stager = staged_copy(run)
        measured = staged_bytes(staged)
        stager.close()
        counted = checkpoint_staging_bytes(model_shape(run.model_config), job.plan)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert counted == pytest.approx(measured, rel=0.01), (counted, measured)


def test_the_plan_counts_the_copy_in_the_checkpoint_phase_on_cpu_and_in_host_ram_on_a_gpu() -> None:
    shape = model_shape(LLAMA)
    cpu = Settings(micro_batch_size=2, seq_len=128, device="cpu")
    staged = checkpoint_staging_bytes(shape, replace(cpu, checkpoint_async=True))
    assert staged == pytest.approx(12 * shape.num_params, rel=1e-5)  # fp32 weights, AdamW's two fp32 states
    assert checkpoint_staging_bytes(shape, cpu) == 0
    sync, background = estimate_memory(LLAMA, cpu), estimate_memory(LLAMA, replace(cpu, checkpoint_async=True))
    # On a CPU device the copy is held beside the steps that run while it is written.
    assert background.phases[CHECKPOINT] >= sync.phases[STEP] + staged
    assert {p: background.phases[p] for p in (LOAD, STEP, EXPORT)} == {p: sync.phases[p] for p in (LOAD, STEP, EXPORT)}
    assert background.host_bytes == sync.host_bytes == 0
    # On a GPU it is host RAM; the device's phases do not change.
    gpu = replace(cpu, device="cuda", mixed_precision="bf16")
    sync, background = estimate_memory(LLAMA, gpu), estimate_memory(LLAMA, replace(gpu, checkpoint_async=True))
    assert background.phases == sync.phases and background.host_bytes == sync.host_bytes + staged
    # Per machine of 4 processes: FSDP's ranks each copy their shards, DDP's main process its whole copy.
    for strategy, copies in (("fsdp", 4 * staged // 4), ("ddp", staged)):
        s = replace(gpu, strategy=strategy, num_processes=4, checkpoint_async=True)
        per_rank = estimate_memory(LLAMA, s).host_bytes
        assert node_host_bytes(shape, s, per_rank, 4)["checkpoint"] == pytest.approx(copies, rel=1e-6), strategy


def test_plan_says_what_the_background_write_holds(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tiny_pipeline(tmp_path, train={"checkpoint_async": True})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["checkpoint_async"] is True
    assert any(reason.startswith("checkpoint_async: each checkpoint's weights and optimizer states are copied")
               for reason in plan["reasons"]), plan["reasons"]


def test_bad_values_and_pipeline_stages_are_refused_naming_the_field(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture) -> None:
    path = tiny_pipeline(tmp_path, train={"checkpoint_async": "sometimes"})
    assert main(["validate", str(path)]) == 2
    assert "pipelines.tiny.train.checkpoint_async" in capsys.readouterr().err
    staged = tiny_pipeline(tmp_path, train={"checkpoint_async": True, "gradient_accumulation_steps": 2},
                           distributed={"strategy": "none", "num_processes": 2, "pipeline_parallel": 2})
    assert main(["validate", str(staged)]) == 2
    assert "train.checkpoint_async with distributed.pipeline_parallel: pipeline stages write their checkpoints " \
           "synchronously" in capsys.readouterr().err


def test_writing_in_the_background_keeps_the_weights_key_and_the_checkpoints(tmp_path: Path) -> None:
    from fulltune.runtime.launch import job_with, resume_conflict
    from fulltune.stages import resolve_pipeline, train_key

    plain = resolve_pipeline(str(tiny_pipeline(tmp_path)), "tiny")
    background = resolve_pipeline(str(tiny_pipeline(tmp_path, train={"checkpoint_async": True})), "tiny")
    settings = Settings(micro_batch_size=2, seq_len=16)
    assert train_key(plain, "data", settings) == train_key(background, "data",
                                                           replace(settings, checkpoint_async=True))
    job = job_with("model", "train.parquet", str(tmp_path / "run"))
    assert resume_conflict(job, job.replace(checkpoint_async=True)) is None
