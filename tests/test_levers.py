"""Memory levers (fulltune/runtime/optim.py, fulltune/runtime/offload.py): what each changes in training, and what it costs in bytes."""

from __future__ import annotations

import copy

import pytest
import torch

from fulltune.runtime.optim import (
    FakeStatesOptimizer,
    build_optimizer,
    device_gradient_bytes,
    host_bytes,
    optimizer_state_bytes,
    torchao_available,
)


def _llama(hidden: int = 32, layers: int = 2, tied: bool = True, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=97, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=dtype).train()


BATCHES = [torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(i)) for i in range(8)]


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, accumulation: int = 1,
           max_grad_norm: float | None = None, start: int = 0) -> list[float]:
    """The trainer's step: micro-batches, clipping, step, zero_grad; returns each step's gradient norm."""
    norms = []
    for step in range(start, start + steps):
        for index in range(accumulation):
            if hasattr(optimizer, "set_micro_batch"):
                optimizer.set_micro_batch(index)
            batch = BATCHES[(step * accumulation + index) % len(BATCHES)]
            (model(input_ids=batch, labels=batch).loss / accumulation).backward()
        if hasattr(optimizer, "clip_grad_norm_"):
            norms.append(float(optimizer.clip_grad_norm_(max_grad_norm or float("inf"))))
        else:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm or float("inf"))))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------------------------------
# Pure bf16 weights with compensated updates


@pytest.mark.parametrize("lever", ["kahan", "offload"])
def test_pure_bf16_keeps_updates_smaller_than_a_bf16_step(lever: str) -> None:
    # A weight of 1.0 in bf16 moves in steps of 2^-7; AdamW's first updates are ~lr = 1e-4 each.
    weight = torch.nn.Parameter(torch.ones(8, 8, dtype=torch.bfloat16))
    plain = torch.nn.Parameter(weight.detach().clone())
    compensated = build_optimizer([weight], "adamw", lr=1e-4, pure_bf16=True, offload_optimizer=lever == "offload")
    uncompensated = build_optimizer([plain], "adamw", lr=1e-4, pure_bf16=True, compensation="none")
    for _ in range(100):
        (weight.sum() + plain.sum()).backward()  # a gradient of ones: updates of ~lr each
        compensated.step()
        uncompensated.step()
        compensated.zero_grad()
        uncompensated.zero_grad()
    assert torch.equal(plain, torch.ones_like(plain))  # every update rounded away
    # 100 updates of ~1e-4: the compensated weight has moved by ~0.01 (a step or two of bf16).
    assert float((1 - weight.detach().float()).mean()) == pytest.approx(0.01, rel=0.25)


@pytest.mark.slow
def test_pure_bf16_with_kahan_tracks_the_fp32_loss_curve() -> None:
    base = _llama(hidden=64)
    batch = torch.randint(0, 97, (4, 32), generator=torch.Generator().manual_seed(0))

    def curve(pure_bf16: bool, compensation: str | None) -> list[float]:
        model = copy.deepcopy(base).to(torch.bfloat16 if pure_bf16 else torch.float32)
        optimizer = build_optimizer(model, "adamw", lr=3e-5, pure_bf16=pure_bf16, compensation=compensation)
        losses = []
        for _ in range(20):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        return losses

    def progress(losses: list[float]) -> float:  # the last three against the first: bf16 forward noise averages out
        return losses[0] - sum(losses[-3:]) / 3

    reference, kahan, plain = curve(False, None), curve(True, "kahan"), curve(True, "none")
    drop = progress(reference)
    assert drop > 0.05
    # Compensated: the same curve within bf16's forward noise; uncompensated: much of the progress lost.
    assert max(abs(a - b) for a, b in zip(reference, kahan)) < 0.1 * drop
    assert progress(kahan) == pytest.approx(drop, rel=0.1)
    assert progress(plain) < 0.75 * drop


# ---------------------------------------------------------------------------------------------------
# Optimizer step inside backward


@pytest.mark.parametrize("name", ["adamw", "adamw_8bit"])
@pytest.mark.parametrize("accumulation", [1, 2])
def test_optimizer_in_backward_gives_the_weights_of_the_normal_step(name: str, accumulation: int) -> None:
    base = _llama()
    expected = copy.deepcopy(base)
    _train(expected, build_optimizer(expected, name, lr=1e-2, weight_decay=0.1), 3, accumulation)
    model = copy.deepcopy(base)
    optimizer = build_optimizer(model, name, lr=1e-2, weight_decay=0.1, optimizer_in_backward=True,
                                gradient_accumulation_steps=accumulation)
    _train(model, optimizer, 3, accumulation)
    _assert_same_weights(model, expected)
    assert all(p.grad is None for p in model.parameters())


def test_optimizer_in_backward_resumes_from_its_state_dict() -> None:
    base = _llama()
    straight = copy.deepcopy(base)
    _train(straight, build_optimizer(straight, "adamw", lr=1e-2, optimizer_in_backward=True), 4)

    first = copy.deepcopy(base)
    optimizer = build_optimizer(first, "adamw", lr=1e-2, optimizer_in_backward=True)
    _train(first, optimizer, 2)
    state = copy.deepcopy(optimizer.state_dict())
    resumed = copy.deepcopy(first)
    optimizer = build_optimizer(resumed, "adamw", lr=1e-2, optimizer_in_backward=True)
    optimizer.load_state_dict(state)
    _train(resumed, optimizer, 2, start=2)
    _assert_same_weights(resumed, straight)


def test_optimizer_in_backward_clips_each_parameter_and_reports_the_global_norm() -> None:
    base = _llama()
    # Reference: the normal step with each parameter's gradient clipped on its own.
    reference = copy.deepcopy(base)
    optimizer = build_optimizer(reference, "adamw", lr=1e-2)
    expected_norms = []
    for step in range(3):
        batch = BATCHES[step]
        reference(input_ids=batch, labels=batch).loss.backward()
        expected_norms.append(float(torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()])))
        for p in reference.parameters():
            torch.nn.utils.clip_grad_norm_([p], 0.05)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    model = copy.deepcopy(base)
    norms = _train(model, build_optimizer(model, "adamw", lr=1e-2, optimizer_in_backward=True, max_grad_norm=0.05), 3)
    _assert_same_weights(model, reference)
    assert norms == pytest.approx(expected_norms, rel=1e-5)  # before clipping, as clip_grad_norm_ reports
    unclipped = copy.deepcopy(base)
    _train(unclipped, build_optimizer(unclipped, "adamw", lr=1e-2, optimizer_in_backward=True), 3)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), unclipped.parameters()))


def test_an_lr_schedule_reaches_the_per_parameter_optimizers() -> None:
    model = _llama()
    optimizer = build_optimizer(model, "adamw", lr=1e-2, optimizer_in_backward=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)
    _train(model, optimizer, 1)
    scheduler.step()
    inner = next(iter(optimizer._optimizers.values()))
    assert inner.param_groups[0]["lr"] == pytest.approx(5e-3)


# ---------------------------------------------------------------------------------------------------
# Optimizer states in host RAM


@pytest.mark.parametrize("accumulation", [1, 2])
def test_offloaded_states_give_the_weights_of_the_normal_step(accumulation: int) -> None:
    base = _llama()
    expected = copy.deepcopy(base)
    expected_norms = _train(expected, build_optimizer(expected, "adamw", lr=1e-2, weight_decay=0.1), 3,
                            accumulation, max_grad_norm=0.5)
    model = copy.deepcopy(base)
    optimizer = build_optimizer(model, "adamw", lr=1e-2, weight_decay=0.1, offload_optimizer=True)
    norms = _train(model, optimizer, 3, accumulation, max_grad_norm=0.5)
    _assert_same_weights(model, expected)
    assert norms == pytest.approx(expected_norms, rel=1e-6)  # global clipping, as without offload
    assert all(p.grad is None for p in model.parameters())
    assert all(not state or state["exp_avg"].device.type == "cpu" for state in optimizer.host_optimizer.state.values())


def test_offload_with_bf16_weights_resumes_from_its_fp32_masters() -> None:
    base = _llama().to(torch.bfloat16)
    straight = copy.deepcopy(base)
    _train(straight, build_optimizer(straight, "adamw", lr=1e-3, pure_bf16=True, offload_optimizer=True), 4)

    first = copy.deepcopy(base)
    optimizer = build_optimizer(first, "adamw", lr=1e-3, pure_bf16=True, offload_optimizer=True)
    _train(first, optimizer, 2)
    state = copy.deepcopy(optimizer.state_dict())
    resumed = copy.deepcopy(first)
    optimizer = build_optimizer(resumed, "adamw", lr=1e-3, pure_bf16=True, offload_optimizer=True)
    optimizer.load_state_dict(state)
    _train(resumed, optimizer, 2, start=2)
    _assert_same_weights(resumed, straight)
    masters = optimizer.state_dict()["masters"]
    assert all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(resumed.parameters(), masters):
        assert torch.equal(p, m.to(torch.bfloat16))


# ---------------------------------------------------------------------------------------------------
# Checkpointed activations in host RAM


def test_offloaded_checkpoint_inputs_give_the_same_gradients() -> None:
    from fulltune.runtime.checkpointing import apply_gradient_checkpointing
    from fulltune.runtime.offload import ActivationOffload

    model = _llama(layers=3)
    apply_gradient_checkpointing(model, 2)
    batch = BATCHES[0]
    model(input_ids=batch, labels=batch).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    offload = ActivationOffload()
    assert offload.install(model) == 2
    model(input_ids=batch, labels=batch).loss.backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=0, atol=0, msg=name)
    # What left the device: each checkpointed layer's input hidden states, (b, s, h) fp32.
    assert offload.bytes_offloaded == 2 * batch.numel() * 32 * 4


# ---------------------------------------------------------------------------------------------------
# Bytes the memory model counts == bytes the optimizers allocate


def _state_nbytes(optimizer: torch.optim.Optimizer) -> int:
    storages = {}  # bitsandbytes shares its quantisation maps between parameters: count each storage once
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                storage = value.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _param_shapes(model: torch.nn.Module):
    """The model's parameters as its optimizer sees them: the decoder layers' 2-D weights apart."""
    from fulltune.optimizers import ParamShapes
    from fulltune.runtime.checkpointing import decoder_layers

    hidden = {id(p) for layer in decoder_layers(model) for p in layer.parameters() if p.ndim == 2}
    return ParamShapes(matrices=tuple(tuple(p.shape) for p in model.parameters() if id(p) in hidden),
                       others=tuple(tuple(p.shape) for p in model.parameters() if id(p) not in hidden))


def _stepped(name: str, model: torch.nn.Module, **levers) -> torch.optim.Optimizer:
    optimizer = build_optimizer(model, name, lr=1e-3, **levers)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    return optimizer


@pytest.mark.parametrize(("name", "pure_bf16", "fake", "compensation"), [
    ("adamw", False, False, "auto"), ("adamw", True, False, "auto"), ("adamw", True, True, "auto"),
    ("adamw", True, False, "none"), ("adamw_8bit", False, False, "auto"), ("adamw_8bit", False, True, "auto"),
    ("adamw_8bit", True, False, "none"), ("adamw_4bit", False, True, "auto"), ("adamw_4bit", True, True, "auto"),
    ("adafactor", False, False, "auto"), ("muon", False, False, "auto"), ("muon", True, False, "auto"),
    ("muon", True, True, "auto"),
])
def test_optimizer_state_bytes_are_what_the_optimizer_allocates(name: str, pure_bf16: bool, fake: bool,
                                                                compensation: str) -> None:
    from fulltune.optimizers import optimizer

    model = _llama(hidden=64, tied=False)  # 64 × 97 and 128 × 64 matrices: both small and quantised tensors
    if pure_bf16:
        model = model.to(torch.bfloat16)
    optimizer_ = _stepped(name, model, pure_bf16=pure_bf16, fake=fake, compensation=compensation)
    shapes = _param_shapes(model)
    runs = optimizer(name).default_compensation if pure_bf16 and compensation == "auto" else compensation
    expected, _ = optimizer_state_bytes(name, shapes, 2 if pure_bf16 else 4, runs if pure_bf16 else "none")
    actual = _state_nbytes(optimizer_)
    if name == "adamw" and runs == "kahan" and not fake:
        actual += 4 * len(shapes.all)  # torch-optimi counts steps per group, the model counts a step per tensor
    # torch AdamW's step, Adafactor's RMS/step: 0-d tensors whose storage rounds to one element.
    assert actual == expected


def test_the_plan_says_which_compensation_runs_and_what_it_costs() -> None:
    # torchtune's pure-bf16 recipe (plain rounding, bf16 states: 2 + 2 + 4 B/param with AdamW) against the Kahan
    # buffer `auto` gives adamw (+2 B/param).
    from transformers import LlamaConfig

    from fulltune.memory import PlanRequest
    from fulltune.memory.shapes import model_shape
    from fulltune.planning import plan_memory

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    plans = {compensation: plan_memory(config, PlanRequest(
        effective_batch_size=4, seq_len=64, device="cuda", bf16_supported=True, budget_bytes=8 * 2**30,
        mixed_precision="bf16", optimizer="adamw", pure_bf16=True, compensation=compensation))
        for compensation in ("auto", "none")}
    kahan, plain = plans["auto"], plans["none"]
    assert kahan.to_dict()["plan"]["compensation"] == "kahan" and plain.to_dict()["plan"]["compensation"] == "none"
    params = model_shape(config).num_params
    states = {name: plan.plan_estimate.breakdown["optimizer_states"] for name, plan in plans.items()}
    assert states["none"] == 2 * 2 * params + 4 * len(model_shape(config).param_shapes)  # bf16 exp_avg, exp_avg_sq
    assert states["auto"] - states["none"] == 2 * params  # the bf16 Kahan buffer
    line = next(r for r in kahan.reasons if r.startswith("compensation kahan (train.compensation auto): "))
    assert "Kahan summation" in line and "against none (plain rounding): " in line
    assert any(r.startswith("compensation none (train.compensation): plain rounding") for r in plain.reasons)


def test_muon_steps_the_decoder_matrices_and_adamw_the_rest_and_resumes_from_its_state_dict() -> None:
    # The split the memory model counts (ModelShape.optimizer_shapes) is the one the builder makes; a
    # state_dict round trip through a fresh optimizer gives the weights of the run that never stopped.
    from transformers import LlamaConfig

    from fulltune.memory.shapes import model_shape
    from fulltune.runtime.optim import SplitOptimizer

    model = _llama(hidden=64, tied=False)
    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    counted, built = model_shape(config).optimizer_shapes, _param_shapes(model)
    assert sorted(counted.matrices) == sorted(built.matrices) and sorted(counted.others) == sorted(built.others)
    optimizer = build_optimizer(model, "muon", lr=1e-3, weight_decay=0.01)
    assert isinstance(optimizer, SplitOptimizer)
    muon, adamw = optimizer.parts
    assert isinstance(muon, torch.optim.Muon) and isinstance(adamw, torch.optim.AdamW)
    assert {id(p) for g in muon.param_groups for p in g["params"]} == {
        id(p) for name, p in model.named_parameters() if ".layers." in name and p.ndim == 2}
    _train(model, optimizer, 3)
    resumed, saved = copy.deepcopy(model), copy.deepcopy(optimizer.state_dict())
    _train(model, optimizer, 2, start=3)
    again = build_optimizer(resumed, "muon", lr=1e-3, weight_decay=0.01)
    again.load_state_dict(saved)
    assert again.parts[0].state is again.state and again.parts[1].param_groups[0] is again.param_groups[1]
    _train(resumed, again, 2, start=3)
    _assert_same_weights(model, resumed)


def test_the_plan_says_muons_split_and_auto_never_chooses_it() -> None:
    from transformers import LlamaConfig

    from fulltune.memory import PlanRequest
    from fulltune.planning import plan_memory

    config = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    request = PlanRequest(effective_batch_size=4, seq_len=64, device="cuda", bf16_supported=True,
                          budget_bytes=2**30, optimizer="muon")
    plan = plan_memory(config, request)
    line = next(r for r in plan.reasons if r.startswith("optimizer muon (torch Muon for the decoder layers' "))
    # 2 layers × 7 matrices: q, k, v, o (64 × 64, 32 × 64 twice, 64 × 64) and the MLP's three (128 × 64).
    assert "the decoder layers' 14 2-D matrices: 73,728 parameters, 288 KiB of states" in line
    assert "the embeddings, output head, norms and biases: 12,736 parameters" in line
    # optimizer: auto on a budget only the smallest states fit: never muon, even where its states are the least.
    tight = plan_memory(config, PlanRequest(effective_batch_size=4, seq_len=64, device="cuda", bf16_supported=True,
                                            budget_bytes=2**30, optimizer=None))
    assert tight.settings.optimizer != "muon"
    assert all(a["optimizer"] != "muon" for a in tight.alternatives)


def test_gradient_and_host_bytes_follow_the_levers() -> None:
    shapes = [(1000, 10), (10,)]
    assert device_gradient_bytes(shapes) == 4 * 10010
    assert device_gradient_bytes(shapes, pure_bf16=True) == 2 * 10010
    assert device_gradient_bytes(shapes, pure_bf16=True, optimizer_in_backward=True) == 2 * 10000
    assert device_gradient_bytes(shapes, offload_optimizer=True) == 4 * 10000
    assert host_bytes("adamw", shapes) == 0
    assert host_bytes("adamw", shapes, pure_bf16=True, optimizer_in_backward=True, gradient_accumulation_steps=4) == 2 * 10010
    assert host_bytes("adamw", shapes, offload_optimizer=True) == 16 * 10010 + 4 * 2  # master, grad, 2 states, steps


def test_levers_run_under_the_memory_trace() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        model = _llama(dtype=torch.bfloat16)  # a FakeTensor model cannot be cast in place
        optimizer = build_optimizer(model, "adamw_8bit", pure_bf16=True, optimizer_in_backward=True, fake=True)
        batch = torch.randint(0, 97, (2, 12))
        model(input_ids=batch, labels=batch).loss.backward()
        assert all(p.grad is None for p in model.parameters())
        assert all(isinstance(o, FakeStatesOptimizer) for o in optimizer._optimizers.values())


# ---------------------------------------------------------------------------------------------------
# The lever records (fulltune/levers.py)


def test_every_lever_record_says_what_it_does_and_what_it_costs() -> None:
    # A lever without a sentence or a cost fails here: not a KeyError in the plan's reasons, nor a lever the
    # step-time model ranks as free because nothing was written for it.
    import dataclasses
    import importlib

    from transformers import LlamaConfig

    from fulltune import levers, spec
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.memory.shapes import model_shape
    from fulltune.memory.types import PlanRequest, Settings
    from fulltune.planning.step_time import StepCosts, lever_seconds

    shape = model_shape(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2))
    for lever in levers.TABLE:
        assert lever.description and spec.TrainSpec.model_fields[lever.name].description == lever.description
        seen = 0
        for device, strategy, processes in (("cuda", "none", 1), ("cuda", "fsdp", 2), ("cpu", "none", 1)):
            try:
                settings = Settings(micro_batch_size=2, seq_len=64, gradient_checkpointing=2, mixed_precision="bf16",
                                    device=device, strategy=strategy, num_processes=processes, **{lever.name: True})
            except MemoryConfigError:
                continue  # a combination the lever table refuses
            seen += 1
            sentence = lever.sentence(settings)
            assert isinstance(sentence, str) and sentence, lever.name
            seconds = lever.cost(settings, StepCosts(shape, settings))
            if isinstance(lever.cost, levers.NoAddedTime):
                assert lever.cost.why and seconds == 0.0 and lever.name not in lever_seconds(shape, settings)
            else:
                if lever.auto is None:
                    assert seconds > 0.0, lever.name  # a memory lever costs step time
                else:  # a step-time lever (float8) saves some on a GPU (a negative cost), none counted on a CPU
                    assert seconds < 0.0 if device == "cuda" else seconds <= 0.0, lever.name
                assert lever_seconds(shape, settings)[lever.name] == seconds, lever.name
        assert seen >= 2, lever.name
        if lever.apply is not None:
            module, function = lever.apply.split(":")
            assert callable(getattr(importlib.import_module(module), function)), lever.apply
    # The generated fields: every lever once, in the declared order, in the spec, the settings and the request.
    for fields, default in ((spec.TrainSpec.model_fields, None), (dataclasses.fields(Settings), False),
                            (dataclasses.fields(PlanRequest), None)):
        names = [f if isinstance(f, str) else f.name for f in fields]
        assert [n for n in names if n in levers.LEVERS] == list(levers.FIELD_ORDER)
    assert Settings(micro_batch_size=1, seq_len=8).levers() == dict.fromkeys(levers.LEVERS, False)


def test_a_levers_options_and_conditions_are_declared_once_in_its_record() -> None:
    # An option (train.compensation, train.float8_recipe) and a condition (what float8: auto reads of the machine)
    # are written once, in the record: the spec's field, the settings' and the request's fields and checks, the
    # request read from a pipeline, the planned settings and the job's planned keys all follow from it.
    import dataclasses

    import pydantic
    from transformers import LlamaConfig

    from fulltune import levers, spec
    from fulltune.memory.budget import Budget
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.memory.types import PlanRequest, Settings
    from fulltune.planning.search import configured_settings
    from fulltune.runtime import launch

    assert [o.name for o in levers.OPTIONS] == ["compensation", "float8_recipe"]
    assert [c.name for c in levers.CONDITIONS] == ["float8_supported", "compile"]
    request_defaults = {f.name: f.default for f in dataclasses.fields(PlanRequest)}
    for option in levers.OPTIONS:
        field = spec.TrainSpec.model_fields[option.name]
        assert (field.description, field.default) == (option.description, option.default)
        with pytest.raises(pydantic.ValidationError, match=option.name):
            spec.TrainSpec(**{option.name: "nonsense"})
        for make in (lambda **kw: Settings(micro_batch_size=1, seq_len=8, **kw),
                     lambda **kw: PlanRequest(effective_batch_size=8, seq_len=8, **kw)):
            assert getattr(make(), option.name) == option.default
            with pytest.raises(MemoryConfigError, match=f"^{option.name} must be one of {', '.join(option.choices)}; "
                                                        "got 'nonsense'$"):
                make(**{option.name: "nonsense"})
        assert option.name in launch.PLANNED_TRAIN_KEYS and option.name not in launch.TrainOptions.model_fields
    assert all(request_defaults[c.name] is False for c in levers.CONDITIONS)
    # The refusal an option declares for its lever off.
    with pytest.raises(pydantic.ValidationError, match="train.pure_bf16 is false"):
        spec.TrainSpec(pure_bf16=False, compensation="kahan")
    # Read from a pipeline's train section and this machine's budget, then carried into the planned settings.
    train = spec.TrainSpec(compensation="kahan", float8_recipe="rowwise", compile=True)
    for capability, tensor_cores in ((None, False), ((8, 0), False), ((8, 9), True), ((9, 0), True)):
        fields = levers.request_fields(train, Budget("cuda", 2**34, capability=capability))
        assert fields["float8_supported"] is tensor_cores and fields["compile"] is True
    request = PlanRequest(effective_batch_size=8, seq_len=8,
                          **levers.request_fields(train, Budget("cuda", 2**34, capability=(9, 0))))
    assert (request.compensation, request.float8_recipe, request.float8) == ("kahan", "rowwise", None)
    settings = configured_settings(LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128,
                                               num_hidden_layers=2, num_attention_heads=4), request)
    assert (settings.compensation, settings.float8_recipe) == ("kahan", "rowwise")
    # What the trainer's first line says of a lever comes from its record too, with its options' values.
    assert levers.started(settings) == ""
    assert levers.started(dataclasses.replace(settings, float8=True)) == " with float8 matmuls (rowwise)"
    # And its terms in the memory walk (a decoder layer's counts, the weights FSDP gathers): the walk names no lever.
    assert [lever.name for lever in levers.LAYER_LEVERS] == [lever.name for lever in levers.GATHER_LEVERS] == ["float8"]


def test_the_model_side_levers_are_applied_by_one_function() -> None:
    # The trainer (fulltune/runtime/train.py apply_levers) and the memory trace (planning/trace.py build_model)
    # both call apply_model_levers: checkpointing, then bf16 weights, then the checkpointed inputs offloaded.
    import functools

    from fulltune.memory.types import Settings
    from fulltune.runtime.checkpointing import apply_model_levers, decoder_layers

    model = _llama()
    settings = Settings(micro_batch_size=2, seq_len=12, gradient_checkpointing=1, mixed_precision="bf16",
                        pure_bf16=True, offload_activations=True)
    assert apply_model_levers(model, settings) == 1
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    first, second = decoder_layers(model)
    assert first.gradient_checkpointing and not second.gradient_checkpointing
    assert isinstance(first._gradient_checkpointing_func, functools.partial)  # the offload hooks around it


# ---------------------------------------------------------------------------------------------------
# Settings that cannot work, and 4-bit states


@pytest.mark.parametrize(("levers", "message"), [
    ({"name": "adafactor", "pure_bf16": True, "compensation": "kahan"}, "compensation"),
    ({"name": "adamw_8bit", "pure_bf16": True, "compensation": "kahan"}, "compensation"),
    ({"name": "adamw", "optimizer_in_backward": True, "offload_optimizer": True}, "choose one"),
    ({"name": "lion"}, "optimizer"),
])
def test_impossible_lever_combinations_are_refused(levers: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_optimizer(_llama(), **levers)


@pytest.mark.skipif(torchao_available(), reason="torchao is installed")
def test_4bit_states_without_torchao_say_what_to_install() -> None:
    with pytest.raises(ValueError, match=r"fulltune\[lowbit\]"):
        build_optimizer(_llama(), "adamw_4bit")
    with pytest.raises(ValueError, match=r"fulltune\[lowbit\]"):  # stochastic rounding is torchao's too
        build_optimizer(_llama(dtype=torch.bfloat16), "adamw", pure_bf16=True, compensation="stochastic")


@pytest.mark.slow
@pytest.mark.skipif(not torchao_available(), reason="needs torchao (fulltune[lowbit])")
def test_4bit_states_train_and_take_the_counted_bytes() -> None:
    model = _llama(hidden=64, tied=False)
    optimizer = build_optimizer(model, "adamw_4bit", lr=1e-3)
    losses = []
    for step in range(6):
        batch = BATCHES[0]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.05
    expected, _ = optimizer_state_bytes("adamw_4bit", [tuple(p.shape) for p in model.parameters()])
    actual = 0
    for state in optimizer.state.values():
        for value in state.values():
            tensors = [getattr(value, a) for a in ("codes", "scale", "qmap")] if hasattr(value, "codes") else [value]
            actual += sum(t.untyped_storage().nbytes() for t in tensors)
    assert actual == expected
