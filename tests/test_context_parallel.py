"""Context parallel (`distributed.context_parallel`): each row's positions split over a group of processes, attention
over the whole row all the same (Ulysses on CPU and GPU; ring attention on CUDA only).

- Ulysses equals one process: loss and gradients of one micro-batch (packed rows and not, sdpa and eager, key/value
  heads split and repeated), tests/context_parallel_worker.py under torchrun, as the device check's dry run runs it
  (tests/test_plan_margin.py `test_device_check_dry_run_writes_its_report` holds its results).
- Through `fulltune run`: context parallel 2 over FSDP trains like one process (fp32, 1e-5 relative, 8 steps),
  resumes bit-exact after a kill -9 of the run's process group (the steps it trains again, as the first time), and
  exports one Hugging Face checkpoint that transformers loads.
- The evaluate stage splits long rows over the group as the run trained, chunked over positions and vocabulary.
- Per rank, the estimate is within 3% of the measured peak (measuring/rank_memory.py `context_parallel`).
- `context_parallel: auto` is planned like the other degrees, with its reasons; refusals are the lever table's.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from fulltune.degrees import ParallelDims
from fulltune.memory import PlanRequest, Settings, estimate_memory
from fulltune.planning import plan_memory
from pipelines_fixture import TINY_LLAMA, tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]
GiB = 2**30
CP = {"strategy": "fsdp", "num_processes": 2, "context_parallel": 2}
# 8 rows per optimizer step (micro 2 × accumulation 4 × one data-parallel group of 2 context-parallel processes),
# as the one-process reference; a checkpoint every 3 steps; unclipped (the same update whatever the split).
TRAIN = {"effective_batch_size": 8, "micro_batch_size": 2, "gradient_accumulation_steps": 4, "max_steps": 8,
         "checkpoint_every_steps": 3, "keep_checkpoints": 2, "max_grad_norm": 1.0e6, "log_every_steps": 1,
         "chunked_loss": False, "optimizer_in_backward": False}


def _cli(pipelines: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "fulltune.cli", *args, "-f", str(pipelines)], cwd=pipelines.parent,
                          env=env, capture_output=True, text=True, timeout=600)


# ---------------------------------------------------------------------------------------------------
# The degree and its rules


def test_the_group_shares_its_rows_and_each_process_keeps_balanced_chunks():
    from fulltune.runtime.context_parallel import kv_repeats, padded_length, zigzag_order

    dims = ParallelDims(8, 1, 1, "fsdp", 4)
    assert (dims.dp, dims.fsdp_shards, dims.dp_replicate) == (2, 8, 1)
    assert [dims.data_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [dims.cp_rank(r) for r in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    # Zigzag: 2N chunks, rank r keeps chunks r and 2N − 1 − r; every position once over the group.
    assert padded_length(27, 2) == 28 and zigzag_order(8, 2, 0) == [0, 1, 6, 7] and zigzag_order(8, 2, 1) == [2, 3, 4, 5]
    assert sorted(p for r in range(4) for p in zigzag_order(32, 4, r)) == list(range(32))
    # Causal work (the pairs a chunk attends to) is the same on every rank.
    work = [sum(p + 1 for p in zigzag_order(32, 4, r)) for r in range(4)]
    assert len(set(work)) == 1
    assert (kv_repeats(8, 4), kv_repeats(2, 4), kv_repeats(1, 2)) == (1, 2, 2)
    assert dims.context_method(32) == "ulysses" and dims.context_method(6) == "ring"


@pytest.mark.parametrize("distributed, message", [
    ({"strategy": "none", "num_processes": 2, "pipeline_parallel": 1},
     "pipelines.tiny.distributed: num_processes > 1 needs a strategy (ddp or fsdp)"),
    ({"strategy": "fsdp", "num_processes": 4, "tensor_parallel": 2},
     "distributed.context_parallel with distributed.tensor_parallel: context parallel is not combined"),
    ({"strategy": "fsdp", "num_processes": 4, "pipeline_parallel": 2},
     "distributed.context_parallel with distributed.pipeline_parallel: context parallel is not combined"),
    ({"strategy": "fsdp", "num_processes": 3, "context_parallel": 2}, "must be a multiple of context_parallel (2)"),
    ({"strategy": "fsdp", "num_processes": 2, "context_parallel": 0}, "context_parallel must be auto or from 1 to 64"),
])
def test_the_spec_refuses_what_context_parallel_cannot_train(tmp_path, distributed, message):
    from fulltune.errors import ConfigError
    from fulltune.pipelines_file import load_pipelines

    pipelines = tiny_pipeline(tmp_path, train={"effective_batch_size": 12},
                              distributed={"context_parallel": 2, **distributed})
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_pipelines(pipelines)


def test_validate_refuses_ring_attention_on_a_cpu_device_in_one_line(tmp_path):
    pipelines = tiny_pipeline(tmp_path, train={"effective_batch_size": 12},
                              distributed={"strategy": "fsdp", "num_processes": 3, "context_parallel": 3})
    result = _cli(pipelines, "validate")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert ("pipelines.tiny.distributed.context_parallel: 3 does not divide the model's 4 attention heads, which needs "
            "ring attention, and ring attention runs on CUDA only") in result.stderr, result.stderr


# ---------------------------------------------------------------------------------------------------
# Through `fulltune run`


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_context_parallel_2_trains_like_one_process_resumes_bit_exact_after_a_kill_and_exports(tmp_path,
                                                                                             prefect_server):
    from runs import assert_same_weights, assert_steps_trained_again_alike, finish, fulltune_run, kill_at_checkpoint, \
        loss_history, rerun_job, saved_model

    pipelines = tiny_pipeline(tmp_path, train=TRAIN, distributed=CP)
    log = tmp_path / "run.log"
    # The 21st micro-batch of a process is the first of step 6: step-3 is then the newest checkpoint, and the steps
    # after it are logged.
    kill_at_checkpoint(pipelines, log, micro_step=21, step=3, timeout_s=900, api=prefect_server, logged=5)
    output = finish(fulltune_run(pipelines, log, prefect_server), log)
    assert "resumed from step 3" in output and "× context parallel 2 (ulysses)" in output, output[-4000:]
    assert "registered tiny-model version 1" in output
    (run_dir,) = (tmp_path / "work").glob("runs/*/model")
    run_dir = run_dir.parent
    losses, weights = loss_history(run_dir), saved_model(run_dir)
    assert len(losses) == 8

    # Killed and rerun, the run trained steps 4 and 5 again as it had the first time, bit for bit.
    assert_steps_trained_again_alike(run_dir, [4, 5])

    # One process over whole rows trains the same steps (fp32: only the order of the sums differs).
    one_losses = loss_history(rerun_job(run_dir, tmp_path / "one", strategy="none", num_processes=1, context_parallel=1))
    for a, b in zip(losses, one_losses, strict=True):
        assert abs(a - b) <= 1e-5 * abs(b), (losses, one_losses)

    # One Hugging Face checkpoint, as transformers loads it.
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert type(loaded).__name__ == "LlamaForCausalLM"
    assert_same_weights({name: t for name, t in loaded.state_dict().items() if name in weights}, weights)


# ---------------------------------------------------------------------------------------------------
# The evaluate stage over long rows


def test_the_evaluate_stage_splits_long_rows_over_the_group_like_one_process(tmp_path: Path) -> None:
    """A run trained context parallel evaluated sharded over its processes, each row's positions split over the group
    and the loss chunked over positions and vocabulary: the metrics are one process's."""
    from fulltune.evaluation.evaluate import EvalOptions, evaluate_model
    from fulltune.evaluation.sharded import Candidate, evaluate_sharded_candidates
    from test_sharded_eval import _rows, assert_same_metrics
    from tests.tiny import make_model, make_tokenizer

    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model = make_model(tmp_path / "model", tokenizer_dir)
    rows = _rows(tokenizer_dir)
    load = {"dtype": "fp32"}
    single = evaluate_model(model, tokenizer_dir, rows, EvalOptions(batch_size=3, generate_examples=3,
                                                                    max_new_tokens=3), load_kwargs=load)
    options = EvalOptions(batch_size=3, generate_examples=3, max_new_tokens=3, device="cpu", processes=2,
                          work_dir=str(tmp_path / "evals"), chunked_loss=True, row_split=2)
    sharded = evaluate_sharded_candidates([Candidate("fine_tuned", model, tokenizer_dir, load)], rows, options)
    assert_same_metrics(sharded["fine_tuned"], single)


def test_a_long_row_evaluation_is_planned_chunked_and_split_like_the_training():
    """Whole-vocabulary logits of a 131k-position row do not fit an 80 GiB GPU (62 GiB in fp32); the plan evaluates
    the held-out loss chunked over positions and vocabulary. At 524k one process's layer cannot hold one row, and
    the plan splits each row over the context-parallel group the run trained with."""
    from fulltune.memory.evaluation import plan_evaluation
    from fulltune.memory.shapes import model_shape
    from fulltune.memory.types import EvalRequest

    shape = model_shape(LLAMA_8B_LONG)
    request = EvalRequest(batch_size=8, generate=False)

    def planned(seq_len: int, context_parallel: int) -> object:
        settings = Settings(micro_batch_size=1, seq_len=seq_len, mixed_precision="bf16", device="cuda",
                            strategy="fsdp", num_processes=8, context_parallel=context_parallel,
                            gradient_checkpointing=32, attention_mask=False)
        return plan_evaluation(shape, settings, request, usable=int(76 * GiB))

    whole = planned(131072, 1)
    assert whole.fits and whole.chunked_loss and whole.to_dict()["context_parallel"] == 1
    assert "chunked over positions and vocabulary" in whole.reason
    longest = planned(524288, 8)
    assert longest.fits and longest.chunked_loss and longest.to_dict()["context_parallel"] == 8
    assert longest.processes == 8
    assert "split over 8 processes (context parallel, as trained)" in longest.reason
    assert not planned(524288, 1).fits


# ---------------------------------------------------------------------------------------------------
# The memory model and the planner

LLAMA_8B_LONG = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                         max_position_embeddings=1 << 20)
BASE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 1024, "max_position_embeddings": 1024, "tie_word_embeddings": False}


@pytest.mark.slow
def test_context_parallel_per_rank_estimate_is_within_3_percent_of_the_measured_peak():
    """Two of benchmarks/context_parallel_memory.py's grid in one torchrun: unpacked rows (sdpa's causal kernel)
    and packed rows (the whole row's mask), Ulysses over FSDP2 on 2 processes."""
    from measuring.rank_memory import against_estimates

    cases = [(BASE, Settings(strategy="fsdp", num_processes=2, context_parallel=2, device="cpu", micro_batch_size=2,
                             seq_len=512, attention_mask=packed)) for packed in (False, True)]
    for result in against_estimates("context_parallel", cases, 2):
        assert len(result["ranks"]) == 2
        for rank in result["ranks"]:
            assert abs(rank["error"]) <= 0.03, result


def test_a_rank_holds_its_share_of_the_activations_and_the_states_of_all_processes():
    fields = dict(micro_batch_size=1, seq_len=32768, mixed_precision="bf16", device="cuda", strategy="fsdp",
                  num_processes=8, gradient_checkpointing=32, attention_mask=False)
    alone, split = (estimate_memory(LLAMA_8B_LONG, Settings(**fields, context_parallel=cp)) for cp in (1, 8))
    # FSDP shards the states over dp × cp: all 8 processes either way.
    assert split.breakdown["optimizer_states"] == alone.breakdown["optimizer_states"]
    assert split.breakdown["activations"] < alone.breakdown["activations"] / 4


def long_rows(**overrides) -> PlanRequest:
    kwargs = dict(effective_batch_size=8, seq_len=524288, device="cuda", bf16_supported=True, budget_bytes=80 * GiB,
                  strategy="fsdp", num_processes=8, context_parallel=None, host_memory_bytes=1024 * GiB,
                  attention_mask=False)
    kwargs.update(overrides)
    return PlanRequest(**kwargs)


def test_context_parallel_auto_chooses_a_degree_where_whole_rows_do_not_fit_and_says_why():
    alone = plan_memory(LLAMA_8B_LONG, long_rows(context_parallel=1))
    assert not alone.fits
    plan = plan_memory(LLAMA_8B_LONG, long_rows())
    s = plan.settings
    assert plan.fits and s.context_parallel > 1 and plan.expected_bytes <= plan.usable_bytes
    assert s.micro_batch_size * s.gradient_accumulation_steps * s.dims.dp == 8  # the effective batch is kept
    reason = next(r for r in plan.reasons if r.startswith(f"context parallel {s.context_parallel} "))
    assert "s/step" in reason and "all-to-alls (assumed" in reason and "1 does not fit" in reason
    assert json.loads(json.dumps(plan.to_dict()))["plan"]["context_parallel"] == s.context_parallel


def test_a_fixed_degree_that_needs_ring_attention_on_cpu_is_refused_by_the_plan():
    from fulltune.memory.errors import MemoryConfigError

    config = transformers.LlamaConfig(**{**BASE, "num_attention_heads": 6, "hidden_size": 384})
    with pytest.raises(MemoryConfigError, match="distributed.context_parallel: 4 does not divide the model's 6"):
        plan_memory(config, PlanRequest(effective_batch_size=4, seq_len=256, strategy="fsdp", num_processes=4,
                                        context_parallel=4, budget_bytes=8 * GiB))
    assert math.isfinite(plan_memory(config, PlanRequest(effective_batch_size=4, seq_len=256, strategy="fsdp",
                                                         num_processes=4, context_parallel=2,
                                                         budget_bytes=8 * GiB)).estimated_step_seconds)
