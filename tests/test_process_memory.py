"""The plan covers the whole training process, not one step: loading, the first step, a checkpoint, the final
export (and reports the evaluate stage's own peak), names the phase of the peak, and on CPU a run stays under
it in resident memory, levers included."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import transformers

from fulltune.cli import main
from fulltune.memory import Settings, estimate_memory
from fulltune.memory.process import CPU_LIBRARY_PAGES_SPREAD
from fulltune.memory.process import EVALUATION, LOAD, STEP, TRAINING_PHASES
from pipelines_fixture import tiny_pipeline
from benchmarks import process_memory

MiB = 2**20


def llama(**overrides) -> transformers.LlamaConfig:
    kwargs = dict(vocab_size=512, hidden_size=384, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=6,
                  num_key_value_heads=2, tie_word_embeddings=True)
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


FRONTIER = Settings(micro_batch_size=4, seq_len=128, gradient_checkpointing=3, mixed_precision="bf16",
                    optimizer="adafactor", pure_bf16=True, optimizer_in_backward=True, device="cpu")


def test_plan_names_the_phase_of_the_peak_in_text_and_json(tmp_path, capsys):
    path = tiny_pipeline(tmp_path)
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    estimate = plan["plan"]["estimate"]
    assert set(TRAINING_PHASES) | {EVALUATION} == set(estimate["phases"])
    assert estimate["process_peak_phase"] in TRAINING_PHASES
    # What must fit is the largest phase of the training process; the step is one of them.
    assert estimate["device_bytes"] == max(estimate["phases"][p] for p in TRAINING_PHASES)
    assert estimate["device_bytes"] >= estimate["step_device_bytes"] == estimate["phases"][STEP]
    assert main(["plan", "tiny", "-f", str(path)]) == 0
    text = capsys.readouterr().out
    assert "process peak in" in text and "whole process (plan): load " in text and "evaluation" in text


def test_a_cast_at_load_holds_the_file_beside_the_weights_and_can_be_the_peak():
    from fulltune.memory import num_parameters
    from fulltune.memory.process import CPU_LOAD_PROCESS_BYTES

    params = 2 * num_parameters(llama())  # bf16 weights
    # Pure bf16 from an fp32 checkpoint: every fp32 page of the file is read while the bf16 copies are made.
    fp32_file = estimate_memory(llama(), FRONTIER)
    assert fp32_file.phases[LOAD] == CPU_LOAD_PROCESS_BYTES + 2 * params + params
    # From a bf16 checkpoint the weights are views of the file's pages: nothing beside them.
    bf16_file = estimate_memory(llama(dtype="bfloat16"), FRONTIER)
    assert bf16_file.phases[LOAD] == CPU_LOAD_PROCESS_BYTES + params
    # The 76M Llama of the frontier case: loading is the process's peak, above the steady step.
    big = estimate_memory(llama(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                                num_key_value_heads=4), replace(FRONTIER, gradient_checkpointing=11))
    assert big.process_peak_phase == LOAD and big.device_bytes == big.phases[LOAD] > big.step_device_bytes
    # fp32 training from an fp32 checkpoint: the step holds the weights, their gradients and the states.
    fp32 = estimate_memory(llama(), replace(FRONTIER, pure_bf16=False, mixed_precision="no"))
    assert fp32.process_peak_phase == STEP


@pytest.mark.slow
def test_a_lever_run_on_cpu_stays_under_its_whole_process_estimate(tmp_path):
    """Pure bf16 + Adafactor stepped in backward + checkpointing, on the trainer's own functions: the peak RSS
    of every phase is at most the plan's whole-process estimate, and that estimate is within 15% of it."""
    case = process_memory.CASES["llama-6m-frontier"]
    measured = process_memory.measure(case, tmp_path)
    estimated = process_memory.estimated_phases(case, measured["target_fraction"])
    peak = max(max(measured["sampled"].values()), max(measured["hwm_after"].values()))
    numbers = json.dumps({"measured": measured, "estimated": estimated})
    # Never below; within 15% beyond what the libraries' resident file pages vary between installations.
    assert peak <= estimated["device_bytes"] <= 1.15 * peak + CPU_LIBRARY_PAGES_SPREAD, numbers
