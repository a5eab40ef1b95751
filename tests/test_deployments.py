"""Deployments from pipelines.yaml: one per pipeline, cron schedules, a typed form for the UI."""

from __future__ import annotations

import pytest
import yaml
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


# ----------------------------------------------------------------------------------------------------
# What a run started from a deployment may change


def _opt_in(path, *fields):
    config = yaml.safe_load(path.read_text())
    config["pipelines"]["tiny"]["run_overrides"] = list(fields)
    path.write_text(yaml.safe_dump(config, sort_keys=False))


def _run_from_deployment(client, deployment_id, **parameters):
    """Create the flow run on the server, as the UI or `prefect deployment run` does, and execute it as
    the deployment's runner does (the flow loaded, the run's parameters read from the server)."""
    from prefect.flow_engine import run_flow

    from flows.pipeline import finetune_pipeline

    flow_run = client.create_flow_run_from_deployment(deployment_id, parameters=parameters)
    return run_flow(finetune_pipeline, flow_run=client.read_flow_run(flow_run.id), return_type="state")


@pytest.mark.slow
@pytest.mark.server
def test_run_parameters_cannot_widen_what_the_pipeline_may_do(tmp_path, prefect_server):
    from prefect.client.orchestration import get_client

    from flows.pipeline import finetune_pipeline

    project = tmp_path / "project"
    project.mkdir()
    path = tiny_pipeline(project)
    _opt_in(path, "data.train")
    outside = tmp_path / "private.jsonl"
    outside.write_text((project / "train.jsonl").read_text())
    (deployment,) = build_deployments(str(path))
    deployment_id = deployment.apply()
    # A deployment as infra/prefect.yaml declares one: the file is the flow's default, pipelines.yaml.
    bare_id = finetune_pipeline.to_deployment(name="bare", parameters={"pipeline": "tiny"}).apply()
    refused = {
        "model.trust_remote_code": {"extra": {"model.trust_remote_code": True}},
        "model.allow_pickle_weights": {"extra": {"model": {"allow_pickle_weights": True}}},
        "evaluate.metrics": {"extra": {"evaluate.metrics": {"x": "os:getcwd"}}},
        "evaluate.lm_eval.tasks": {"extra": {"evaluate": {"lm_eval": {"tasks": ["t.yaml"]}}}},
        "model.token_env": {"extra": {"model.token_env": "MLFLOW_TRACKING_TOKEN"}},
        "data.eval": {"extra": {"data.eval": "train.jsonl"}},  # not in the pipeline's run_overrides
        "data.train": {"extra": {"data.train": str(outside)}},  # opted in, but outside the project
    }
    # The same path in the other shapes data.train takes: a one-item list, a list item's `path`.
    outside_shapes = [{"extra": {"data.train": [str(outside)]}},
                      {"extra": {"data": {"train": ["train.jsonl", {"path": "../private.jsonl", "weight": 2}]}}}]
    with get_client(sync_client=True) as client:
        with pytest.raises(Exception, match="pipelines_file"):  # the server's schema check refuses it
            client.create_flow_run_from_deployment(deployment_id, parameters={"pipelines_file": str(outside)})
        for field, overrides in [*refused.items(), *(("data.train", shape) for shape in outside_shapes)]:
            state = _run_from_deployment(client, deployment_id, overrides=overrides)
            assert state.is_failed(), field
            assert f"overrides.{field}" in state.message, state.message
        state = _run_from_deployment(client, bare_id, pipelines_file=str(path))
        assert state.is_failed() and "pipelines_file: deployment" in state.message, state.message
    assert not (project / "work").exists(), "refused before any stage ran"


def test_run_parameters_may_set_the_training_knobs_and_what_the_pipeline_opts_in(tmp_path):
    from fulltune.stages.run_overrides import check_overrides, flatten
    from fulltune.errors import ConfigError

    path = tiny_pipeline(tmp_path)
    _opt_in(path, "evaluate.compare_champion", "data.eval")
    (tmp_path / "held_out.jsonl").write_text((tmp_path / "train.jsonl").read_text())
    fields = flatten(Overrides(max_steps=2, budget_memory="1GiB", extra={
        "distributed.strategy": "ddp", "distributed": {"num_processes": 2}, "evaluate.compare_champion": False,
        "data.eval": "held_out.jsonl"}).dotted())
    assert fields["distributed.num_processes"] == 2  # a nested mapping sets its fields, not the whole section
    check_overrides(str(path), "tiny", fields)  # nothing refused
    with pytest.raises(ConfigError, match=r"overrides\.model\.revision: pipeline tiny does not let"):
        check_overrides(str(path), "tiny", flatten({"model": {"revision": "main"}}))
    # A path outside the project is refused in every shape data.eval takes; inside it, or a hub id, passes.
    outside = tmp_path.parent / "elsewhere.jsonl"
    outside.write_text((tmp_path / "train.jsonl").read_text())
    for shape in (str(outside), [str(outside)], ["held_out.jsonl", {"path": str(outside)}],
                  [{"path": "../elsewhere.jsonl"}], {"eval": [str(outside)]}):
        dotted = flatten({"data": shape} if isinstance(shape, dict) else {"data.eval": shape})
        with pytest.raises(ConfigError, match=r"overrides\.data(\.eval)?: .*elsewhere\.jsonl \(data\.eval.*\) is "
                                              r"outside"):
            check_overrides(str(path), "tiny", dotted)
    check_overrides(str(path), "tiny", {"data.eval": ["held_out.jsonl", {"path": "org/name", "split": "test"},
                                                      "org/name:validation"]})


def test_a_pipeline_cannot_opt_in_to_what_runs_code(tmp_path):
    from fulltune.errors import ConfigError
    from fulltune.pipelines_file import load_pipelines

    path = tiny_pipeline(tmp_path)
    _opt_in(path, "model")
    with pytest.raises(ConfigError, match=r"pipelines\.tiny\.run_overrides: 'model': a run parameter may never set "
                                          r"model\.trust_remote_code"):
        load_pipelines(path)
