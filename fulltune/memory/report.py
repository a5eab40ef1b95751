"""Show a memory plan: a terminal table and a stacked-bar PNG of both breakdowns against the budget."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from fulltune.memory.types import BREAKDOWN_KEYS, LEVERS, MemoryEstimate, MemoryPlan, Settings
from fulltune.memory.units import format_bytes, format_seconds


def _settings_line(plan: MemoryPlan) -> str:
    s = plan.settings
    return (
        f"plan: micro_batch_size={s.micro_batch_size} gradient_accumulation_steps="
        f"{s.gradient_accumulation_steps} gradient_checkpointing={s.gradient_checkpointing} "
        f"mixed_precision={s.mixed_precision} optimizer={s.optimizer}"
        + "".join(f" {name}=true" for name, on in s.levers().items() if on)
        + (f" tensor_parallel={s.tensor_parallel}" if s.dims.tp_enabled else "")
        + (f" context_parallel={s.context_parallel}" if s.dims.cp_enabled else "")
    )


def margin_line(plan: MemoryPlan) -> str | None:
    """'fits with 0.4 GiB to spare; the estimate's uncertainty here is ±1 GiB (…)' — None without a budget."""
    u = plan.uncertainty or {}
    spare = plan.spare_bytes
    if spare is None or "bytes" not in u:
        return None
    basis = {
        "trace": "estimate and trace of this step differ by that much; planned for the larger",
        "measured": f"the largest disagreement measured for {u['kind']}",
        "assumed": f"{u['kind']} is not measured; assumed",
    }[u["basis"]]
    uncertainty = f"±{format_bytes(u['bytes'])} ({basis})"
    if spare >= 0:
        return f"fits with {format_bytes(spare)} to spare; the estimate's uncertainty here is {uncertainty}"
    return f"{format_bytes(-spare)} over the usable budget; the estimate's uncertainty here is {uncertainty}"


def _step_total(estimate: MemoryEstimate) -> int:
    return estimate.step_device_bytes or estimate.device_bytes


def _process_phase(estimate: MemoryEstimate) -> str:
    return estimate.process_peak_phase or "training step"


def phase_lines(plan: MemoryPlan) -> list[str]:
    """The planned run's whole process phase by phase, and the evaluate stage's own plan against the budget."""
    from fulltune.memory.process import EVALUATION

    phases = plan.plan_estimate.phases
    if not phases:
        return []
    training = ", ".join(f"{name} {format_bytes(value)}" for name, value in phases.items() if name != EVALUATION)
    lines = [f"whole process (plan): {training}; peak in {_process_phase(plan.plan_estimate)}"]
    if plan.evaluation is not None:
        lines.append(evaluation_line(plan.evaluation))
    return lines


def evaluation_line(evaluation: dict) -> str:
    """'evaluation (the evaluate stage's own process, bf16 weights): 3.1 GiB — weights …; loss batch 8, …'."""
    memory = evaluation["memory"]
    batches = f"loss batch {evaluation['loss_batch']}, generation batch {evaluation['generation_batch']}"
    if evaluation["harness_batch"]:
        batches += f", lm-eval batch {evaluation['harness_batch']}"
    parts = ", ".join(f"{name} {format_bytes(memory[name])}" for name in
                      ("weights", "gathered", "loss", "generation", "harness") if memory.get(name))
    load = f", load {format_bytes(memory['load'])}" if memory["load"] else ""
    head = "fits" if evaluation["fits"] else "DOES NOT FIT"
    processes = evaluation.get("processes", 1)
    where = (f"{processes} processes of the evaluate stage, FSDP2-sharded, per process" if processes > 1
             else "the evaluate stage's own process")
    return (f"evaluation ({where}, {evaluation['dtype']} weights): "
            f"{format_bytes(evaluation['device_bytes'])}, {head} — {parts}{load}; {batches}")


def format_plan_table(plan: MemoryPlan) -> str:
    """A readable table: configured vs planned breakdown, totals, budget, reasons, alternatives."""
    lines = _table_lines(plan)
    margin = margin_line(plan)
    if margin:
        lines.append(margin)
    lines.extend(phase_lines(plan))
    lines.append(_settings_line(plan))
    share = plan.settings.target_fraction
    if share < 1.0:
        lines.append(f"logits: at most {share:.0%} of a row's positions have a target (from the data); the output "
                     f"head runs only there")
    if plan.estimated_step_seconds is not None:
        lines.append(f"estimated step time (ranking model): {format_seconds(plan.estimated_step_seconds)}")
    host = plan.plan_estimate.host_bytes
    if host:
        # On a GPU the plan counts one machine's host RAM (every rank's offloaded tensors, what budget.host_memory
        # holds: planning/search.py `_per_machine`); a CPU device's memory is each process's own.
        where = "per process, inside the device total (a CPU device's memory is the host's)" if plan.device == "cpu" \
            else "per machine, besides the device memory"
        lines.append(f"host RAM for the offloaded tensors: {format_bytes(host)} {where}")
    lines.extend(_data_host_lines(plan))
    if plan.reasons:
        lines.append("why:")
        lines.extend(f"  - {r}" for r in plan.reasons)
    if plan.suggestions:
        lines.append("to make it fit:")
        lines.extend(f"  - {s}" for s in plan.suggestions)
    if plan.pipeline_parallel:
        lines.append(plan.pipeline_parallel["advice"])
    lines.extend(_alternative_lines(plan))
    configured, planned = plan.configured_estimate.notes, plan.plan_estimate.notes
    for note in dict.fromkeys(configured + planned):  # a note of one of the two says whose it is
        whose = "" if note in configured and note in planned else " (plan)" if note in planned else " (configured)"
        lines.append(f"note{whose}: {note}")
    return "\n".join(lines)


def _table_lines(plan: MemoryPlan) -> list[str]:
    """The plan's heading and its configured-against-planned table."""
    budget = plan.budget_bytes
    configured, planned = plan.configured_estimate, plan.plan_estimate
    rows: list[tuple[str, str, str]] = []
    for key in BREAKDOWN_KEYS:
        rows.append((key.replace("_", " "), format_bytes(configured.breakdown.get(key, 0)),
                     format_bytes(planned.breakdown.get(key, 0))))
    rows.append(("step peak (allocated)", format_bytes(configured.peak_bytes), format_bytes(planned.peak_bytes)))
    rows.append(("step total", format_bytes(_step_total(configured)), format_bytes(_step_total(planned))))
    rows.append(("step peak during", configured.peak_phase, planned.peak_phase))
    rows.append(("process peak", format_bytes(configured.device_bytes), format_bytes(planned.device_bytes)))
    if budget is not None:
        pct = [f"{100 * e.device_bytes / budget:.0f}% of budget" for e in (configured, planned)]
        rows.append(("", pct[0], pct[1]))
    rows.append(("process peak in", _process_phase(configured), _process_phase(planned)))
    w0 = max(len(r[0]) for r in rows + [("", "", "")])
    w1 = max(max(len(r[1]) for r in rows), len("configured"))
    w2 = max(max(len(r[2]) for r in rows), len("plan"))
    sep = f"+-{'-' * w0}-+-{'-' * w1}-+-{'-' * w2}-+"
    head = "fits" if plan.fits else "DOES NOT FIT"
    budget_text = format_bytes(budget) if budget is not None else "none"
    usable = f", usable {format_bytes(plan.usable_bytes)}" if plan.usable_bytes is not None else ""
    lines = [f"memory plan on {plan.device}: budget {budget_text}{usable} — {head}", sep,
             f"| {'':{w0}} | {'configured':>{w1}} | {'plan':>{w2}} |", sep]
    for i, (a, b, c) in enumerate(rows):
        if i == len(BREAKDOWN_KEYS):
            lines.append(sep)
        lines.append(f"| {a:{w0}} | {b:>{w1}} | {c:>{w2}} |")
    lines.append(sep)
    return lines


def _alternative_lines(plan: MemoryPlan) -> list[str]:
    """The first five alternatives the search weighed, each with why it was not chosen."""
    if not plan.alternatives:
        return []
    lines = ["alternatives:"]
    for alt in plan.alternatives[:5]:
        tp = f", tensor parallel {alt['tensor_parallel']}" if alt.get("tensor_parallel", 1) > 1 else ""
        if alt.get("strategy", plan.settings.strategy) != plan.settings.strategy:  # strategy auto weighed another
            tp = f", strategy {alt['strategy']}{tp}"
        lines.append(
            f"  - micro {alt['micro_batch_size']} × accum {alt['gradient_accumulation_steps']}, "
            f"ckpt {alt['gradient_checkpointing']}, {alt['mixed_precision']}, {alt['optimizer']}"
            f"{''.join(f', {name}' for name in LEVERS if alt.get(name))}{tp}: "
            f"{format_bytes(alt['device_bytes'])} — {alt['rejected_because']}"
        )
    return lines


_COLORS = {
    "parameters": "#4C72B0",
    "gradients": "#DD8452",
    "optimizer_states": "#55A868",
    "activations": "#C44E52",
    "logits": "#8172B3",
    "temporary": "#937860",
    "runtime_overhead": "#8C8C8C",
}


def render_breakdown_png(plan: MemoryPlan, path: str | Path) -> Path:
    """Stacked bars of the configured and planned breakdowns (GiB) with the budget as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    gib = float(2**30)
    labels = ["configured", "plan"]
    estimates = [plan.configured_estimate, plan.plan_estimate]
    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=110)
    bottoms = [0.0, 0.0]
    for key in BREAKDOWN_KEYS:
        values = [e.breakdown.get(key, 0) / gib for e in estimates]
        ax.bar(labels, values, bottom=bottoms, color=_COLORS[key], label=key.replace("_", " "), width=0.55)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    if plan.budget_bytes is not None:
        ax.axhline(plan.budget_bytes / gib, color="black", linestyle="-", linewidth=1.2, label="budget")
        if plan.usable_bytes is not None:
            ax.axhline(plan.usable_bytes / gib, color="black", linestyle="--", linewidth=1.0, label="budget − headroom")
    ax.set_ylabel("GiB per device")
    title = "fits" if plan.fits else "does not fit"
    ax.set_title(f"memory per training step on {plan.device} ({title})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def describe_settings(settings: Settings | dict[str, Any], num_layers: int) -> str:
    """One line of the planned settings (the run summary, the log, the registered version's description)."""
    if not isinstance(settings, dict):
        settings = asdict(settings)
    ckpt = settings["gradient_checkpointing"]
    ckpt_text = "off" if ckpt == 0 else ("all layers" if ckpt >= num_layers else f"{ckpt} of {num_layers} layers")
    return (f"micro_batch_size={settings['micro_batch_size']} × gradient_accumulation_steps="
            f"{settings['gradient_accumulation_steps']}, mixed_precision={settings['mixed_precision']}, "
            f"optimizer={settings['optimizer']}, gradient checkpointing {ckpt_text}"
            + "".join(f", {lever}" for lever in LEVERS if settings.get(lever)))


def _data_host_lines(plan: MemoryPlan) -> list[str]:
    """Host RAM per machine for the training data (`process.data_host_bytes`), and with the levers' host RAM."""
    data = plan.data_host
    if not data:
        return []
    ranks = data["ranks_per_node"]
    each = f"{ranks} ranks'" if ranks > 1 else "the rank's"
    where = " (on a CPU device, the same RAM as the device's)" if plan.device == "cpu" else ""
    lines = [f"host RAM per machine for the training data: {format_bytes(data['total'])}{where}: "
             f"{format_bytes(data['mapped'])} train.arrow mapped once (page cache, shared by the ranks), "
             f"{format_bytes(data['row_index'])} {each} row index, {format_bytes(data['batches'])} micro-batch buffers"]
    levers = plan.plan_estimate.host_bytes
    if levers and plan.device != "cpu":
        lines.append(f"host RAM per machine in all: {format_bytes(levers + data['total'])} (offloaded tensors "
                     f"{format_bytes(levers)} + data {format_bytes(data['total'])})")
    return lines
