"""Against real servers: `prefect server start`, `mlflow server`, and `fulltune serve`.

A run of the demo deployment is started through the Prefect API; MLflow's REST API must then show the
new version with its aliases, a separate process loads `@champion` from the server, and a second run on
unchanged data registers nothing new. Every server is stopped at the end, also when a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

from conftest import ROOT

pytestmark = [pytest.mark.server, pytest.mark.slow]
BIN = Path(sys.executable).parent
MODEL = "fulltune-demo-served"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, seconds: float = 180) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode} before {url} answered")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {seconds} s")


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.loads(response.read())


class Servers:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.processes: list[subprocess.Popen] = []
        self.prefect_url = f"http://127.0.0.1:{free_port()}/api"
        self.mlflow_url = f"http://127.0.0.1:{free_port()}"
        # A real server as a team runs it: every service on (the session's test server turns idle ones off).
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_SERVER_SERVICES_"))}
        self.env = {**inherited, "PREFECT_HOME": str(root / "prefect-home"), "PREFECT_API_URL": self.prefect_url,
                    "MLFLOW_TRACKING_URI": self.mlflow_url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_UI_ENABLED": "false", "PYTHONPATH": str(ROOT)}

    def start(self, name: str, args: list[str], env: dict | None = None) -> subprocess.Popen:
        log = open(self.root / f"{name}.log", "w")
        process = subprocess.Popen(args, cwd=self.root, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        self.processes.append(process)
        return process

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text()[-4000:]

    def stop(self) -> None:
        """The last started first, each gone before the next is told (a runner stops gracefully through the
        Prefect API: stopped after the server, it retries an API that is gone)."""
        for process in reversed(self.processes):
            if process.poll() is not None:
                continue
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


# As infra/docker-compose.yml runs it: without MLflow's job runners (fulltune runs no MLflow server jobs; each
# runner is a process of its own that imports MLflow).
MLFLOW_SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("servers")
    servers = Servers(root)
    try:
        port = urllib.parse.urlparse(servers.prefect_url).port
        prefect = servers.start("prefect", [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1",
                                            "--port", str(port)],
                                env={k: v for k, v in servers.env.items() if k != "PREFECT_API_URL"})
        mlflow_port = urllib.parse.urlparse(servers.mlflow_url).port
        mlflow = servers.start("mlflow", [str(BIN / "mlflow"), "server", "--backend-store-uri",
                                          f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination",
                                          str(root / "mlflow-artifacts"), "--host", "127.0.0.1", "--port",
                                          str(mlflow_port), "--workers", "1"],
                               env={**servers.env, **MLFLOW_SERVER_ENV})
        wait_for(f"{servers.prefect_url}/health", prefect)
        wait_for(f"{servers.mlflow_url}/health", mlflow)
        yield servers
    finally:
        servers.stop()


def write_pipelines(root: Path) -> Path:
    """The demo pipeline, shortened so the test stays quick, with a schedule like a retraining flow."""
    shipped = yaml.safe_load((ROOT / "pipelines.yaml").read_text())
    demo = shipped["pipelines"]["demo"]
    demo["model"]["from_config"] = str(ROOT / demo["model"]["from_config"])
    demo["data"]["train"] = str(ROOT / demo["data"]["train"])
    demo["data"]["eval"] = str(ROOT / demo["data"]["eval"])
    demo["train"].update({"max_steps": 8, "checkpoint_every_steps": 4, "log_every_steps": 4})
    demo["evaluate"].update({"max_generate_examples": 8})
    # Served runs are about the servers: no harness task, and a gate 8 steps can pass.
    demo["evaluate"].pop("lm_eval", None)
    demo["register"]["promote_if"] = {"metric": "eval_loss"}
    demo["register"]["model_name"] = MODEL
    demo["schedule"] = "0 3 * * 1"
    path = root / "pipelines.yaml"
    path.write_text(yaml.safe_dump({"workdir": "work", "defaults": shipped.get("defaults", {}),
                                    "pipelines": {"demo": demo}}))
    return path


def run_deployment(servers: Servers) -> str:
    """Start a run of the served demo deployment through the Prefect API and wait for its final state."""
    script = ("from prefect.deployments import run_deployment; "
              "run = run_deployment('fulltune-pipeline/demo', timeout=900, poll_interval=1); "
              "print('STATE', run.state.type.value)")
    done = subprocess.run([sys.executable, "-c", script], env=servers.env, cwd=servers.root, capture_output=True,
                          text=True, timeout=960)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip().splitlines()[-1]


def deployment_names(servers: Servers) -> list[str]:
    """The deployments the Prefect API knows, as `flow/deployment` (what `prefect deployment ls` lists)."""
    def post(path: str) -> list[dict]:
        request = urllib.request.Request(f"{servers.prefect_url}/{path}", data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    flows = {flow["id"]: flow["name"] for flow in post("flows/filter")}
    return [f"{flows.get(d['flow_id'])}/{d['name']}" for d in post("deployments/filter")]


def model_versions(servers: Servers) -> list[dict]:
    query = urllib.parse.urlencode({"filter": f"name='{MODEL}'"})
    return get_json(f"{servers.mlflow_url}/api/2.0/mlflow/model-versions/search?{query}").get("model_versions", [])


def test_served_deployment_run_registers_champion_and_reruns_register_nothing(servers):
    pipelines = write_pipelines(servers.root)
    # The runner looks for runs to start every second (Prefect's default is 10 s).
    serve = servers.start("serve", [str(BIN / "fulltune"), "serve", "-f", str(pipelines)],
                          env={**servers.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"})
    deadline = time.time() + 180
    while time.time() < deadline:
        assert serve.poll() is None, servers.log("serve")
        if "fulltune-pipeline/demo" in deployment_names(servers):
            break
        time.sleep(1)
    else:
        pytest.fail("the demo deployment never appeared:\n" + servers.log("serve"))

    assert run_deployment(servers) == "STATE COMPLETED", servers.log("serve")
    alias = get_json(f"{servers.mlflow_url}/api/2.0/mlflow/registered-models/alias?"
                     + urllib.parse.urlencode({"name": MODEL, "alias": "champion"}))["model_version"]
    assert alias["version"] == "1"
    assert set(alias.get("aliases", [])) >= {"challenger", "champion"}
    tags = {t["key"]: t["value"] for t in alias.get("tags", [])}
    assert tags["fulltune.pipeline"] == "demo" and tags["fulltune.data_fingerprint"]

    load = ("import mlflow; p = mlflow.transformers.load_model('models:/%s@champion'); "
            "print('OUT', repr(p('reverse 48213=', max_new_tokens=8, do_sample=False)[0]['generated_text']))" % MODEL)
    loaded = subprocess.run([sys.executable, "-c", load], env=servers.env, cwd=servers.root, capture_output=True,
                            text=True, timeout=300)
    assert loaded.returncode == 0, loaded.stderr[-3000:]
    assert "OUT 'reverse 48213=" in loaded.stdout

    assert run_deployment(servers) == "STATE COMPLETED", servers.log("serve")
    assert [v["version"] for v in model_versions(servers)] == ["1"]
