"""The host allocator of a CPU training process: large blocks go back to the system when freed.

glibc's malloc serves a request of at least `M_MMAP_THRESHOLD` bytes with its own mapping, which `free`
unmaps; smaller requests come from the heap, whose freed chunks stay resident for reuse. By default the
threshold is dynamic: each mapped block freed raises it to that block's size (up to 32 MiB). Loading a
checkpoint frees a few weight-sized blocks, so from then on every activation, gradient and optimizer
temporary of a training step comes from the heap, and the heap fragments: on a 76M-parameter Llama with
pure bf16, Adafactor stepped in backward and 11 of 12 layers checkpointed, the step's live allocations
peak 66 MiB above the weights while the heap keeps 420 MiB more resident after it
(benchmarks/process_memory.py). A fixed threshold turns the dynamic one off: tensors of 1 MiB or more are
mapped and unmapped as they come and go, so resident memory follows the live tensors the memory model
counts, at no step time measurable on that case.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt's parameter number for the mmap threshold (glibc malloc.h).
M_MMAP_THRESHOLD = -3
# Requests of this size or more get their own mapping: the step's tensors, not Python's small objects.
MMAP_THRESHOLD_BYTES = 1 << 20


def return_large_blocks(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process; False where malloc is not glibc's
    (the call then does nothing)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
