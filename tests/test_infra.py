"""The files under infra/ and examples/ agree with each other and with the installed tools.

No Docker and no cluster: the compose file, the work-pool templates, the Accelerate configs and the
deployment file are checked with the same code that will read them (Prefect's template renderer and
validators, Accelerate's config loader and launcher, docker-py's device requests, MLflow's host check),
so a key that the real tool would reject or silently ignore fails here.
"""

from __future__ import annotations

import asyncio
import json
import os
import py_compile
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
INFRA = ROOT / "infra"
COMPOSE = INFRA / "docker-compose.yml"
COMPOSE_GPU = INFRA / "docker-compose.gpu.yml"
ENV_EXAMPLE = INFRA / ".env.example"
DOCKERFILE = INFRA / "Dockerfile"
PREFECT_YAML = INFRA / "prefect.yaml"
K8S_TEMPLATE = INFRA / "kubernetes" / "base-job-template.json"
DOCKER_TEMPLATE = INFRA / "docker" / "base-job-template.json"
ACCELERATE_DIR = INFRA / "accelerate"
LOAD_CHAMPION = ROOT / "examples" / "load_champion.py"

# `${VAR}` / `${VAR:-default}` / `$VAR`, but not `$$VAR` (compose's escape for the container's shell).
COMPOSE_VARIABLE = re.compile(r"(?<!\$)\$(?:\{([A-Za-z_][A-Za-z0-9_]*)[^}]*\}|([A-Za-z_][A-Za-z0-9_]*))")
PREFECT_ENV_PLACEHOLDER = re.compile(r"\{\{\s*\$([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def read_env_example() -> dict[str, str]:
    values: dict[str, str] = {}
    for number, line in enumerate(ENV_EXAMPLE.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), f".env.example:{number}: not KEY=VALUE: {line!r}"
        assert key not in values, f".env.example:{number}: {key} defined twice"
        values[key] = value
    return values


def strings(node: Any) -> list[str]:
    """Every string value (and mapping key) of a parsed YAML document: what compose interpolates."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, dict):
        return [s for key, value in node.items() for s in strings(key) + strings(value)]
    if isinstance(node, list):
        return [s for item in node for s in strings(item)]
    return []


def interpolate(node: Any, values: dict[str, str]) -> Any:
    """What `docker compose` does to the parsed file, given infra/.env = .env.example."""
    if isinstance(node, str):
        return COMPOSE_VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], node).replace("$$", "$")
    if isinstance(node, dict):
        return {interpolate(key, values): interpolate(value, values) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(item, values) for item in node]
    return node


@pytest.fixture(scope="module")
def env_example() -> dict[str, str]:
    return read_env_example()


@pytest.fixture(scope="module")
def compose(env_example: dict[str, str]) -> dict[str, Any]:
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env_example)


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, Any]:
    return compose["services"]


def command_args(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else list(command)


def container_paths(volumes: list[str]) -> set[str]:
    return {volume.split(":")[1] for volume in volumes}


# ------------------------------------------------------------------------------------------- compose


def test_compose_files_parse_into_the_expected_services() -> None:
    raw = yaml.safe_load(COMPOSE.read_text())
    assert set(raw["services"]) == {
        "prefect-db", "prefect-server", "mlflow-db", "minio", "create-bucket", "mlflow", "worker",
    }
    gpu = yaml.safe_load(COMPOSE_GPU.read_text())
    assert set(gpu["services"]) <= set(raw["services"]), "the GPU override names a service the stack lacks"
    devices = gpu["services"]["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["driver"] == "nvidia" and devices[0]["capabilities"] == ["gpu"]


def test_every_compose_variable_is_in_env_example_and_every_example_variable_is_used(
    env_example: dict[str, str],
) -> None:
    used = set()
    for path in (COMPOSE, COMPOSE_GPU):
        for text in strings(yaml.safe_load(path.read_text())):
            for match in COMPOSE_VARIABLE.finditer(text):
                name = match.group(1) or match.group(2)
                assert name in env_example, f"{path.name} uses ${{{name}}}, which infra/.env.example does not define"
                used.add(name)
    used |= set(PREFECT_ENV_PLACEHOLDER.findall(PREFECT_YAML.read_text()))
    assert set(env_example) - used == set(), "variables in .env.example that nothing reads"


def test_env_example_holds_no_real_secret(env_example: dict[str, str]) -> None:
    for key, value in env_example.items():
        if re.search(r"PASSWORD|SECRET|TOKEN", key):
            assert value == "" or value.startswith("change-me"), f"{key} looks like a real secret: {value!r}"
    # MinIO refuses secret keys shorter than 8 characters.
    assert len(env_example["MINIO_ROOT_PASSWORD"]) >= 8 and len(env_example["MLFLOW_S3_SECRET_KEY"]) >= 8


def test_every_service_image_is_pinned_or_built(services: dict[str, Any]) -> None:
    for name, service in services.items():
        if "build" in service:
            build = service["build"]
            context = (COMPOSE.parent / build["context"]).resolve()
            assert context == ROOT, f"{name}: builds from {context}, not the repository root"
            assert (context / build["dockerfile"]).is_file(), f"{name}: {build['dockerfile']} does not exist"
            continue
        image = service["image"]
        repository, _, tag = image.rpartition(":")
        assert repository and "/" not in tag, f"{name}: image {image!r} has no tag"
        assert tag != "latest" and re.search(r"\d", tag), f"{name}: image {image!r} is not pinned to a version"


def test_server_images_are_not_older_than_the_installed_clients(env_example: dict[str, str]) -> None:
    # A Prefect client newer than its server is unsupported; the worker image pins both clients to these.
    from importlib.metadata import version

    from packaging.version import Version

    assert Version(env_example["PREFECT_VERSION"]) >= Version(version("prefect"))
    assert Version(env_example["MLFLOW_VERSION"]) >= Version(version("mlflow"))


def test_depends_on_targets_exist_and_wait_for_health(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for target, spec in service.get("depends_on", {}).items():
            assert target in services, f"{name} depends on unknown service {target}"
            condition = spec["condition"]
            assert condition in {"service_healthy", "service_completed_successfully"}, (name, target)
            if condition == "service_healthy":
                assert "healthcheck" in services[target], f"{name} waits for {target}, which has no healthcheck"


def test_named_volumes_are_declared(compose: dict[str, Any], services: dict[str, Any]) -> None:
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if not source.startswith((".", "/")):
                assert source in compose["volumes"], f"{name} mounts undeclared volume {source}"


def test_worker_reaches_both_servers_and_polls_the_process_pool(services: dict[str, Any]) -> None:
    worker = services["worker"]
    env = worker["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["MLFLOW_TRACKING_URI"] == "http://mlflow:5000"
    assert "--port" in command_args(services["prefect-server"]) and "4200" in command_args(services["prefect-server"])
    assert "--port=5000" in command_args(services["mlflow"])
    assert "--pool=fulltune-process" in command_args(worker)
    assert any(path == "/opt/fulltune/.fulltune" for path in container_paths(worker["volumes"]))


def test_mlflow_serves_artifacts_from_the_bucket_and_accepts_the_workers_host(
    services: dict[str, Any], env_example: dict[str, str],
) -> None:
    from mlflow.server.security_utils import is_allowed_host_header

    mlflow_args = command_args(services["mlflow"])
    assert "--serve-artifacts" in mlflow_args
    assert f"--artifacts-destination=s3://{env_example['MLFLOW_BUCKET']}/artifacts" in mlflow_args
    assert services["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql+psycopg2://")
    assert services["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://minio:9000"
    allowed = [host.strip() for host in env_example["MLFLOW_ALLOWED_HOSTS"].split(",")]
    # The Host headers of the worker (http://mlflow:5000) and of a browser on the server itself.
    for host in ("mlflow:5000", f"localhost:{env_example['MLFLOW_PORT']}"):
        assert is_allowed_host_header(allowed, host), f"MLflow would reject Host: {host}"
    assert services["prefect-server"]["environment"]["PREFECT_SERVER_DATABASE_CONNECTION_URL"].startswith(
        "postgresql+asyncpg://"
    )


def test_worker_image_installs_the_project_as_a_non_root_user(env_example: dict[str, str]) -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)", text, re.MULTILINE).group(1)
    assert base.startswith("pytorch/pytorch:") and "-cuda" in base and "-cudnn" in base
    assert "TOKENIZERS_PARALLELISM=false" in text and "PREFECT_SERVER_ANALYTICS_ENABLED=false" in text
    for package in ("bitsandbytes", "nvidia-ml-py", "/opt/fulltune[gpu]"):
        assert package in text
    users = re.findall(r"^USER (\S+)", text, re.MULTILINE)
    assert users and users[-1] not in {"root", "0"}
    for name in ("PREFECT_VERSION", "MLFLOW_VERSION"):
        assert re.search(rf"^ARG {name}={re.escape(env_example[name])}$", text, re.MULTILINE), (
            f"infra/Dockerfile's default {name} differs from .env.example"
        )
    ignored = (INFRA / "Dockerfile.dockerignore").read_text().split()
    assert {".venv", ".fulltune", ".git", "infra/.env"} <= set(ignored)


# ------------------------------------------------------------------------------- work-pool templates


def default_template(package: str, worker_type: str) -> dict[str, Any]:
    import prefect

    path = (Path(prefect.__file__).parent / "server" / "api" / "collections_data" / "views"
            / "aggregate-worker-metadata.json")
    if not path.is_file():
        pytest.skip("this Prefect does not ship its workers' default templates")
    return json.loads(path.read_text())[package][worker_type]["default_base_job_configuration"]


def render(template: dict[str, Any], values: dict[str, Any], **fields: Any) -> Any:
    """Render `template` the way a worker does, into a configuration with the worker's extra fields."""
    from pydantic import create_model
    from prefect.workers.base import BaseJobConfiguration

    class NoClient:
        def __getattr__(self, name: str) -> Any:
            raise AssertionError(f"rendering needed the Prefect API ({name}); the template has a block or variable")

    config = create_model("Config", __base__=BaseJobConfiguration, **fields)
    return asyncio.run(config.from_template_and_values(template, values, client=NoClient()))


@pytest.mark.parametrize("path", [K8S_TEMPLATE, DOCKER_TEMPLATE], ids=["kubernetes", "docker"])
def test_template_placeholders_are_declared_variables_with_valid_defaults(path: Path) -> None:
    import jsonschema
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect.utilities.templating import PlaceholderType, find_placeholders

    template = json.loads(path.read_text())
    validate_base_job_template(template)  # what the server runs on `prefect work-pool create`
    placeholders = find_placeholders(template["job_configuration"])
    assert all(p.type is PlaceholderType.STANDARD for p in placeholders), "env/block placeholders need the API"
    declared = set(template["variables"]["properties"])
    assert {p.name for p in placeholders} <= declared
    for name, schema in template["variables"]["properties"].items():
        if "default" in schema:
            jsonschema.validate(schema["default"], schema)


@pytest.mark.parametrize(
    ("path", "package", "worker_type"),
    [(K8S_TEMPLATE, "prefect-kubernetes", "kubernetes"), (DOCKER_TEMPLATE, "prefect-docker", "docker")],
    ids=["kubernetes", "docker"],
)
def test_template_extends_prefects_default(path: Path, package: str, worker_type: str) -> None:
    template = json.loads(path.read_text())
    default = default_template(package, worker_type)
    assert set(default["job_configuration"]) <= set(template["job_configuration"])
    assert set(default["variables"]["properties"]) <= set(template["variables"]["properties"])


def test_kubernetes_template_requests_gpus_shared_memory_and_servers() -> None:
    from typing import Optional

    template = json.loads(K8S_TEMPLATE.read_text())
    fields = {"job_manifest": (dict, ...), "namespace": (str, "default"), "cluster_config": (Optional[dict], None),
              "job_watch_timeout_seconds": (Optional[int], None), "pod_watch_timeout_seconds": (int, 60),
              "stream_output": (bool, True)}
    config = render(template, {"gpu_count": 8, "image": "registry.example.com/fulltune:1",
                               "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
                               "env": {"HF_HUB_OFFLINE": "1"}}, **fields)
    pod = config.job_manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # What prefect-kubernetes requires of a job manifest (worker.py: _get_base_job_manifest).
    assert (pod["restartPolicy"], pod["parallelism"], pod["completions"]) == ("Never", 1, 1)
    assert container["name"] == "prefect-job"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert container["image"] == "registry.example.com/fulltune:1"
    shm = next(v for v in pod["volumes"] if v["name"] == "shm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert config.env == {"MLFLOW_TRACKING_URI": "http://mlflow:5000", "HF_HUB_OFFLINE": "1"}

    # Unset variables disappear rather than render as empty strings: the worker's PREFECT_API_URL
    # then reaches the pod, and a pod without a node selector may land on any GPU node.
    bare = render(template, {}, **fields)
    assert "PREFECT_API_URL" not in bare.env
    assert "nodeSelector" not in bare.job_manifest["spec"]["template"]["spec"]
    pinned = render(template, {"prefect_api_url": "http://prefect.internal/api"}, **fields)
    assert pinned.env["PREFECT_API_URL"] == "http://prefect.internal/api"


def _kubernetes_env(entries: list[dict[str, Any]], downward: dict[str, str]) -> dict[str, str]:
    """The environment Kubernetes gives the container: downward-API values filled in, `$(NAME)` expanded
    from the entries before it (the kubelet's rule)."""
    env: dict[str, str] = {}
    for entry in entries:
        if "valueFrom" in entry:
            env[entry["name"]] = downward[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), entry["value"])
    return env


def test_kubernetes_template_runs_n_pods_that_meet_through_the_headless_service() -> None:
    """num_nodes pods of one indexed Job; pod i resolves as <job>-i.<service>; every pod runs the flow-run
    command through fulltune.runtime.rendezvous, which gives pod 0 the flow and the others its training."""
    from fulltune.runtime.rendezvous import Rendezvous

    template = json.loads(K8S_TEMPLATE.read_text())
    service = yaml.safe_load((INFRA / "kubernetes" / "rendezvous-service.yaml").read_text())
    fields = {"job_manifest": (dict, ...)}
    config = render(template, {"num_nodes": 2, "gpu_count": 8}, **fields)
    job = config.job_manifest["spec"]
    assert (job["completionMode"], job["completions"], job["parallelism"]) == ("Indexed", 2, 2)
    pod = job["template"]
    container = pod["spec"]["containers"][0]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert pod["spec"]["subdomain"] == service["metadata"]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["ports"][0]["port"] == 29400
    assert container["command"] == ["python", "-m", "fulltune.runtime.rendezvous", "pod", "--"]

    downward = {"metadata.labels['batch.kubernetes.io/job-name']": "demo-x7k2p"}
    for index in (0, 1):
        env = _kubernetes_env(container["env"], downward)
        env.update(JOB_COMPLETION_INDEX=str(index), PREFECT__FLOW_RUN_ID="4f0c")
        rendezvous = Rendezvous.from_environment(env)
        assert rendezvous.endpoint == "demo-x7k2p-0.fulltune-rdzv:29400"
        assert rendezvous.node_rank == index and rendezvous.run_id == "4f0c"
        assert str(rendezvous.directory).startswith("/opt/fulltune/.fulltune/")
        args = rendezvous.torchrun_args(nnodes=2, nproc_per_node=8)
        assert args[args.index("--rdzv-conf") + 1] == f"is_host={1 - index}"

    # One node stays the default: a plain single-pod Job.
    bare = render(template, {}, **fields).job_manifest["spec"]
    assert (bare["completions"], bare["parallelism"]) == (1, 1)


def test_rendezvous_environment_errors_name_the_variable() -> None:
    from fulltune.errors import ConfigError
    from fulltune.runtime.rendezvous import Rendezvous, launch_command

    assert Rendezvous.from_environment({}) is None
    assert launch_command("JOB.json", 8, 1, {"FULLTUNE_RDZV_ENDPOINT": "h"}) is None
    assert Rendezvous.from_environment({"FULLTUNE_RDZV_ENDPOINT": "h"}).endpoint == "h:29400"
    for env, name in [({"FULLTUNE_RDZV_ENDPOINT": "h:port"}, "FULLTUNE_RDZV_ENDPOINT"),
                      ({"FULLTUNE_RDZV_ENDPOINT": "h", "FULLTUNE_NODE_RANK": "x"}, "FULLTUNE_NODE_RANK")]:
        with pytest.raises(ConfigError, match=name):
            Rendezvous.from_environment(env)
    with pytest.raises(ConfigError, match="num_processes"):
        launch_command("JOB.json", 3, 2, {"FULLTUNE_RDZV_ENDPOINT": "h", "FULLTUNE_RDZV_DIR": "/tmp"})
    with pytest.raises(ConfigError, match="FULLTUNE_RDZV_DIR"):
        launch_command("JOB.json", 4, 2, {"FULLTUNE_RDZV_ENDPOINT": "h"})


def test_other_pods_run_each_launch_of_pod_0_and_leave_when_its_flow_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from fulltune.runtime import rendezvous as rdzv

    calls: list[list[str]] = []
    monkeypatch.setattr(rdzv.subprocess, "call", lambda command: calls.append(command) or 0)
    base = {"FULLTUNE_RDZV_ENDPOINT": "job-0.svc:29400", "FULLTUNE_RDZV_DIR": str(tmp_path), "FULLTUNE_RDZV_ID": "r1"}
    follower_env = {**base, "JOB_COMPLETION_INDEX": "1"}
    follower = rdzv.Rendezvous.from_environment(follower_env)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(follower.follow(poll_seconds=0.05)))
    thread.start()
    # Pod 0: the flow publishes its training launch, then the pod entrypoint reports the flow's end.
    command = rdzv.launch_command(tmp_path / "runs" / "k" / "JOB.json", 16, 2, {**base, "JOB_COMPLETION_INDEX": "0"})
    assert command[command.index("--nproc-per-node") + 1] == "8" and command[-1].endswith("JOB.json")
    assert rdzv.pod_main(["prefect", "flow-run", "execute"], {**base, "JOB_COMPLETION_INDEX": "0"}) == 0
    thread.join(timeout=30)
    assert not thread.is_alive() and codes == [0]
    follower_run = next(c for c in calls if "torch.distributed.run" in c)
    assert follower_run[follower_run.index("--rdzv-conf") + 1] == "is_host=0"
    assert follower_run[-1] == str((tmp_path / "runs" / "k" / "JOB.json").resolve())
    assert ["prefect", "flow-run", "execute"] in calls


def test_docker_template_hands_gpus_to_docker_and_joins_the_compose_network(compose: dict[str, Any]) -> None:
    from typing import Optional

    docker_types = pytest.importorskip("docker.types")  # docker-py, installed with mlflow
    DeviceRequest, HostConfig = docker_types.DeviceRequest, docker_types.HostConfig

    template = json.loads(DOCKER_TEMPLATE.read_text())
    config = render(template, {"gpu_count": 2, "image": "fulltune:dev"},
                    image=(str, ...), networks=(list, []), volumes=(list, []),
                    container_create_kwargs=(Optional[dict], None))
    kwargs = config.container_create_kwargs
    requests = [DeviceRequest(**request) for request in kwargs["device_requests"]]
    assert (requests[0]["Driver"], requests[0]["Count"], requests[0]["Capabilities"]) == ("nvidia", 2, [["gpu"]])
    host_config = HostConfig(version="1.41", device_requests=requests, shm_size=kwargs["shm_size"])
    assert host_config["ShmSize"] == 16 * 1024**3
    assert config.networks == [compose["networks"]["default"]["name"]]
    assert config.env == {"MLFLOW_TRACKING_URI": "http://mlflow:5000",
                          "PREFECT_API_URL": "http://prefect-server:4200/api"}
    # Flow-run containers keep the same workdir as the compose worker.
    assert container_paths(config.volumes) & container_paths(compose["services"]["worker"]["volumes"])


# ----------------------------------------------------------------------------------- accelerate configs

ACCELERATE_CONFIGS = {
    "ddp.yaml": ("MULTI_GPU", 8, 1),
    "fsdp.yaml": ("FSDP", 8, 1),
    "multi_node.yaml": ("MULTI_GPU", 16, 2),
    "cpu_ddp.yaml": ("MULTI_CPU", 2, 1),
}


def test_the_shipped_accelerate_configs_are_the_documented_ones() -> None:
    assert {path.name for path in ACCELERATE_DIR.glob("*.yaml")} == set(ACCELERATE_CONFIGS)


@pytest.mark.parametrize("name", sorted(ACCELERATE_CONFIGS))
def test_accelerate_config_loads_and_launches(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from accelerate.commands.config.config_args import ClusterConfig, load_config_from_file
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import launch as launch_utils

    path = str(ACCELERATE_DIR / name)
    distributed_type, num_processes, num_machines = ACCELERATE_CONFIGS[name]

    # Accelerate's own loader: rejects any unknown top-level key.
    config = load_config_from_file(path)
    assert isinstance(config, ClusterConfig)
    assert (config.distributed_type.value, config.num_processes, config.num_machines) == (
        distributed_type, num_processes, num_machines)
    assert config.num_processes % config.num_machines == 0
    assert config.mixed_precision == ("no" if config.use_cpu else "bf16")
    if num_machines > 1:
        assert config.main_process_ip and config.main_process_port

    # `accelerate launch --config_file PATH -m fulltune.runtime.train JOB.json`, up to the point where it would
    # start processes. Nested keys become launch arguments; one the launcher does not know would be
    # ignored without a word, so it fails here.
    parser = launch_command_parser()
    known = {action.dest for action in parser._actions}
    for section in ("fsdp_config", "deepspeed_config", "dynamo_config", "mpirun_config"):
        for key in getattr(config, section):
            assert key in known, f"{name}: {section}.{key} is not an `accelerate launch` argument"
    args = parser.parse_args(["--config_file", path, "-m", "fulltune.runtime.train", "JOB.json"])
    args, defaults, _ = _validate_launch_command(args)
    monkeypatch.setattr(launch_utils, "is_port_in_use", lambda port: False)
    if args.use_fsdp or args.multi_gpu:
        env = launch_utils.prepare_multi_gpu_env(args)
        assert int(args.nproc_per_node) * num_machines == num_processes
    else:
        _, env = launch_utils.prepare_simple_launcher_cmd_env(args)
        assert env["ACCELERATE_USE_CPU"] == "True"
    assert env["ACCELERATE_MIXED_PRECISION"] == config.mixed_precision

    if args.use_fsdp:
        from accelerate.utils import FullyShardedDataParallelPlugin

        for key, value in env.items():
            if key.startswith(("FSDP_", "ACCELERATE_")):
                monkeypatch.setenv(key, value)
        plugin = FullyShardedDataParallelPlugin()
        assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True  # FSDP2 full shard
        assert plugin.auto_wrap_policy.__name__ == "transformer_auto_wrap_policy"


# ------------------------------------------------------------------------------------- prefect.yaml


@pytest.fixture(scope="module")
def prefect_yaml() -> dict[str, Any]:
    return yaml.safe_load(PREFECT_YAML.read_text())


def test_prefect_yaml_is_valid_for_prefect_deploy(prefect_yaml: dict[str, Any]) -> None:
    try:
        from prefect.cli.deploy._models import PrefectYamlModel
    except ImportError:
        pytest.skip("this Prefect has no prefect.yaml model to validate against")
    model = PrefectYamlModel.model_validate(prefect_yaml)
    names = [deployment.name for deployment in model.deployments]
    assert len(names) == len(set(names)), "deployment names must be unique"
    pools = {deployment.work_pool.name for deployment in model.deployments}
    assert pools == {"fulltune-process", "fulltune-docker", "fulltune-k8s"}


def test_prefect_yaml_runs_the_code_where_the_image_puts_it(
    prefect_yaml: dict[str, Any], services: dict[str, Any],
) -> None:
    [step] = prefect_yaml["pull"]
    directory = step["prefect.deployments.steps.set_working_directory"]["directory"]
    assert re.search(rf"^WORKDIR {re.escape(directory)}$", DOCKERFILE.read_text(), re.MULTILINE)
    process_pools = {d["work_pool"]["name"] for d in prefect_yaml["deployments"]
                     if "job_variables" not in d["work_pool"]}
    worker_pool = next(arg.split("=", 1)[1] for arg in command_args(services["worker"]) if arg.startswith("--pool="))
    assert process_pools == {worker_pool}


def test_container_deployments_set_only_variables_their_pool_declares(prefect_yaml: dict[str, Any]) -> None:
    import jsonschema

    templates = {"fulltune-docker": DOCKER_TEMPLATE, "fulltune-k8s": K8S_TEMPLATE}
    for deployment in prefect_yaml["deployments"]:
        pool = deployment["work_pool"]
        if pool["name"] not in templates:
            continue
        properties = json.loads(templates[pool["name"]].read_text())["variables"]["properties"]
        assert {"image", "gpu_count"} <= set(pool["job_variables"]), deployment["name"]
        for key, value in pool["job_variables"].items():
            # An undeclared job variable is silently dropped by the worker.
            assert key in properties, f"{deployment['name']}: {key} is not a variable of {pool['name']}"
            if not (isinstance(value, str) and PREFECT_ENV_PLACEHOLDER.fullmatch(value)):
                jsonschema.validate(value, properties[key])


def test_every_deployment_calls_the_flow_with_its_real_parameters(
    prefect_yaml: dict[str, Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    entrypoints = {deployment["entrypoint"] for deployment in prefect_yaml["deployments"]}
    assert entrypoints == {"flows/pipeline.py:finetune_pipeline"}
    [entrypoint] = entrypoints
    if not (ROOT / entrypoint.split(":")[0]).is_file():
        pytest.skip(f"{entrypoint} is not written yet")
    import inspect

    from prefect.flows import load_flow_from_entrypoint

    monkeypatch.chdir(ROOT)  # `prefect deploy --all --prefect-file infra/prefect.yaml` runs from the root
    flow = load_flow_from_entrypoint(entrypoint)
    accepted = set(inspect.signature(flow.fn).parameters)
    for deployment in prefect_yaml["deployments"]:
        assert set(deployment["parameters"]) <= accepted, deployment["name"]


def test_every_shipped_pipeline_has_a_process_pool_deployment(prefect_yaml: dict[str, Any]) -> None:
    pipelines_file = ROOT / "pipelines.yaml"
    if not pipelines_file.is_file():
        pytest.skip("pipelines.yaml is not written yet")
    shipped = set(yaml.safe_load(pipelines_file.read_text())["pipelines"])
    deployed = {d["parameters"]["pipeline"] for d in prefect_yaml["deployments"]
                if d["work_pool"]["name"] == "fulltune-process"}
    assert deployed == shipped, "add (or remove) the deployment in infra/prefect.yaml"
    referenced = {d["parameters"]["pipeline"] for d in prefect_yaml["deployments"]}
    assert referenced <= shipped


# ---------------------------------------------------------------------------------------- READMEs


@pytest.mark.parametrize("readme", [INFRA / "README.md", ROOT / "examples" / "README.md"],
                         ids=["infra", "examples"])
def test_readme_mentions_only_files_that_exist(readme: Path) -> None:
    for path in set(re.findall(r"\b((?:infra|examples)/[\w./-]*\w)", readme.read_text())):
        if path == "infra/.env":  # created by the reader from .env.example
            continue
        assert (ROOT / path).exists(), f"{readme.relative_to(ROOT)} mentions {path}, which does not exist"


# ---------------------------------------------------------------------------------------- examples


def run_example(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {key: value for key, value in os.environ.items()
                   if key not in {"MLFLOW_TRACKING_URI", "FULLTUNE_WORKDIR"}}
    environment.update(env or {})
    return subprocess.run([sys.executable, str(LOAD_CHAMPION), *args], cwd=cwd, env=environment,
                          capture_output=True, text=True, timeout=600)


def test_load_champion_compiles_and_explains_itself(tmp_path: Path) -> None:
    py_compile.compile(str(LOAD_CHAMPION), cfile=str(tmp_path / "load_champion.pyc"), doraise=True)
    result = run_example("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for option in ("--model", "--prompt", "--tracking-uri", "--max-new-tokens", "--alias"):
        assert option in result.stdout


def test_load_champion_without_a_store_says_what_to_pass(tmp_path: Path) -> None:
    result = run_example("--model", "fulltune-demo", "--prompt", "1+1=", cwd=tmp_path)
    assert result.returncode == 2
    assert "--tracking-uri" in result.stderr and "MLFLOW_TRACKING_URI" in result.stderr
    assert not (tmp_path / ".fulltune").exists(), "it must not create an empty store"


@pytest.mark.slow
def test_load_champion_generates_with_the_champion_in_a_fresh_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import mlflow
    import mlflow.tracking._model_registry.utils
    import mlflow.tracking._tracking_service.utils
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, pipeline

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(["12+35=47", "20+22=42", "11+11=22"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", eos_token="<eos>",
                                        pad_token="<eos>")
    torch.manual_seed(0)  # a fixed random model: its greedy continuation is the same every run
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None))

    store = tmp_path / ".fulltune"
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    # MLflow keeps both URIs in module globals; patching them (restored after the test) keeps this
    # store out of other tests, whatever they set before.
    monkeypatch.setattr(mlflow.tracking._tracking_service.utils, "_tracking_uri", uri)
    monkeypatch.setattr(mlflow.tracking._model_registry.utils, "_registry_uri", uri)
    experiment = mlflow.create_experiment("load-champion", artifact_location=(store / "mlartifacts").as_uri())
    with mlflow.start_run(experiment_id=experiment):
        mlflow.transformers.log_model(
            pipeline("text-generation", model=model, tokenizer=tokenizer), name="model",
            registered_model_name="tiny-lm", pip_requirements=["torch", "transformers"])
    mlflow.MlflowClient().set_registered_model_alias("tiny-lm", "champion", "1")

    # No --tracking-uri: the script falls back to fulltune's local store under the current directory.
    result = run_example("--model", "tiny-lm", "--prompt", "12+35=", "--max-new-tokens", "4",
                         cwd=tmp_path, env={"HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, result.stderr
    # The whole stdout is the generation: the prompt, then what the random model added (any bytes,
    # newlines included, hence no splitting into lines).
    assert result.stdout.startswith("12+35=") and len(result.stdout.rstrip("\n")) > len("12+35=")
    assert "version 1" in result.stderr

    missing = run_example("--model", "tiny-lm", "--alias", "no-such-alias", "--prompt", "1", cwd=tmp_path)
    assert missing.returncode == 2 and "no-such-alias" in missing.stderr
