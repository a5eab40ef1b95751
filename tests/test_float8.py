"""`train.float8`: torchao's float8 training of the decoder layers' linears, planned like every lever.

On CPU (torchao 0.18 runs float8 matmuls there, not fast): a run with float8 trains like the same run without it
(its loss within 2% after the same steps) and its step peak is within 3% of the memory model's estimate, on the
trainer's own step (tests/float8_worker.py) and through `fulltune run` under FSDP2 over two processes; each
converted linear's float8 casts hold what `memory.float8` counts. The tests that need torchao run it in processes of
their own (tests/lowbit.py). What float8 refuses, what `auto` decides and what the plan says need no torchao.
Its speed is a GPU's to measure: benchmarks/device_check.py (`float8_case`).
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import transformers

from fulltune import levers
from fulltune.cli import main
from fulltune.memory import PlanRequest, Settings, estimate_memory
from fulltune.memory.float8 import converted, kept
from fulltune.memory.shapes import model_shape
from pipelines_fixture import tiny_pipeline

LLAMA = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                 num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.slow
def test_float8_trains_like_bf16_and_holds_what_the_plan_counts(tmp_path: Path) -> None:
    import lowbit

    done = subprocess.run([sys.executable, str(Path(__file__).parent / "float8_worker.py"), str(tmp_path)],
                          env=lowbit.environment(OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    variants = result["variants"]
    every = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj"]
    for name, plain in (("pure_bf16_float8_tensorwise", "pure_bf16"), ("pure_bf16_float8_rowwise", "pure_bf16"),
                        ("fp32_float8_tensorwise", "fp32")):
        run = variants[name]
        assert run["float8_linears"] == every and variants[plain]["float8_linears"] == [], name
        # Trains: the loss falls, and after the same steps it is within 2% of the run without float8.
        assert run["losses"][-1] < 0.8 * run["losses"][0], (name, run["losses"])
        assert run["losses"][-1] == pytest.approx(variants[plain]["losses"][-1], rel=0.02), name
        # The steady steps' peak (the first allocates the optimizer's states) within 3% of the estimate.
        measured = max(run["peaks"][1:])
        assert abs(run["estimate"] / measured - 1) <= 0.03, (name, run["estimate"], measured)
        assert measured > max(variants[plain]["peaks"][1:]), name  # the casts' bytes are real, and counted
    for row in result["linears"]:  # one converted linear: its forward's and backward's peaks as counted
        assert row["counted_forward"] == pytest.approx(row["forward"], rel=0.005), row
        assert row["counted_backward"] == pytest.approx(row["backward"], rel=0.005), row


@pytest.mark.slow
def test_fulltune_run_trains_float8_under_fsdp_like_the_same_run_without_it(tmp_path: Path, shared_run,
                                                                             prefect_server) -> None:
    """The shared two-process FSDP run (tests/runs.py TWO_SHARDS) with float8 on: the plan says what is converted,
    each process's step peak is within 3% of its estimate, and the losses stay within 2% of the run without it.
    (Its evaluation is the default one, in one process: the shared run proves the sharded one and the harness.)"""
    import lowbit
    from runs import FSDP, SHARDED, TWO_SHARDS, assert_rank_peaks_within, finish, fulltune_run, loss_history

    plain = shared_run(**TWO_SHARDS)
    sections = {"train": {**FSDP, "float8": True}, "distributed": SHARDED}
    log = tmp_path / "run.log"
    run = fulltune_run(tiny_pipeline(tmp_path, **sections), log, prefect_server,
                       **{"PYTHONPATH": lowbit.environment()["PYTHONPATH"], "FULLTUNE_TRACK_MEMORY": "1"})
    output = finish(run, log)
    assert "float8: 7 of the 7 linears of each decoder layer run float8 matmuls (tensorwise scales)" in output
    assert "with float8 matmuls (tensorwise)" in output  # the trainer converted them
    assert_rank_peaks_within(tmp_path / "work", stages=[0, 0])
    float8_losses, plain_losses = loss_history(tmp_path / "work"), loss_history(plain.finish() / "work")
    assert float8_losses == pytest.approx(plain_losses, rel=0.02)


def float8_sets_accepted_by_validate() -> dict[str, list[dict[str, bool]]]:
    """float8 with each other lever on its own, AdamW, bf16 (pure bf16 beside it on one process and under DDP, where
    CPU autocast would stand in its way), under each strategy, validated as on a machine with torchao: the lever sets
    accepted, by strategy; a refused one names its fields."""
    from test_lever_table import STRATEGIES, validate

    accepted: dict[str, list[dict[str, bool]]] = {}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(levers, "_torchao_installed", lambda: True)  # what the training processes have
        for layout in STRATEGIES:
            base = {"float8": True, **({"pure_bf16": True} if layout != "fsdp" else {})}
            for other in (None, *(name for name in levers.LEVERS if name not in base)):
                on = {**dict.fromkeys(levers.LEVERS, False), **base, **({other: True} if other else {})}
                problem = validate(on, "adamw", layout)
                if problem is None:
                    accepted.setdefault(layout, []).append(on)
                else:
                    assert "pipelines.t" in problem and f"train.{other}" in problem, problem
    return accepted


def test_float8_beside_each_other_lever_is_refused_by_validate_or_accepted() -> None:
    """One process: alone and beside each of the 4 others; DDP: not beside the two that step from gradient hooks;
    FSDP on a CPU device: alone and beside each but its CPU offload (it needs CUDA). The accepted ones train two
    optimizer steps in tests/test_lever_table.py's processes (with torchao), beside every other combination."""
    accepted = float8_sets_accepted_by_validate()
    assert {layout: len(sets) for layout, sets in accepted.items()} == {"none": 5, "ddp": 3, "fsdp": 5}


# ---------------------------------------------------------------------------------------------------
# Without torchao: the lever table, `auto`, the plan


def test_float8_is_refused_where_it_cannot_train_naming_the_fields() -> None:
    def refused(**fields) -> list[str]:
        return levers.problems(levers.Combination(levers={"float8": True}, **fields), installed=False)

    assert refused() == []
    assert any(p.startswith("train.float8 with distributed.tensor_parallel:") for p in refused(
        strategy="fsdp", num_processes=2, tensor_parallel=2))
    assert any(p.startswith("train.float8 with train.mixed_precision:") for p in refused(mixed_precision="fp16"))
    assert any(p.startswith("train.float8 with distributed.pipeline_parallel:") for p in refused(
        pipeline_parallel=2, num_processes=2))
    # CPU autocast is not what torchao's float8 linear follows; pure bf16, fp32 or FSDP's bf16 weights are.
    assert any(p.startswith("train.float8 with train.mixed_precision with budget.device:")
               for p in refused(device="cpu", mixed_precision="bf16"))
    assert levers.problems(levers.Combination(levers={"float8": True, "pure_bf16": True}, device="cpu",
                                              mixed_precision="bf16"), installed=False) == []
    assert refused(device="cpu", mixed_precision="bf16", strategy="fsdp", num_processes=2) == []
    assert refused(device="cuda", mixed_precision="bf16") == []


@pytest.mark.skipif(levers._torchao_installed(), reason="torchao is installed")
def test_float8_without_torchao_says_what_to_install(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tiny_pipeline(tmp_path, train={"float8": True, "pure_bf16": True, "mixed_precision": "bf16"})
    assert main(["validate", str(path)]) == 2
    assert "train.float8: float8 training needs torchao: pip install 'fulltune[lowbit]'" in capsys.readouterr().err


def test_a_bad_recipe_is_refused_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["validate", str(tiny_pipeline(tmp_path, train={"float8_recipe": "blockwise"}))]) == 2
    assert "pipelines.tiny.train.float8_recipe" in capsys.readouterr().err


def test_auto_turns_float8_on_only_for_a_float8_gpu_with_a_compiled_step(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(levers, "_torchao_installed", lambda: True)
    gpu = PlanRequest(effective_batch_size=8, seq_len=128, device="cuda", float8_supported=True, compile=True)
    assert levers.decided(gpu)["float8"] is True
    assert levers.decided(replace(gpu, compile=False))["float8"] is False  # eager casts cost more than float8 saves
    assert levers.decided(replace(gpu, float8_supported=False))["float8"] is False  # an A100: no float8 tensor cores
    assert levers.decided(replace(gpu, float8=False))["float8"] is False  # what the user fixed stands
    assert levers.decided(PlanRequest(effective_batch_size=8, seq_len=128, device="cpu", compile=True))["float8"] is False
    monkeypatch.setattr(levers, "_torchao_installed", lambda: False)
    assert levers.decided(gpu)["float8"] is False


def test_the_plan_says_which_linears_stay_in_their_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    from fulltune.planning import plan_memory

    monkeypatch.setattr(levers, "_torchao_installed", lambda: True)  # planned for a GPU machine that has it

    # An intermediate size that is not a multiple of 16: the MLP's linears stay bf16, the attention's convert.
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=680, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    shape = model_shape(config)
    assert [x.name for x in kept(shape)] == ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    plan = plan_memory(config, PlanRequest(effective_batch_size=4, seq_len=64, device="cuda", budget_bytes=80 * 2**30,
                                           mixed_precision="bf16", float8=True))
    assert plan.settings.float8
    (line,) = [r for r in plan.reasons if r.startswith("float8:")]
    assert line == ("float8: 4 of the 7 linears of each decoder layer run float8 matmuls (tensorwise scales); the "
                    "output head and the embeddings stay bf16, and so do mlp.gate_proj, mlp.up_proj, mlp.down_proj "
                    "(a dimension not a multiple of 16)")
    # auto on a GPU without float8 tensor cores: off, and the plan says why.
    plan = plan_memory(config, PlanRequest(effective_batch_size=4, seq_len=64, device="cuda", budget_bytes=80 * 2**30,
                                           mixed_precision="bf16"))
    assert not plan.settings.float8
    assert "float8: auto stays off: it needs a GPU with float8 tensor cores (compute capability 8.9 or above) and " \
           "train.compile (eager, torchao's casts cost more than float8 saves)" in plan.reasons


def test_a_model_float8_converts_nothing_of_is_refused_naming_the_field() -> None:
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.planning import plan_memory

    gpt2 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=128)
    with pytest.raises(MemoryConfigError, match="train.float8: float8 training converts the decoder linears of the "
                                                "Llama layout"):
        plan_memory(gpt2, PlanRequest(effective_batch_size=4, seq_len=32, budget_bytes=2**30, float8=True))
    plan = plan_memory(gpt2, PlanRequest(effective_batch_size=4, seq_len=32, budget_bytes=2**30))  # auto: off
    assert not plan.settings.float8


def test_float8_changes_what_the_memory_model_counts() -> None:
    shape = model_shape(LLAMA)
    assert len(converted(shape)) == 7
    base = Settings(micro_batch_size=2, seq_len=256, mixed_precision="bf16", device="cuda")
    amp, amp8 = estimate_memory(LLAMA, base), estimate_memory(LLAMA, replace(base, float8=True))
    # Under autocast no 16-bit copy of a converted weight is kept from the forward to the backward; the casts add
    # their own bytes in the layers' backward.
    assert amp8.breakdown["activations"] < amp.breakdown["activations"]
    # FSDP2 on GPUs gathers the converted weights in float8 with tensorwise scales (rowwise: in bf16).
    fsdp = replace(base, strategy="fsdp", num_processes=8, float8=True)
    tensorwise, rowwise = estimate_memory(LLAMA, fsdp), estimate_memory(LLAMA, replace(fsdp, float8_recipe="rowwise"))
    assert tensorwise.peak_bytes < rowwise.peak_bytes
    # The step-time model ranks a float8 step faster on a GPU.
    from fulltune.planning.step_time import step_seconds

    assert step_seconds(shape, replace(base, float8=True)) < step_seconds(shape, base)
