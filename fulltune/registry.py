"""MLflow tracking and the model registry: one run per pipeline run, versions, and the champion gate."""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fulltune.errors import ConfigError
from fulltune.storage import code_version

CHALLENGER = "challenger"
CHAMPION = "champion"

# Tags on every registered version: pipeline, data fingerprint, config hash, code version.
TAG_PIPELINE = "fulltune.pipeline"
TAG_DATA = "fulltune.data_fingerprint"
TAG_CONFIG = "fulltune.config_hash"
TAG_VERSION = "fulltune.version"
TAG_TRAIN_KEY = "fulltune.train_key"
TAG_FLOW_RUN = "fulltune.flow_run_id"
# How the new version was compared with the champion (fulltune/evaluate.py), and why.
TAG_COMPARISON = "fulltune.comparison"
TAG_COMPARISON_REASON = "fulltune.comparison_reason"

SECRET_KEY = re.compile(r"(token|password|secret|api[_-]?key|credential)", re.IGNORECASE)
URI_PASSWORD = re.compile(r"(?<=://)([^:/@\s]+):([^@/\s]+)@")


def redact(text: str) -> str:
    """Remove a password from a URI (`postgresql://user:pw@host` → `postgresql://user:***@host`)."""
    return URI_PASSWORD.sub(r"\1:***@", text)


def tracking_uri(workdir: str | Path) -> str:
    """`MLFLOW_TRACKING_URI` when set, else SQLite in the workdir (the registry needs a database)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(workdir).resolve() / 'mlflow.db'}"


def configure(workdir: str | Path) -> str:
    """Point this process's MLflow client at the pipeline's tracking server; returns the URI.

    `mlflow.set_tracking_uri` also exports the URI as MLFLOW_TRACKING_URI; the environment is put back
    as the user left it, so the next pipeline in this process and every child process still see the
    user's choice rather than this workdir's database. The registry follows the tracking URI.
    """
    import mlflow

    uri = tracking_uri(workdir)
    previous = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    if previous is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous
    return uri


def experiment_id(name: str, workdir: str | Path) -> str:
    """Get or create the experiment; local stores keep artifacts under `<workdir>/mlartifacts`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    location = None
    if tracking_uri(workdir).startswith("sqlite:"):
        location = (Path(workdir).resolve() / "mlartifacts").as_uri()
    from mlflow.exceptions import MlflowException

    try:
        return client.create_experiment(name, artifact_location=location)
    except MlflowException:
        # Another run created it between the two calls.
        experiment = client.get_experiment_by_name(name)
        if experiment is None:
            raise
        return experiment.experiment_id


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """Nested mapping → `{dotted.key: str}` for MLflow params; secrets are dropped."""
    flat: dict[str, str] = {}
    if isinstance(value, dict):
        for key, child in value.items():
            if SECRET_KEY.search(str(key)) and not str(key).endswith("_env"):
                continue
            flat.update(flatten(child, f"{prefix}{key}."))
    else:
        flat[prefix.rstrip(".")] = redact(str(value))[:500]
    return flat


def start_pipeline_run(pipeline: str, params: dict[str, Any], tags: dict[str, str], workdir: str | Path) -> str:
    """Create the MLflow run of one pipeline run; returns its id (it stays open until `end_pipeline_run`)."""
    from mlflow.entities import Param, RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    run = client.create_run(experiment_id(f"fulltune-{pipeline}", workdir), run_name=f"{pipeline}",
                            tags={TAG_PIPELINE: pipeline, TAG_VERSION: code_version(), **tags})
    flat = [Param(k, v) for k, v in flatten(params).items()]
    for start in range(0, len(flat), 100):
        client.log_batch(run.info.run_id, params=flat[start:start + 100])
    client.log_batch(run.info.run_id, tags=[RunTag("mlflow.runName", pipeline)])
    return run.info.run_id


def end_pipeline_run(run_id: str, status: str = "FINISHED") -> None:
    from mlflow.tracking import MlflowClient

    MlflowClient().set_terminated(run_id, status=status)


def log_metrics(run_id: str, metrics: dict[str, float | None], step: int | None = None, client: Any = None) -> None:
    """Log the finite values of `metrics` into run `run_id` in one request (None and NaN are left out).

    `client`: an MlflowClient bound to a tracking URI (default: the configured one); the trainer's child
    process passes its own."""
    import time

    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    now = int(time.time() * 1000)
    batch = [Metric(k, float(v), now, step or 0) for k, v in metrics.items() if v is not None and math.isfinite(v)]
    if batch:
        (client or MlflowClient()).log_batch(run_id, metrics=batch)


def set_run_tags(run_id: str, tags: dict[str, str]) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    for key, value in tags.items():
        client.set_tag(run_id, key, redact(str(value)))


@dataclass(frozen=True)
class Champion:
    """The version that currently holds the `champion` alias."""

    name: str
    version: str
    source: str  # models:/name/version
    train_key: str | None
    metrics: dict[str, float] = field(default_factory=dict)


def current_champion(name: str) -> Champion | None:
    """The registered model's champion, or None when the model or the alias does not exist yet."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    metrics = {k.removeprefix("metric."): float(v) for k, v in version.tags.items() if k.startswith("metric.")}
    return Champion(name, str(version.version), f"models:/{name}/{version.version}",
                    version.tags.get(TAG_TRAIN_KEY), metrics)


def download_version(source: str, destination: str | Path) -> str:
    """Download a registered version's transformers checkpoint (the `model` directory of the flavor)."""
    import mlflow

    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=str(destination)))
    for candidate in (local / "model", local):
        if (candidate / "config.json").is_file():
            return str(candidate)
    # Retrying cannot help: the registered version itself holds no checkpoint.
    raise ConfigError(f"register.model_name: {source} holds no transformers checkpoint (looked in {local}); move "
                      "the champion alias to a version fulltune registered, or set evaluate.compare_champion: false")


@dataclass(frozen=True)
class GateDecision:
    promote: bool
    reason: str


def decide_promotion(candidate: dict[str, float], champion: dict[str, float] | None, base: dict[str, float] | None,
                     metric: str, mode: str, min_delta: float, require_better_than_base: bool, *,
                     keep_champion: str | None = None) -> GateDecision:
    """The `champion` gate: promote when there is no champion, or when `metric` beats it by `min_delta`.

    All values come from one evaluation on the same held-out examples, the champion's in the candidate's
    units (fulltune/evaluate.py), so they are comparable. `keep_champion` is the reason a champion exists
    but was not compared (`evaluate.compare_champion: false`, or no comparable measurement): the candidate
    is then never promoted over it.
    """
    value = candidate.get(metric)
    if value is None or not math.isfinite(value):
        return GateDecision(False, f"{metric} of the new model is missing or not finite")

    def better(a: float, b: float, delta: float) -> bool:
        return a <= b - delta if mode == "min" else a >= b + delta

    if require_better_than_base and base and base.get(metric) is not None:
        if not better(value, base[metric], 0.0) or value == base[metric]:
            return GateDecision(False, f"{metric} {value:.4g} does not beat the base model ({base[metric]:.4g})")
    if keep_champion:
        return GateDecision(False, f"the champion keeps its alias: {keep_champion}")
    if champion is None:
        return GateDecision(True, "no champion yet")
    reference = champion.get(metric)
    if reference is None:
        return GateDecision(True, f"the champion has no {metric} on this data")
    if better(value, reference, min_delta) and value != reference:
        return GateDecision(True, f"{metric} {value:.4g} beats the champion's {reference:.4g} (min_delta {min_delta})")
    return GateDecision(False, f"{metric} {value:.4g} does not beat the champion's {reference:.4g} by {min_delta}")


@dataclass(frozen=True)
class Registration:
    """What the register stage did."""

    name: str
    version: str
    aliases: tuple[str, ...]
    promoted: bool
    reason: str
    run_id: str


def register_model(model_dir: str, name: str, run_id: str, tags: dict[str, str], metrics: dict[str, float],
                   decision: GateDecision) -> Registration:
    """Log the saved checkpoint into the run, register it, tag it and move the aliases."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    requirements = [f"{pkg}=={_version(pkg)}" for pkg in ("torch", "transformers", "accelerate", "tokenizers",
                                                          "safetensors")]
    with mlflow.start_run(run_id=run_id), _pipeline_classes_resolved():
        info = mlflow.transformers.log_model(
            transformers_model=model_dir,
            name="model",
            task="text-generation",
            pip_requirements=requirements,
            # Declaring params lets served models honour {"params": {"max_new_tokens": ...}}.
            signature=mlflow.models.infer_signature(["prompt"], ["text"],
                                                    params={"max_new_tokens": 64, "do_sample": False}),
            registered_model_name=name,
        )
    version = str(info.registered_model_version)
    for key, value in {**tags, **{f"metric.{k}": f"{v:.6g}" for k, v in metrics.items()}}.items():
        client.set_model_version_tag(name, version, key, redact(str(value)))
    client.set_model_version_tag(name, version, "fulltune.gate", decision.reason)
    client.set_registered_model_alias(name, CHALLENGER, version)
    aliases = [CHALLENGER]
    if decision.promote:
        client.set_registered_model_alias(name, CHAMPION, version)
        aliases.append(CHAMPION)
    return Registration(name, version, tuple(aliases), decision.promote, decision.reason, run_id)


@contextlib.contextmanager
def _pipeline_classes_resolved() -> Iterator[None]:
    """Let MLflow log a checkpoint directory under transformers 5.

    MLflow's path-based logging reads `check_task(task)[1]["impl"].__name__`, but transformers 5 lists
    pipeline classes as dotted strings (transformers/pipelines/__init__.py). Resolve the string to the
    class for the duration of the call, so the model is logged from disk without being loaded.
    """
    import importlib

    from transformers import pipelines

    original = pipelines.check_task

    def check_task(task: str) -> Any:
        name, metadata, options = original(task)
        impl = metadata.get("impl")
        if isinstance(impl, str):
            module, _, cls = impl.rpartition(".")
            metadata = {**metadata, "impl": getattr(importlib.import_module(module), cls)}
        return name, metadata, options

    pipelines.check_task = check_task
    try:
        yield
    finally:
        pipelines.check_task = original


def find_version(name: str, train_key: str) -> str | None:
    """The version already registered from the same trained weights, if any."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        found = MlflowClient().search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    matches = [v.version for v in found if v.tags.get(TAG_TRAIN_KEY) == train_key]
    return str(min(matches, key=int)) if matches else None


def aliases_of(name: str, version: str) -> tuple[str, ...]:
    """The aliases a version holds now (another run may have moved them since it was registered)."""
    from mlflow.tracking import MlflowClient

    return tuple(sorted(MlflowClient().get_model_version(name, version).aliases))


def version_exists(name: str, version: str, train_key: str) -> bool:
    """Whether a cached registration still matches the registry (a deleted database re-runs the stage)."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        found = MlflowClient().get_model_version(name, version)
    except MlflowException:
        return False
    return found.tags.get(TAG_TRAIN_KEY) == train_key


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)
