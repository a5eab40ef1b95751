"""Pipeline parallel: per-stage memory and the bubble (fulltune.memory.pipeline), what `fulltune plan` says about
it, and a real 2-process 1F1B run (fulltune.runtime.pipeline_parallel) against one process and against its per-stage estimate."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import LlamaConfig

from fulltune.cli import main
from fulltune.memory import Settings
from fulltune.planning import step_seconds
from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.pipeline import bubble_fraction
from fulltune.planning.pipeline import estimate_pipeline
from fulltune.planning.step_time import pipeline_step_seconds
from fulltune.memory.shapes import model_shape
from measuring.rank_memory import pipeline_against_estimate

from pipelines_fixture import TINY_LLAMA, tiny_pipeline

TOLERANCE = 0.03
# benchmarks/pipeline_parallel.py's fp32-1f1b case: 2 stages of a 4-layer Llama, 4 micro-batches of 2 per step.
STAGED = {"hidden_size": 128, "intermediate_size": 344, "num_hidden_layers": 4, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 256, "tie_word_embeddings": False}
SMALL = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=False)


@pytest.mark.slow
def test_two_stages_under_1f1b_train_like_one_process_within_3_percent_of_each_stage_estimate():
    settings = Settings(micro_batch_size=2, seq_len=128, gradient_accumulation_steps=4, device="cpu")
    result = pipeline_against_estimate(STAGED, settings, "1f1b", 2, steps=3, timed_steps=3, timeout_s=240)
    # fp32: the same weights after every step as one process accumulating the same micro-batches.
    assert result["max_loss_difference"] < 1e-5, (result["losses"], result["reference_losses"])
    assert [rank["in_flight"] for rank in result["ranks"]] == [2, 1]
    for rank in result["ranks"]:
        assert abs(rank["error"]) <= TOLERANCE, (
            f"stage {rank['stage']}: estimate {rank['estimate_peak_bytes']} B, "
            f"measured {rank['measured_peak_bytes']} B ({rank['error']:+.2%})")


def test_under_1f1b_the_first_stage_holds_the_most_micro_batches_and_gpipe_holds_them_all():
    settings = Settings(micro_batch_size=2, seq_len=256, gradient_accumulation_steps=8, attention_mask=False)
    one_f_one_b = estimate_pipeline(SMALL, settings, 4, "1f1b")
    gpipe = estimate_pipeline(SMALL, settings, 4, "gpipe")
    assert [s.in_flight for s in one_f_one_b.stages] == [4, 3, 2, 1]
    assert [s.in_flight for s in gpipe.stages] == [8, 8, 8, 8]
    assert one_f_one_b.worst.stage == 0
    for fill_drain, interleaved in zip(gpipe.stages, one_f_one_b.stages):
        assert fill_drain.peak_bytes > interleaved.peak_bytes
    assert [s.layers for s in one_f_one_b.stages] == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_the_bubble_shrinks_with_micro_batches_and_the_step_costs_it():
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(4, 4) > bubble_fraction(4, 16)
    shape = model_shape(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    settings = Settings(micro_batch_size=1, seq_len=4096, gradient_accumulation_steps=8, mixed_precision="bf16",
                        device="cuda", attention_mask=False)
    one_device = step_seconds(shape, settings)
    two_stages, p2p = pipeline_step_seconds(shape, settings, 2)
    # Two devices share the work but wait through the bubble: between half the time and all of it.
    assert one_device / 2 < two_stages < one_device
    assert 0 < p2p < two_stages


def test_1f1b_needs_a_micro_batch_per_stage_and_a_layer_per_stage():
    with pytest.raises(MemoryConfigError, match="at least as many micro-batches as stages"):
        estimate_pipeline(SMALL, Settings(micro_batch_size=2, seq_len=64, gradient_accumulation_steps=2), 4)
    with pytest.raises(MemoryConfigError, match="1 to 8"):
        estimate_pipeline(SMALL, Settings(micro_batch_size=1, seq_len=64, gradient_accumulation_steps=16), 16)


def _wide(tmp_path: Path, memory: str) -> Path:
    """A from_config Llama of 134M parameters planned for one cuda device of `memory`, AdamW fixed."""
    config = {**TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False}
    return tiny_pipeline(tmp_path, model={"from_config": config}, budget={"device": "cuda", "memory": memory},
                         train={"optimizer": "adamw", "mixed_precision": "bf16"})


def test_plan_says_what_pipeline_parallel_would_cost_when_one_device_fits_only_with_offload(tmp_path, capsys):
    path = _wide(tmp_path, "1.5GiB")
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["offload_optimizer"] is True
    advice = plan["pipeline_parallel"]
    assert advice["fits"] is True and advice["num_stages"] == 2 and advice["schedule"] == "1f1b"
    assert advice["device_bytes"] <= plan["usable_bytes"]
    assert advice["device_bytes"] == max(stage["device_bytes"] for stage in advice["stages"])
    assert advice["bubble"] == pytest.approx(1 / (advice["micro_batches"] + 1))
    assert advice["estimated_step_seconds"] < plan["plan"]["estimated_step_seconds"]
    assert main(["plan", "tiny", "-f", str(path)]) == 0
    assert "pipeline parallel 2 (1F1B" in capsys.readouterr().out


def test_plan_offers_no_pipeline_when_one_device_fits_without_slow_levers(tmp_path, capsys):
    assert main(["plan", "tiny", "-f", str(_wide(tmp_path, "8GiB")), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is True and plan["pipeline_parallel"] is None


def _auto_stages(tmp_path: Path, memory: str) -> Path:
    """The 134M Llama on two cuda devices with `pipeline_parallel: auto`, 8-bit AdamW fixed (FSDP refuses it,
    so the choice is DDP's whole replica per device or two stages of half the model each)."""
    config = {**TINY_LLAMA, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8,
              "num_attention_heads": 8, "num_key_value_heads": 8, "tie_word_embeddings": False}
    return tiny_pipeline(tmp_path, model={"from_config": config}, budget={"device": "cuda", "memory": memory,
                                                                          "host_memory": "64GiB"},
                         train={"optimizer": "adamw_8bit", "mixed_precision": "bf16"},
                         distributed={"strategy": "auto", "num_processes": 2, "pipeline_parallel": "auto"})


def test_pipeline_parallel_auto_picks_stages_where_only_they_fit_and_data_parallel_where_it_is_faster(tmp_path,
                                                                                                       capsys):
    path = _auto_stages(tmp_path, "1.5GiB")
    assert main(["validate", str(path)]) == 0
    capsys.readouterr()
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] and (plan["plan"]["pipeline_parallel"], plan["plan"]["strategy"]) == (2, "none")
    why = next(r for r in plan["reasons"] if r.startswith("pipeline parallel 2 (distributed.pipeline_parallel auto)"))
    assert "stage peaks" in why and "bubble 33%" in why and "point-to-point sends" in why
    assert "1 does not fit" in why
    (tmp_path / "roomy").mkdir()
    assert main(["plan", "tiny", "-f", str(_auto_stages(tmp_path / "roomy", "3GiB")), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["plan"]["pipeline_parallel"], plan["plan"]["strategy"]) == (1, "ddp")
    why = next(r for r in plan["reasons"] if r.startswith("pipeline parallel 1 (distributed.pipeline_parallel auto)"))
    assert "2 is slower" in why


def test_pipeline_parallel_auto_does_not_try_stages_for_a_tied_head_and_says_why(tmp_path, capsys):
    path = tiny_pipeline(tmp_path, distributed={"strategy": "auto", "num_processes": 2, "pipeline_parallel": "auto"})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["pipeline_parallel"] == 1
    assert any("2 not tried (the model ties its output head" in r for r in plan["reasons"])
