"""Deployments from pipelines.yaml: one per pipeline, cron schedules, a typed form for the UI."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from flows.deployments import build_deployments
from flows.pipeline import Overrides

from pipelines_fixture import tiny_pipeline


def test_one_deployment_per_pipeline_with_schedule_and_dropdown(tmp_path):
    path = tiny_pipeline(tmp_path)
    text = path.read_text().replace("pipelines:\n  tiny:", "pipelines:\n  tiny:\n    schedule: 0 3 * * 1")
    path.write_text(text)
    (deployment,) = build_deployments(str(path))
    assert deployment.name == "tiny"
    assert deployment.parameters["pipeline"] == "tiny"
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * 1"]
    schema = deployment._parameter_openapi_schema.model_dump()
    assert schema["properties"]["pipeline"]["enum"] == ["tiny"]
    assert schema["properties"]["pipelines_file"]["readOnly"] is True
    overrides = schema["definitions"]["Overrides"]["properties"]
    assert {"learning_rate", "max_steps", "extra"} <= set(overrides)


def test_overrides_form_maps_to_dotted_keys_and_rejects_bad_values():
    dotted = Overrides(learning_rate=1e-3, max_length=64, extra={"evaluate.max_new_tokens": 2}).dotted()
    assert dotted == {"train.learning_rate": 1e-3, "data.max_length": 64, "evaluate.max_new_tokens": 2}
    with pytest.raises(ValidationError):
        Overrides(learning_rate=-1)
    with pytest.raises(ValidationError):
        Overrides(learnign_rate=1)
