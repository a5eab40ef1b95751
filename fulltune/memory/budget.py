"""The memory budget of a run, resolved once on the machine that runs it.

`budget:` in the YAML says `device: auto`, `memory: auto`, `host_memory: auto` or a size; what those mean
depends on the machine (is a GPU visible, how large is it, how much RAM is there). `resolve_budget` turns
them into numbers once, into a `Budget` that the resolved pipeline carries to every stage: the plan, the
cache key of the budget stage and an OOM replan all read the same value.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from fulltune.memory.errors import MemoryConfigError
from fulltune.memory.units import format_bytes, parse_bytes

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def usable_bytes(budget_bytes: int, headroom: float) -> int:
    """The part of a budget the planner may fill: `budget × (1 − headroom)`, the rest kept free for what no
    estimate sees (fragmentation, other processes). The one place this is computed."""
    return int(budget_bytes * (1.0 - headroom))


@dataclass(frozen=True)
class Budget:
    """`budget:` resolved on this machine.

    Attributes:
        device: `cpu` or `cuda` (`auto` resolved: cuda when a GPU is visible).
        bytes: memory per device (`auto` resolved: the GPU's total memory, or on CPU each process's share of the
            physical RAM or the cgroup limit when lower: the processes of one machine share its RAM).
        headroom: the fraction of `bytes` kept free.
        host_bytes: host RAM the offload levers may use (`budget.host_memory`; `auto`: this machine's RAM).
        bf16_supported: the device computes in bf16 (CPU autocast always can; slower without bf16 matrix
            units, which the step-time model knows).
        capability: the GPU's CUDA compute capability (major, minor), what a lever's `auto` may read of the
            hardware (fulltune/levers.py `Condition`); None on a CPU or where no GPU is visible.
        host_assumed: what `host_memory: auto` was taken to mean when it cannot mean the RAM of the machine that
            runs the plan (`device: cuda` planned on a machine without a GPU), and how to say it instead; None
            when `host_bytes` is this machine's and this machine runs it, or was given.
        shared: how `memory: auto` on CPU was shared by the processes of one machine (a line the plan shows);
            None for one process, a GPU, or a size given.
    """

    device: str
    bytes: int
    headroom: float = 0.05
    host_bytes: int | None = None
    bf16_supported: bool = True
    host_assumed: str | None = None
    shared: str | None = None
    capability: tuple[int, int] | None = None

    @property
    def usable_bytes(self) -> int:
        """What the plan may fill: bytes × (1 − headroom)."""
        return usable_bytes(self.bytes, self.headroom)


def resolve_budget(device: str = "auto", memory: int | str = "auto", headroom: float = 0.05,
                   host_memory: int | str = "auto", where: str = "budget", processes: int = 1) -> Budget:
    """The `Budget` that `budget.device` / `memory` / `headroom` / `host_memory` mean on this machine.

    `where` is the YAML path of the budget section (e.g. `pipelines.demo.budget`); errors name its field.
    `processes` is how many training processes one machine runs: on CPU they share its RAM, so `memory: auto`
    gives each an equal share (a GPU is each process's own; a size given is per process already).

    Raises:
        MemoryConfigError (a ConfigError: exit 2), naming `<where>.device`, `<where>.memory` or
            `<where>.host_memory`: an unknown device, an unreadable size, or `memory: auto` for cuda on a
            machine without a GPU.
    """
    if device not in DEVICE_CHOICES:
        raise MemoryConfigError(f"{where}.device: must be auto, cpu or cuda; got {device!r}")
    has_cuda = device != "cpu" and _gpu_visible()
    shared = None
    resolved = ("cuda" if has_cuda else "cpu") if device == "auto" else device
    # CPU autocast supports bf16 (slower without bf16 matrix units: the planner's step time knows).
    bf16 = bool(_torch().cuda.is_bf16_supported()) if resolved == "cuda" and has_cuda else True
    capability = tuple(_torch().cuda.get_device_capability(0)) if resolved == "cuda" and has_cuda else None
    if memory == "auto":
        if resolved == "cuda" and not has_cuda:
            raise MemoryConfigError(
                f"{where}.memory: auto needs a visible GPU to read its size, and none is visible here "
                f"({where}.device is cuda). Give the per-GPU memory, e.g. {where.rsplit('.', 1)[-1]}.memory: 80GiB"
            )
        total = int(_torch().cuda.get_device_properties(0).total_memory) if resolved == "cuda" else host_ram()
        if resolved == "cpu" and processes > 1:
            shared = (f"{where}.memory is auto on cpu: this machine's {format_bytes(total)} of RAM shared by its "
                      f"{processes} processes, {format_bytes(total // processes)} each")
            total //= processes
    else:
        total = _parse(memory, f"{where}.memory")
    host = host_ram() if host_memory == "auto" else _parse(host_memory, f"{where}.host_memory")
    assumed = None
    if host_memory == "auto" and resolved == "cuda" and not has_cuda:
        assumed = (f"{where}.host_memory is auto and this machine has no GPU: the plan assumed the GPU machine has "
                   f"this machine's RAM ({format_bytes(host)}); set {where.rsplit('.', 1)[-1]}.host_memory to the RAM "
                   "of the machine that trains (e.g. host_memory: 512GiB)")
    if not 0.0 <= headroom < 1.0:
        raise MemoryConfigError(f"{where}.headroom: must be in [0, 1); got {headroom}")
    return Budget(resolved, total, headroom, host, bf16, assumed, shared, capability=capability)


def _torch():  # noqa: ANN202 - the torch module
    import torch

    return torch


def _gpu_visible() -> bool:
    """`torch.cuda.is_available()`, without importing torch (seconds of every CLI start) on a Linux machine
    that has no GPU device node at all: NVIDIA's /dev/nvidiaN, ROCm's /dev/kfd, WSL's /dev/dxg."""
    import glob
    import sys

    if sys.platform.startswith("linux") and not (glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd")
                                                 or os.path.exists("/dev/dxg")):
        return False
    return bool(_torch().cuda.is_available())


def _parse(value: int | str, field: str) -> int:
    try:
        return parse_bytes(value)
    except MemoryConfigError as exc:
        raise MemoryConfigError(f"{field}: {exc}") from None


def host_ram() -> int:
    """This machine's RAM: physical memory, or the cgroup's limit when that is lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = open(path).read().strip()
        except OSError:
            continue
        if text.isdigit() and 0 < int(text) < total:
            total = int(text)
    return int(total)
