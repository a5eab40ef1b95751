"""A parallelism is a degree of `ParallelDims` plus one object per kind (fulltune/memory/parallelism.py), whose
runtime half is fulltune/runtime/parallelize.py's, dispatched once: what the rest of the engine reads instead of
testing `distributed.strategy` by its string."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fulltune.degrees import ParallelDims
from fulltune.memory import parallelism
from fulltune.memory.types import Settings

ROOT = Path(__file__).resolve().parents[1]

# The modules that still compare `strategy` with a string, and why (every other module asks `ParallelDims` or a
# parallelism object): each reads the YAML value as the user wrote it, `auto` still open, and names it.
STRATEGY_STRINGS_ALLOWED = {
    "fulltune/degrees.py": "the one place the value becomes the layout (fsdp_enabled, ddp_enabled, alone)",
    "fulltune/levers.py": "a rule of the lever table names the YAML value it refuses (auto: None, no rule holds)",
    "fulltune/spec.py": "the schema's checks of distributed.* name the values as written",
    "fulltune/memory/types.py": "Settings checks its field before the degrees are built; a request's auto is None",
    "fulltune/planning/strategy.py": "`strategy: auto`'s choices are read from the value as written",
}


def test_a_degree_is_one_record_that_makes_its_fields_keys_and_rules():
    """`DEGREES` makes the degree fields of Settings, PlanRequest and the lever table's Combination (in its order),
    the job's planned keys, each one's `ParallelDims` attribute, the plan's keys and its "not combined" rules."""
    from dataclasses import fields

    from fulltune import degrees, levers, spec
    from fulltune.memory import PlanRequest
    from fulltune.runtime.launch import PLANNED_DISTRIBUTED_KEYS

    names = [d.name for d in degrees.DEGREES]
    for kind in (Settings, PlanRequest, levers.Combination):
        assert [f.name for f in fields(kind) if f.name in names] == names
    assert set(names) <= set(spec.DistributedSpec.model_fields)  # each is a YAML key
    assert PLANNED_DISTRIBUTED_KEYS == ("tensor_parallel", "context_parallel")
    settings = Settings(micro_batch_size=1, seq_len=8, strategy="fsdp", num_processes=4, context_parallel=2)
    assert {d.attr: getattr(settings.dims, d.attr) for d in degrees.DEGREES} == {"tp": 1, "pp": 1, "cp": 2}
    assert set(parallelism.BY_DEGREE) <= set(degrees.BY_NAME)  # a kind explains a degree that has a record
    # Settings.to_dict records the degrees whose records say where (not the stages), in the records' order.
    assert [k for k in settings.to_dict() if k in names] == ["tensor_parallel", "context_parallel"]
    combination = levers.Combination(levers={}, context_parallel=2, pipeline_parallel=2)
    assert levers.problems(combination) == ["distributed.context_parallel with distributed.pipeline_parallel: context "
                                            "parallel is not combined with pipeline stages (not built); set one of "
                                            "them to 1"]


def test_every_kind_has_its_runtime_half_and_one_name():
    from fulltune.runtime.parallelize import RUNTIME

    names = [k.name for k in parallelism.KINDS]
    assert len(set(names)) == len(names)
    assert set(RUNTIME) == set(names)


@pytest.mark.parametrize("fields, kinds", [
    ({}, ["one process"]),
    ({"strategy": "ddp", "num_processes": 2}, ["ddp"]),
    ({"strategy": "fsdp", "num_processes": 1}, ["fsdp"]),
    ({"strategy": "fsdp", "num_processes": 4, "tensor_parallel": 2}, ["fsdp", "tensor parallel"]),
    ({"num_processes": 2, "pipeline_parallel": 2, "gradient_accumulation_steps": 2}, ["one process", "pipeline stages"]),
    ({"strategy": "ddp", "num_processes": 4, "pipeline_parallel": 2, "gradient_accumulation_steps": 2},
     ["ddp", "pipeline stages"]),
])
def test_a_rank_runs_one_data_parallel_kind_and_the_kinds_over_it(fields, kinds):
    settings = Settings(micro_batch_size=1, seq_len=16, **fields)
    assert [k.name for k in parallelism.kinds(settings)] == kinds
    assert parallelism.rank_kind(settings).name == kinds[-1]


def test_the_degrees_say_how_the_data_parallel_processes_hold_the_model():
    fsdp = ParallelDims(8, 2, 1, "fsdp")
    assert (fsdp.dp, fsdp.dp_shard, fsdp.dp_replicate) == (4, 4, 1)
    assert fsdp.fsdp_enabled and fsdp.tp_enabled and not fsdp.pp_enabled and not fsdp.ddp_enabled
    ddp = ParallelDims(4, 1, 2, "ddp")
    assert (ddp.dp, ddp.dp_shard, ddp.dp_replicate) == (2, 1, 2) and ddp.per_stage().world_size == 2
    assert ParallelDims(16, 1, 1, None).auto_strategy and ParallelDims(16).per_machine(2) == 8


def test_no_module_tests_the_strategy_string_but_the_few_that_say_why():
    pattern = re.compile(r"strategy\s*(==|!=|\bin\b|\bnot in\b)\s*[\"'(]")
    found = {str(path.relative_to(ROOT)) for path in (ROOT / "fulltune").rglob("*.py")
             if pattern.search(path.read_text())}
    assert sorted(found - set(STRATEGY_STRINGS_ALLOWED)) == []
    assert sorted(set(STRATEGY_STRINGS_ALLOWED) - found) == [], "a module no longer tests the string: delete its line"
