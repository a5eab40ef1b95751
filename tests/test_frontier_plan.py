"""The memory levers in the planner: Llama-3 8B on one 24 GiB GPU, 70B on 8×80 GiB and, with FSDP's CPU
offload and 1 TiB of host RAM, on 8×24 and 8×40 GiB keep their effective batch, the plan says host RAM and step time, a host RAM budget is respected, and every lever's estimate is
within 3% of the traced step (FakeTensorMode: nothing is allocated)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import transformers

from fulltune.memory import PlanRequest, Settings, estimate_memory, format_bytes, format_plan_table
from fulltune.planning import plan_memory, simulate_memory
from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.shapes import model_shape

GiB = 2**30


def llama3(hidden: int, intermediate: int, layers: int, heads: int) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                                    num_attention_heads=heads, num_key_value_heads=8, vocab_size=128256,
                                    tie_word_embeddings=False)


LLAMA_8B = llama3(4096, 14336, 32, 32)
LLAMA_70B = llama3(8192, 28672, 80, 64)
LLAMA_70B_PARAMS = 70_553_706_496


def gpu_request(**overrides) -> PlanRequest:
    # Packed rows without padding: no attention mask. The trainer's default optimizer (adamw).
    kwargs = dict(effective_batch_size=8, seq_len=2048, device="cuda", bf16_supported=True, budget_bytes=24 * GiB,
                  attention_mask=False, optimizer="adamw", host_memory_bytes=256 * GiB)
    kwargs.update(overrides)
    return PlanRequest(**kwargs)


def test_llama3_8b_fits_one_24gib_gpu_with_the_effective_batch_kept():
    plan = plan_memory(LLAMA_8B, gpu_request())
    s = plan.settings
    assert plan.fits
    assert s.micro_batch_size * s.gradient_accumulation_steps == 8
    assert s.pure_bf16 and s.offload_optimizer and s.chunked_loss
    assert plan.expected_bytes <= plan.usable_bytes
    host = plan.plan_estimate.host_bytes
    assert 100 * GiB < host <= 256 * GiB  # fp32 masters + gradients + AdamW states of 8B parameters
    text = format_plan_table(plan)
    assert "host RAM" in text and "s/step" in text and "estimated step time" in text
    assert "offload_optimizer: " in text and "saves" in text
    data = plan.to_dict()
    assert data["plan"]["offload_optimizer"] is True and data["plan"]["host_bytes"] == host
    assert data["plan"]["estimated_step_seconds"] > 0


def test_a_small_host_memory_budget_refuses_offload_and_says_so():
    plan = plan_memory(LLAMA_8B, gpu_request(host_memory_bytes=32 * GiB))
    assert not plan.settings.offload_optimizer or not plan.fits
    assert not plan.fits  # 8B needs its optimizer states somewhere: not on a 24 GiB GPU, not in 32 GiB of RAM
    assert any("budget.host_memory" in r and "refused" in r for r in plan.reasons)


def test_strategy_auto_keeps_the_parameters_on_one_gpu_where_they_fit():
    # Both fit without a lever or checkpointing, in the same step time: the unsharded strategy stays.
    plan = plan_memory(LLAMA_8B, gpu_request(budget_bytes=80 * GiB, strategy="auto", effective_batch_size=1,
                                             seq_len=512))
    assert plan.fits and plan.settings.strategy == "none"
    assert plan.to_dict()["plan"]["strategy"] == "none" and plan.to_dict()["plan"]["host_step"] is None
    assert any(r.startswith("strategy none (distributed.strategy auto)") for r in plan.reasons)


@pytest.mark.slow
def test_strategy_auto_puts_the_parameters_in_host_ram_where_only_that_fits_one_gpu():
    request = gpu_request(budget_bytes=12 * GiB, optimizer=None)
    unsharded = plan_memory(LLAMA_8B, request)
    assert not unsharded.fits  # 16 GiB of bf16 weights alone
    advice = [s for s in unsharded.suggestions if s.startswith("distributed.strategy: fsdp (or auto)")]
    assert advice and "parameters in host RAM" in advice[0]

    plan = plan_memory(LLAMA_8B, replace(request, strategy="auto"))
    s = plan.settings
    assert plan.fits and (s.strategy, s.num_processes, s.offload_optimizer) == ("fsdp", 1, True)
    assert plan.to_dict()["plan"]["strategy"] == "fsdp"
    assert plan.expected_bytes <= plan.usable_bytes and plan.plan_estimate.host_bytes <= 256 * GiB
    line = next(r for r in plan.reasons if r.startswith("parameters in host RAM (FSDP2 CPU offload over one GPU)"))
    assert "strategy none needs" in line
    terms = next(r for r in plan.reasons if r.startswith("step time "))
    assert "parameters in" in terms and "host optimizer step" in terms and "tokens/s" in terms
    assumed = next(r for r in plan.reasons if r.startswith("step-time terms assumed, not measured"))
    assert "PCIe at 25 GB/s" in assumed and "host optimizer at 1.5 GB/s" in assumed


def test_one_process_copies_its_parameters_in_on_the_compute_stream():
    """FSDP2 at world size 1 gathers on the compute stream: the parameter copies add to the step in full, only
    the gradient copies hide behind compute; over several processes both hide (torch 2.13's FSDPParamGroup)."""
    from fulltune.planning.step_time import OFFLOAD_OVERLAP, fsdp_offload_terms

    shape = model_shape(LLAMA_8B)
    one = Settings(micro_batch_size=2, seq_len=4096, device="cuda", mixed_precision="bf16", strategy="fsdp",
                   num_processes=1, offload_optimizer=True, attention_mask=False)
    t = fsdp_offload_terms(shape, one)
    assert t["params_in_s"] == pytest.approx(2 * t["grads_out_s"])
    assert t["pcie_bytes"] == 3 * 4 * shape.num_params  # fp32 shards: in twice, out once
    hidden = OFFLOAD_OVERLAP * t["compute_s"]
    assert t["exposed_pcie_s"] == pytest.approx(t["params_in_s"] + max(0.0, t["grads_out_s"] - hidden))
    eight = fsdp_offload_terms(shape, replace(one, num_processes=8))
    assert eight["exposed_pcie_s"] == pytest.approx(max(0.0, eight["pcie_s"] - OFFLOAD_OVERLAP * eight["compute_s"]))
    assert eight["exposed_pcie_s"] < t["exposed_pcie_s"] / 8


def test_one_process_under_cpu_offload_counts_the_parameter_it_stages_while_gathering():
    """Each parameter comes in as an fp32 copy and its bf16 cast before the gathered unit holds it: the embedding
    when it is gathered, the largest layer matrix while a layer is."""
    one = Settings(micro_batch_size=1, seq_len=2048, device="cuda", mixed_precision="bf16", strategy="fsdp",
                   num_processes=1, offload_optimizer=True, attention_mask=False, gradient_checkpointing=32)
    from fulltune.memory.estimate import _estimate

    shape = model_shape(LLAMA_8B)
    staged, plain = [], []
    _estimate(shape, one, staged)
    _estimate(shape, replace(one, offload_optimizer=False), plain)
    vh, layer = 128256 * 4096, 4096 * 14336  # the embedding; a layer's largest matrix (an MLP projection)
    # The embedding's forward: the gathered bf16 embedding and the root (final norm), plus the embedding's fp32
    # copy and bf16 cast being staged; without offload its fp32 shard is among the persistent parameters.
    assert staged[0][0] == "forward" and staged[0][2]["parameters"] == 2 * vh + 2 * 4096 + 6 * vh + 4 * (128 // 2)
    assert plain[0][2]["parameters"] > staged[0][2]["parameters"]
    # A layer's backward, first phase: the layer gathered again, its largest matrix staged.
    layer5 = [parts for name, _, parts in staged if name == "backward of layer 5"]
    assert layer5[0]["parameters"] - layer5[1]["parameters"] == 6 * layer


@pytest.mark.slow
@pytest.mark.parametrize(("config", "budget_gib", "host_gib"), [
    (LLAMA_70B, 80, 1024),  # Llama-3-70B, seq 4096 packed, effective batch 64, one 80 GiB GPU
    (llama3(12288, 33792, 72, 96), 141, 1536),  # a 120B Llama shape on one 141 GiB GPU: MegaTrain's record
])
def test_parameters_in_host_ram_fit_70b_and_120b_on_one_gpu_with_a_step_time_that_adds_up(config, budget_gib,
                                                                                          host_gib):
    from fulltune.memory.units import format_seconds

    request = PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                          budget_bytes=budget_gib * GiB, attention_mask=False, strategy="auto", num_processes=1,
                          host_memory_bytes=host_gib * GiB)
    plan = plan_memory(config, request)
    s = plan.settings
    assert plan.fits and (s.strategy, s.num_processes, s.offload_optimizer) == ("fsdp", 1, True)
    assert s.micro_batch_size * s.gradient_accumulation_steps == 64
    assert plan.expected_bytes <= plan.usable_bytes and plan.plan_estimate.host_bytes <= host_gib * GiB
    terms = next(r for r in plan.reasons if r.startswith("step time "))
    # The terms add up to the step time the plan ranks by; `plan --json` carries them, with what is assumed.
    assert terms.startswith(f"step time {format_seconds(plan.estimated_step_seconds)} = compute ")
    step = plan.to_dict()["plan"]["host_step"]
    assert step["seconds"] == pytest.approx(plan.estimated_step_seconds)
    assert step["wall_s"] == pytest.approx(step["compute_s"] + step["exposed_pcie_s"] + step["host_step_s"]
                                           + sum(step["levers"].values()))
    assert step["exposed_pcie_s"] >= step["params_in_s"] > 0  # one process: the parameter copies are not hidden
    assert step["tokens_per_s"] == pytest.approx(64 * 4096 / step["wall_s"])
    assert step["assumed"]["pcie_bytes_per_s"] == 25e9 and step["measured_correction"] is None


def test_levers_fixed_off_are_never_turned_on():
    plan = plan_memory(LLAMA_8B, gpu_request(offload_optimizer=False, pure_bf16=False))
    assert not plan.fits and not plan.settings.offload_optimizer and not plan.settings.pure_bf16


def test_optimizer_in_backward_needs_one_micro_batch_per_step():
    with pytest.raises(MemoryConfigError, match="gradient_accumulation_steps"):
        gpu_request(optimizer_in_backward=True, gradient_accumulation_steps=2)
    plan = plan_memory(LLAMA_8B, gpu_request(optimizer_in_backward=True, offload_optimizer=False, optimizer=None,
                                             budget_bytes=48 * GiB))
    assert plan.settings.gradient_accumulation_steps == 1 and plan.settings.micro_batch_size == 8


def test_llama3_70b_fits_8x80gib_with_fsdp_and_the_effective_batch_kept():
    request = PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                          budget_bytes=80 * GiB, attention_mask=False, strategy="fsdp", num_processes=8,
                          host_memory_bytes=1024 * GiB)
    plan = plan_memory(LLAMA_70B, request)
    s = plan.settings
    assert plan.fits
    assert s.micro_batch_size * s.gradient_accumulation_steps * s.num_processes == 64
    assert s.pure_bf16 and not s.offload_optimizer  # the gradient hooks run on one process only
    assert "estimated step time" in format_plan_table(plan)


def fsdp_70b_request(gib: int, host_gib: int = 1024) -> PlanRequest:
    return PlanRequest(effective_batch_size=64, seq_len=4096, device="cuda", bf16_supported=True,
                       budget_bytes=gib * GiB, attention_mask=False, strategy="fsdp", num_processes=8,
                       host_memory_bytes=host_gib * GiB)


@pytest.mark.parametrize("gib", [24, 40])
def test_llama3_70b_fits_8_gpus_of_24_or_40gib_with_fsdp_cpu_offload_and_1tib_of_host_ram(gib):
    plan = plan_memory(LLAMA_70B, fsdp_70b_request(gib))
    s = plan.settings
    assert plan.fits and s.offload_optimizer and s.strategy == "fsdp"
    assert s.micro_batch_size * s.gradient_accumulation_steps * s.num_processes == 64
    assert plan.expected_bytes <= plan.usable_bytes  # device memory per GPU
    host = plan.plan_estimate.host_bytes  # per machine: 8 ranks' shards + rank 0's export
    assert 2 * LLAMA_70B_PARAMS <= host <= 1024 * GiB
    assert plan.estimated_step_seconds > 0
    text = format_plan_table(plan)
    assert "host RAM per machine" in text and "FSDP's CPU offload" in text and "estimated step time" in text
    # The summary and the reasons name the one figure the same way: the machine's, not each process's.
    figure = format_bytes(host)
    assert f"host RAM for the offloaded tensors: {figure} per machine" in text
    assert f"host RAM per machine: {figure}" in text and f"{figure} per process" not in text
    data = plan.to_dict()["plan"]
    assert data["offload_optimizer"] is True and data["host_bytes"] == host


def test_fsdp_offload_over_the_host_ram_budget_is_refused_and_says_so():
    plan = plan_memory(LLAMA_70B, fsdp_70b_request(24, host_gib=256))
    assert not plan.fits  # 8 ranks' shards of 70B do not fit 256 GiB of one machine's RAM
    assert any("budget.host_memory" in r and "refused" in r for r in plan.reasons)


def test_a_configuration_that_fits_turns_no_lever_on():
    small = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                                     num_attention_heads=4, num_key_value_heads=2, vocab_size=32000)
    plan = plan_memory(small, gpu_request(seq_len=256))
    assert plan.fits and not any(plan.settings.levers().values())


# --- estimate vs trace, per lever ---------------------------------------------------------------

TINY = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=16384, max_position_embeddings=256)
BASE = Settings(micro_batch_size=2, seq_len=128, mixed_precision="bf16", attention_mask=False)
LEVER_CASES = {
    "pure_bf16": dict(pure_bf16=True),
    "chunked_loss": dict(chunked_loss=True),
    "chunked_loss_fp32": dict(chunked_loss=True, mixed_precision="no"),
    "optimizer_in_backward": dict(optimizer_in_backward=True, gradient_checkpointing=2),
    "offload_optimizer": dict(offload_optimizer=True),
    "offload_optimizer_accumulating": dict(offload_optimizer=True, gradient_accumulation_steps=2),
    "offload_activations": dict(offload_activations=True, gradient_checkpointing=2),
    "all_with_8bit": dict(pure_bf16=True, optimizer="adamw_8bit", optimizer_in_backward=True, chunked_loss=True,
                          gradient_checkpointing=1, offload_activations=True),
    "pure_offload_chunked": dict(pure_bf16=True, offload_optimizer=True, chunked_loss=True, gradient_checkpointing=2),
}


@pytest.mark.parametrize("case", sorted(LEVER_CASES))
def test_estimate_is_within_3_percent_of_the_traced_step_for_each_lever(case):
    settings = replace(BASE, **LEVER_CASES[case])
    estimate = estimate_memory(TINY, settings).peak_bytes
    traced = simulate_memory(TINY, settings).peak_bytes
    assert abs(estimate / traced - 1) <= 0.03, (case, estimate, traced)


# ---------------------------------------------------------------------------------------------------
# The whole pipeline: training, the streamed export and the evaluate stage inside the budget


def test_the_8b_evaluate_stage_runs_in_bf16_with_its_batches_fitted_to_the_24gib_gpu():
    """fp32 copies with a generous batch needed ~3× the GPU; the plan evaluates in the trained bf16 and
    lowers each phase's batch to what fits beside the weights."""
    from fulltune.memory.evaluation import EvalRequest

    generous = EvalRequest(batch_size=64, seq_len=2048, max_new_tokens=256)
    plan = plan_memory(LLAMA_8B, gpu_request(evaluation=generous))
    evaluation = plan.evaluation
    assert plan.fits and evaluation["fits"] and evaluation["dtype"] == "bf16" and evaluation["offload"] is None
    assert 1 <= evaluation["loss_batch"] < 64 and 1 <= evaluation["generation_batch"] < 64
    assert evaluation["device_bytes"] <= plan.usable_bytes
    assert plan.plan_estimate.phases["evaluation"] == evaluation["device_bytes"]
    fp32 = plan_memory(LLAMA_8B, gpu_request(budget_bytes=None, evaluation=replace(generous, precision="fp32")))
    assert fp32.evaluation["device_bytes"] > 3 * 24 * GiB
    assert "evaluation (the evaluate stage's own process, bf16 weights)" in format_plan_table(plan)


def test_the_70b_evaluate_stage_is_sharded_over_the_8_gpus_that_trained_it():
    from fulltune.memory.evaluation import EvalRequest

    request = replace(fsdp_70b_request(80), evaluation=EvalRequest(batch_size=8, seq_len=4096))
    plan = plan_memory(LLAMA_70B, request)
    evaluation = plan.evaluation
    assert plan.fits and evaluation["fits"] and evaluation["dtype"] == "bf16" and evaluation["processes"] == 8
    assert evaluation["offload"] is None and evaluation["loss_batch"] == 8
    # Per GPU: an eighth of the bf16 weights (16.4 GiB, not 131 GiB) and the units FSDP2 gathers.
    assert evaluation["memory"]["weights"] == -(-LLAMA_70B_PARAMS // 8) * 2
    assert 0 < evaluation["memory"]["gathered"] < 5 * GiB
    assert evaluation["device_bytes"] <= plan.usable_bytes
    assert "8 processes of the evaluate stage, FSDP2-sharded, per process" in format_plan_table(plan)
    # On 8×24 GiB an eighth of the weights and a batch of 1 do not fit a GPU: the shards go to host RAM, as
    # training's CPU offload keeps them, and the GPU holds the gathered units and the batches.
    small = plan_memory(LLAMA_70B, replace(request, budget_bytes=24 * GiB))
    evaluation = small.evaluation
    assert small.fits and evaluation["fits"] and evaluation["processes"] == 8
    assert evaluation["offload"] == {"device_bytes": 0, "host_bytes": 8 * (-(-LLAMA_70B_PARAMS // 8) * 2)}
    assert evaluation["device_bytes"] <= small.usable_bytes and "shards in host RAM" in evaluation["reason"]


def test_a_sharded_run_whose_model_fits_one_gpu_is_evaluated_on_one_process_unless_told_to_shard():
    """evaluate.processes auto: the 8B model trained FSDP over 8 GPUs of 80 GiB (bf16 weights: 15 GiB) is evaluated
    on one process at the configured batches, no second launch of 8; 8 shards it like the training; the 70B
    model, which one GPU cannot hold, is sharded under auto."""
    from fulltune.memory.evaluation import EvalRequest, plan_evaluation

    settings = Settings(micro_batch_size=1, seq_len=4096, device="cuda", mixed_precision="bf16", strategy="fsdp",
                        num_processes=8)
    request = EvalRequest(batch_size=8, seq_len=4096)
    one = plan_evaluation(model_shape(LLAMA_8B), settings, request, 76 * GiB)
    assert one.fits and one.processes == 1 and one.loss_batch == 8 and one.offload_device_bytes is None
    assert "on one process: the whole model fits one device" in one.reason
    assert one.memory.weights == 2 * model_shape(LLAMA_8B).num_params
    sharded = plan_evaluation(model_shape(LLAMA_8B), settings, replace(request, processes=8), 76 * GiB)
    assert sharded.fits and sharded.processes == 8 and sharded.memory.weights < one.memory.weights / 7
    # Lowered batches on one process are not a fit for auto: then it shards, as the 70B model does.
    tight = plan_evaluation(model_shape(LLAMA_8B), settings, replace(request, batch_size=512), 20 * GiB)
    assert tight.processes == 8
    assert plan_evaluation(model_shape(LLAMA_70B), settings, request, 76 * GiB).processes == 8
    assert plan_evaluation(model_shape(LLAMA_70B), settings, replace(request, processes=1), 76 * GiB).processes == 1


def test_evaluate_processes_names_what_sharding_the_evaluation_needs():
    from fulltune.errors import ConfigError
    from fulltune.pipelines_file import validate_pipelines

    def pipelines(processes, **distributed):
        return {"pipelines": {"t": {"model": {"name_or_path": "local/model"}, "data": {"train": "train.jsonl"},
                                    "train": {"effective_batch_size": 4}, "evaluate": {"processes": processes},
                                    "distributed": distributed}}}

    for processes in ("auto", 1, 2):
        validate_pipelines(pipelines(processes, strategy="fsdp", num_processes=2))
    for processes, distributed in ((4, {"strategy": "fsdp", "num_processes": 2}),
                                   (2, {"strategy": "ddp", "num_processes": 2})):
        with pytest.raises(ConfigError, match=r"pipelines.t: evaluate.processes: \d shards each candidate over the "
                                              r"training's processes, which needs distributed.strategy fsdp"):
            validate_pipelines(pipelines(processes, **distributed))
    with pytest.raises(ConfigError, match=r"evaluate.processes"):
        validate_pipelines(pipelines(0, strategy="fsdp", num_processes=2))


def test_the_70b_evaluate_stage_of_one_process_is_layer_offloaded_where_one_gpu_cannot_hold_its_weights():
    from fulltune.memory.evaluation import EvalRequest, plan_evaluation

    settings = Settings(micro_batch_size=1, seq_len=4096, device="cuda", mixed_precision="bf16")
    usable, request = 76 * GiB, EvalRequest(batch_size=8, seq_len=4096)
    shape = model_shape(LLAMA_70B)
    plan = plan_evaluation(shape, settings, request, usable, 1024 * GiB)
    assert plan.fits and plan.dtype == "bf16" and plan.processes == 1 and plan.offload_device_bytes is not None
    assert plan.offload_device_bytes + plan.offload_host_bytes == 2 * LLAMA_70B_PARAMS
    assert plan.device_bytes <= usable and "layer-offloaded" in plan.reason
    # Without the host RAM to hold the rest, the plan refuses before training, and says why.
    refused = plan_evaluation(shape, settings, replace(request, precision="fp32"), usable, 160 * GiB)
    assert not refused.fits and "evaluation does not fit even layer-offloaded" in refused.reason


def test_the_70b_export_streams_its_host_ram_is_one_file_not_the_model():
    from fulltune.memory.process import node_host_bytes

    plan = plan_memory(LLAMA_70B, replace(fsdp_70b_request(80), host_memory_bytes=int(23.5 * GiB)))
    rank = plan.plan_estimate.host_bytes
    export = node_host_bytes(model_shape(LLAMA_70B), plan.settings, 0, 8)["export"]
    assert export <= 2 * 128256 * 8192 * 2 < 2 * LLAMA_70B_PARAMS / 30  # the bf16 embedding, not 131 GiB
    assert not any("host_memory" in r and "refused" in r for r in plan.reasons) and rank <= 23.5 * GiB


def test_advice_names_the_host_ram_its_configuration_needs_when_none_fits_budget_host_memory():
    # Every FSDP configuration needs host RAM at the export; 1 GiB holds none of them.
    plan = plan_memory(LLAMA_70B, replace(fsdp_70b_request(80), host_memory_bytes=GiB))
    assert not plan.fits
    assert "budget.host_memory of" in plan.suggestions[0] and "per machine" in plan.suggestions[0]


def test_a_gpu_plan_made_without_a_gpu_says_what_host_memory_auto_assumed(tmp_path, capsys):
    import json

    from fulltune.memory.budget import _gpu_visible

    if _gpu_visible():
        pytest.skip("this machine has a GPU: host_memory auto is its own RAM")
    from fulltune.cli import main
    from pipelines_fixture import tiny_pipeline

    path = tiny_pipeline(tmp_path, budget={"device": "cuda", "memory": "24GiB"})
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    reasons = json.loads(capsys.readouterr().out)["reasons"]
    assert any("host_memory is auto and this machine has no GPU" in r and "set budget.host_memory" in r
               for r in reasons), reasons


def test_the_alternatives_name_each_settings_once():
    # The search's stages reach some settings twice (8B on 48 GiB: one of the three that do not fit).
    plan = plan_memory(LLAMA_8B, gpu_request(budget_bytes=48 * GiB, seq_len=2048))
    settings = [{k: v for k, v in alt.items() if k != "rejected_because"} for alt in plan.alternatives]
    assert len(settings) > 1 and all(a != b for i, a in enumerate(settings) for b in settings[i + 1:])
    lines = format_plan_table(plan).split("alternatives:\n")[1].splitlines()
    assert len(lines) == len(set(lines)) == min(len(settings), 5)  # the table shows the first five
