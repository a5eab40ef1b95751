"""The memory model and planner: exact byte counts, planner rules, the plan --json contract."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import transformers

from fulltune.memory import (
    MemoryPlan,
    PlanRequest,
    Settings,
    estimate_memory,
    format_plan_table,
    parse_bytes,
    render_breakdown_png,
    resolve_budget,
)
from fulltune.planning import plan_memory, replan_after_oom
from fulltune.runtime.checkpointing import apply_gradient_checkpointing
from fulltune.memory.shapes import model_shape
from fulltune.memory.types import LEVERS

GiB = 2**30
MiB = 2**20


def tiny_llama(**overrides):
    # 2 layers, hidden 32, 4 heads of 8 (2 kv heads), MLP 64, vocab 128, untied lm head.
    kwargs = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    return transformers.LlamaConfig(**kwargs)


def small_llama(layers=8):
    """Big enough for the planner to have choices (~5M parameters, 32k vocabulary)."""
    return transformers.LlamaConfig(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32000,
    )


# --- parse_bytes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (1000000, 1000000),
        ("1000000", 1000000),
        ("24GiB", 24 * GiB),
        ("512MiB", 512 * MiB),
        ("1.5GB", 1_500_000_000),
        ("80 GiB", 80 * GiB),
        ("2TiB", 2 * 2**40),
        ("16g", 16 * GiB),
    ],
)
def test_parse_bytes_reads_sizes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["lots", "24 GiBs", "-1GiB", "", "1e9", -5, True, None, "GiB"])
def test_parse_bytes_rejects_garbage_with_a_clear_message(bad):
    with pytest.raises(ValueError, match="memory size|cannot read"):
        parse_bytes(bad)


# --- exact byte counts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        tiny_llama(),
        tiny_llama(tie_word_embeddings=True),
        transformers.Qwen2Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128,
        ),
        transformers.Qwen3Config(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=128, head_dim=16,
        ),
        transformers.GemmaConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, vocab_size=128, head_dim=8,
        ),
        transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=128, n_positions=64),
        transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, vocab_size=128
        ),
    ],
    ids=["llama", "llama-tied", "qwen2", "qwen3", "gemma", "gpt2", "gpt_neox"],
)
def test_parameter_count_matches_the_real_model(config):
    model = transformers.AutoModelForCausalLM.from_config(config)
    assert model_shape(config).num_params == sum(p.numel() for p in model.parameters())


def test_tiny_llama_parameters_gradients_and_adamw_states_by_hand():
    # embed 128·32 + 2 × (norms 2·32 + q 32·32 + k 16·32 + v 16·32 + o 32·32 + mlp 3·32·64)
    # + final norm 32 + lm_head 128·32 = 4096 + 2 × 9280 + 32 + 4096 = 26784 parameters in 21 tensors.
    P, tensors = 26784, 21
    settings = Settings(micro_batch_size=2, seq_len=16, gradient_accumulation_steps=2, attention_mask=False)
    est = estimate_memory(tiny_llama(), settings)
    b = est.breakdown
    assert b["parameters"] == 4 * P + 16  # fp32 weights + rotary inv_freq (4 floats)
    assert b["optimizer_states"] == 8 * P + 4 * tensors  # exp_avg + exp_avg_sq + fp32 step per tensor
    assert b["gradients"] == 4 * P  # accumulating: every gradient exists through the step
    assert sum(v for k, v in b.items() if k != "runtime_overhead") == est.peak_bytes
    assert est.device_bytes - est.peak_bytes == b["runtime_overhead"]


def test_tiny_llama_8bit_and_adafactor_states_by_hand():
    settings = Settings(micro_batch_size=1, seq_len=8, optimizer="adamw_8bit", attention_mask=False)
    # Tensors of 4096+ elements get uint8 states + one fp32 absmax per 256 elements per state:
    # embed and lm_head (4096 each), gate/up/down (2048 each: under 4096, so 32-bit), q/o (1024), ...
    big = [4096, 4096]
    small = 26784 - sum(big)
    expected = sum(2 * n + 2 * 4 * (n // 256) for n in big) + 8 * small + 2 * 256 * 4
    assert estimate_memory(tiny_llama(), settings).breakdown["optimizer_states"] == expected

    settings = replace(settings, optimizer="adafactor")
    shapes = model_shape(tiny_llama()).param_shapes
    expected = sum(4 * (sh[0] + sh[1]) if len(sh) == 2 else 4 * sh[0] for sh in shapes) + 4 * len(shapes)
    assert estimate_memory(tiny_llama(), settings).breakdown["optimizer_states"] == expected


def test_mixed_precision_keeps_fp32_weights_and_halves_activations():
    cfg = small_llama()
    fp32 = estimate_memory(cfg, Settings(micro_batch_size=8, seq_len=512))
    bf16 = estimate_memory(cfg, Settings(micro_batch_size=8, seq_len=512, mixed_precision="bf16"))
    assert bf16.breakdown["parameters"] == fp32.breakdown["parameters"]
    assert bf16.breakdown["optimizer_states"] == fp32.breakdown["optimizer_states"]
    assert bf16.breakdown["activations"] < 0.8 * fp32.breakdown["activations"]
    # Accelerate does not autocast fp16 on CPU: the same bytes as fp32.
    fp16_cpu = estimate_memory(cfg, Settings(micro_batch_size=8, seq_len=512, mixed_precision="fp16"))
    assert fp16_cpu.peak_bytes == fp32.peak_bytes


def test_checkpointing_more_layers_never_needs_more_memory():
    cfg = small_llama()
    cfg.vocab_size = 1000  # keep the logits from hiding the activations
    peaks = [
        estimate_memory(cfg, Settings(micro_batch_size=4, seq_len=1024, gradient_checkpointing=k)).peak_bytes
        for k in range(cfg.num_hidden_layers + 1)
    ]
    assert all(a >= b for a, b in zip(peaks, peaks[1:]))
    assert peaks[-1] < 0.5 * peaks[0]


@pytest.mark.parametrize("layout, tensor_parallel", [({}, 1), ({"strategy": "fsdp", "num_processes": 2}, 1),
                                                     ({"strategy": "fsdp", "num_processes": 4, "tensor_parallel": 2}, 2)])
def test_offloaded_activations_save_all_but_the_input_a_layer_recomputes_under_every_layout(layout, tensor_parallel):
    """Offloading k checkpointed layers' inputs saves k − 1 of them at a layer's backward: the input the layer
    recomputes from is back on the device (one process, FSDP, FSDP × TP alike: one walk, memory/walk.py)."""
    cfg = tiny_llama(num_hidden_layers=4)
    b, s, k = 2, 256, 4
    peaks = [estimate_memory(cfg, Settings(micro_batch_size=b, seq_len=s, gradient_checkpointing=k, device="cuda",
                                           offload_activations=offload, **layout)) for offload in (False, True)]
    assert all(p.peak_phase.startswith("backward of layer") for p in peaks)
    layer_input = 4 * b * (s // tensor_parallel) * cfg.hidden_size  # a rank's fp32 (b, s/T, h) block input
    assert peaks[0].peak_bytes - peaks[1].peak_bytes == (k - 1) * layer_input


def test_validate_refuses_offloaded_activations_under_fsdp_on_cuda_naming_the_fields():
    """Unmeasured on a GPU, the combination is refused (the lever table); on a CPU device nothing is offloaded."""
    from fulltune.errors import ConfigError
    from fulltune.pipelines_file import validate_pipelines

    def pipelines(device):
        return {"pipelines": {"t": {
            "model": {"name_or_path": "local/model"}, "data": {"train": "train.jsonl"}, "budget": {"device": device},
            "train": {"effective_batch_size": 4, "offload_activations": True, "gradient_checkpointing": True,
                      "mixed_precision": "bf16"},
            "distributed": {"strategy": "fsdp", "num_processes": 2}}}}

    with pytest.raises(ConfigError, match=r"train.offload_activations with distributed.strategy with budget.device"):
        validate_pipelines(pipelines("cuda"))
    validate_pipelines(pipelines("cpu"))


def test_sharding_strategies_divide_per_process_states():
    cfg = small_llama()
    one = estimate_memory(cfg, Settings(micro_batch_size=1, seq_len=256))
    fsdp = estimate_memory(cfg, Settings(micro_batch_size=1, seq_len=256, strategy="fsdp", num_processes=4))
    ddp = estimate_memory(cfg, Settings(micro_batch_size=1, seq_len=256, strategy="ddp", num_processes=4))
    assert fsdp.breakdown["optimizer_states"] == pytest.approx(one.breakdown["optimizer_states"] / 4, rel=1e-3)
    assert fsdp.peak_bytes < one.peak_bytes < ddp.peak_bytes


def test_estimate_to_dict_has_the_contract_keys():
    d = estimate_memory(tiny_llama(), Settings(micro_batch_size=1, seq_len=8)).to_dict()
    assert set(d) >= {"peak_bytes", "device_bytes", "breakdown"}
    assert set(d["breakdown"]) == {
        "parameters", "gradients", "optimizer_states", "activations", "logits", "temporary", "runtime_overhead",
    }


def test_settings_reject_unknown_values():
    with pytest.raises(ValueError, match="optimizer"):
        Settings(micro_batch_size=1, seq_len=8, optimizer="sgd")
    with pytest.raises(ValueError, match="micro_batch_size"):
        Settings(micro_batch_size=0, seq_len=8)
    with pytest.raises(ValueError, match="num_processes"):
        Settings(micro_batch_size=1, seq_len=8, num_processes=2)


# --- planner ----------------------------------------------------------------------------------


def request(**kw):
    base = dict(effective_batch_size=16, seq_len=1024, device="cuda", bf16_supported=True)
    base.update(kw)
    return PlanRequest(**base)


def test_without_a_budget_the_configured_settings_run():
    plan = plan_memory(small_llama(), request(budget_bytes=None))
    assert plan.fits and plan.budget_bytes is None
    assert plan.settings.micro_batch_size == 16 and plan.settings.gradient_accumulation_steps == 1
    assert plan.settings.mixed_precision == "bf16" and plan.settings.optimizer == "adamw"
    assert plan.plan_estimate == plan.configured_estimate


def test_planner_keeps_the_effective_batch_and_fits_the_budget():
    cfg = small_llama()
    budget = 2 * GiB
    plan = plan_memory(cfg, request(budget_bytes=budget))
    s = plan.settings
    assert plan.fits
    assert s.micro_batch_size * s.gradient_accumulation_steps * s.num_processes == 16
    assert plan.plan_estimate.device_bytes <= budget * 0.95
    assert plan.configured_estimate.device_bytes > budget  # the naive configuration would not have fit
    assert any("effective batch stays 16" in r for r in plan.reasons)


def test_data_with_fewer_targets_per_row_plans_a_larger_micro_batch():
    # Completions that are at most a quarter of a row: the logits of a 32k vocabulary shrink 4×, and the
    # budget that needed micro-batch 2 (or recomputation) for targets everywhere fits more rows at once.
    cfg = small_llama()
    budget = 2 * GiB
    everywhere = plan_memory(cfg, request(budget_bytes=budget))
    quarter = plan_memory(cfg, request(budget_bytes=budget, target_fraction=0.25))
    assert quarter.fits and quarter.settings.target_fraction == 0.25
    assert quarter.settings.micro_batch_size > everywhere.settings.micro_batch_size
    assert quarter.configured_estimate.breakdown["logits"] < everywhere.configured_estimate.breakdown["logits"] / 3.5
    assert quarter.configured_estimate.peak_bytes < everywhere.configured_estimate.peak_bytes
    assert quarter.estimated_step_seconds < everywhere.estimated_step_seconds
    assert plan_memory(cfg, request(budget_bytes=budget, target_fraction=1.0)).settings == everywhere.settings
    with pytest.raises(ValueError, match="target_fraction"):
        request(target_fraction=1.5)


def test_planner_never_changes_fixed_fields():
    cfg = small_llama()
    plan = plan_memory(
        cfg,
        request(budget_bytes=int(1.6 * GiB), micro_batch_size=4, mixed_precision="no", optimizer="adamw"),
    )
    s = plan.settings
    assert (s.micro_batch_size, s.gradient_accumulation_steps) == (4, 4)
    assert s.mixed_precision == "no" and s.optimizer == "adamw"


def test_checkpointing_only_as_many_layers_as_needed():
    cfg = small_llama()
    req = request(micro_batch_size=4, mixed_precision="bf16", optimizer="adamw")
    settings = Settings(
        micro_batch_size=4, seq_len=1024, gradient_accumulation_steps=4, mixed_precision="bf16", device="cuda"
    )
    none = estimate_memory(cfg, settings).device_bytes
    every = estimate_memory(cfg, replace(settings, gradient_checkpointing=8)).device_bytes
    budget = int((none + every) / 2 / 0.95)  # between "no layer" and "all layers"
    plan = plan_memory(cfg, replace(req, budget_bytes=budget))
    k = plan.settings.gradient_checkpointing
    assert plan.fits and 0 < k < cfg.num_hidden_layers
    one_less = estimate_memory(cfg, replace(plan.settings, gradient_checkpointing=k - 1))
    assert one_less.device_bytes > plan.usable_bytes
    assert any(f"gradient checkpointing on {k} of {cfg.num_hidden_layers} layers" in r for r in plan.reasons)


def test_fixed_checkpointing_is_respected():
    plan = plan_memory(small_llama(), request(budget_bytes=8 * GiB, gradient_checkpointing=True))
    assert plan.settings.gradient_checkpointing == 8
    plan = plan_memory(small_llama(), request(budget_bytes=8 * GiB, gradient_checkpointing=False))
    assert plan.settings.gradient_checkpointing == 0


def test_nothing_fits_says_so_with_suggestions():
    # ~0.5B parameters, short vocabulary: weights, gradients and optimizer states dominate, so
    # sharding over more GPUs helps (estimates only: nothing is allocated).
    cfg = transformers.LlamaConfig(
        hidden_size=1536, intermediate_size=4096, num_hidden_layers=16, num_attention_heads=16,
        num_key_value_heads=4, vocab_size=2000,
    )
    smallest = plan_memory(cfg, request(budget_bytes=MiB)).plan_estimate.device_bytes
    plan = plan_memory(cfg, request(budget_bytes=int(smallest * 0.9)))
    assert not plan.fits
    assert plan.smallest_peak_bytes == plan.plan_estimate.peak_bytes
    assert all(a["peak_bytes"] >= plan.smallest_peak_bytes for a in plan.alternatives)
    text = " ".join(plan.suggestions)
    assert "budget of" in text and "FSDP" in text
    assert plan.to_dict()["fits"] is False
    assert "DOES NOT FIT" in format_plan_table(plan)


def test_nothing_fits_for_long_sequences_suggests_a_shorter_max_length():
    cfg = small_llama()  # 32k vocabulary: the logits of 8k-token rows dominate (without the chunked loss)
    req = request(seq_len=8192, **dict.fromkeys(LEVERS, False))
    smallest = plan_memory(cfg, replace(req, budget_bytes=MiB)).plan_estimate.device_bytes
    plan = plan_memory(cfg, replace(req, budget_bytes=int(smallest * 0.9)))
    assert not plan.fits
    assert any("data.max_length 4096" in s for s in plan.suggestions)


def test_plan_to_dict_is_the_design_contract():
    plan = plan_memory(small_llama(), request(budget_bytes=2 * GiB))
    d = json.loads(json.dumps(plan.to_dict()))
    assert set(d) >= {"device", "budget_bytes", "fits", "estimate", "plan", "alternatives", "reasons"}
    assert d["device"] == "cuda" and d["budget_bytes"] == 2 * GiB and d["fits"] is True
    keys = {"parameters", "gradients", "optimizer_states", "activations", "logits", "temporary", "runtime_overhead"}
    for est in (d["estimate"], d["plan"]["estimate"]):
        assert isinstance(est["peak_bytes"], int) and isinstance(est["device_bytes"], int)
        assert set(est["breakdown"]) == keys
    assert set(d["plan"]) >= {
        "micro_batch_size", "gradient_accumulation_steps", "gradient_checkpointing", "mixed_precision",
        "optimizer", "estimate",
    }
    assert all("rejected_because" in a for a in d["alternatives"])


def test_replan_after_oom_shrinks_the_micro_batch_and_keeps_the_effective_batch():
    cfg = small_llama()
    req = request(budget_bytes=3 * GiB)
    plan = plan_memory(cfg, req)
    previous = plan.settings
    new = replan_after_oom(cfg, req, previous, observed_peak_bytes=3 * GiB)
    s = new.settings
    assert s.micro_batch_size < previous.micro_batch_size
    assert s.micro_batch_size * s.gradient_accumulation_steps == 16
    assert any("out of memory" in r for r in new.reasons)


def test_replan_at_micro_batch_one_turns_on_more_checkpointing():
    cfg = small_llama()
    req = request(budget_bytes=3 * GiB)
    previous = Settings(
        micro_batch_size=1, seq_len=1024, gradient_accumulation_steps=16, gradient_checkpointing=0,
        mixed_precision="bf16", device="cuda",
    )
    new = replan_after_oom(cfg, req, previous, observed_peak_bytes=None)
    assert new.settings.micro_batch_size == 1
    assert new.settings.gradient_checkpointing > 0


def test_plan_request_validates_the_batch_arithmetic():
    with pytest.raises(ValueError, match="effective_batch_size"):
        PlanRequest(effective_batch_size=16, seq_len=8, micro_batch_size=4, gradient_accumulation_steps=3)
    with pytest.raises(ValueError, match="divide"):
        PlanRequest(effective_batch_size=16, seq_len=8, micro_batch_size=3)


# --- budget, reports ----------------------------------------------------------------------------


def test_resolve_budget():
    budget = resolve_budget("cpu", "auto")
    assert budget.device == "cpu" and budget.bytes > 256 * MiB and budget.bf16_supported is True
    assert budget.host_bytes == budget.bytes  # auto: this machine's RAM
    assert resolve_budget("cpu", "24GiB").bytes == 24 * GiB
    assert resolve_budget("cpu", "24GiB", headroom=0.25).usable_bytes == 18 * GiB
    with pytest.raises(ValueError, match="device"):
        resolve_budget("tpu", "auto")
    with pytest.raises(ValueError):
        resolve_budget("cpu", "plenty")


def test_resolve_budget_cuda_auto_without_a_gpu_explains_what_to_do():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    from fulltune.errors import ConfigError

    # A user error (exit 2 through the CLI), naming the YAML field.
    with pytest.raises(ConfigError, match="^budget.memory: auto needs a visible GPU"):
        resolve_budget("cuda", "auto")
    with pytest.raises(ConfigError, match="^budget.memory: cannot read memory size"):
        resolve_budget("cpu", "plenty")
    with pytest.raises(ConfigError, match="^budget.device: "):
        resolve_budget("tpu", "auto")
    with pytest.raises(ConfigError, match=r"^pipelines\.x\.budget\.host_memory: "):
        resolve_budget("cpu", "1GiB", host_memory="lots", where="pipelines.x.budget")
    budget = resolve_budget("cuda", "80GiB")
    assert (budget.device, budget.bytes, budget.bf16_supported) == ("cuda", 80 * GiB, True)


def test_format_plan_table_and_png(tmp_path):
    plan: MemoryPlan = plan_memory(small_llama(), request(budget_bytes=2 * GiB))
    text = format_plan_table(plan)
    for word in ("configured", "plan", "optimizer states", "activations", "budget", "why:"):
        assert word in text
    path = render_breakdown_png(plan, tmp_path / "plan.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_picture_of_a_plan_far_below_its_budget_zooms_to_its_bars():
    # The demo's size: the tiny model's bars against a 23.5 GiB budget would be a grey sliver at the budget's scale.
    from fulltune.memory.report import ZOOM_BELOW, breakdown_chart

    plan = plan_memory(tiny_llama(), request(device="cpu", bf16_supported=False, seq_len=64,
                                             budget_bytes=int(23.5 * GiB)))
    chart = breakdown_chart(plan)
    tallest = max(sum(value for _, value in parts) for _, parts in chart.bars)
    assert tallest < ZOOM_BELOW * plan.budget_bytes
    assert chart.top_bytes < 2 * tallest and chart.lines == () and chart.unit[0] == "MiB"
    assert "23.5 GiB" in chart.note and "far above" in chart.note
    assert [heading for heading, _ in chart.bars] == ["configured", "plan"]


def test_the_picture_of_an_8b_plan_shows_the_budget_and_cuts_the_configured_bar():
    from fulltune.memory.report import breakdown_chart

    llama_8b = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
    plan = plan_memory(llama_8b, request(effective_batch_size=8, seq_len=2048, budget_bytes=24 * GiB,
                                         attention_mask=False, optimizer="adamw", host_memory_bytes=256 * GiB))
    chart = breakdown_chart(plan)
    totals = {heading: sum(value for _, value in parts) for heading, parts in chart.bars}
    assert chart.note == "" and [label for label, _ in chart.lines] == ["budget", "budget − headroom"]
    assert totals["plan"] < chart.top_bytes < totals["configured"], "the plan's bar whole, the configured one cut"
    assert chart.top_bytes >= 24 * GiB and chart.unit[0] == "GiB"


def test_after_autotune_the_plan_shows_what_trains_beside_the_analytic_plan(tmp_path):
    from fulltune.memory import estimate_memory
    from fulltune.memory.report import Trained, breakdown_chart

    plan = plan_memory(small_llama(), request(budget_bytes=2 * GiB))
    tuned = replace(plan.settings, micro_batch_size=plan.settings.micro_batch_size // 2,
                    gradient_accumulation_steps=plan.settings.gradient_accumulation_steps * 2)
    trained = Trained(tuned, estimate_memory(small_llama(), tuned), "autotune measured 0.41 s a step")
    text = format_plan_table(plan, trained)
    heading = text.splitlines()[2].split("|")
    assert [cell.strip() for cell in heading[2:5]] == ["configured", "analytic plan", "trains (autotune)"]
    assert f"trains (autotune): micro_batch_size={tuned.micro_batch_size} " in text
    assert "autotune measured 0.41 s a step" in text
    assert f"analytic plan: micro_batch_size={plan.settings.micro_batch_size} " in text
    assert "\nplan: " not in text
    assert "estimated step time of the analytic plan (ranking model, predicted, not measured)" in text
    assert [heading for heading, _ in breakdown_chart(plan, trained).bars] == \
        ["configured", "analytic plan", "trains (autotune)"]
    assert render_breakdown_png(plan, tmp_path / "tuned.png", trained).read_bytes()[:4] == b"\x89PNG"


# --- gradient checkpointing helper ----------------------------------------------------------------


@pytest.mark.parametrize(
    "config",
    [
        tiny_llama(num_hidden_layers=3),
        transformers.GPT2Config(n_embd=32, n_layer=3, n_head=4, vocab_size=64, n_positions=32),
        transformers.GPTNeoXConfig(
            hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64, vocab_size=64
        ),
    ],
    ids=["llama", "gpt2", "gpt_neox"],
)
def test_apply_gradient_checkpointing_first_k_layers(config):
    import torch

    from fulltune.runtime.checkpointing import decoder_layers

    model = transformers.AutoModelForCausalLM.from_config(config)
    assert apply_gradient_checkpointing(model, 2) == 2
    assert [layer.gradient_checkpointing for layer in decoder_layers(model)] == [True, True, False]
    model.train()
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()  # recompute runs and gradients arrive
    assert all(p.grad is not None for p in decoder_layers(model)[0].parameters())
    assert apply_gradient_checkpointing(model, True) == 3
    assert apply_gradient_checkpointing(transformers.AutoModelForCausalLM.from_config(config), False) == 0
