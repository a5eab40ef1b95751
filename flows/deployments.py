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
        schema = deployment._parameter_openapi_schema
        properties = schema.properties
        properties["pipeline"].update({"enum": names, "default": name})
        # The server refuses a run naming another file (the flow checks it again: flows/run_parameters.py).
        properties["pipelines_file"].update({"readOnly": True, "default": pipelines_file, "enum": [pipelines_file]})
        _overrides_form(schema, spec)
        deployments.append(deployment)
    return deployments


def _overrides_form(schema: Any, spec: Any) -> None:
    """The deployment's `overrides` as a form of empty fields (not a choice between "None" and a form, nor a field
    that starts as "None"), each field's help saying the pipeline's value, which an empty field keeps."""
    from flows.pipeline import OVERRIDE_KEYS

    definition = schema.definitions["Overrides"]
    schema.properties["overrides"] = {"title": definition.get("title", "overrides"), "default": {},
                                      "description": definition.get("description", ""),
                                      "allOf": [{"$ref": "#/definitions/Overrides"}]}
    values = spec.model_dump(mode="json")
    for field, dotted in OVERRIDE_KEYS.items():
        section, key = dotted.split(".")
        current = values.get(section, {}).get(key)
        prop = definition["properties"][field]
        typed = [option for option in prop.pop("anyOf", []) if option.get("type") != "null"]
        prop.update(typed[0] if len(typed) == 1 else {"anyOf": typed} if typed else {})
        prop.pop("default", None)  # empty: the pipeline's value
        prop["description"] = f"{prop.get('description', dotted)}. This pipeline: {current}"


def serve_pipelines(pipelines_file: str, limit: int | None = None) -> None:
    """Serve every pipeline's deployment from this process until interrupted."""
    from prefect import serve

    serve(*build_deployments(pipelines_file), limit=limit)
