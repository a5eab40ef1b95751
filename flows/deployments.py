"""Deployments built from pipelines.yaml: one per pipeline, its `schedule` as a cron schedule."""

from __future__ import annotations

from typing import Any

from fulltune.pipelines_file import load_pipelines


def build_deployments(pipelines_file: str) -> list[Any]:
    """One deployment per pipeline; the Prefect UI lists them and starts them with a typed form:
    the pipeline as a dropdown of the file's pipelines, the overrides as fields the server validates, the
    pipelines file fixed (the only value the server accepts)."""
    from flows.pipeline import finetune_pipeline

    pipelines = load_pipelines(pipelines_file)
    names = list(pipelines.pipelines)
    deployments = []
    for name, spec in pipelines.pipelines.items():
        deployment = finetune_pipeline.to_deployment(
            name=name,
            parameters={"pipeline": name, "pipelines_file": pipelines_file},
            cron=spec.schedule,
            description=spec.description or f"fulltune pipeline {name}",
            tags=["fulltune", name],
        )
        properties = deployment._parameter_openapi_schema.properties
        properties["pipeline"].update({"enum": names, "default": name})
        # The server refuses a run naming another file (the flow checks it again: flows/run_parameters.py).
        properties["pipelines_file"].update({"readOnly": True, "default": pipelines_file, "enum": [pipelines_file]})
        deployments.append(deployment)
    return deployments


def serve_pipelines(pipelines_file: str, limit: int | None = None) -> None:
    """Serve every pipeline's deployment from this process until interrupted."""
    from prefect import serve

    serve(*build_deployments(pipelines_file), limit=limit)
