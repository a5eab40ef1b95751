"""Tensor parallel in the memory model and the planner.

The per-rank estimate against the peak each rank measures: torchrun starts the ranks (gloo, CPU) of TP 2 on 2
processes and FSDP 2 × TP 2 on 4; each splits a tiny Llama with fulltune.runtime.parallel and runs two optimizer steps of
the trainer's step under FSDPMemTracker (measuring/rank_memory.py; benchmarks/tensor_parallel_memory.py
runs the full grid, in BENCHMARKS.md). `estimate_memory(..., Settings(strategy="fsdp", num_processes=N, tensor_parallel=2))` must be
within 3% of every rank's peak.

`distributed.tensor_parallel: auto`: the plan chooses the degree, and says why.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from fulltune.memory import PlanRequest, Settings, estimate_memory
from fulltune.planning import plan_memory
from measuring.rank_memory import against_estimate
from pipelines_fixture import tiny_pipeline

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.03
GiB = 2**30
# A Llama-3-8B shape with a 32k vocabulary, at 32k-token rows on one machine of 8 × 24 GiB: with every layer
# checkpointed the activations alone overflow one GPU under FSDP, and tensor parallel splits them.
LLAMA_8B_32K = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000)
BASE = {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 8192, "max_position_embeddings": 512,
        "tie_word_embeddings": False}
# Two of benchmarks/tensor_parallel_memory.py's grid: (config, processes, settings), tensor parallel 2.
CASES = {
    "tp2-fp32-tied": ({**BASE, "tie_word_embeddings": True}, 2,
                      {"micro_batch_size": 2, "seq_len": 128, "mixed_precision": "no"}),
    "fsdp2xtp2-bf16-untied-ckpt2": (BASE, 4, {"micro_batch_size": 2, "seq_len": 128, "mixed_precision": "bf16",
                                             "gradient_checkpointing": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", ["tp2-fp32-tied", "fsdp2xtp2-bf16-untied-ckpt2"])
def test_tensor_parallel_per_rank_estimate_is_within_3_percent_of_the_measured_peak(case):
    config, processes, settings = CASES[case]
    result = against_estimate("tensor_parallel", config, Settings(strategy="fsdp", num_processes=processes,
                                                                  tensor_parallel=2, device="cpu", **settings), processes)
    assert len(result["ranks"]) == processes
    for rank in result["ranks"]:
        assert abs(rank["error"]) <= TOLERANCE, (
            f"{case} rank {rank['rank']}: estimate {result['estimate_peak_bytes']} B, "
            f"measured {rank['measured_peak_bytes']} B ({rank['error']:+.2%})")


def long_rows(**overrides) -> PlanRequest:
    # The levers that would also fit it (the chunked head, offloading) are fixed off: tensor parallel is the way.
    kwargs = dict(effective_batch_size=8, seq_len=32768, device="cuda", bf16_supported=True, budget_bytes=24 * GiB,
                  strategy="fsdp", num_processes=8, tensor_parallel=None, host_memory_bytes=1024 * GiB,
                  chunked_loss=False, offload_activations=False, offload_optimizer=False)
    kwargs.update(overrides)
    return PlanRequest(**kwargs)


def test_tensor_parallel_auto_chooses_a_degree_where_fsdp_alone_does_not_fit_and_says_why():
    alone = plan_memory(LLAMA_8B_32K, long_rows(tensor_parallel=1))
    assert not alone.fits
    plan = plan_memory(LLAMA_8B_32K, long_rows())
    s = plan.settings
    assert plan.fits and s.tensor_parallel > 1 and plan.expected_bytes <= plan.usable_bytes
    # The data-parallel processes keep the effective batch.
    assert s.micro_batch_size * s.gradient_accumulation_steps * (s.num_processes // s.tensor_parallel) == 8
    # The plan is the estimate of the rank it describes.
    assert plan.plan_estimate.device_bytes == estimate_memory(LLAMA_8B_32K, s).device_bytes
    reason = next(r for r in plan.reasons if r.startswith(f"tensor parallel {s.tensor_parallel} "))
    assert "s/step" in reason and "collectives" in reason and "1 does not fit" in reason
    assert plan.to_dict()["plan"]["tensor_parallel"] == s.tensor_parallel


def test_tensor_parallel_auto_keeps_fsdp_alone_when_it_fits_and_is_faster():
    plan = plan_memory(LLAMA_8B_32K, long_rows(seq_len=2048))
    assert plan.fits and plan.settings.tensor_parallel == 1
    reason = next(r for r in plan.reasons if r.startswith("tensor parallel 1 "))
    assert "2 is slower" in reason


def test_tensor_parallel_auto_tries_only_degrees_the_heads_split_and_the_lever_table_allows():
    # 8 key/value heads: 16 processes may not split 16 ways; a fixed optimizer step in backward refuses every TP degree.
    plan = plan_memory(LLAMA_8B_32K, long_rows(num_processes=16, effective_batch_size=16))
    assert any("16 not tried" in r and "num_key_value_heads (8)" in r for r in plan.reasons)
    fixed = plan_memory(LLAMA_8B_32K, long_rows(seq_len=2048, optimizer_in_backward=True))
    assert fixed.settings.tensor_parallel == 1
    assert any("2 not tried" in r and "distributed.tensor_parallel" in r for r in fixed.reasons)


@pytest.mark.slow
def test_tensor_parallel_auto_validates_and_plans_through_the_cli(tmp_path: Path):
    pipelines = tiny_pipeline(tmp_path, distributed={"strategy": "fsdp", "num_processes": 2, "tensor_parallel": "auto"})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "fulltune.cli", "plan", "tiny", "--json", "-f", str(pipelines)],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    plan = json.loads(result.stdout)
    assert plan["plan"]["tensor_parallel"] in (1, 2)
    assert any(r.startswith(f"tensor parallel {plan['plan']['tensor_parallel']} ") for r in plan["reasons"])
