"""What a run parameter (a deployment run's `overrides`, from the Prefect UI or API) may change in a pipeline.

Run parameters come from whoever can reach the Prefect server; the pipelines file from whoever can edit
the worker's files. So `overrides` may set the training knobs of `DEFAULT_RUN_OVERRIDES` and the fields
the pipeline lists under `run_overrides`, never those of `fulltune.spec.NEVER_RUN_OVERRIDES` (they run
code, load pickles, read a secret or choose where outputs go), and a local path a run parameter sets
(data, model, tokenizer) stays inside the pipelines file's folder. flows/run_parameters.py applies it
to runs started from a deployment; `fulltune run --set` (the user's own shell) is not limited.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fulltune.errors import ConfigError
from fulltune.spec import NEVER_RUN_OVERRIDES, covers

# What a run parameter may always change: how long and how fast to train, the memory budget and the
# processes, and how much of the held-out data to evaluate. None of it runs code or reads a file.
DEFAULT_RUN_OVERRIDES = ("train", "budget", "distributed", "data.max_length", "evaluate.batch_size",
                         "evaluate.max_examples", "evaluate.max_generate_examples", "evaluate.max_new_tokens")


def check_overrides(pipelines_file: str, pipeline: str, fields: dict[str, Any]) -> None:
    """ConfigError naming `overrides.<field>` for the first of `fields` (dotted, as `flatten` gives
    them) that the pipeline does not let a run parameter set."""
    from fulltune.stages import resolve_pipeline

    allowed = (*DEFAULT_RUN_OVERRIDES, *resolve_pipeline(pipelines_file, pipeline).spec.run_overrides)
    for field in fields:
        never = next((k for k in NEVER_RUN_OVERRIDES if covers(field, k) or covers(k, field)), None)
        if never:
            raise ConfigError(f"overrides.{field}: a run parameter may never set {never} (it runs code, loads "
                              "pickles, reads a secret or chooses where outputs go); edit the pipelines file")
        if not any(covers(entry, field) for entry in allowed):
            raise ConfigError(f"overrides.{field}: pipeline {pipeline} does not let a run parameter set it; add it "
                              f"to pipelines.{pipeline}.run_overrides in {pipelines_file}, or run "
                              f"`fulltune run {pipeline} --set {field}=...` on the worker")
    _check_paths(pipelines_file, pipeline, fields)


def flatten(overrides: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """The dotted fields a set of overrides changes: `{"model": {"revision": "x"}}` → `{"model.revision":
    "x"}` (an empty mapping stays: it replaces its whole section, so it counts as that section)."""
    found: dict[str, Any] = {}
    for key, value in overrides.items():
        dotted = f"{prefix}{key}"
        found.update(flatten(value, dotted + ".") if isinstance(value, dict) and value else {dotted: value})
    return found


def _check_paths(pipelines_file: str, pipeline: str, overrides: dict[str, Any]) -> None:
    """Each local path the overrides set resolves inside the pipelines file's folder (hub ids pass), read from the
    pipeline as the overrides leave it: every file it reads (fulltune/stages `references`), in whatever shape the
    run parameter gave it (a string, a list, `{path, split}` items), under a field the overrides set."""
    from fulltune.stages import is_hub, references, resolve_pipeline

    folder = Path(pipelines_file).resolve().parent
    for field, reference, _, _ in references(resolve_pipeline(pipelines_file, pipeline, overrides)):
        base = field.partition("[")[0]  # data.train[2] is data.train's
        setter = next((f for f in overrides if covers(f, base) or covers(base, f)), None)
        if setter is not None and not is_hub(reference) and not Path(reference).resolve().is_relative_to(folder):
            raise ConfigError(f"overrides.{setter}: {reference} ({field}) is outside {folder}; a run parameter may "
                              "point only at files inside the pipelines file's folder")
