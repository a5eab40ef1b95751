"""What each stage shows in the Prefect UI: its artifacts, from its inputs, key and record."""

from __future__ import annotations

import base64
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)

from fulltune.stages import EVALUATE, FINE_TUNE, MEMORY_BUDGET, REGISTER, TOKENIZE
from fulltune.stages.runner import Inputs


def tokenized_table(inputs: Inputs, key: str, record: Any) -> None:
    """What the tokenized data holds, one quantity a row (a row of ten columns is cut off in a narrow window)."""
    from fulltune.stages.tokenize import data_summary

    name = inputs.pipeline.name
    rows = [{"quantity": quantity, "value": value}
            for quantity, value in data_summary(record.data, inputs.pipeline.spec).items()]
    create_table_artifact(key=f"{name}-tokenized", table=rows, description=f"Tokenized data of pipeline {name}")


def memory_plan(inputs: Inputs, key: str, record: Any) -> None:
    """The plan table and the breakdown picture; autotune's picture below when it measured."""
    markdown = plan_markdown(inputs.pipeline.name, record.table, Path(record.picture))
    tuned = record.plan["autotune"].get("picture")
    if tuned:  # measured step time against measured peak memory, the budget as a line
        markdown += f"\n\n![autotune]({_data_uri(Path(tuned))})"
    create_markdown_artifact(key=f"{inputs.pipeline.name}-memory-plan", markdown=markdown,
                             description="Estimated peak memory against the budget")


def plan_markdown(name: str, table: str, picture: Path) -> str:
    """The plan table and the breakdown picture, embedded as a data URI: the Prefect UI renders it from
    the artifact itself, on any machine (a file:// link only resolves where the run wrote the file)."""
    return (f"## Memory plan for `{name}`\n\n```\n{wrapped(table)}\n```\n\n"
            f"![memory breakdown]({_data_uri(picture)})\n\n"
            f"The picture is also at `{picture}` on the machine that ran the plan.")


# The widest line a code block shows whole in the Prefect UI's artifact page at a 1400 px window.
PAGE_COLUMNS = 95


def wrapped(text: str, width: int = PAGE_COLUMNS) -> str:
    """`text` with each line longer than `width` broken at spaces, its continuation indented under its start
    (a list item's under its text): a code block in the UI scrolls rather than wraps, and cuts long lines off."""
    import textwrap

    out = []
    for line in text.splitlines():
        if len(line) <= width:
            out.append(line)
            continue
        body = line.lstrip(" ")
        indent = " " * (len(line) - len(body))
        hanging = indent + ("  " if body.startswith("- ") else "    ")
        out += textwrap.wrap(body, width, initial_indent=indent, subsequent_indent=hanging, break_on_hyphens=False)
    return "\n".join(out)


def _data_uri(picture: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(picture.read_bytes()).decode("ascii")


def evaluation(inputs: Inputs, key: str, record: Any) -> None:
    """The metrics side by side, the gate's metric named, and whether there was a champion to compare with."""
    p = inputs.pipeline
    against = f"champion v{record.champion_version}" if record.champion_version is not None else "no champion yet"
    create_markdown_artifact(key=f"{p.name}-evaluation", markdown=f"## Evaluation of `{p.name}`\n\n"
                             + record.markdown(p.spec.registration.gates),
                             description=f"Base vs fine-tuned ({against})")


def registration(inputs: Inputs, key: str, record: Any) -> None:
    """The version, whether it was promoted and by which setting, and the line that loads it (the version itself
    when it is not the champion, with what `@champion` loads instead)."""
    from fulltune.tracking.registry import current_champion

    if record.promoted:
        verdict, champion = "promoted to champion", ""
    else:
        holder = current_champion(record.name)
        verdict = "not promoted (challenger)" if record.created else "already registered (the same weights)"
        champion = (f"\n\n`models:/{record.name}@champion` loads version {holder.version}, not this one."
                    if holder is not None else f"\n\nThere is no champion yet: `models:/{record.name}@champion` "
                    "loads nothing until a version is promoted.")
    create_markdown_artifact(
        key=f"{inputs.pipeline.name}-registration",
        markdown=(f"## `{record.name}` version {record.version}: {verdict}\n\n"
                  f"aliases: {', '.join(record.aliases)}\n\ndecided by {record.rules}: {record.reason}\n\n"
                  f"```python\nmlflow.transformers.load_model(\"{record.model_uri()}\")\n```{champion}"),
        description=f"MLflow registration: version {record.version}, {verdict}")


class TrainingProgress:
    """Mirror the child's `progress.json` into a Prefect progress artifact while it trains."""

    def __init__(self, pipeline: str, output_dir: Path) -> None:
        self.output_dir = output_dir
        self.stop = threading.Event()
        self.artifact_id = create_progress_artifact(progress=0.0, key=f"{pipeline}-training-progress",
                                                    description=f"Training progress of {pipeline}")
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> TrainingProgress:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
        self._update()

    def _poll(self) -> None:
        while not self.stop.wait(3.0):
            self._update()

    def _update(self) -> None:
        from fulltune.stages.finetune import training_progress

        progress = training_progress(self.output_dir)
        if progress is not None:
            update_progress_artifact(self.artifact_id, progress=min(100.0 * progress[0] / max(progress[1], 1), 100.0))


def training_progress(inputs: Inputs) -> Callable[[Path], AbstractContextManager[Any]]:
    """The fine-tune stage's watch: a progress artifact per training attempt."""
    return lambda output_dir: TrainingProgress(inputs.pipeline.name, output_dir)


# Each stage's artifacts once it has run (inputs, key, record); a stage without any has no entry.
ARTIFACTS: dict[str, Callable[[Inputs, str, Any], None]] = {
    TOKENIZE: tokenized_table, MEMORY_BUDGET: memory_plan, EVALUATE: evaluation, REGISTER: registration}
# What a stage shows while it runs: its log's `watch` (fulltune/stages/runner.py `StageLog`), made from its inputs.
WATCHES: dict[str, Callable[[Inputs], Callable[[Path], AbstractContextManager[Any]]]] = {FINE_TUNE: training_progress}
