"""Each process's measured step peak beside the plan's estimate for that process: in result.json, the log and
the fine-tune stage's metrics, so that a run shows per rank (a pipeline stage, an FSDP or tensor-parallel
shard) how far its plan was from what it used.

- CUDA: `torch.cuda.max_memory_allocated` from the run's first optimizer step on (its peak statistics are
  reset before it; the checkpoints between steps are included), every run.
- CPU: torch's MemTracker over the real tensors of each step (the model and optimizer registered before it),
  only when `FULLTUNE_TRACK_MEMORY=1`: it intercepts every operation in Python, so it is for checking a plan
  on CPU (the tests do it through `fulltune run`), not for real runs. Otherwise a CPU run measures nothing.

The estimate is `fulltune.memory.estimate.rank_peak_bytes`: the tensors at the peak of that rank's step
(`MemoryEstimate.peak_bytes`, without the runtime overhead the plan adds for the device as a whole).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import asdict, dataclass
from typing import Any, Iterator

import torch

TRACK_ENV = "FULLTUNE_TRACK_MEMORY"


def peak_tracker() -> Any:
    """MemTracker without its per-module statistics: a pipeline stage's forward runs once per micro-batch,
    interleaved with backwards, which its module bookkeeping refuses; the global peak is all that is read."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, *args: Any, **kwargs: Any) -> None:
            pass

        def _post_fw_hook(self, *args: Any, **kwargs: Any) -> None:
            pass

        def _pre_bw_hook(self, *args: Any, **kwargs: Any) -> None:
            pass

        def _post_bw_hook(self, *args: Any, **kwargs: Any) -> None:
            pass

    return PeakTracker()


def state_holders(optimizer: Any) -> list[Any]:
    """The optimizer (inside accelerate's wrapper) and, for the lever wrappers, the inner ones that hold the
    states: what a MemTracker registers so that states which exist before it is entered are counted."""
    optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer
    return [optimizer, *getattr(optimizer, "inner_optimizers", lambda: [])()]


def tracked_peak_bytes(tracker: Any) -> int:
    """The largest total any device reached while `tracker` was entered (MemTracker keeps no public getter)."""
    return int(max(tracker._peak_mem.values(), default=0))


@dataclass(frozen=True)
class RankPeak:
    """One process's step peak against its estimate (bytes)."""

    rank: int
    stage: int
    measured_bytes: int
    estimated_bytes: int

    @property
    def error(self) -> float:
        """The estimate's relative error: + when it is above the measurement."""
        return self.estimated_bytes / self.measured_bytes - 1


class StepMemory:
    """Measures this process's step peak, step by step (`step`), on `device` ("cuda" or "cpu")."""

    def __init__(self, device: str, model: torch.nn.Module, optimizer: Any) -> None:
        self.device, self.model, self.optimizer = device, model, optimizer
        self.tracking = device == "cuda" or os.environ.get(TRACK_ENV) == "1"
        self.peak: int | None = None
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """One optimizer step, measured when this run measures."""
        if not self.tracking or self.device == "cuda":
            yield
            if self.tracking:
                self.peak = int(torch.cuda.max_memory_allocated())
            return
        tracker = peak_tracker()
        # Registered each step: a resumed run's states were loaded outside any step, and a tracker sees only
        # what was registered with it or allocated while it was entered.
        tracker.track_external(self.model, *state_holders(self.optimizer))
        with tracker:
            yield
        self.peak = max(self.peak or 0, tracked_peak_bytes(tracker))

    def gathered(self) -> list[int] | None:
        """Every process's peak in rank order (a collective: every process calls it), None when not measured."""
        if not self.tracking or self.peak is None:
            return None
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return [self.peak]
        peaks: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peaks, self.peak)
        return [int(p) for p in peaks]


def rank_peaks(measured: list[int], config: Any, settings: Any) -> list[RankPeak]:
    """Each rank's measured peak beside `rank_peak_bytes`' estimate for it under the plan's `settings`; none when
    the memory model cannot estimate this model (a report after training must not fail the run)."""
    from fulltune.memory.errors import MemoryConfigError
    from fulltune.memory.estimate import rank_peak_bytes

    dims = settings.dims
    try:
        return [RankPeak(rank, dims.stage(rank), peak, rank_peak_bytes(config, settings, rank))
                for rank, peak in enumerate(measured) if peak > 0]
    except (MemoryConfigError, ValueError):
        return []


def describe(peaks: list[RankPeak]) -> str:
    """One line for the log: each rank's peak, its estimate and the estimate's error."""
    from fulltune.memory.units import format_bytes

    staged = any(p.stage for p in peaks)
    parts = [f"rank {p.rank}{f' (stage {p.stage})' if staged else ''} {format_bytes(p.measured_bytes)}, "
             f"estimated {format_bytes(p.estimated_bytes)} ({p.error:+.1%})" for p in peaks]
    return "step peak per process: " + "; ".join(parts)


def as_dicts(peaks: list[RankPeak]) -> list[dict[str, Any]]:
    """result.json's `rank_peaks`."""
    return [{**asdict(p), "error": round(p.error, 6)} for p in peaks]
