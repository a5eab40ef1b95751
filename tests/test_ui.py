"""What a person sees in the Prefect and MLflow UIs: the run form, the artifacts' long lines, and — through a real
headless Chromium on a real Prefect UI and `mlflow server` — the memory plan's page and the MLflow run's page."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from pathlib import Path

import pytest

from pipelines_fixture import tiny_pipeline
from runs import ONE_PROCESS

# Chromium from Debian's package (`apt-get install chromium`); the network is closed, so nothing of its own runs.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--window-size=1400,1000"]


def test_long_lines_of_an_artifact_wrap_under_their_start():
    from tasks.artifacts import PAGE_COLUMNS, wrapped

    line = "fits with 20.4 GiB to spare; the estimate's uncertainty here is ±174 KiB " * 3
    item = "  - " + "the configured settings fit: 723 MiB (peak in backward of the lm head / loss) " * 2
    table = "| parameters | 417 KiB | 417 KiB |"
    out = wrapped("\n".join([line.strip(), item.rstrip(), table])).splitlines()
    assert all(len(text) <= PAGE_COLUMNS for text in out)
    start = next(i for i, text in enumerate(out) if text.startswith("  - "))
    assert not out[0].startswith(" ") and all(text.startswith("    ") for text in out[1:start]), "continued, indented"
    assert all(text.startswith("    ") and text[4] != " " for text in out[start + 1:-1]), "under the item's text"
    assert out[-1] == table, "a short line is left as it is"
    assert " ".join(" ".join(out).split()) == " ".join(" ".join([line, item, table]).split()), "no word lost"


def test_the_run_form_starts_empty_and_says_each_fields_value_in_the_pipeline(tmp_path):
    from flows.deployments import build_deployments

    (deployment,) = build_deployments(str(tiny_pipeline(tmp_path, train={"learning_rate": 0.002})))
    schema = deployment._parameter_openapi_schema.model_dump()
    overrides = schema["properties"]["overrides"]
    assert "anyOf" not in overrides and overrides["default"] == {}, "a form, not a choice of None"
    assert overrides["title"] == "Changes for this run" and "Leave a field empty" in overrides["description"]
    assert "flows/" not in overrides["description"] and "dotted.key" in overrides["description"]
    fields = schema["definitions"]["Overrides"]["properties"]
    assert fields["learning_rate"]["description"].endswith("This pipeline: 0.002")
    assert fields["learning_rate"]["type"] == "number" and "default" not in fields["learning_rate"]
    assert "This pipeline: auto" in fields["budget_memory"]["description"]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def page(url: str, profile: Path, screenshot: Path | None = None) -> str:
    """The DOM of `url` once its scripts have rendered it, in headless Chromium with a fresh profile."""
    args = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--virtual-time-budget=20000"]
    if screenshot is not None:
        subprocess.run([*args, f"--screenshot={screenshot}", url], capture_output=True, timeout=180, check=True)
    done = subprocess.run([*args, "--dump-dom", url], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


@pytest.mark.slow
@pytest.mark.server
@pytest.mark.skipif(chromium() is None, reason="no Chromium: `apt-get install chromium` (Debian's package) to run it")
def test_the_plan_page_and_the_mlflow_run_page_show_the_settings_the_decision_and_the_loss_curve(
        shared_run, tmp_path):
    """The shared one-process run: its memory plan as the budget stage's artifact on a Prefect UI, its MLflow run on
    `mlflow server`. The artifact is published again from the plan the run logged to MLflow, on a UI server of this
    test's own (the session's test API serves no UI, and under pytest-xdist another worker's API ran the run)."""
    from prefect import flow
    from prefect.artifacts import create_markdown_artifact
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tasks.artifacts import plan_markdown
    from test_servers import MLFLOW_SERVER_ENV, BIN, Servers, get_json, wait_for

    work = shared_run(**ONE_PROCESS).finish() / "work"
    servers = Servers(tmp_path)
    try:
        prefect = servers.start("prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port",
                                            str(urllib.parse.urlparse(servers.prefect_url).port), "--no-services"],
                                env={**servers.env, "PREFECT_UI_ENABLED": "true",
                                     "PREFECT_UI_API_URL": servers.prefect_url})  # where the page's scripts call
        mlflow = servers.start("mlflow", [str(BIN / "mlflow"), "server", "--backend-store-uri",
                                          f"sqlite:///{work / 'mlflow.db'}", "--host", "127.0.0.1", "--port",
                                          str(urllib.parse.urlparse(servers.mlflow_url).port), "--workers", "1"],
                               env={**servers.env, **MLFLOW_SERVER_ENV})
        wait_for(f"{servers.prefect_url}/health", prefect)
        wait_for(f"{servers.mlflow_url}/health", mlflow)
        experiment = _experiment(servers.mlflow_url)
        (run,) = _post(f"{servers.mlflow_url}/api/2.0/mlflow/runs/search", {"experiment_ids": [experiment]})["runs"]
        run_id = run["info"]["run_id"]
        artifacts = Path(urllib.parse.urlparse(run["info"]["artifact_uri"]).path)
        table = (artifacts / "memory_plan" / "memory_plan.txt").read_text()
        @flow
        def publish() -> str:
            return str(create_markdown_artifact(
                markdown=plan_markdown("tiny", table, artifacts / "memory_plan" / "memory_plan.png"),
                key="tiny-memory-plan"))

        with temporary_settings({PREFECT_API_URL: servers.prefect_url}):
            artifact = publish()
        ui = servers.prefect_url.removesuffix("/api")
        plan = page(f"{ui}/artifacts/artifact/{artifact}", tmp_path / "profile-plan")
        assert "Memory plan for" in plan and "micro_batch_size=" in plan and "data:image/png;base64," in plan
        overview = page(f"{servers.mlflow_url}/#/experiments/{experiment}/runs/{run_id}", tmp_path / "profile-run")
        assert "tiny · v1 · champion" in overview, "the run named for what it did"
        assert "no champion yet" in overview, "the chosen version's reason"
        assert "micro_batch_size=2" in overview and "trains.micro_batch_size" in overview, "the settings that trained"
        assert "tiny-train" in overview, "the tokenized data as the run's dataset"
        listed = page(f"{servers.mlflow_url}/#/experiments/{experiment}/runs/{run_id}/artifacts",
                      tmp_path / "profile-artifacts")
        assert "loss_curve.png" in listed and "memory_plan" in listed
    finally:
        servers.stop()


def _experiment(mlflow_url: str) -> str:
    """The id of the tiny pipeline's experiment, which MLflow's UI opens on its runs (not its GenAI view)."""
    from test_servers import get_json

    experiment = get_json(f"{mlflow_url}/api/2.0/mlflow/experiments/get-by-name?experiment_name=fulltune-tiny")[
        "experiment"]
    tags = {tag["key"]: tag["value"] for tag in experiment.get("tags", [])}
    assert tags["mlflow.experimentKind"] == "custom_model_development"
    return experiment["experiment_id"]


def _post(url: str, body: dict) -> dict:
    import urllib.request

    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.loads(response.read())
