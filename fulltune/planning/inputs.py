"""What the planner is asked and what it answers, for one pipeline: the records every floor above reads.

`ResolvedPipeline` is a validated pipeline with its overrides applied and its budget resolved on this machine
(built by fulltune/stages `resolve_pipeline`); `plan_request` turns it into the planner's `PlanRequest`;
`BudgetDecision` is the memory budget stage's answer (the settings the run uses and the plan that chose them),
and `describe_settings` its one line for people.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from fulltune import degrees, levers
from fulltune.memory.budget import Budget, resolve_budget
from fulltune.memory.report import describe_settings  # noqa: F401  (re-exported: one line of a plan)
from fulltune.memory.types import Settings
from fulltune.spec import PipelineSpec


@dataclass(frozen=True)
class ResolvedPipeline:
    """A validated pipeline with its overrides applied, and where its outputs live.

    `budget` is `budget:` resolved on the machine that runs the pipeline (`with_budget`), once per run:
    every stage that plans or keys on it reads this one value.
    """

    name: str
    spec: PipelineSpec
    workdir: str
    pipelines_file: str
    budget: Budget | None = None

    @property
    def model_name(self) -> str:
        return self.spec.model_name(self.name)


def with_budget(p: ResolvedPipeline) -> ResolvedPipeline:
    """`p` carrying its budget resolved on this machine. The flow and the CLI call this once, before any
    stage; a pipeline that already carries one keeps it.

    Raises MemoryConfigError (a ConfigError: exit 2) naming `pipelines.<name>.budget.<field>`, e.g.
    `memory: auto` for cuda where no GPU is visible.
    """
    if p.budget is not None:
        return p
    b, d = p.spec.budget, p.spec.distributed
    per_machine = -(-d.num_processes // d.num_machines)  # the processes are spread evenly over the machines
    return replace(p, budget=resolve_budget(b.device, b.memory, b.headroom, b.host_memory,
                                            where=f"pipelines.{p.name}.budget", processes=per_machine))


def resolved_budget(p: ResolvedPipeline) -> Budget:
    """The budget `p` carries (`with_budget`), or, for a pipeline resolved without one, resolved now."""
    return p.budget if p.budget is not None else with_budget(p).budget  # type: ignore[return-value]


@dataclass(frozen=True)
class BudgetDecision:
    """The settings the run will use, and the plan that chose them (as the `plan --json` object).

    A frozen record of plain values (Prefect pickles it as the budget stage's persisted result)."""

    settings: Settings
    plan: dict[str, Any]
    table: str
    seq_len: int
    num_layers: int
    picture: str | None = None
    vocab_size: int | None = None  # of the trained tokenizer, for a model built from a config
    target_fraction: float = 1.0  # the most positions with a target in one row ÷ (seq_len - 1)
    document_length: int = 0  # packed rows: Σ length² / Σ length of their documents (Settings.document_length)


def plan_request(p: ResolvedPipeline, seq_len: int, target_fraction: float = 1.0, document_length: int = 0,
                 config: Any = None) -> Any:
    """The planner's request for `p` on its resolved budget: the fields left on auto are None.

    Packed rows (`document_length` > 0, or `data.packing` not yet resolved) reach the model without a mask under
    `sdpa` (fulltune/attention.py); they get transformers' dense (s × s) mask under eager attention, or where the
    model `config` has a sliding window shorter than the row (`attention.dense_mask_reason`)."""
    from fulltune.attention import dense_mask_reason
    from fulltune.memory import PlanRequest

    t, d = p.spec.train, p.spec.distributed
    budget = resolved_budget(p)
    # The lever table again, now that `budget.device: auto` has a device (validate checked the rest).
    combination = replace(levers.from_spec(p.spec), device=budget.device,
                          bf16_supported=budget.bf16_supported if budget.device == "cuda" else None)
    levers.check(combination, where=f"pipelines.{p.name}.")
    checkpointing = None if t.gradient_checkpointing == "auto" else t.gradient_checkpointing
    return PlanRequest(
        effective_batch_size=t.effective_batch_size,
        seq_len=seq_len,
        micro_batch_size=None if t.micro_batch_size == "auto" else t.micro_batch_size,
        gradient_accumulation_steps=None if t.gradient_accumulation_steps == "auto" else t.gradient_accumulation_steps,
        gradient_checkpointing=checkpointing,
        mixed_precision=None if t.mixed_precision == "auto" else t.mixed_precision,
        optimizer=None if t.optimizer == "auto" else t.optimizer,
        attn_implementation=p.spec.model.attn_implementation,
        device=budget.device,
        budget_bytes=budget.bytes,
        headroom=budget.headroom,
        strategy=d.strategy,
        num_processes=d.num_processes,
        **degrees.requested(d),  # each parallel degree; None (auto): the planner chooses
        pipeline_schedule=d.pipeline_schedule,
        bf16_supported=budget.bf16_supported,
        # Unpacked rows are right-padded and the trainer passes no mask at all (fulltune/data/batching.py);
        # packed rows need none under sdpa. `auto` not yet resolved: as packed.
        attention_mask=p.spec.data.packing is not False and (p.spec.model.attn_implementation != "sdpa"
                                                             or dense_mask_reason(config, seq_len) is not None),
        document_length=document_length,
        target_fraction=target_fraction,
        **levers.request_fields(t, budget),  # each lever, its options and what its auto reads
        checkpoint_async=t.checkpoint_async,
        host_memory_bytes=budget.host_bytes,
        num_machines=d.num_machines,
        evaluation=evaluation_request(p.spec),
        host_memory_assumed=budget.host_assumed,
        notes=(*((budget.shared,) if budget.shared else ()),
               # (on a CPU device one process has no strategy to choose: planning/strategy.py)
               *((f"pipelines.{p.name}.distributed.strategy is not set: for one process the plan chooses it as "
                  "under auto",) if d.strategy_unset and d.dims.auto_strategy and budget.device != "cpu" else ())),
    )


def evaluation_request(spec: PipelineSpec) -> Any:
    """The evaluate stage as `evaluate.*` configures it, for the plan (memory/evaluation.py)."""
    from fulltune.data.sources import generating_sources
    from fulltune.memory.evaluation import EvalRequest

    e = spec.evaluate
    return EvalRequest(batch_size=e.batch_size, max_new_tokens=e.max_new_tokens,
                       generate=e.max_generate_examples > 0 and any(generating_sources(spec.data)),
                       harness_batch_size=(e.lm_eval.batch_size or e.batch_size) if e.lm_eval else None,
                       precision=e.precision, processes=e.processes)
