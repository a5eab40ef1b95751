"""The one torchrun driver of the multi-process benchmarks (and of the tests that run their cases).

A driver calls `torchrun_ranks("benchmarks.<name>", case, processes)`: torchrun starts `processes` ranks of
`python -m benchmarks.<name> --worker CASE --out FILE` from the repository root, so every rank imports this
checkout's `fulltune` and `benchmarks`, with one OpenMP thread each (gloo, CPU). Each rank measures and ends
with `send_to_driver(result, out)`: the results are all-gathered and rank 0 writes them, in rank order, to
the file the driver reads back. A benchmark's parser takes the worker's two options from `add_worker_arguments`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 900  # a whole torchrun; a hung collective ends there instead of holding the machine


def add_worker_arguments(parser: argparse.ArgumentParser, cases: Sequence[str] | None = None) -> None:
    """`--worker CASE` and `--out FILE`, the options `torchrun_ranks` starts every rank with (hidden from --help)."""
    parser.add_argument("--worker", choices=cases, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def send_to_driver(measured: dict, out: Path) -> None:
    """Every rank's `measured`, written to `out` by rank 0 (in rank order); ends the process group."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, measured)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(gathered))
    dist.destroy_process_group()


def torchrun_ranks(module: str, case: str, processes: int, *options: str, timeout_s: float = TIMEOUT_S) -> list[dict]:
    """`python -m module --worker case --out FILE *options` in `processes` torchrun ranks: what every rank sent
    (`send_to_driver`), in rank order. Raises RuntimeError with torchrun's output when no result came back,
    subprocess.TimeoutExpired past `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="fulltune-ranks-") as tmp:
        out = Path(tmp) / "ranks.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
                   "--module", module, "--worker", case, "--out", str(out), *options]
        returncode, output = _run(command, timeout_s)
        if returncode != 0 and not out.exists():
            # gloo sometimes aborts a rank at exit on this VM ("terminate called without an active
            # exception") before the result is written: one more try.
            returncode, output = _run(command, timeout_s)
        if not out.exists():
            raise RuntimeError(f"{module} {case}: torchrun exited {returncode}\n{output[-6000:]}")
        return json.loads(out.read_text())


def _run(command: list[str], timeout_s: float) -> tuple[int, str]:
    """(exit status, stdout + stderr) of `command` run from the repository root. Past `timeout_s`, torchrun
    gets SIGTERM (it stops its ranks before it exits) and subprocess.TimeoutExpired is raised: no second try."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    with subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as process:
        try:
            output, _ = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.terminate()
            process.communicate()
            raise
    return process.returncode, output
