"""What a run started from a deployment (the Prefect UI, the API, a schedule) may change.

Run parameters come from whoever can reach the Prefect server; the pipelines file from whoever can edit
the worker's files. A run parameter therefore changes only what the pipelines file lets it:

- the pipelines file is the deployment's own (`fulltune serve -f FILE`, or `pipelines.yaml` in the
  working directory of the deployments in infra/prefect.yaml); a run naming another one is refused;
- `overrides` may change only what fulltune/stages/run_overrides.py allows: the training knobs, the fields the
  pipeline lists under `run_overrides`, never what runs code, loads pickles, reads a secret or chooses
  where outputs go, and local paths only inside the pipelines file's folder.

Everything is checked before any stage runs; a refusal fails the flow run with one message naming the
field. A flow called in-process (`fulltune run --set`, a script) is the user's own shell and is not limited.
"""

from __future__ import annotations

from typing import Any

from fulltune.errors import ConfigError
from fulltune.stages.run_overrides import check_overrides, flatten

# The flow's default `pipelines_file`: relative to the working directory of the run.
PIPELINES_FILE = "pipelines.yaml"


def check_deployment_run(pipeline: str, overrides: dict[str, Any], pipelines_file: str) -> dict[str, Any]:
    """The overrides to apply: as given when not run from a deployment; from a deployment, checked and
    flattened to the dotted fields they set (what was checked is what is applied: a nested mapping then
    changes its fields, not the whole section). ConfigError for what the run may not change."""
    from prefect.runtime import deployment

    if deployment.id is None:
        return overrides
    fixed = _deployment_parameters(deployment.id).get("pipelines_file", PIPELINES_FILE)
    if pipelines_file != fixed:
        raise ConfigError(f"pipelines_file: deployment {deployment.name} runs the pipelines of {fixed}; a run "
                          f"parameter cannot name another file ({pipelines_file})")
    fields = flatten(overrides)
    check_overrides(fixed, pipeline, fields)
    return fields


def _deployment_parameters(deployment_id: str) -> dict[str, Any]:
    """The parameters stored with the deployment (its operator's), not those of this run."""
    from uuid import UUID

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return dict(client.read_deployment(UUID(deployment_id)).parameters or {})
