"""Every combination of memory levers × optimizer × strategy a user can write is either refused by `fulltune
validate` (exit 2, naming the fields) or trains: the lever table (fulltune/levers.py) is the trainer's truth.

The refused ones are checked through the spec's validation (every one) and the CLI (one). The accepted ones
train two optimizer steps each through the trainer's own `setup` and `train_step` (tests/lever_table_worker.py):
the one-process combinations in one child process, the ddp and fsdp ones in one 2-process torchrun group, each
combination with the accumulation and micro-batch a plan would give it (accumulation 1 with the step in
backward, else 2), bf16 and all layers checkpointed (so that offloaded activations have layers to offload).
float8 beside each other lever (tests/test_float8.py finds which) trains in the same processes, which then have
torchao.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fulltune import levers
from fulltune.runtime import optim
from fulltune.errors import ConfigError
from fulltune.optimizers import OPTIMIZERS, OPTIMIZERS_BY_NAME
from fulltune.runtime.launch import job_with
from fulltune.pipelines_file import validate_pipelines
from test_train import build_model, counting_rows, write_rows

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "lever_table_worker.py"
STRATEGIES = {"none": 1, "ddp": 2, "fsdp": 2}
# Pipeline stages (1F1B): (strategy, processes, stages) — 2 stages alone, and 2 stages beside 2 data-parallel
# processes sharded (fsdp) or replicated (ddp).
STAGED = {"pp2": ("none", 2, 2), "pp2 x fsdp2": ("fsdp", 4, 2), "pp2 x ddp2": ("ddp", 4, 2)}
EFFECTIVE_BATCH = 4


def layout_of(strategy: str) -> tuple[str, int, int]:
    """(strategy, processes, pipeline stages) of a STRATEGIES or STAGED name."""
    return STAGED.get(strategy) or (strategy, STRATEGIES[strategy], 1)


def batch_of(on: dict[str, bool], strategy: str) -> tuple[int, int]:
    """(micro-batch, accumulation) a plan gives the combination: the step in backward takes one micro-batch."""
    _, processes, stages = layout_of(strategy)
    accumulation = 1 if on["optimizer_in_backward"] else 2
    return EFFECTIVE_BATCH // (processes // stages * accumulation), accumulation


SCHEDULES = {"1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}  # torch.distributed.pipelining's classes


def schedule_of(on: dict[str, bool]) -> str:
    """The pipeline schedule a combination trains under: both schedules train, each for half of the lever sets
    (GPipe where pure bf16 is on, 1F1B where it is off)."""
    return "gpipe" if on["pure_bf16"] else "1f1b"


def validate(on: dict[str, bool], optimizer: str, strategy: str, **train: str) -> str | None:
    """None when the pipelines file validates (`train`: more keys of its train section); else the error message."""
    micro, accumulation = batch_of(on, strategy)
    name, processes, stages = layout_of(strategy)
    schedule = {"pipeline_schedule": schedule_of(on)} if stages > 1 else {}
    raw = {"pipelines": {"t": {
        "model": {"name_or_path": "local/model"}, "data": {"train": "train.jsonl"}, "budget": {"device": "cpu"},
        "train": {"effective_batch_size": EFFECTIVE_BATCH, "micro_batch_size": micro,
                  "gradient_accumulation_steps": accumulation, "gradient_checkpointing": True,
                  "mixed_precision": "bf16", "optimizer": optimizer, **on, **train},
        "distributed": {"strategy": name, "num_processes": processes, "pipeline_parallel": stages, **schedule}}}}
    try:
        validate_pipelines(raw)
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lever-table")
    build_model(root / "model", attention_dropout=0.0)
    write_rows(root / "train.parquet", counting_rows(16))
    return {"model": root / "model", "data": root / "train.parquet", "root": root}


def job_text(assets: dict[str, Path], on: dict[str, bool], optimizer: str, strategy: str, index: int,
             **plan: str) -> str:
    micro, accumulation = batch_of(on, strategy)
    name, processes, stages = layout_of(strategy)
    job = job_with(str(assets["model"]), str(assets["data"]), str(assets["root"] / "runs" / strategy / str(index)),
                   micro_batch_size=micro, gradient_accumulation_steps=accumulation, gradient_checkpointing=2,
                   mixed_precision="bf16", optimizer=optimizer, strategy=name, num_processes=processes,
                   pipeline_parallel=stages, max_steps=2, checkpoint_every_steps=0, learning_rate=1e-2,
                   warmup_ratio=0.0, **({"pipeline_schedule": schedule_of(on)} if stages > 1 else {}), **on, **plan)
    return job.to_json()


def train_all(assets: dict[str, Path], texts: list[str], processes: int, name: str,
              env: dict[str, str] | None = None) -> list[dict]:
    jobs, out = assets["root"] / f"{name}.json", assets["root"] / f"{name}-out.json"
    jobs.write_text(json.dumps(texts))
    env = {**(env or {**os.environ, "PYTHONPATH": str(ROOT)}), "OMP_NUM_THREADS": "1"}
    if processes == 1:
        command = [sys.executable, str(WORKER), str(jobs), str(out)]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   str(WORKER), str(jobs), str(out)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def accepted_by_validate(layouts: tuple[str, ...]) -> dict[str, list[tuple[dict[str, bool], str]]]:
    """Validate every lever set × optimizer under each layout of `layouts` (STRATEGIES or STAGED names); the
    accepted ones by layout. A refused one names the pipeline and a field of the combination."""
    accepted: dict[str, list] = {layout: [] for layout in layouts}
    for values in itertools.product((False, True), repeat=len(levers.LEVERS)):
        on = dict(zip(levers.LEVERS, values))
        for optimizer in OPTIMIZERS:
            for layout in layouts:
                problem = validate(on, optimizer, layout)
                if problem is None:
                    accepted[layout].append((on, optimizer))
                    continue
                fields = [f"train.{name}" for name, value in on.items() if value] + [
                    "train.optimizer", "distributed.strategy"]
                if layout_of(layout)[2] > 1:
                    fields.append("distributed.pipeline_parallel")
                assert "pipelines.t" in problem and any(field in problem for field in fields), problem
    return accepted


def train_accepted(assets: dict[str, Path], accepted: dict[str, list], env: dict[str, str] | None = None) -> list[str]:
    """Two optimizer steps of each accepted combination, one process or torchrun group per layout (`env`: theirs);
    what did not train. A combination is (levers, optimizer) or (levers, optimizer, more of the plan)."""
    failures = []
    for layout, combos in accepted.items():
        combos = [combo if len(combo) == 3 else (*combo, {}) for combo in combos]
        texts = [job_text(assets, on, optimizer, layout, i, **plan) for i, (on, optimizer, plan) in enumerate(combos)]
        results = train_all(assets, texts, layout_of(layout)[1], layout.replace(" ", ""), env)
        for (on, optimizer, plan), result in zip(combos, results):
            label = f"{layout} {optimizer} {[name for name, value in on.items() if value]} {plan or ''}"
            if "error" in result:
                failures.append(f"{label}: {result['error']}")
            elif not (all(loss == loss and loss < 1e4 for loss in result["losses"]) and result["moved"]):
                failures.append(f"{label}: did not train: {result}")
            elif layout_of(layout)[2] > 1 and result["schedule"] != SCHEDULES[schedule_of(on)]:
                failures.append(f"{label}: trained under {result['schedule']}, not {schedule_of(on)}")
    return failures


def compensations_accepted_by_validate() -> list[tuple[dict[str, bool], str, dict[str, str]]]:
    """`train.compensation` with pure bf16 weights on one process, validated for every optimizer: the accepted
    (levers, optimizer, {"compensation": ...}); a refused one names the pipeline and train.compensation or
    train.optimizer (4-bit states without torchao)."""
    on = {**dict.fromkeys(levers.LEVERS, False), "pure_bf16": True}
    accepted = []
    for optimizer in OPTIMIZERS:
        for compensation in ("kahan", "stochastic", "none"):
            problem = validate(on, optimizer, "none", compensation=compensation)
            if problem is None:
                accepted.append((on, optimizer, {"compensation": compensation}))
            else:
                assert "pipelines.t" in problem and ("train.compensation" in problem or "train.optimizer" in problem)
    return accepted


def test_every_lever_optimizer_strategy_combination_is_refused_by_validate_or_trains(assets) -> None:
    accepted = accepted_by_validate(tuple(STRATEGIES))
    # What can train on a CPU device (no FSDP CPU offload): on one process 24 of the 32 lever sets (all but the
    # step in backward with the optimizer offload) with every AdamW-family optimizer and adafactor (4-bit states
    # only with torchao installed), and muon in the 16 sets without the optimizer offload; under DDP the 8 sets
    # without those two; under FSDP, with adamw, adafactor and muon, the 16 sets of the chunked head, pure bf16,
    # the step in backward and offloaded activations.
    optimizers = 3 + optim.torchao_available()
    counts = {strategy: len(combos) for strategy, combos in accepted.items()}
    assert counts == {"none": 24 * optimizers + 16, "ddp": 8 * (optimizers + 1), "fsdp": 16 * 3}, counts
    # With them, in the same process: pure bf16's compensations other than each optimizer's default (which the
    # lever sets above train), as `test_every_compensation_...` finds validate accepts them.
    accepted["none"] += [(on, optimizer, plan) for on, optimizer, plan in compensations_accepted_by_validate()
                         if plan["compensation"] != OPTIMIZERS_BY_NAME[optimizer].default_compensation]
    # And float8 beside each other lever, as tests/test_float8.py finds validate accepts it on a machine with
    # torchao: the processes then have torchao (.lowbit/, tests/lowbit.py; `make test` requires it).
    import lowbit
    from test_float8 import float8_sets_accepted_by_validate

    env = None
    if lowbit.available():
        for layout, sets in float8_sets_accepted_by_validate().items():
            accepted[layout] += [(on, "adamw") for on in sets]
        env = lowbit.environment()
    assert train_accepted(assets, accepted, env) == []


def test_every_compensation_with_every_optimizer_is_refused_by_validate_or_accepted() -> None:
    """`train.compensation` with pure bf16 weights: validate accepts what each optimizer's record offers
    (stochastic rounding only with torchao installed) and refuses the rest, naming train.compensation; the
    accepted ones train in `test_every_lever_optimizer_strategy_...`."""
    accepted = {(optimizer, plan["compensation"]) for _, optimizer, plan in compensations_accepted_by_validate()}
    expected = {("adamw", "kahan"), ("adamw", "none"), ("adamw_8bit", "none"), ("adafactor", "none"), ("muon", "none")}
    if optim.torchao_available():
        expected |= {("adamw", "stochastic"), ("adamw_8bit", "stochastic"), ("adamw_4bit", "stochastic"),
                     ("adamw_4bit", "none")}
    assert accepted == expected


@pytest.mark.parametrize(("settings", "named"), [
    (("train.optimizer_in_backward=true", "distributed.strategy=ddp", "distributed.num_processes=2"),
     "train.optimizer_in_backward with distributed.strategy"),
    (("train.pure_bf16=true", "train.optimizer=adafactor", "train.compensation=kahan"),
     "train.compensation with train.optimizer: adafactor offers none with pure bf16 weights"),
], ids=["step_in_backward_under_ddp", "a_compensation_the_optimizer_does_not_offer"])
def test_a_refused_combination_exits_2_from_fulltune_validate_naming_its_fields(settings: tuple[str, ...],
                                                                               named: str) -> None:
    command = [sys.executable, "-m", "fulltune.cli", "validate", str(ROOT / "pipelines.yaml"),
               *(arg for setting in settings for arg in ("--set", setting))]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert named in result.stderr
    assert "Traceback" not in result.stderr


def test_plan_applies_the_table_once_budget_device_auto_has_a_device() -> None:
    """`budget.device: auto` is unknown at validate; `plan` resolves it and refuses what the device cannot run."""
    command = [sys.executable, "-m", "fulltune.cli", "plan", "demo", "-f", str(ROOT / "pipelines.yaml"),
               "--set", "train.offload_optimizer=true", "--set", "distributed.strategy=fsdp",
               "--set", "distributed.num_processes=2", "--set", "train.effective_batch_size=8"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 2, result.stderr
    assert "pipelines.demo.train.offload_optimizer with budget.device" in result.stderr
    assert "Traceback" not in result.stderr


def test_strategy_auto_is_not_decided_for_the_table() -> None:
    """`distributed.strategy: auto` may still choose fsdp: the rules that need fsdp are not broken by it."""
    from dataclasses import replace

    from fulltune.pipelines_file import validate_pipelines

    body = {"model": {"name_or_path": "m"}, "data": {"train": "t.jsonl"},
            "train": {"offload_optimizer": True, "effective_batch_size": 8},
            "distributed": {"strategy": "auto", "num_processes": 2}}
    spec = validate_pipelines({"pipelines": {"a": body}}).pipelines["a"]
    combination = levers.from_spec(spec)
    assert combination.strategy is None and levers.problems(combination) == []
    assert levers.problems(replace(combination, strategy="ddp"))  # fixed ddp breaks the offload rule


def test_every_lever_and_optimizer_with_two_pipeline_stages_is_refused_by_validate_or_trains(assets) -> None:
    """With 2 stages (1F1B, and GPipe for the lever sets with pure bf16): the chunked head and pure bf16 with every
    optimizer (4-bit states with torchao); the step in backward and both offloads are refused, each naming its
    fields. The combinations beside data
    parallel are validated here and trained by the `heavy` test below (4 processes)."""
    accepted = accepted_by_validate(tuple(STAGED))
    optimizers = 4 + optim.torchao_available()
    counts = {layout: len(combos) for layout, combos in accepted.items()}
    # Beside data parallel the chunked head is refused, and the stages' DTensors (FSDP2 shards, DDP replicas) take
    # adamw, adafactor and muon only.
    assert counts == {"pp2": 4 * optimizers, "pp2 x fsdp2": 2 * 3, "pp2 x ddp2": 2 * 3}, counts
    assert train_accepted(assets, {"pp2": accepted["pp2"]}) == []


@pytest.mark.heavy
def test_every_lever_and_optimizer_with_pipeline_stages_beside_data_parallel_trains_if_validate_accepts(assets):
    accepted = accepted_by_validate(("pp2 x fsdp2", "pp2 x ddp2"))
    assert train_accepted(assets, accepted) == []
