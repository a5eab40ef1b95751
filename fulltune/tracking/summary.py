"""What a pipeline run did, as the lines `fulltune run` ends with (and the flow logs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulltune.tracking import registry


@dataclass(frozen=True)
class PipelineSummary:
    """What a pipeline run did: each stage ran or was cached, the numbers, and what was registered."""

    pipeline: str
    stages: dict[str, str]
    settings: str
    train_metrics: dict[str, float]
    evaluation: dict[str, dict[str, float]]
    model_name: str
    version: str
    aliases: tuple[str, ...]
    promoted: bool
    gate: str
    tracking_uri: str
    mlflow_run_id: str
    notes: tuple[str, ...] = field(default_factory=tuple)
    example_prompt: str = "Hello"
    outcome: str = ""  # `v3 · not promoted`: what the run did, as its MLflow and Prefect runs are named
    experiment_id: str = ""  # of the MLflow run

    def markdown(self) -> str:
        """The summary as the MLflow run's description: the outcome and the gate's reason, then the lines as a list
        (a page wraps it; a code block would cut the long lines off)."""
        first, *rest = self.lines()
        items = "\n".join(f"- `{line.strip()}`" if line.strip().startswith(("load it:", "see it:"))
                          else f"- {line.strip()}" for line in rest)
        return f"**{self.pipeline} · {self.outcome}**: {self.gate}\n\n{first}\n\n{items}"

    def lines(self) -> list[str]:
        """The summary as printed: stages, settings, training, each metric per candidate, the registration."""
        out = [f"pipeline {self.pipeline}: " + ", ".join(f"{k} {v}" for k, v in self.stages.items())]
        out.append(f"  settings: {self.settings}")
        if "train_loss" in self.train_metrics:
            out.append(f"  train loss {self.train_metrics['train_loss']:.4f} after "
                       f"{int(self.train_metrics.get('steps', 0))} steps "
                       f"({self.train_metrics.get('tokens_per_second', 0):.0f} tokens/s)")
        names = list(self.evaluation)
        benchmarks = sorted({m for values in self.evaluation.values() for m in values} - {"bits_per_byte"})
        for metric in dict.fromkeys(("eval_loss", "perplexity", "exact_match", *benchmarks)):
            values = [self.evaluation[n].get(metric) for n in names]
            if any(v is not None for v in values):
                cells = ", ".join(f"{n} {v:.4f}" for n, v in zip(names, values) if v is not None)
                out.append(f"  {metric}: {cells}")
        out.append(f"  registered {self.model_name} version {self.version}, aliases: {', '.join(self.aliases)}"
                   f" ({self.gate})")
        out.append(f"  see it: {mlflow_page(self.tracking_uri, self.experiment_id, self.mlflow_run_id)}")
        out.append(f"  load it: MLFLOW_TRACKING_URI={registry.redact(self.tracking_uri)} python -c \"import mlflow; "
                   f"print(mlflow.transformers.load_model('{self.model_uri}')({self.example_prompt!r}))\"")
        return out

    @property
    def model_uri(self) -> str:
        """Where this version loads from (fulltune/tracking/registry.py `model_uri`), by the aliases it holds now."""
        return registry.model_uri(self.model_name, self.version, self.aliases)


def mlflow_page(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    """Where MLflow's UI shows the run: on its server, or after `mlflow ui` for a workdir's own store. The link opens
    MLflow 3 in its model-training view (`workflowType`), where the runs and the registry are; its default, the GenAI
    view, shows traces."""
    path = f"/#/experiments/{experiment_id}/runs/{run_id}?workflowType=machine_learning"
    if tracking_uri.lower().startswith(("http://", "https://")):
        return registry.redact(tracking_uri.rstrip("/")) + path
    return f"mlflow ui --backend-store-uri {registry.redact(tracking_uri)}, then http://127.0.0.1:5000{path}"


def summarise(pipeline: str, stages: dict[str, str], settings: str, trained: Any, report: Any, registration: Any,
              tracking_uri: str, run_id: str) -> PipelineSummary:
    """The summary of a finished run from its stages' records (TrainedModel, EvalReport, Registration);
    the aliases are read from the registry now, as another run may have moved them since."""
    samples = report.candidates["fine_tuned"].samples
    prompt = samples[0][0] if samples and samples[0][0] else "Hello"
    return PipelineSummary(
        pipeline, dict(stages), settings, trained.metrics,
        {name: metrics.as_dict() for name, metrics in report.candidates.items()}, registration.name,
        registration.version, registry.aliases_of(registration.name, registration.version), registration.promoted,
        registration.reason, tracking_uri, run_id, trained.replans, prompt,
        registration.outcome(stages.get("register") == "cached"), _experiment_of(run_id))


def _experiment_of(run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient().get_run(run_id).info.experiment_id
