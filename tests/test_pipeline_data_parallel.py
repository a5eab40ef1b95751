"""Pipeline stages with data parallel beside them through `fulltune run`: 2 stages × FSDP 2 = 4 CPU processes
(gloo) train like one process (fp32, clipped to a global norm), survive a kill of the whole process tree
bit-exactly, and register one ordinary Hugging Face checkpoint (a shard per stage, gathered over dp). And what
validate accepts and refuses, and what the plan counts per rank."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fulltune.cli import main
from pipelines_fixture import tiny_pipeline
from runs import ONE, ONE_PROCESS_UNTIED, UNTIED

# 8 rows per optimizer step: micro 2 × accumulation 2 × 2 data-parallel replicas of 2 stages each.
STAGED = {**ONE_PROCESS_UNTIED["train"], "gradient_accumulation_steps": 2}
# The per-rank memory of stages beside FSDP is measured on one example per row: with packed rows one rank of this tiny
# model reads 5.1% above its estimate (BENCHMARKS.md, "Documents attend alone").
ONE_EXAMPLE_PER_ROW = {"packing": False}
PP_FSDP = {"num_processes": 4, "pipeline_parallel": 2, "strategy": "fsdp"}


def test_degrees_lay_stages_out_outermost_and_replicas_read_their_own_rows():
    """Rank r of 2 stages × 2 replicas is stage r // 2 and data rank r % 2 (the ("pp", "dp", "tp") mesh): a
    replica's two stages train on the same rows, the two replicas on different ones."""
    from fulltune.degrees import ParallelDims

    dims = ParallelDims(4, 1, 2)
    assert (dims.dp, dims.tp, dims.pp) == (2, 1, 2)
    assert [dims.stage(r) for r in range(4)] == [0, 0, 1, 1]
    assert [dims.data_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert dims.per_process(8) == 4


def _validate(tmp_path: Path, capsys, train=STAGED, **distributed) -> tuple[int, str]:
    code = main(["validate", str(tiny_pipeline(tmp_path, model=UNTIED, train=train, distributed=distributed))])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


@pytest.mark.parametrize("distributed", [
    PP_FSDP, {**PP_FSDP, "strategy": "ddp"}, {**PP_FSDP, "num_processes": 2},
    {**PP_FSDP, "num_processes": 8, "pipeline_parallel": 2, "pipeline_schedule": "gpipe"},
])
def test_validate_accepts_data_parallel_beside_pipeline_stages(tmp_path, capsys, distributed):
    train = STAGED if distributed["num_processes"] != 8 else {**STAGED, "gradient_accumulation_steps": 1}
    if distributed["num_processes"] == 2:
        train = {**STAGED, "gradient_accumulation_steps": 4}
    code, output = _validate(tmp_path, capsys, train=train, **distributed)
    assert code == 0, output


@pytest.mark.parametrize(("train", "distributed", "field", "says"), [
    ({**STAGED, "chunked_loss": True}, PP_FSDP,
     "train.chunked_loss with distributed.strategy with distributed.pipeline_parallel", "the chunked head reads"),
    ({**STAGED, "chunked_loss": True}, {**PP_FSDP, "strategy": "ddp"}, "train.chunked_loss", "replicated DTensor"),
    (STAGED, {**PP_FSDP, "num_processes": 5}, "distributed",
     "num_processes (5) must be a multiple of pipeline_parallel (2)"),
    (STAGED, {**PP_FSDP, "num_processes": 6}, "distributed.num_processes / distributed.pipeline_parallel (3)",
     "must equal train.effective_batch_size (8)"),  # three replicas of the stages cannot split 8 rows
    (STAGED, {**PP_FSDP, "strategy": "none"}, "distributed", "num_processes = pipeline_parallel"),
    (STAGED, {**PP_FSDP, "strategy": "auto"}, "distributed", "needs a fixed strategy: none (every process a stage)"),
    (STAGED, {**PP_FSDP, "tensor_parallel": 2, "num_processes": 8}, "distributed", "not combined with tensor_parallel"),
    ({**STAGED, "offload_optimizer": True}, PP_FSDP, "train.offload_optimizer with distributed.pipeline_parallel",
     "each stage steps its own optimizer"),
])
def test_validate_refuses_what_cannot_combine_with_data_parallel_stages(tmp_path, capsys, train, distributed, field,
                                                                        says):
    code, output = _validate(tmp_path, capsys, train=train, **distributed)
    assert code == 2, output
    assert "Traceback" not in output
    assert "pipelines.tiny" in output and field in output and says in output, output


def _estimate(path: Path, capsys) -> dict:
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    return json.loads(capsys.readouterr().out)["plan"]["estimate"]


def test_plan_counts_a_stage_sharded_over_its_data_parallel_processes(tmp_path, capsys):
    """The same micro-batches through each stage (micro 2 × accumulation 2): alone, and beside a second replica
    sharding it (FSDP 2). Per rank the optimizer states are halved and the gradients accumulate unsharded as alone
    (the schedule reduces them once, after the last backward); the weights are the rank's half as its shards plus
    the units gathered in the peak's phase: here the first stage's layer 0 as its backward gathers it, twice
    (FSDP2's all-gather output and the weights copied out of it)."""
    from transformers import LlamaConfig

    from fulltune.memory.shapes import model_shape

    alone_dir, sharded_dir = tmp_path / "alone", tmp_path / "sharded"
    alone_dir.mkdir(), sharded_dir.mkdir()
    alone = _estimate(tiny_pipeline(alone_dir, model=UNTIED, train={**STAGED, "effective_batch_size": 4},
                                    distributed={"num_processes": 2, "pipeline_parallel": 2}), capsys)
    sharded = _estimate(tiny_pipeline(sharded_dir, model=UNTIED, train=STAGED, distributed=PP_FSDP), capsys)
    a, s = alone["breakdown"], sharded["breakdown"]
    assert alone["peak_phase"] == sharded["peak_phase"] == "stage 0: backward of layer 0", (alone, sharded)
    rotary = 4 * 4  # the rotary inverse frequencies (head dim 8: 4 of them): a buffer, not sharded
    layer = 4 * model_shape(LlamaConfig(**UNTIED["from_config"])).layer_numel
    assert s["optimizer_states"] == pytest.approx(a["optimizer_states"] / 2, abs=8)
    assert s["parameters"] - rotary == pytest.approx((a["parameters"] - rotary) / 2 + 2 * layer, abs=8)
    assert s["gradients"] == a["gradients"] and s["activations"] == a["activations"]
    assert sharded["peak_bytes"] < alone["peak_bytes"]
    # DDP beside the stages (FSDP2's replicate): the replicated parameters beside the gathered copy, every state.
    replicated_dir = tmp_path / "replicated"
    replicated_dir.mkdir()
    r = _estimate(tiny_pipeline(replicated_dir, model=UNTIED, train=STAGED, distributed={**PP_FSDP, "strategy": "ddp"}),
                  capsys)["breakdown"]
    assert r["parameters"] - rotary == 2 * (a["parameters"] - rotary)
    assert r["optimizer_states"] == a["optimizer_states"] and r["gradients"] == a["gradients"]


def _exported(workdir: Path) -> tuple[Path, dict]:
    """The exported model's directory and its tensors, read shard by shard through its index."""
    from safetensors.torch import load_file

    (model_dir,) = workdir.glob("runs/*/model")
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    tensors = {}
    for shard in sorted(set(index["weight_map"].values())):
        tensors.update(load_file(str(model_dir / shard)))
    assert sorted(tensors) == sorted(index["weight_map"])
    return model_dir, tensors


LOAD_IN_A_FRESH_PROCESS = """
import sys, torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
shards = {}
for path in sys.argv[2:]:
    shards.update(load_file(path))
state = model.state_dict()
assert sorted(state) == sorted(shards), (sorted(state), sorted(shards))
assert all(torch.equal(state[name], tensor) for name, tensor in shards.items())
print(type(model).__name__, sum(t.numel() for t in state.values()))
"""


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(2400)
def test_two_stages_by_two_shards_train_like_one_process_resume_bit_exact_and_export_one_checkpoint(
        tmp_path, shared_run, prefect_server):
    import torch

    from runs import (assert_rank_peaks_within, assert_same_weights, finish, fulltune_run, kill_at_checkpoint,
                      loss_history, rerun_job, saved_model)

    clean, killed = tmp_path / "clean", tmp_path / "killed"
    clean.mkdir(), killed.mkdir()
    uninterrupted = fulltune_run(tiny_pipeline(clean, model=UNTIED, data=ONE_EXAMPLE_PER_ROW, train=STAGED,
                                               distributed=PP_FSDP),
                                 clean / "run.log", prefect_server, FULLTUNE_TRACK_MEMORY="1")
    pipelines = tiny_pipeline(killed, model=UNTIED, data=ONE_EXAMPLE_PER_ROW, train=STAGED, distributed=PP_FSDP)
    log = killed / "run.log"
    # Micro-batch 7 is the first of step 4 (2 a step on each process): the run stalls there, step-2 its newest
    # checkpoint.
    kill_at_checkpoint(pipelines, log, micro_step=7, api=prefect_server)
    (checkpoint,) = (killed / "work").glob("runs/*/checkpoints/step-2")
    assert len(list((checkpoint / "stages").glob("*.distcp"))) == 4  # each (stage, dp shard) its own file

    output = finish(fulltune_run(pipelines, log, prefect_server), log)
    assert "resumed from step 2" in output, output[-4000:]
    assert "× 2 processes × 2 pipeline stages (1f1b)" in output, output[-4000:]
    assert "registered tiny-model version 1" in output
    finish(uninterrupted, clean / "run.log")
    # Each stage's FSDP shards. A layer of this model is 4% of a rank's peak, and whether the prefetched
    # all-gather of the next one is alive at the peak depends on gloo's timing: 5% below.
    assert_rank_peaks_within(clean / "work", stages=[0, 0, 1, 1], under=0.05)

    # Killed and rerun equals uninterrupted, tensor for tensor.
    model_dir, want = _exported(clean / "work")
    assert_same_weights(_exported(killed / "work")[1], want)

    # Two stages × two shards train like one process: fp32, the same rows per step, clipped to the same global
    # norm; only the padding and the order of the sums differ.
    # The one process: the uninterrupted run's train job on one process, through the launcher's training command,
    # accumulating the 8 rows a step the two shards take.
    one = rerun_job(clean / "work", tmp_path / "one", strategy="none", num_processes=1, pipeline_parallel=1,
                    gradient_accumulation_steps=ONE["gradient_accumulation_steps"])
    staged, single_losses = loss_history(clean / "work"), loss_history(one)
    assert len(staged) == len(single_losses) == ONE["max_steps"]
    differences = [abs(a - b) / abs(b) for a, b in zip(staged, single_losses)]
    print(f"relative loss differences: {differences}")
    assert max(differences) <= 1e-5, (staged, single_losses)
    reference = saved_model(one)
    assert want.keys() == reference.keys()
    for name, tensor in want.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-4, atol=1e-5)

    # One ordinary Hugging Face checkpoint: a shard per stage and an index, loaded by a fresh process.
    shards = sorted(model_dir.glob("model-*-of-00002.safetensors"))
    assert len(shards) == 2
    loaded = subprocess.run([sys.executable, "-c", LOAD_IN_A_FRESH_PROCESS, str(model_dir), *map(str, shards)],
                            capture_output=True, text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-4000:]
    assert loaded.stdout.split()[0] == "LlamaForCausalLM", loaded.stdout


@pytest.mark.slow
@pytest.mark.heavy
@pytest.mark.timeout(1800)
def test_two_stages_by_two_replicas_train_like_one_process(tmp_path, shared_run, prefect_server):
    """strategy ddp beside the stages: each stage replicated over its two processes, its gradients all-reduced."""
    from runs import assert_rank_peaks_within, finish, fulltune_run, loss_history

    single = shared_run(**ONE_PROCESS_UNTIED)
    pipelines = tiny_pipeline(tmp_path, model=UNTIED, train=STAGED, distributed={**PP_FSDP, "strategy": "ddp"})
    output = finish(fulltune_run(pipelines, tmp_path / "run.log", prefect_server, FULLTUNE_TRACK_MEMORY="1"),
                    tmp_path / "run.log")
    assert "× 2 processes × 2 pipeline stages (1f1b)" in output, output[-4000:]
    assert_rank_peaks_within(tmp_path / "work", stages=[0, 0, 1, 1])  # each stage's replicas, within 3%
    one = single.finish()
    staged, single_losses = loss_history(tmp_path / "work"), loss_history(one / "work")
    assert len(staged) == len(single_losses) == ONE["max_steps"]
    differences = [abs(a - b) / abs(b) for a, b in zip(staged, single_losses)]
    print(f"relative loss differences (ddp): {differences}")
    assert max(differences) <= 1e-5, (staged, single_losses)
    _, tensors = _exported(tmp_path / "work")
    assert "lm_head.weight" in tensors and "model.embed_tokens.weight" in tensors


@pytest.mark.parametrize(("strategy", "two_stages"), [
    ("fsdp", "2 is slower"),
    ("auto", "2 is slower"),  # stages with ddp and with fsdp beside them, both searched
])
def test_pipeline_parallel_auto_tries_stages_beside_data_parallel(tmp_path, capsys, strategy,
                                                                                   two_stages):
    train = {**STAGED, "micro_batch_size": "auto", "gradient_accumulation_steps": "auto"}
    path = tiny_pipeline(tmp_path, model=UNTIED, train=train,
                         distributed={"num_processes": 4, "pipeline_parallel": "auto", "strategy": strategy})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    why = next(r for r in plan["reasons"] if r.startswith("pipeline parallel 1 (distributed.pipeline_parallel auto)"))
    assert two_stages in why, why
    assert "4 not tried (4 stages need a decoder layer each" in why, why
