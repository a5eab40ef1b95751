"""pipelines.yaml schema: typed, strict, every error at once with its YAML path."""

from __future__ import annotations

import textwrap

import pytest

from fulltune.errors import ConfigError
from fulltune.pipelines_file import apply_overrides, load_pipelines, validate_pipelines
from fulltune.sizes import parse_size

MINIMAL = {"model": {"name_or_path": "some/model"}, "data": {"train": "train.jsonl"}}


def write(tmp_path, text):
    path = tmp_path / "pipelines.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_all_errors_reported_at_once_with_yaml_paths(tmp_path):
    path = write(tmp_path, """
        pipelines:
          demo:
            model: {name_or_path: m}
            data: {train: t.jsonl, format: poetry}
            train: {learning_rate: -1, bogus: 3, micro_batch_size: 0}
            budget: {memory: 12 apples}
    """)
    with pytest.raises(ConfigError) as caught:
        load_pipelines(path)
    message = str(caught.value)
    assert "pipelines.demo.train.learning_rate: must be > 0" in message
    assert "pipelines.demo.train.bogus: unknown key" in message
    assert "pipelines.demo.train.micro_batch_size" in message
    assert "pipelines.demo.budget.memory" in message
    assert "pipelines.demo.data.format" in message
    assert "5 problem(s)" in message


def test_malformed_yaml_names_the_line(tmp_path):
    path = write(tmp_path, """
        pipelines:
          demo:
            model: {name_or_path: m
            data: x
    """)
    with pytest.raises(ConfigError, match=r"line \d+"):
        load_pipelines(path)


def test_defaults_merge_deeply_and_pipeline_wins():
    spec = validate_pipelines({
        "defaults": {"train": {"learning_rate": 0.1, "seed": 7}, "budget": {"memory": "8GiB"}},
        "pipelines": {"a": {**MINIMAL, "train": {"learning_rate": 0.5}}},
    }).pipelines["a"]
    assert spec.train.learning_rate == 0.5
    assert spec.train.seed == 7
    assert spec.budget.memory == "8GiB"


def test_overrides_are_typed_yaml_scalars():
    spec = validate_pipelines(
        {"pipelines": {"a": MINIMAL}},
        {"a": ["train.learning_rate=1e-4", "train.gradient_checkpointing=true", "data.packing=true",
               "train.max_steps=12"]},
    ).pipelines["a"]
    assert spec.train.learning_rate == 1e-4
    assert spec.train.gradient_checkpointing is True
    assert spec.data.packing is True
    assert spec.train.max_steps == 12


def test_yaml_11_no_means_the_word_for_mixed_precision():
    overridden = validate_pipelines(
        {"pipelines": {"a": MINIMAL}},
        {"a": ["train.mixed_precision=no", "data.packing=yes", "train.gradient_checkpointing=off"]},
    ).pipelines["a"]
    assert overridden.train.mixed_precision == "no"
    assert overridden.data.packing is True
    assert overridden.train.gradient_checkpointing is False
    unquoted = validate_pipelines({"pipelines": {"a": {**MINIMAL, "train": {"mixed_precision": False}}}})
    assert unquoted.pipelines["a"].train.mixed_precision == "no"


def test_override_of_unknown_key_is_reported_with_its_path():
    with pytest.raises(ConfigError, match=r"pipelines.a.train.learnign_rate: unknown key"):
        validate_pipelines({"pipelines": {"a": MINIMAL}}, {"a": ["train.learnign_rate=1"]})


def test_model_needs_exactly_one_source():
    with pytest.raises(ConfigError, match="exactly one of model.name_or_path and model.from_config"):
        validate_pipelines({"pipelines": {"a": {"model": {}, "data": {"train": "t"}}}})


def test_batch_arithmetic_must_match_effective_batch():
    body = {**MINIMAL, "train": {"effective_batch_size": 8, "micro_batch_size": 4, "gradient_accumulation_steps": 4}}
    with pytest.raises(ConfigError, match="must equal train.effective_batch_size"):
        validate_pipelines({"pipelines": {"a": body}})


def test_gradient_checkpointing_accepts_auto_bool_and_layer_count():
    for value, expected in (("auto", "auto"), (True, True), (False, False), (3, 3)):
        body = {**MINIMAL, "train": {"gradient_checkpointing": value}}
        spec = validate_pipelines({"pipelines": {"a": body}}).pipelines["a"]
        assert spec.train.gradient_checkpointing == expected
        assert type(spec.train.gradient_checkpointing) is type(expected)


def test_register_gate_direction_is_checked():
    body = {**MINIMAL, "register": {"promote_if": {"metric": "exact_match", "mode": "min"}}}
    with pytest.raises(ConfigError, match="exact_match improves in mode 'max'"):
        validate_pipelines({"pipelines": {"a": body}})


def test_schedule_must_be_cron():
    with pytest.raises(ConfigError, match="pipelines.a.schedule"):
        validate_pipelines({"pipelines": {"a": {**MINIMAL, "schedule": "every monday"}}})


def test_config_hash_is_stable_and_sensitive():
    one = validate_pipelines({"pipelines": {"a": MINIMAL}}).pipelines["a"]
    two = validate_pipelines({"pipelines": {"a": dict(reversed(list(MINIMAL.items())))}}).pipelines["a"]
    three = validate_pipelines({"pipelines": {"a": MINIMAL}}, {"a": ["train.seed=1"]}).pipelines["a"]
    assert one.config_hash() == two.config_hash() != three.config_hash()


def test_specs_are_frozen():
    spec = validate_pipelines({"pipelines": {"a": MINIMAL}}).pipelines["a"]
    with pytest.raises(Exception):
        spec.train.learning_rate = 1.0


@pytest.mark.parametrize("text,expected", [("24GiB", 24 * 2**30), ("512MiB", 512 * 2**20), ("1.5GB", 1_500_000_000),
                                           ("1000", 1000)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_apply_overrides_creates_missing_sections():
    assert apply_overrides({}, ["budget.memory=4GiB"]) == {"budget": {"memory": "4GiB"}}


def test_an_unset_strategy_is_auto_for_one_process_and_none_for_a_stage_per_process():
    def strategy(**distributed) -> tuple[str, bool]:
        d = validate_pipelines({"pipelines": {"a": {**MINIMAL, "distributed": distributed}}}).pipelines["a"].distributed
        return d.strategy, d.strategy_unset

    assert strategy() == ("auto", True)  # the plan chooses, as it chooses levers
    assert strategy(strategy="none") == ("none", False)
    assert strategy(num_processes=2, pipeline_parallel=2) == ("none", True)
    assert strategy(strategy="auto", num_processes=2) == ("auto", False)
    with pytest.raises(ConfigError, match="num_processes > 1 needs a strategy"):
        strategy(num_processes=2)


@pytest.mark.parametrize(("train", "named"), [
    ({"compensation": "fast"}, "pipelines.a.train.compensation"),
    ({"pure_bf16": False, "compensation": "none"}, "train.compensation is how pure_bf16's bf16 weights"),
    ({"pure_bf16": True, "optimizer": "adafactor", "compensation": "kahan"},
     "train.compensation with train.optimizer: adafactor offers none with pure bf16 weights"),
    ({"pure_bf16": True, "offload_optimizer": True, "compensation": "kahan"},
     "train.compensation with train.offload_optimizer: the offloaded optimizer steps fp32 masters"),
])
def test_a_compensation_the_optimizer_or_the_levers_cannot_run_is_refused_naming_its_fields(train, named):
    # strategy none: left unset, one process plans as auto, which may still choose FSDP's CPU offload (bf16 shards
    # stepped on the host, where a compensation applies).
    body = {**MINIMAL, "train": {"effective_batch_size": 8, **train}, "distributed": {"strategy": "none"}}
    with pytest.raises(ConfigError, match="pipelines.a.") as caught:
        validate_pipelines({"pipelines": {"a": body}})
    assert named in str(caught.value)


def test_plain_rounding_and_kahan_are_accepted_with_pure_bf16_and_auto_follows_the_optimizer():
    from fulltune import levers

    for compensation in ("none", "kahan", "auto"):
        spec = validate_pipelines({"pipelines": {"a": {**MINIMAL, "train": {
            "pure_bf16": True, "compensation": compensation}}}}).pipelines["a"]
        assert spec.train.compensation == compensation
        assert levers.from_spec(spec).compensation == (None if compensation == "auto" else compensation)


def test_stochastic_rounding_needs_torchao():
    from fulltune.runtime.optim import torchao_available

    raw = {"pipelines": {"a": {**MINIMAL, "train": {"pure_bf16": True, "compensation": "stochastic"}}}}
    if torchao_available():
        assert validate_pipelines(raw).pipelines["a"].train.compensation == "stochastic"
        return
    with pytest.raises(ConfigError, match=r"train.compensation: stochastic rounding needs torchao: pip install"):
        validate_pipelines(raw)
