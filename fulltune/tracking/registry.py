"""MLflow tracking and the model registry: one run per pipeline run, versions, and the champion gate."""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulltune.storage import cache_dir, code_version, fsync_dir, fsync_tree
from fulltune.tracking.gates import GateDecision, comparison_tags, gate_tags, promotion_decision

if TYPE_CHECKING:
    from fulltune.evaluation.champion import Champion
    from fulltune.data import TokenizedData
    from fulltune.evaluation.evaluate import EvalReport
    from fulltune.spec import PipelineSpec

CHALLENGER = "challenger"
CHAMPION = "champion"

# Tags on every registered version: pipeline, data fingerprint, config hash, code version.
TAG_PIPELINE = "fulltune.pipeline"
TAG_DATA = "fulltune.data_fingerprint"
TAG_CONFIG = "fulltune.config_hash"
TAG_VERSION = "fulltune.version"
TAG_TRAIN_KEY = "fulltune.train_key"
TAG_FLOW_RUN = "fulltune.flow_run_id"

# A workdir's own MLflow store when MLFLOW_TRACKING_URI is not set.
STORE_FILE = "mlflow.db"
# MLflow 3's UI opens an experiment by its kind: without this tag it may open the GenAI view (traces), where the
# runs, their metrics and the registry are one click further ("Model training"). Training runs are this kind.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")

SECRET_KEY = re.compile(r"(token|password|secret|api[_-]?key|credential)", re.IGNORECASE)
URI_PASSWORD = re.compile(r"(?<=://)([^:/@\s]+):([^@/\s]+)@")


def redact(text: str) -> str:
    """Remove a password from a URI (`postgresql://user:pw@host` → `postgresql://user:***@host`)."""
    return URI_PASSWORD.sub(r"\1:***@", text)


def tracking_uri(workdir: str | Path) -> str:
    """`MLFLOW_TRACKING_URI` when set, else SQLite in the workdir (the registry needs a database)."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(workdir).resolve() / STORE_FILE}"


def configure(workdir: str | Path) -> str:
    """Point this process's MLflow client at the pipeline's tracking server; returns the URI.

    `mlflow.set_tracking_uri` also exports the URI as MLFLOW_TRACKING_URI; the environment is put back
    as the user left it, so the next pipeline in this process and every child process still see the
    user's choice rather than this workdir's database. The registry follows the tracking URI.
    """
    import mlflow

    previous = os.environ.get("MLFLOW_TRACKING_URI")
    uri = tracking_uri(workdir)
    if not previous:
        seed_store(Path(workdir).resolve() / STORE_FILE)
    mlflow.set_tracking_uri(uri)
    if previous is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = previous
    return uri


def seed_store(database: Path) -> None:
    """Start a workdir's new SQLite store as a copy of an empty one this machine's MLflow made once.

    MLflow builds a new database by running every schema migration it ships (alembic: about 3 CPU-seconds
    for MLflow 3.x), in each new workdir. The empty store is made that way once per MLflow version, under
    `fulltune.storage.cache_dir()`, and copied: the copy is at MLflow's newest schema, so MLflow opens it as
    any database it made. The default experiment's artifact location is written as MLflow writes it for a
    database it creates (`./mlruns/0` under the current directory). A database already there (this
    workdir's, or one another run made a moment ago) is left alone, and anything that fails here leaves the
    database for MLflow to create as before.
    """
    if database.exists():
        return
    with contextlib.suppress(OSError, ImportError):
        import sqlite3
        import time

        empty = _empty_store()
        database.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=f".tmp-{database.name}-", dir=database.parent)
        os.close(fd)
        partial = Path(name)
        try:
            shutil.copyfile(empty, partial)
            now = int(time.time() * 1000)
            with contextlib.closing(sqlite3.connect(partial)) as connection, connection:
                connection.execute("UPDATE experiments SET artifact_location = ?, creation_time = ?, "
                                   "last_update_time = ? WHERE experiment_id = 0",
                                   (str(Path.cwd() / "mlruns" / "0"), now, now))
            with open(partial, "rb+") as handle:
                os.fsync(handle.fileno())
            os.link(partial, database)  # never over a database another process made first
            fsync_dir(database.parent)
        except FileExistsError:
            pass
        finally:
            partial.unlink(missing_ok=True)


def _empty_store() -> Path:
    """This machine's empty MLflow store for the installed MLflow version (made once, then read)."""
    import mlflow
    from mlflow.tracking import MlflowClient

    empty = cache_dir() / "mlflow-store" / mlflow.__version__ / STORE_FILE
    if empty.exists():
        return empty
    empty.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=empty.parent) as scratch:
        made = Path(scratch) / STORE_FILE
        MlflowClient(tracking_uri=f"sqlite:///{made}").search_experiments(max_results=1)
        fsync_tree(Path(scratch))  # every new workdir copies it: never a truncated one after a crash
        os.replace(made, empty)
    return empty


def experiment_id(name: str, workdir: str | Path) -> str:
    """Get or create the experiment, of the kind MLflow's UI shows as model training (`EXPERIMENT_KIND`); local
    stores keep artifacts under `<workdir>/mlartifacts`."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        location = None
        if tracking_uri(workdir).startswith("sqlite:"):
            location = (Path(workdir).resolve() / "mlartifacts").as_uri()
        from mlflow.exceptions import MlflowException

        try:
            return client.create_experiment(name, artifact_location=location, tags=dict([EXPERIMENT_KIND]))
        except MlflowException:
            # Another run created it between the two calls.
            experiment = client.get_experiment_by_name(name)
            if experiment is None:
                raise
    if experiment.tags.get(EXPERIMENT_KIND[0]) is None:  # made before fulltune tagged its kind
        client.set_experiment_tag(experiment.experiment_id, *EXPERIMENT_KIND)
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
    name = run_name(pipeline, "running")
    run = client.create_run(experiment_id(f"fulltune-{pipeline}", workdir), run_name=name,
                            tags={TAG_PIPELINE: pipeline, TAG_VERSION: code_version(), **tags})
    flat = [Param(k, v) for k, v in flatten(params).items()]
    for start in range(0, len(flat), 100):
        client.log_batch(run.info.run_id, params=flat[start:start + 100])
    client.log_batch(run.info.run_id, tags=[RunTag("mlflow.runName", name)])
    return run.info.run_id


def run_name(pipeline: str, outcome: str) -> str:
    """`demo · v3 · not promoted`: the name of a pipeline run's MLflow run (and Prefect flow run) once its outcome
    is known, `demo · running` before."""
    return f"{pipeline} · {outcome}"


def end_pipeline_run(run_id: str, status: str = "FINISHED", name: str | None = None,
                     description: str | None = None) -> None:
    """End the run with `status`, renamed to `name` and described by `description` (markdown) when given."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    tags = ([RunTag("mlflow.runName", name)] if name else []) + \
        ([RunTag("mlflow.note.content", redact(description))] if description else [])
    if tags:
        client.log_batch(run_id, tags=tags)
    client.set_terminated(run_id, status=status)


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


def current_champion(name: str) -> Champion | None:
    """The registered model's champion, or None when the model or the alias does not exist yet."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    from fulltune.evaluation.champion import Champion

    client = MlflowClient()
    try:
        version = client.get_model_version_by_alias(name, CHAMPION)
    except MlflowException:
        return None
    metrics = {k.removeprefix("metric."): float(v) for k, v in version.tags.items() if k.startswith("metric.")}
    return Champion(name, str(version.version), f"models:/{name}/{version.version}",
                    version.tags.get(TAG_TRAIN_KEY), metrics)


@dataclass(frozen=True)
class Registration:
    """What the register stage did: `created` is False when these weights were registered before (no new version)."""

    name: str
    version: str
    aliases: tuple[str, ...]
    promoted: bool
    reason: str
    run_id: str
    created: bool = True
    rules: str = "`register.promote_if`"  # the settings that decided (GateDecision.rules)

    def outcome(self, cached: bool = False) -> str:
        """`v3 · champion`, `v3 · not promoted`, or `v1 · nothing new registered` (a cached or repeated registration)."""
        if cached or not self.created:
            return f"v{self.version} · nothing new registered"
        return f"v{self.version} · {'champion' if self.promoted else 'not promoted'}"

    def model_uri(self) -> str:
        """What loads this version (`model_uri`), by the aliases it was registered with."""
        return model_uri(self.name, self.version, self.aliases)


def model_uri(name: str, version: str, aliases: tuple[str, ...]) -> str:
    """Where a version loads from: `@champion` when it holds the alias (what services load), else the version itself
    (a version that was not promoted is not what `@champion` loads; a first one has no champion to load at all)."""
    return f"models:/{name}@{CHAMPION}" if CHAMPION in aliases else f"models:/{name}/{version}"


def register_model(model_dir: str, name: str, run_id: str, tags: dict[str, str], metrics: dict[str, float],
                   decision: GateDecision, description: str | None = None) -> Registration:
    """Log the saved checkpoint into the run, register it, tag it, describe it and move the aliases."""
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient()
    requirements = [f"{pkg}=={_version(pkg)}" for pkg in ("torch", "transformers", "accelerate", "tokenizers",
                                                          "safetensors")]
    with _discarded_on_failure(client, name, run_id):
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
        for key, value in gate_tags(decision).items():
            client.set_model_version_tag(name, version, key, redact(value))
        if description:
            client.update_model_version(name, version, description=redact(description))
        client.set_registered_model_alias(name, CHALLENGER, version)
    aliases = [CHALLENGER]
    if decision.promote:
        client.set_registered_model_alias(name, CHAMPION, version)
        aliases.append(CHAMPION)
    return Registration(name, version, tuple(aliases), decision.promote, decision.reason, run_id, rules=decision.rules)


@contextlib.contextmanager
def _discarded_on_failure(client: Any, name: str, run_id: str) -> Iterator[None]:
    """Undo a registration that fails half way: the model versions and logged models (with their
    artifacts: a full copy of the weights) it created in `run_id` are deleted before the error goes on,
    so a retry starts clean instead of leaving an untagged version and a copy per attempt."""
    def created() -> tuple[set[str], set[str]]:
        versions = {str(v.version) for v in client.search_model_versions(f"name='{name}' and run_id='{run_id}'")}
        experiment = client.get_run(run_id).info.experiment_id
        models = {m.model_id for m in client.search_logged_models([experiment], f"source_run_id = '{run_id}'")}
        return versions, models

    versions, models = created()
    try:
        yield
    except BaseException:
        from mlflow.store.artifact.artifact_repository_registry import get_artifact_repository

        new_versions, new_models = created()
        for version in new_versions - versions:
            with contextlib.suppress(Exception):
                client.delete_model_version(name, version)
        for model_id in new_models - models:
            with contextlib.suppress(Exception):
                get_artifact_repository(client.get_logged_model(model_id).artifact_location).delete_artifacts()
                client.delete_logged_model(model_id)
        raise


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


# ---------------------------------------------------------------------------------------------------
# The stage: register the new version, gate the champion, say what it is


@dataclass(frozen=True)
class TrainedVersion:
    """What a new version was trained from and how: the fine-tune stage's checkpoint, plan and metrics, and the
    tokenized data it read."""

    model_dir: str
    train_key: str
    settings: dict[str, Any]
    train_metrics: dict[str, float]
    data: TokenizedData


def register_version(spec: PipelineSpec, pipeline: str, trained: TrainedVersion, report: EvalReport, *,
                     mlflow_run_id: str, flow_run_id: str) -> Registration:
    """Stage 5: the fine-tuned checkpoint as a new version of `register.model_name` with `challenger`,
    and `champion` when `register.promote_if` holds; the version's tags hold the reason for the decision
    and its description says what was trained on what, with which plan, and how it compared.

    Weights already registered (only the evaluation changed) make no new version.
    """
    name = spec.model_name(pipeline)
    existing = find_version(name, trained.train_key)
    if existing is not None:
        aliases = aliases_of(name, existing)
        return Registration(name, existing, aliases, CHAMPION in aliases, "same weights as an existing version",
                            mlflow_run_id, created=False)
    decision = promotion_decision(spec.registration, report)
    tags = {TAG_PIPELINE: pipeline, TAG_DATA: trained.data.fingerprint, TAG_CONFIG: spec.config_hash(),
            TAG_VERSION: code_version(), TAG_TRAIN_KEY: trained.train_key, TAG_FLOW_RUN: flow_run_id,
            **comparison_tags(report)}
    description = describe_version(spec, pipeline, trained, report, decision)
    return register_model(trained.model_dir, name, mlflow_run_id, tags, report.candidates["fine_tuned"].as_dict(),
                          decision, description)


def describe_version(spec: PipelineSpec, pipeline: str, trained: TrainedVersion, report: EvalReport,
                     decision: GateDecision) -> str:
    """The registered version's description (markdown), the decision first (the registry lists the descriptions'
    beginnings side by side): promoted or not and by which setting, the gate metric's value, what set this training
    apart (steps, learning rate, seed, data); then the model and data it was trained from, the settings that
    trained, the evaluation of base, fine-tuned and champion side by side."""
    import json as json_module

    from fulltune.data.sources import describe
    from fulltune.memory.report import describe_settings

    source = f"`{spec.model.name_or_path}`" if spec.model.name_or_path else "a new model from `model.from_config`"
    if spec.model.revision and spec.model.name_or_path:
        source += f" @ {spec.model.revision[:12]}"
    held_out = (f"`{describe(spec.data.eval)}`" if spec.data.eval else
                f"{spec.data.eval_split:.0%} of the training examples held out (seed {spec.train.seed})")
    settings, train_metrics, data = trained.settings, trained.train_metrics, trained.data
    try:
        layers = int(json_module.loads((Path(trained.model_dir) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, KeyError, ValueError):  # a checkpoint without a readable config: "all layers" or "off"
        layers = int(settings.get("gradient_checkpointing") or 0)
    steps = int(train_metrics.get("steps", 0))
    run = f"{steps} optimizer steps" + (f", final train loss {train_metrics['train_loss']:.4f}"
                                        if "train_loss" in train_metrics else "")
    verdict = "Champion — promoted to champion" if decision.promote else "Not promoted — stays challenger"
    lines = [  # plain words first: the registry's version list shows the beginning, unrendered
        f"{verdict} by {decision.rules}: {decision.reason}. {steps} steps at learning rate "
        f"{spec.train.learning_rate:g}, seed {spec.train.seed}, data {data.fingerprint[:12]}.",
        "",
        f"Pipeline `{pipeline}`: {source} fully fine-tuned on `{describe(spec.data.train)}` (format {data.format}, "
        f"{data.num_train_examples} examples, {data.train_label_tokens} target tokens per epoch"
        f"{', packed' if data.packing else ''}; data fingerprint {data.fingerprint[:12]}).",
        "",
        f"Trained with {describe_settings(settings, layers)}, effective batch {spec.train.effective_batch_size}, "
        f"learning rate {spec.train.learning_rate:g}; {run}.",
        "",
        f"Evaluated on {held_out}: {report.num_examples} examples, the base model, this one"
        + (f" and the champion (version {report.champion_version}, compared on {report.comparison.replace('_', ' ')})"
           if report.champion_version is not None else " (no champion yet)") + ".",
        "",
        _metrics_table(report),
    ]
    return "\n".join(lines)


def _metrics_table(report: EvalReport) -> str:
    from fulltune.evaluation.evaluate import metric_names

    columns = dict(report.candidates)
    if "champion" in columns and report.champion_version is not None:
        columns[f"champion v{report.champion_version}"] = columns.pop("champion")
    lines = ["| metric | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for metric in metric_names(columns.values()):
        values = [c.as_dict().get(metric) for c in columns.values()]
        if any(v is not None for v in values):
            lines.append(f"| {metric} | " + " | ".join("—" if v is None else f"{v:.4f}" for v in values) + " |")
    return "\n".join(lines)
