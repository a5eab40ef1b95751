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
        out.append(f"  load it: MLFLOW_TRACKING_URI={registry.redact(self.tracking_uri)} python -c \"import mlflow; "
                   f"print(mlflow.transformers.load_model('{self.model_uri}')({self.example_prompt!r}))\"")
        return out

    @property
    def model_uri(self) -> str:
        """Where this version loads from: `@champion` when it holds the alias (what services load), else the
        version itself (a version that was not promoted; there may be no champion at all)."""
        if "champion" in self.aliases:
            return f"models:/{self.model_name}@champion"
        return f"models:/{self.model_name}/{self.version}"


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
        registration.reason, tracking_uri, run_id, trained.replans, prompt)
