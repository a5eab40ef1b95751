"""What a process holds on its device beyond the tensors the memory model counts: the CUDA context and the
caching allocator's slack on a GPU, the interpreter and its libraries on a CPU (where host RAM is the device).
Added to every phase of the training process (`fulltune/memory/process.py`) and of the evaluate stage
(`fulltune/memory/evaluation.py`)."""

from __future__ import annotations

from fulltune.memory.activations import compute_bytes
from fulltune.memory.fsdp import activation_settings
from fulltune.memory.process import CPU_LIBRARY_PAGES_SPREAD, CPU_LOAD_PROCESS_BYTES, LOAD
from fulltune.memory.shapes import ModelShape
from fulltune.memory.types import Settings

# CUDA context + cuBLAS workspace on a recent GPU with lazy module loading (torch 2.x): ~0.5 GiB.
CUDA_CONTEXT_BYTES = 600 * 2**20
# The caching allocator reserves more than it hands out; 8% of the peak is typical for training
# steps with varying activation sizes (torch.cuda.memory_reserved vs max_memory_allocated).
CUDA_ALLOCATOR_SLACK = 0.08
# A CPU training process, measured (benchmarks/cpu_rss.py and benchmarks/process_memory.py: peak RSS of real
# runs, MLflow on, one OpenMP thread, 0.02M-124M parameters, with the trainer's allocator setting,
# runtime/allocator.py): 590-635 MiB beside the step's tensors (interpreter, torch, transformers, accelerate,
# MLflow, the accelerator, tokenizer and rows, kernels' workspaces), and what the heap keeps of freed
# tensors below the mmap threshold: a few % of the tensor peak. Computing in bf16 with the optimizer
# stepped in backward, the process holds about one more bf16 copy of the weights than its tensors (76M
# Llama: +94 MiB with pure bf16, +136 MiB under autocast; without the step in backward, bf16 runs show
# none: a 124M GPT-2 and a 7M Llama under autocast). With these constants the estimate is 3-9% above
# every measured peak (11 configurations; BENCHMARKS.md).
# The file-backed part of that (torch's and transformers' shared libraries) is not fixed: the same libraries
# map ~110 MiB more resident pages when their files sit in the page cache as freshly written (large folios:
# libtorch_cpu.so alone 93 MiB against 48 MiB, measured in /proc/self/smaps of `import torch` in a just-built
# virtual environment and in an older one). A new installation is the common case (CI, containers), so the
# constant holds it (128 MiB with a margin); an older one measures up to that much less (CPU_LIBRARY_PAGES_SPREAD,
# memory/process.py).
# The trainer imports neither MLflow nor matplotlib (the launcher forwards its metrics: runtime/run_tracking.py):
# 104-107 MiB less at the peak than with them (benchmarks/process_memory.py, 6.5M Llama fp32, 764 -> 657 MiB), so
# its constant is 96 MiB below the 656 MiB measured with MLflow. The evaluate stage's process still imports MLflow
# and Prefect, and keeps the measured 656 MiB (CPU_EVAL_PROCESS_BYTES).
CPU_PROCESS_BYTES = 560 * 2**20 + CPU_LIBRARY_PAGES_SPREAD
CPU_EVAL_PROCESS_BYTES = 656 * 2**20 + CPU_LIBRARY_PAGES_SPREAD
CPU_ALLOCATOR_SLACK = 0.03
CPU_16BIT_IN_BACKWARD_BYTES = 2  # per parameter: 16-bit compute with the optimizer stepped in backward


def training_overhead(settings: Settings, peak: int, phase: str, shape: ModelShape) -> int:
    """What the device needs beyond `peak` tensor bytes in `phase`: the CUDA context and allocator slack,
    or on CPU the process itself (a CPU process loading its model holds less than a training one)."""
    if settings.device == "cuda":
        return int(CUDA_CONTEXT_BYTES + CUDA_ALLOCATOR_SLACK * peak)
    if phase == LOAD:
        return CPU_LOAD_PROCESS_BYTES
    sixteen_bit = compute_bytes(activation_settings(settings)) == 2
    converted = CPU_16BIT_IN_BACKWARD_BYTES * shape.num_params if sixteen_bit and settings.optimizer_in_backward else 0
    return int(CPU_PROCESS_BYTES + CPU_ALLOCATOR_SLACK * peak + converted)


def evaluation_overhead(device: str, tensors: int) -> int:
    """The device memory beside the evaluate stage's tensors: the CUDA context and allocator slack, or the CPU
    process itself (measured with the libraries the evaluate stage's process imports: MLflow and Prefect beside
    torch)."""
    if device == "cuda":
        return int(CUDA_CONTEXT_BYTES + CUDA_ALLOCATOR_SLACK * tensors)
    return int(CPU_EVAL_PROCESS_BYTES + CPU_ALLOCATOR_SLACK * tensors)
