"""The torchrun driver of the multi-process benchmarks' own workers.

A driver calls `torchrun_ranks("benchmarks.<name>", case, processes)`: torchrun starts `processes` ranks of
`python -m benchmarks.<name> --worker CASE --out FILE` from the repository root, so every rank imports this
checkout's `fulltune` and `benchmarks`, with one OpenMP thread each (gloo, CPU). Each rank measures and ends
with `send_to_driver(result, out)`: the results are all-gathered and rank 0 writes them, in rank order, to
the file the driver reads back. A benchmark's parser takes the worker's two options from `add_worker_arguments`.
Both ends are the measuring harness's (`measuring.measure`), which also runs the ranks of
`measuring.rank_memory` (FSDP, tensor-parallel and pipeline ranks under torch's memory trackers).
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path

from measuring.measure import TORCHRUN_TIMEOUT_S, send_to_driver, torchrun_results  # noqa: F401 (send_to_driver)


def add_worker_arguments(parser: argparse.ArgumentParser, cases: Sequence[str] | None = None) -> None:
    """`--worker CASE` and `--out FILE`, the options `torchrun_ranks` starts every rank with (hidden from --help)."""
    parser.add_argument("--worker", choices=cases, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)


def torchrun_ranks(module: str, case: str, processes: int, *options: str,
                   timeout_s: float = TORCHRUN_TIMEOUT_S) -> list[dict]:
    """`python -m module --worker case --out FILE *options` in `processes` torchrun ranks: what every rank sent
    (`send_to_driver`), in rank order. Raises RuntimeError with torchrun's output when no result came back,
    subprocess.TimeoutExpired past `timeout_s`."""
    with tempfile.TemporaryDirectory(prefix="fulltune-ranks-") as tmp:
        out = Path(tmp) / "ranks.json"
        return torchrun_results(["--module", module, "--worker", case, "--out", str(out), *options], processes, out,
                                timeout_s=timeout_s, what=f"{module} {case}")
