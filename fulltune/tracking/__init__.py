"""The MLflow side of one pipeline run: the server check, the run's lifecycle, what to compare against.

The flow only orders the stages; what a run does in MLflow around them lives here (fulltune/stages/runner.py
calls it):

- `check_tracking_server` — before any stage runs, an `http(s)` tracking URI must answer: MLflow's
  client would otherwise retry for minutes before the first stage that logs anything fails;
- `pipeline_run` — one MLflow run per pipeline run, ended FINISHED, KILLED (Ctrl-C) or FAILED, with each
  stage's outcome (`ran` / `cached`) as a tag, named for what it did (`demo · v3 · not promoted`, `demo · failed
  in fine-tune`) and described by the run's summary;
- `log_tokenized_data` — the tokenized training and held-out data as the run's dataset inputs;
- `champion_to_compare` — the registry question whose answer is part of the evaluate stage's cache key (the
  register stage's, whether its version is still there, is fulltune/stages/register.py `still_valid`).
"""

from __future__ import annotations

import contextlib
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fulltune.tracking import registry
from fulltune.errors import ConfigError

if TYPE_CHECKING:
    from fulltune.data import TokenizedData
    from fulltune.spec import PipelineSpec

# MLflow's tracking server answers GET /health with 200 "OK".
HEALTH_PATH = "/health"


def check_tracking_server(workdir: str, timeout: float = 5.0) -> str:
    """The tracking URI the run will use (registry.tracking_uri); ConfigError naming MLFLOW_TRACKING_URI
    when it is an http(s) URI where no server answers within `timeout` seconds.

    Any HTTP answer counts, also an error status (a server behind authentication answers 401): only a
    refused connection, an unknown host or silence is "unreachable". Local stores (sqlite, file) and
    other schemes are left to MLflow.
    """
    uri = registry.tracking_uri(workdir)
    if not uri.lower().startswith(("http://", "https://")):
        return uri
    try:
        with urllib.request.urlopen(uri.rstrip("/") + HEALTH_PATH, timeout=timeout):
            return uri
    except urllib.error.HTTPError:
        return uri
    except (OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise ConfigError(f"MLFLOW_TRACKING_URI={registry.redact(uri)}: no MLflow server answers there ({reason}); "
                          "start it, or unset MLFLOW_TRACKING_URI to track in the workdir's SQLite database") from None


def warm_up(workdir: str) -> None:
    """Import MLflow and open its store (a SQLite database's schema check included) ahead of the run.

    The CLI calls this while the temporary Prefect server boots, so the seconds it takes overlap that
    start-up instead of following it; the flow's `pipeline_run` then finds the store open.
    """
    import fcntl

    from mlflow.tracking import MlflowClient

    uri = registry.configure(workdir)
    if not uri.startswith("sqlite:"):
        MlflowClient().search_experiments(max_results=1)
        return
    # Two runs sharing a workdir would both create the new database's schema ("table ... already
    # exists"): the first to open it does, the other waits for it.
    Path(workdir).mkdir(parents=True, exist_ok=True)
    with open(Path(workdir) / ".mlflow-store.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            MlflowClient().search_experiments(max_results=1)
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@dataclass
class PipelineRun:
    """The open MLflow run of a pipeline run: `stages` collects each stage's outcome for its tags, `running` the
    stage under way, `outcome` what the run did once known (its name), `description` its summary (markdown)."""

    tracking_uri: str
    run_id: str
    stages: dict[str, str] = field(default_factory=dict)
    running: str | None = None
    outcome: str | None = None
    description: str | None = None


@contextlib.contextmanager
def pipeline_run(pipeline: str, spec: PipelineSpec, workdir: str, flow_run_id: str,
                 stages: dict[str, str] | None = None) -> Iterator[PipelineRun]:
    """Open the MLflow run of pipeline run `flow_run_id` of `pipeline` (its resolved `spec`, its workdir), named
    `<pipeline> · running`; on exit tag each stage's outcome and end it: FINISHED (named for its outcome and described
    when the caller set them), KILLED when interrupted (Ctrl-C: `<pipeline> · stopped in <stage>`), FAILED on any
    other exception (`<pipeline> · failed in <stage>`; the exception is re-raised).

    `stages` (stage → "ran" / "cached") is the caller's record, read when the run ends, so stages that
    finished before the run opened are tagged too."""
    uri = registry.configure(workdir)
    run_id = registry.start_pipeline_run(
        pipeline, spec.model_dump(mode="json", by_alias=True),
        {registry.TAG_FLOW_RUN: flow_run_id, registry.TAG_CONFIG: spec.config_hash()}, workdir)
    run = PipelineRun(uri, run_id, stages if stages is not None else {})

    def ended(how: str) -> str:
        return registry.run_name(pipeline, how + (f" in {run.running}" if run.running else ""))

    try:
        yield run
    except KeyboardInterrupt:
        registry.end_pipeline_run(run_id, "KILLED", ended("stopped"))
        raise
    except BaseException:
        registry.end_pipeline_run(run_id, "FAILED", ended("failed"))
        raise
    _tag_stages(run_id, run.stages)
    registry.end_pipeline_run(run_id, name=registry.run_name(pipeline, run.outcome) if run.outcome else None,
                              description=run.description)


def _tag_stages(run_id: str, stages: dict[str, str]) -> None:
    """`fulltune.stage.<stage>: ran | cached` on the run, in one request."""
    from mlflow.entities import RunTag
    from mlflow.tracking import MlflowClient

    MlflowClient().log_batch(run_id, tags=[RunTag(f"fulltune.stage.{stage}", outcome) for stage, outcome in stages.items()])


def champion_to_compare(model_name: str, train_key: str) -> registry.Champion | None:
    """The current champion when it is another model than the one just trained, else None: re-running
    an unchanged pipeline whose own model is champion keeps the evaluation cached."""
    champion = registry.current_champion(model_name)
    if champion is None or champion.train_key == train_key:
        return None
    return champion


def log_tokenized_data(run_id: str, pipeline: str, spec: PipelineSpec, data: TokenizedData) -> None:
    """The tokenized training and held-out data as dataset inputs of run `run_id` (MLflow's Dataset column and the
    run page's datasets): where each came from, its fingerprint as the digest, rows and tokens in its profile, and
    what the fingerprint covers (fulltune/data/store.py `fingerprint_covers`: `train.seed` only where it shapes the
    rows)."""
    import json

    from mlflow.entities import Dataset, DatasetInput, InputTag
    from mlflow.tracking import MlflowClient

    from fulltune.data.sources import describe
    from fulltune.data.store import fingerprint_covers

    common = {"format": data.format, "max_length": data.max_length, "fingerprint covers": fingerprint_covers(spec.data),
              "tokenizer": data.tokenizer}
    splits = [
        ("train", "training", spec.data.train, data.training_fingerprint, Path(data.train_file),
         {"rows": data.num_train_rows, "examples": data.num_train_examples, "tokens": data.train_tokens,
          "target tokens": data.train_label_tokens, "packing": data.packing, "longest row": data.max_row_length}),
        ("eval", "evaluation", spec.data.eval, data.fingerprint, Path(data.eval_file),
         {"rows": data.num_eval_examples, "examples": data.num_eval_examples, "tokens": data.eval_tokens,
          "target tokens": data.eval_label_tokens, "held out": "data.eval" if spec.data.eval is not None
          else f"data.eval_split {spec.data.eval_split:g} of data.train"}),
    ]
    inputs = []
    for split, context, reference, fingerprint, tokenized, counts in splits:
        source_type, source = _dataset_source(reference, tokenized)
        profile = {**counts, **common, "from": describe(reference if reference is not None else spec.data.train),
                   "fingerprint": fingerprint, "tokenized": str(tokenized)}
        dataset = Dataset(name=f"{pipeline}-{split}", digest=fingerprint[:12], source_type=source_type,
                          source=json.dumps(source), profile=json.dumps(profile, default=str))
        inputs.append(DatasetInput(dataset, tags=[InputTag("mlflow.data.context", context)]))
    MlflowClient().log_inputs(run_id, datasets=inputs)


def _dataset_source(reference: object, tokenized: Path) -> tuple[str, dict[str, str]]:
    """(MLflow source type, source) of a resolved `data.train` / `data.eval` reference (local paths are absolute,
    hub ids are not): a local file as itself, a hub dataset by its page, several sources (or none: a held-out
    split) as the tokenized file the run read."""
    from fulltune.hub import split_dataset_id

    if isinstance(reference, str) and not Path(reference).is_absolute():
        return "http", {"url": f"https://huggingface.co/datasets/{split_dataset_id(reference)[0]}"}
    if isinstance(reference, str):
        return "local", {"uri": Path(reference).as_uri()}
    return "local", {"uri": tokenized.as_uri()}
