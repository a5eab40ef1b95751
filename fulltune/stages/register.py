"""Stage 5: the fine-tuned model as a new version of `register.model_name`; `champion` only when it wins.

The work is fulltune/tracking/registry.py `register_version`: the version, its tags and description, `challenger`,
and `champion` when every condition of `register.promote_if` holds (fulltune/tracking/gates.py). Weights already
registered make no new version. The stage writes no file: its marker records the version, and a cached result
stands only while that version is in the registry holding these weights (a deleted or replaced database re-runs
the stage).
"""

from __future__ import annotations

from typing import Any

from fulltune.planning.inputs import ResolvedPipeline
from fulltune.stages import EVALUATE, FINE_TUNE, REGISTER, TOKENIZE, read_marker
from fulltune.stages.runner import Inputs, Stage, StageLog
from fulltune.tracking.registry import Registration

CODE = ("stages/register.py", "tracking/registry.py", "tracking/gates.py", "evaluation/evaluate.py")


def code(p: ResolvedPipeline) -> tuple[str, ...]:
    return CODE


def key(inputs: Inputs) -> dict[str, Any]:
    """The trained weights, their evaluation, the `register:` section, the model's name and the registry."""
    p = inputs.pipeline
    return {"train": inputs.record(FINE_TUNE).key, "evaluate": inputs.keys[EVALUATE],
            "register": p.spec.registration.model_dump(mode="json"), "name": p.model_name,
            "tracking_uri": inputs.mlflow_uri}


def run(inputs: Inputs, key: str, log: StageLog) -> Registration:
    from fulltune.tracking.registry import TrainedVersion, register_version

    p, trained = inputs.pipeline, inputs.record(FINE_TUNE)
    version = TrainedVersion(model_dir=trained.model_dir, train_key=trained.key, settings=trained.settings,
                             train_metrics=trained.metrics, data=inputs.record(TOKENIZE).data)
    registration = register_version(p.spec, p.name, version, inputs.record(EVALUATE),
                                    mlflow_run_id=inputs.mlflow_run_id, flow_run_id=inputs.flow_run_id)
    log.logger.info("%s version %s %s: %s", registration.name, registration.version, list(registration.aliases),
                    registration.reason)
    return registration


def writes(inputs: Inputs, key: str, record: Registration) -> list[str]:
    return []


def marker(record: Registration) -> dict[str, Any]:
    return {"name": record.name, "version": record.version}


def still_valid(inputs: Inputs, key: str) -> bool:
    """Whether the version the marker names exists and holds these weights."""
    from fulltune.tracking import registry

    recorded = read_marker(inputs.pipeline.workdir, REGISTER, key)
    return bool(recorded) and registry.version_exists(recorded["name"], recorded["version"],
                                                      inputs.record(FINE_TUNE).key)


STAGE = Stage(REGISTER, code, key, run, writes, rerun_after="training and evaluation are cached; it registers the "
              "new version (none was left half-registered)", retry_delays=(5, 20), tracked=True, still_valid=still_valid,
              marker=marker)
