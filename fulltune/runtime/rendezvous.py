"""Several machines, one training run: torchrun's c10d rendezvous, configured from the environment.

Every machine (a pod of a Kubernetes indexed Job, or a host) runs one torchrun agent; the agents meet
at a TCP store on machine 0 and number the processes 0 … N·G-1. The number of machines N and the
processes per machine G come from the pipeline (`distributed.num_machines`, `num_processes`); what each
machine needs from its environment:

    FULLTUNE_RDZV_ENDPOINT  host[:port] of machine 0 that every machine reaches (port 29400 when
                            omitted); in the Kubernetes work pool `<job>-0.<headless service>:29400`.
                            Unset: no rendezvous (one machine, or the MASTER_ADDR launch by hand).
    FULLTUNE_NODE_RANK      this machine's index 0 … N-1; an indexed Job's JOB_COMPLETION_INDEX also works
    FULLTUNE_RDZV_ID        the run's id, the same everywhere (default: PREFECT__FLOW_RUN_ID, which the
                            Prefect worker gives every pod of the flow run's Job)
    FULLTUNE_RDZV_DIR       a directory every machine mounts (beside the shared workdir): machine 0
                            publishes there which job the others start (`publish_launch` / `follow`)

Machine 0 runs the Prefect flow; when the flow reaches training, `launch_command` publishes the job file
and returns machine 0's torchrun command. Every pod runs `python -m fulltune.runtime.rendezvous pod -- <the
flow-run command>`: on machine 0 that runs the flow and then tells the others it ended; on the other
machines it waits for each published launch, runs the same torchrun with its own rank, and leaves when
machine 0's flow has ended.

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint job-0.fulltune-rdzv:29400
             --rdzv-id <flow run> --rdzv-conf is_host=1 --max-restarts 0 --module fulltune.runtime.train JOB.json

`is_host` is set explicitly (1 on machine 0, 0 elsewhere) rather than guessed from the host name, so two
agents on one host (the CI test) or a service name that differs from the pod's host name both work.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from fulltune.errors import ConfigError
from fulltune.storage import atomic_write_text

DEFAULT_PORT = 29400
FINISHED_FILE = "finished.json"


@dataclass(frozen=True)
class Rendezvous:
    """Where and as whom this machine joins a multi-machine run."""

    endpoint: str  # host:port
    node_rank: int
    run_id: str
    directory: Path | None = None  # FULLTUNE_RDZV_DIR/<run_id>: the launch hand-off, on shared storage

    @classmethod
    def from_environment(cls, env: Mapping[str, str] | None = None) -> Rendezvous | None:
        """The rendezvous the environment describes, or None when FULLTUNE_RDZV_ENDPOINT is unset.

        Raises:
            ConfigError: a malformed endpoint or node rank.
        """
        env = os.environ if env is None else env
        endpoint = env.get("FULLTUNE_RDZV_ENDPOINT", "").strip()
        if not endpoint:
            return None
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", str(DEFAULT_PORT))
        if not host or not port.isdigit():
            raise ConfigError(f"FULLTUNE_RDZV_ENDPOINT={endpoint!r} is not host[:port]")
        rank_name = "FULLTUNE_NODE_RANK" if env.get("FULLTUNE_NODE_RANK") else "JOB_COMPLETION_INDEX"
        node_rank = _int(env, rank_name, "0")
        if node_rank < 0:
            raise ConfigError(f"{rank_name}={node_rank} must be >= 0")
        run_id = env.get("FULLTUNE_RDZV_ID") or env.get("PREFECT__FLOW_RUN_ID") or "fulltune"
        root = env.get("FULLTUNE_RDZV_DIR")
        return cls(f"{host}:{port}", node_rank, run_id, Path(root) / run_id if root else None)

    def torchrun_args(self, nnodes: int, nproc_per_node: int) -> list[str]:
        """torchrun's options for this machine (before the script or `--module`)."""
        if not 0 <= self.node_rank < nnodes:
            raise ConfigError(f"node rank {self.node_rank} is outside 0 … {nnodes - 1} (num_machines {nnodes})")
        return ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
                "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id,
                "--rdzv-conf", f"is_host={1 if self.node_rank == 0 else 0}", "--max-restarts", "0"]

    def training_command(self, job_file: str | Path, nnodes: int, nproc_per_node: int) -> list[str]:
        """The command that runs this machine's share of `python -m fulltune.runtime.train JOB.json`."""
        return [sys.executable, "-m", "torch.distributed.run", *self.torchrun_args(nnodes, nproc_per_node),
                "--module", "fulltune.runtime.train", str(job_file)]

    def publish_launch(self, job_file: str | Path, nnodes: int, nproc_per_node: int) -> Path:
        """Machine 0: tell the waiting machines to start `job_file` (a new file per launch: a retry
        after an out-of-memory re-plan is a second launch). Returns the file written."""
        directory = self._require_directory()
        directory.mkdir(parents=True, exist_ok=True)
        number = len(list(directory.glob("launch-*.json")))
        path = directory / f"launch-{number:04d}.json"
        atomic_write_text(path, json.dumps({"job_file": str(Path(job_file).resolve()), "nnodes": nnodes,
                                            "nproc_per_node": nproc_per_node}))
        return path

    def finish(self, code: int) -> None:
        """Machine 0: the flow ended; the waiting machines may leave."""
        directory = self._require_directory()
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / FINISHED_FILE, json.dumps({"exit_code": code}))

    def follow(self, poll_seconds: float = 2.0) -> int:
        """Machines 1 … N-1: run every launch machine 0 publishes until it finishes; returns the exit
        code of the last training run (0 when there was none)."""
        directory = self._require_directory()
        done, code = 0, 0
        while True:
            # The marker is read before the launches: machine 0 writes its last launch before the marker.
            finished = (directory / FINISHED_FILE).is_file()
            launches = sorted(directory.glob("launch-*.json")) if directory.is_dir() else []
            for path in launches[done:]:
                launch = json.loads(path.read_text())
                command = self.training_command(launch["job_file"], launch["nnodes"], launch["nproc_per_node"])
                print(f"fulltune rendezvous: node {self.node_rank} runs {' '.join(command)}", file=sys.stderr,
                      flush=True)
                code = subprocess.call(command)
                done += 1
            if finished:
                return code
            time.sleep(poll_seconds)

    def _require_directory(self) -> Path:
        if self.directory is None:
            raise ConfigError("a multi-machine run needs FULLTUNE_RDZV_DIR: a directory every machine mounts")
        return self.directory


def _int(env: Mapping[str, str], name: str, default: str) -> int:
    value = env.get(name) or default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not an integer") from None


def launch_command(job_file: str | Path, num_processes: int, num_machines: int,
                   env: Mapping[str, str] | None = None) -> list[str] | None:
    """For fulltune.runtime.launch: this machine's torchrun command for a `num_machines` job, after publishing
    the launch to the other machines; None for one machine or without FULLTUNE_RDZV_ENDPOINT.

    Raises:
        ConfigError: `num_processes` does not split evenly, or FULLTUNE_RDZV_DIR / the rank is wrong.
    """
    rendezvous = Rendezvous.from_environment(env)
    if rendezvous is None or num_machines == 1:
        return None
    if num_processes % num_machines:
        raise ConfigError(f"distributed.num_processes ({num_processes}) must be a multiple of num_machines "
                          f"({num_machines})")
    nproc = num_processes // num_machines
    command = rendezvous.training_command(job_file, num_machines, nproc)
    if rendezvous.node_rank == 0:
        rendezvous.publish_launch(job_file, num_machines, nproc)
    return command


def pod_main(command: list[str], env: Mapping[str, str] | None = None) -> int:
    """The entrypoint of every pod: machine 0 (and any single-machine run) runs `command` (the flow
    run) and then releases the others; machines 1 … N-1 follow machine 0's launches."""
    rendezvous = Rendezvous.from_environment(env)
    if rendezvous is not None and rendezvous.node_rank > 0:
        return rendezvous.follow()
    if not command:
        print("usage: python -m fulltune.runtime.rendezvous pod -- COMMAND...", file=sys.stderr)
        return 2
    code = subprocess.call(command)
    if rendezvous is not None and rendezvous.directory is not None:
        with contextlib.suppress(OSError):  # a single-machine pod has nobody waiting
            rendezvous.finish(code)
    return code


def main(argv: list[str] | None = None) -> int:
    """`python -m fulltune.runtime.rendezvous pod -- COMMAND...` (see the module docstring)."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] != "pod":
        print("usage: python -m fulltune.runtime.rendezvous pod -- COMMAND...", file=sys.stderr)
        return 2
    command = args[1:]
    if command[:1] == ["--"]:
        command = command[1:]
    try:
        return pod_main(command)
    except ConfigError as exc:
        print(f"fulltune rendezvous: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
