"""Show a memory plan: a terminal table and a stacked-bar PNG of the breakdowns against the budget.

Where autotune measured other settings faster than the analytic plan's (fulltune/planning/autotune.py), those are
what trains: the table, the settings line and the picture show them (`Trained`) beside the analytic plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fulltune.degrees import DEGREES
from fulltune.memory.types import BREAKDOWN_KEYS, LEVERS, MemoryEstimate, MemoryPlan, Settings
from fulltune.memory.units import format_bytes, format_seconds


@dataclass(frozen=True)
class Trained:
    """Settings a measurement chose over the analytic plan's (autotune), their estimate, and why they won."""

    settings: Settings
    estimate: MemoryEstimate
    why: str  # "autotune measured 0.41 s a step, the analytic plan 0.51 s"


def _settings_line(plan: MemoryPlan, trained: Trained | None = None) -> str:
    if trained is not None:
        return (f"trains (autotune): {_settings_text(trained.settings)} — {trained.why}\n"
                f"analytic plan: {_settings_text(plan.settings)}")
    return f"plan: {_settings_text(plan.settings)}"


def _settings_text(s: Settings) -> str:
    return (
        f"micro_batch_size={s.micro_batch_size} gradient_accumulation_steps="
        f"{s.gradient_accumulation_steps} gradient_checkpointing={s.gradient_checkpointing} "
        f"mixed_precision={s.mixed_precision} optimizer={s.optimizer}"
        + "".join(f" {name}=true" for name, on in s.levers().items() if on)
        + "".join(f" {degree.name}={getattr(s, degree.name)}" for degree in DEGREES
                  if degree.recorded_after and degree.on(s.dims))
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


def format_plan_table(plan: MemoryPlan, trained: Trained | None = None) -> str:
    """A readable table: configured vs planned breakdown (and what trains, when autotune chose other settings),
    totals, budget, reasons, alternatives."""
    lines = _table_lines(plan, trained)
    margin = margin_line(plan)
    if margin:
        lines.append(margin)
    lines.extend(phase_lines(plan))
    lines.append(_settings_line(plan, trained))
    share = plan.settings.target_fraction
    if share < 1.0:
        lines.append(f"logits: at most {share:.0%} of a row's positions have a target (from the data); the output "
                     f"head runs only there")
    if plan.estimated_step_seconds is not None:
        whose = " of the analytic plan" if trained is not None else ""
        lines.append(f"estimated step time{whose} (ranking model, predicted, not measured): "
                     f"{format_seconds(plan.estimated_step_seconds)}")
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


def _columns(plan: MemoryPlan, trained: Trained | None) -> list[tuple[str, MemoryEstimate]]:
    """(heading, estimate) of each column of the table and bar of the picture."""
    columns = [("configured", plan.configured_estimate)]
    if trained is None:
        return columns + [("plan", plan.plan_estimate)]
    return columns + [("analytic plan", plan.plan_estimate), ("trains (autotune)", trained.estimate)]


def _table_lines(plan: MemoryPlan, trained: Trained | None = None) -> list[str]:
    """The plan's heading and its configured-against-planned table."""
    budget = plan.budget_bytes
    columns = _columns(plan, trained)
    estimates = [e for _, e in columns]
    rows: list[tuple[str, ...]] = []
    for key in BREAKDOWN_KEYS:
        rows.append((key.replace("_", " "), *(format_bytes(e.breakdown.get(key, 0)) for e in estimates)))
    rows.append(("step peak (allocated)", *(format_bytes(e.peak_bytes) for e in estimates)))
    rows.append(("step total", *(format_bytes(_step_total(e)) for e in estimates)))
    rows.append(("step peak during", *(e.peak_phase for e in estimates)))
    rows.append(("process peak", *(format_bytes(e.device_bytes) for e in estimates)))
    if budget is not None:
        rows.append(("", *(f"{100 * e.device_bytes / budget:.0f}% of budget" for e in estimates)))
    rows.append(("process peak in", *(_process_phase(e) for e in estimates)))
    widths = [max(len(r[0]) for r in rows)] + [max(max(len(r[i + 1]) for r in rows), len(heading))
                                                 for i, (heading, _) in enumerate(columns)]
    sep = "+" + "+".join("-" * (w + 2) for w in widths) + "+"

    def line(cells: tuple[str, ...]) -> str:
        return "| " + " | ".join([f"{cells[0]:{widths[0]}}"] + [f"{c:>{w}}" for c, w in zip(cells[1:], widths[1:])]) + " |"

    head = "fits" if plan.fits else "DOES NOT FIT"
    budget_text = format_bytes(budget) if budget is not None else "none"
    usable = f", usable {format_bytes(plan.usable_bytes)}" if plan.usable_bytes is not None else ""
    lines = [f"memory plan on {plan.device}: budget {budget_text}{usable} — {head}", sep,
             line(("", *(heading for heading, _ in columns))), sep]
    for i, cells in enumerate(rows):
        if i == len(BREAKDOWN_KEYS):
            lines.append(sep)
        lines.append(line(cells))
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


# A plan whose bars are all under this share of the budget is drawn to its own scale: at the budget's, the bars of
# a small model (the demo's 0.7 MiB against a 23.5 GiB budget) would be a sliver and no component would show.
ZOOM_BELOW = 0.25
# A component's value is written inside its bar when it is at least this share of the axis (every value is in the
# legend too).
LABELLED_SHARE = 0.06


@dataclass(frozen=True)
class BreakdownChart:
    """What the picture draws: each bar's components (name, bytes), the axis's top and unit, the budget's lines
    (drawn when on the axis), and a note saying where the budget is when the chart is zoomed to the bars. A bar
    taller than the axis (the configured settings, many times over the budget) is cut at its top, its total
    written there."""

    bars: tuple[tuple[str, tuple[tuple[str, int], ...]], ...]
    top_bytes: float
    unit: tuple[str, int]
    lines: tuple[tuple[str, int], ...]
    note: str


def breakdown_chart(plan: MemoryPlan, trained: Trained | None = None) -> BreakdownChart:
    """The picture of `plan` as data: bars of the configured, planned (and trained) breakdowns. The axis reaches the
    budget and the bars that run (the configured bar may be cut); when every bar is under ZOOM_BELOW of the budget
    it is zoomed to the bars instead, the budget named in a note."""
    bars = tuple((heading, tuple((key, int(e.breakdown.get(key, 0))) for key in BREAKDOWN_KEYS))
                 for heading, e in _columns(plan, trained))
    totals = [sum(value for _, value in parts) for _, parts in bars]
    budget, usable = plan.budget_bytes, plan.usable_bytes
    lines = tuple((label, value) for label, value in (("budget", budget), ("budget − headroom", usable))
                  if value is not None)
    note = ""
    if budget is not None and max(totals) < ZOOM_BELOW * budget:
        note = (f"zoomed to the bars: the budget, {format_bytes(budget)}"
                + (f" (usable {format_bytes(usable)})" if usable is not None else "")
                + f", is far above; the tallest bar is {100 * max(totals) / budget:.1f}% of it")
        lines, top = (), max(totals) * 1.25
    else:
        top = max([t * 1.12 for t in totals[1:]] + [value * 1.08 for _, value in lines] + [1.0])
    unit = next((u for u in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)) if top >= 2 * u[1]), ("B", 1))
    return BreakdownChart(bars, top, unit, lines, note)


def render_breakdown_png(plan: MemoryPlan, path: str | Path, trained: Trained | None = None) -> Path:
    """Stacked bars of the configured and planned breakdowns (and what trains, after autotune) against the budget,
    or zoomed to the bars when they are far below it (`breakdown_chart`): each bar's total above it, each component
    tall enough to read labelled inside, and every component's values in the legend."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    chart = breakdown_chart(plan, trained)
    unit_name, unit = chart.unit
    top = chart.top_bytes / unit
    labels = [heading for heading, _ in chart.bars]
    fig, ax = plt.subplots(figsize=(8.5 if trained is not None else 7.5, 4.8), dpi=110)
    bottoms = [0.0] * len(labels)
    for index, key in enumerate(BREAKDOWN_KEYS):
        values = [parts[index][1] for _, parts in chart.bars]
        if not any(values):
            continue
        shown = ", ".join(dict.fromkeys(format_bytes(v) for v in values))
        ax.bar(labels, [v / unit for v in values], bottom=bottoms, color=_COLORS[key], width=0.55,
               label=f"{key.replace('_', ' ')}: {shown}")
        for x, (value, bottom) in enumerate(zip(values, bottoms)):
            middle = bottom + value / unit / 2
            if value >= LABELLED_SHARE * chart.top_bytes and middle < top:
                ax.text(x, middle, format_bytes(value), ha="center", va="center", fontsize=7, color="white")
        bottoms = [b + v / unit for b, v in zip(bottoms, values)]
    for x, total in enumerate(bottoms):
        cut = total > top
        ax.text(x, min(total, top), format_bytes(total * unit) + (" ↑ (cut)" if cut else ""),
                ha="center", va="top" if cut else "bottom", fontsize=8, fontweight="bold",
                color="white" if cut else "black")
    for (label, value), style in zip(chart.lines, ("-", "--")):
        ax.axhline(value / unit, color="black", linestyle=style, linewidth=1.2 if style == "-" else 1.0,
                   label=f"{label}: {format_bytes(value)}")
    ax.set_ylim(0, top)
    ax.set_ylabel(f"{unit_name} per device")
    ax.set_title(f"memory per training step on {plan.device} ({'fits' if plan.fits else 'does not fit'})")
    if chart.note:
        ax.set_xlabel("\n".join(textwrap.wrap(chart.note, 80)), fontsize=8, style="italic")
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
