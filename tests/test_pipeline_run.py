"""`distributed.pipeline_parallel: 2` through `fulltune run` as a user runs it: two CPU processes (gloo), one
pipeline stage each, train like one process (fp32), survive a kill of the whole process tree bit-exactly (the steps
they train again after resuming, as the first time), and register one ordinary Hugging Face checkpoint written a
shard per stage. And what validate refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulltune.cli import main
from pipelines_fixture import TINY_LLAMA, tiny_pipeline

# 8 rows per optimizer step, 4 micro-batches of 2: one process accumulates them, the two stages pipeline them.
ONE = {"effective_batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 6,
       "checkpoint_every_steps": 2, "keep_checkpoints": 3}
STAGES = {"num_processes": 2, "pipeline_parallel": 2}
UNTIED = {"from_config": {**TINY_LLAMA, "tie_word_embeddings": False}, "tokenizer": {"vocab_size": 96}}


def _validate(tmp_path: Path, capsys, **sections) -> tuple[int, str]:
    code = main(["validate", str(tiny_pipeline(tmp_path, model=UNTIED, **sections))])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize(("train", "distributed", "field", "says"), [
    (ONE, {"num_processes": 3, "pipeline_parallel": 2, "strategy": "ddp"}, "distributed",
     "num_processes (3) must be a multiple of pipeline_parallel (2)"),
    (ONE, {"strategy": "fsdp", "num_processes": 2, "pipeline_parallel": 2, "tensor_parallel": 2}, "distributed",
     "not combined with tensor_parallel"),
    ({**ONE, "effective_batch_size": 2, "micro_batch_size": 2, "gradient_accumulation_steps": 1}, STAGES,
     "train.gradient_accumulation_steps with distributed.pipeline_schedule",
     "1F1B needs at least as many micro-batches as stages"),
    ({**ONE, "offload_activations": True}, STAGES, "train.offload_activations with distributed.pipeline_parallel",
     "keep the schedule's in-flight activations"),
    ({**ONE, "effective_batch_size": 16, "chunked_loss": True}, {**STAGES, "num_processes": 4, "strategy": "fsdp"},
     "train.chunked_loss with distributed.strategy with distributed.pipeline_parallel", "the chunked head reads"),
])
def test_validate_refuses_what_pipeline_stages_cannot_train_naming_the_field(tmp_path, capsys, train, distributed,
                                                                             field, says):
    code, output = _validate(tmp_path, capsys, train=train, distributed=distributed)
    assert code == 2, output
    assert "Traceback" not in output
    assert "pipelines.tiny" in output and field in output and says in output, output


def test_validate_accepts_two_stages_and_gpipe_with_fewer_micro_batches_than_stages(tmp_path, capsys):
    assert _validate(tmp_path, capsys, train=ONE, distributed=STAGES)[0] == 0
    few = {**ONE, "effective_batch_size": 2, "gradient_accumulation_steps": 1}
    assert _validate(tmp_path, capsys, train=few, distributed={**STAGES, "pipeline_schedule": "gpipe"})[0] == 0


def test_plan_refuses_more_stages_than_layers_and_a_tied_head(tmp_path, capsys):
    deep = {**STAGES, "num_processes": 4, "pipeline_parallel": 4}
    assert main(["plan", "tiny", "-f", str(tiny_pipeline(tmp_path, model=UNTIED, train=ONE, distributed=deep))]) == 2
    assert "pipelines.tiny.distributed.pipeline_parallel: 4 stages need at least one decoder layer each" in (
        capsys.readouterr().err)
    assert main(["plan", "tiny", "-f", str(tiny_pipeline(tmp_path, train=ONE, distributed=STAGES))]) == 2
    assert "tie_word_embeddings" in capsys.readouterr().err


def _plan(path: Path, capsys) -> dict:
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_fits_the_largest_stage_and_chooses_a_micro_batch_per_stage_at_least(tmp_path, capsys):
    auto = {**ONE, "micro_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    staged = _plan(tiny_pipeline(tmp_path, model=UNTIED, train=auto, distributed=STAGES), capsys)
    whole = _plan(tiny_pipeline(tmp_path, model=UNTIED, train=auto), capsys)
    plan, estimate = staged["plan"], staged["plan"]["estimate"]
    # 1F1B: the first stage holds two micro-batches in flight, the embedding and half the layers.
    assert estimate["peak_phase"].startswith("stage 0: ")
    assert estimate["peak_bytes"] < whole["plan"]["estimate"]["peak_bytes"]
    assert (plan["pipeline_parallel"], plan["pipeline_schedule"]) == (2, "1f1b")
    assert plan["gradient_accumulation_steps"] >= 2
    assert all(a["gradient_accumulation_steps"] >= 2 for a in staged["alternatives"])


def _exported(workdir: Path) -> dict:
    """The exported model's tensors, read shard by shard through its index."""
    from safetensors.torch import load_file

    (model_dir,) = workdir.glob("runs/*/model")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(model_dir / shard)))
    assert sorted(tensors) == sorted(index["weight_map"])
    return tensors


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_stages_train_like_one_process_resume_bit_exact_after_a_kill_and_export_one_checkpoint(tmp_path,
                                                                                                  prefect_server):
    import torch
    from transformers import AutoModelForCausalLM

    from runs import (assert_rank_peaks_within, assert_steps_trained_again_alike, finish, fulltune_run,
                      kill_at_checkpoint, loss_history, rerun_job, saved_model)

    # A checkpoint every 3 steps, the loss logged every step: killed in step 6, the rerun trains steps 4 and 5 again.
    train = {**ONE, "checkpoint_every_steps": 3, "log_every_steps": 1}
    pipelines = tiny_pipeline(tmp_path, model=UNTIED, train=train, distributed=STAGES)
    log = tmp_path / "run.log"
    # Micro-batch 21 is the first of step 6: the run stalls there with step-3 its newest checkpoint.
    kill_at_checkpoint(pipelines, log, micro_step=21, step=3, api=prefect_server, logged=5)
    (checkpoint,) = (tmp_path / "work").glob("runs/*/checkpoints/step-3")
    assert len(list((checkpoint / "stages").glob("*.distcp"))) == 2  # each stage wrote its own state

    # The rerun measures each stage's step peak (MemTracker on the real tensors: CPU has no device peak) and sets
    # it beside the plan's estimate for that stage.
    output = finish(fulltune_run(pipelines, log, prefect_server, FULLTUNE_TRACK_MEMORY="1"), log)
    assert "resumed from step 3" in output, output[-4000:]
    assert "2 pipeline stages (1f1b)" in output
    assert "registered tiny-model version 1" in output
    assert "step peak per process: rank 0 (stage 0)" in output
    assert_rank_peaks_within(tmp_path / "work", stages=[0, 1])  # within 3% either way
    from mlflow.tracking import MlflowClient

    from fulltune.tracking import registry

    registry.configure(tmp_path / "work")
    client = MlflowClient()
    (version,) = client.search_model_versions("name='tiny-model'")
    metrics = client.get_run(version.run_id).data.metrics
    assert abs(metrics["step_peak_estimate_error"]) <= 0.03 and metrics["step_peak_bytes"] > 0, metrics

    # Killed and rerun, the stages trained steps 4 and 5 again as they had the first time, bit for bit.
    assert_steps_trained_again_alike(tmp_path / "work", [4, 5])

    # Two stages train like one process: fp32, the same micro-batches, only the padding and sum order differ. The
    # one process is the run's train job on one process, through the launcher's training command.
    want = _exported(tmp_path / "work")
    one = rerun_job(tmp_path / "work", tmp_path / "one", strategy="none", num_processes=1, pipeline_parallel=1)
    staged, single_losses = loss_history(tmp_path / "work"), loss_history(one)
    assert len(staged) == len(single_losses) == ONE["max_steps"]
    for a, b in zip(staged, single_losses):
        assert abs(a - b) <= 1e-5 * abs(b), (staged, single_losses)
    reference = saved_model(one)
    assert want.keys() == reference.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)

    # One ordinary Hugging Face checkpoint: two shards and an index, loaded here, not by the trainer.
    (model_dir,) = (tmp_path / "work").glob("runs/*/model")
    assert len(list(model_dir.glob("model-*-of-00002.safetensors"))) == 2
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in want.items())
