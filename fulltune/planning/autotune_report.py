"""Autotune's report: the measured candidates as a table, a picture of step time against peak memory, and
both as artifacts of the pipeline's MLflow run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.memory.units import format_seconds
from fulltune.planning.autotune import describe

if TYPE_CHECKING:
    from fulltune.planning.autotune import Tuning


def format_table(result: Tuning | dict[str, Any]) -> str:
    """The candidates with predicted beside measured step time, tokens/s, peak and outcome."""
    from fulltune.memory.types import Settings
    from fulltune.memory.units import format_bytes

    data = result if isinstance(result, dict) else result.to_dict()
    rows = [("#", "settings", "predicted", "measured", "tokens/s", "peak", "outcome")]
    for i, c in enumerate(data["candidates"]):
        settings = Settings(**{"seq_len": 2, **c["settings"]})
        mark = "  ← chosen" if i == data["chosen"] else ""
        rows.append((str(i), describe(settings), format_seconds(c["predicted_step_seconds"]),
                     format_seconds(c["measured_step_seconds"]),
                     f"{c['tokens_per_second']:,.0f}" if c["tokens_per_second"] else "-",
                     format_bytes(c["measured_peak_bytes"]) if c["measured_peak_bytes"] else "-",
                     c["outcome"] + (" (cached)" if c["cached"] else "") + mark))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    usable = f", usable {format_bytes(data['usable_bytes'])}" if data.get("usable_bytes") else ""
    head = (f"autotune on {data['device_kind']}: {len(data['candidates'])} candidate(s), {data['warmup_steps']} "
            f"warm-up + {data['steps']} timed step(s) each, {format_seconds(data['seconds'])} of at most "
            f"{format_seconds(data['max_seconds'])}{usable}")
    lines = [head] + ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"  {i}: {c['detail']}" for i, c in enumerate(data["candidates"]) if c["detail"]]
    lines.append("predicted: the step time the planner's model ranks the candidates by (calibrated once steps on this "
                 "kind of device were measured); measured: the median timed step and the peak on this machine")
    lines.append(data["reason"])
    return "\n".join(lines)


def render_png(result: Tuning, path: str | Path) -> Path:
    """Measured step time against measured peak memory, one point per candidate, the budget as a line; zoomed to
    the points with the budget named when they are all far below it (as the plan's picture, memory/report.py)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fulltune.memory.report import ZOOM_BELOW
    from fulltune.memory.units import format_bytes

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    measured = [(i, t) for i, t in enumerate(result.trials)
                if t.measured_step_seconds is not None and t.measured_peak_bytes is not None]
    peak = max((t.measured_peak_bytes for _, t in measured), default=0)
    zoom = result.budget_bytes is not None and peak < ZOOM_BELOW * result.budget_bytes
    unit_name, unit = ("GiB", 2**30) if not zoom or peak >= 2 * 2**30 else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(6.5, 4.5), dpi=110)
    colors = {"fits": "tab:green", "over budget": "tab:red", "oom": "tab:red"}
    for i, t in measured:
        x, y = t.measured_peak_bytes / unit, t.measured_step_seconds
        ax.scatter([x], [y], s=90 if i == result.chosen else 40, color=colors.get(t.outcome, "tab:gray"),
                   edgecolors="black" if i == result.chosen else "none", zorder=3)
        ax.annotate(f"{i}: {describe(t.settings)}", (x, y), textcoords="offset points", xytext=(6, 4), fontsize=7)
    if zoom:
        ax.set_xlim(0, peak * 1.6 / unit)
        usable = f" (usable {format_bytes(result.usable_bytes)})" if result.usable_bytes is not None else ""
        ax.set_title(f"zoomed to the points: the budget, {format_bytes(result.budget_bytes)}{usable}, is far to the "
                     "right", fontsize=8, style="italic", loc="left")
    else:
        for value, label, style in ((result.budget_bytes, "budget", "-"), (result.usable_bytes, "budget − headroom",
                                                                             "--")):
            if value is not None:
                ax.axvline(value / unit, color="black", linestyle=style, linewidth=1.0, label=label)
    ax.set_xlabel(f"measured peak memory ({unit_name} per device)")
    ax.set_ylabel("measured step time (s)")
    fig.suptitle(f"autotune on {result.device_kind}")
    if not zoom and (result.budget_bytes is not None or result.usable_bytes is not None):
        ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def log_to_mlflow(run_id: str, plan: dict[str, Any]) -> None:
    """The autotune table, its JSON and its picture as artifacts of MLflow run `run_id` (when it ran)."""
    autotune = plan.get("autotune") or {}
    if not autotune.get("ran"):
        return
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    client.log_text(run_id, format_table(autotune), "autotune/autotune.txt")
    client.log_dict(run_id, autotune, "autotune/autotune.json")
    if autotune.get("picture") and Path(autotune["picture"]).is_file():
        client.log_artifact(run_id, autotune["picture"], "autotune")
