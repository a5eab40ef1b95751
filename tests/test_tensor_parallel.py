"""`distributed.tensor_parallel` on CPU processes through `fulltune run`, as a user runs it: FSDP 2 × TP 2 on 4
processes survives a kill of its whole process tree (the steps it trains again after resuming, bit for bit as the
first time) and registers a plain Hugging Face checkpoint; it, and its train job run again through the launcher's
training command as tensor parallel alone on 2 processes, train like one process. Also what validate refuses:
DeepSpeed strategies, a tensor-parallel degree that does not divide the processes or the model's heads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from pipelines_fixture import tiny_pipeline

from runs import ONE, ONE_PROCESS

# 8 rows per optimizer step however they are split: one process (or one tensor-parallel pair) × micro 2 ×
# accumulation 4, or two data-parallel groups × micro 2 × accumulation 2. A checkpoint every 3 steps: killed in
# step 6, a rerun trains steps 4 and 5 again.
TWO_D = {**ONE, "gradient_accumulation_steps": 2, "checkpoint_every_steps": 3}
TP = {"strategy": "fsdp", "num_processes": 2, "tensor_parallel": 2}
FSDP_TP = {"strategy": "fsdp", "num_processes": 4, "tensor_parallel": 2}


def validate(pipelines: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fulltune.cli", "validate", str(pipelines)], cwd=pipelines.parent,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("strategy", ["deepspeed_zero2", "deepspeed_zero3"])
def test_deepspeed_strategies_are_refused_by_validate(tmp_path: Path, strategy: str) -> None:
    result = validate(tiny_pipeline(tmp_path, distributed={"strategy": strategy, "num_processes": 2}))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr + result.stdout
    assert "pipelines.tiny.distributed.strategy" in result.stderr and f"{strategy} is not offered" in result.stderr


def test_a_tensor_parallel_degree_must_divide_the_processes_and_needs_fsdp(tmp_path: Path) -> None:
    bad = validate(tiny_pipeline(tmp_path, distributed={"strategy": "fsdp", "num_processes": 3, "tensor_parallel": 2}))
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "num_processes (3) must be a multiple of tensor_parallel (2)" in bad.stderr
    ddp = validate(tiny_pipeline(tmp_path, distributed={"strategy": "ddp", "num_processes": 2, "tensor_parallel": 2}))
    assert ddp.returncode == 2 and "tensor_parallel > 1 needs strategy fsdp" in ddp.stderr
    # The tensor-parallel processes share their rows: 8 = micro 2 × accumulation 2 × 2 data-parallel groups.
    ok = validate(tiny_pipeline(tmp_path, train=TWO_D, distributed=FSDP_TP))
    assert ok.returncode == 0, ok.stderr[-2000:]


def test_validate_refuses_a_tensor_parallel_degree_the_heads_do_not_split(tmp_path: Path) -> None:
    # 3 processes, all one tensor-parallel group: 3 divides the processes but not the 4 heads of the model.
    result = validate(tiny_pipeline(tmp_path, train=ONE,
                                    distributed={"strategy": "fsdp", "num_processes": 3, "tensor_parallel": 3}))
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout, result.stderr[-2000:]
    assert ("pipelines.tiny.distributed.tensor_parallel: 3 does not divide the model's num_attention_heads (4), "
            "num_key_value_heads (2), intermediate_size (64)") in result.stderr


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_tensor_parallel_and_2d_train_like_one_process_and_resume_bit_exact_after_a_kill(tmp_path: Path,
                                                                                      shared_run,
                                                                                      prefect_server) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from runs import assert_steps_trained_again_alike, finish, fulltune_run, kill_at_checkpoint, loss_history, \
        rerun_job, saved_model

    killed = tmp_path / "killed"
    killed.mkdir()
    single = shared_run(**ONE_PROCESS)
    pipelines = tiny_pipeline(killed, train=TWO_D, distributed=FSDP_TP)
    log = killed / "run.log"
    # The 11th micro-batch of a process is the first of step 6: step-3 is then the newest checkpoint, and the steps
    # after it are logged.
    kill_at_checkpoint(pipelines, log, micro_step=11, step=3, timeout_s=900, api=prefect_server, logged=5)

    output = finish(fulltune_run(pipelines, log, prefect_server), log)
    assert "resumed from step 3" in output, output[-4000:]
    assert "registered tiny-model version 1" in output
    # Killed and rerun, the run trained steps 4 and 5 again as it had the first time, bit for bit.
    assert_steps_trained_again_alike(killed / "work", [4, 5])

    (model_dir,) = (killed / "work").glob("runs/*/model")
    # The same job as tensor parallel alone: one pair of processes, 8 rows a step by accumulating 4 micro-batches.
    tp = rerun_job(killed / "work", tmp_path / "tp", num_processes=TP["num_processes"],
                   gradient_accumulation_steps=ONE["gradient_accumulation_steps"])

    # Tensor parallel and FSDP × TP (killed and rerun) train like one process (fp32: only the order of sums differs).
    one = single.finish()
    reference = loss_history(one / "work")
    for workdir in (tp, killed / "work"):
        losses = loss_history(workdir)
        assert len(losses) == len(reference)
        for a, b in zip(losses, reference):
            assert abs(a - b) <= 1e-4 * abs(b), (workdir, losses, reference)
    single_model = saved_model(one / "work")
    for workdir in (tp, killed / "work"):
        trained = saved_model(workdir)
        assert trained.keys() == single_model.keys()
        for name, tensor in trained.items():
            torch.testing.assert_close(tensor, single_model[name], rtol=1e-3, atol=1e-4)

    # The registered model is a plain Hugging Face checkpoint (tied embeddings stay tied).
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


def test_plan_refuses_a_tensor_parallel_degree_the_heads_do_not_split(tmp_path: Path) -> None:
    from pipelines_fixture import TINY_LLAMA

    pipelines = tiny_pipeline(tmp_path, model={"from_config": {**TINY_LLAMA, "num_key_value_heads": 1},
                                               "tokenizer": {"vocab_size": 96}},
                              train=TWO_D, distributed=FSDP_TP)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "fulltune.cli", "plan", "tiny", "-f", str(pipelines)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "pipelines.tiny.distributed.tensor_parallel: 2 does not divide the model's num_key_value_heads (1)" \
        in result.stderr
