"""Packed rows' attention on CPU: transformers' masked SDPA against fulltune's document attention, kernel alone.

8 packed rows of Zipf-length documents (3 + Zipf(1.6) words of prompt and of completion, ~1.4 tokens a word, next
fit into rows, the rest of a row one padding document, as `fulltune.data.collate` pads them), 4 heads of 64 (and
GQA, 8 query heads over 2 key/value heads), fp32, one thread: forward and backward of

- `masked`: F.scaled_dot_product_attention with the (b, 1, s, s) boolean block-causal mask transformers builds
  from the position_ids (its packed-row path, key/value heads repeated as transformers repeats them with a mask);
- `documents`: `fulltune.attention.document_attention` (the CPU kernel: documents regrouped by length), at several
  `GROUP_RATIO`s (how much longer than the shortest the longest document of one SDPA call may be);

checked against each other (outputs and gradients), timed interleaved (median of `--repeats`, CPU time).

Usage:
    python -m benchmarks.document_attention                 # rows of 256 and 2,048 positions (~2 min)
    python -m benchmarks.document_attention --lengths 256
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from fulltune import attention
from fulltune.attention import GROUP_RATIO, Documents, document_attention

RATIOS = (1.1, 1.2, 1.5, 2.0)


def packed_rows(length: int, rows: int, seed: int = 0) -> list[list[int]]:
    """Each row's document lengths: Zipf-length examples packed next fit, the rest of a row one padding document."""
    rng = np.random.default_rng(seed)
    out, current = [], []
    while len(out) < rows:
        words = min(length // 4, 3 + rng.zipf(1.6)) + min(length // 4, 3 + rng.zipf(1.6))
        n = int(min(length // 2, words * 1.4 + 3))
        if sum(current) + n > length:
            out.append(current + ([length - sum(current)] if sum(current) < length else []))
            current = []
        current.append(n)
    return out


def masked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: list[list[int]]) -> torch.Tensor:
    """transformers' packed-row path: a boolean (b, 1, s, s) block-causal mask, k/v heads repeated."""
    s = query.shape[2]
    document = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in rows])
    position = torch.arange(s)
    mask = (document[:, :, None] == document[:, None, :]) & (position[:, None] >= position[None, :])
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask[:, None])
    return out.transpose(1, 2).contiguous()


def documents(ratio: float, rows: list[list[int]]):  # noqa: ANN201
    """The document kernel at GROUP_RATIO `ratio`, given a new `Documents` each call: its groups are made (and
    timed) as the trainer makes them, once per micro-batch."""
    def run(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, _rows: list[list[int]]) -> torch.Tensor:
        attention.GROUP_RATIO = ratio
        return document_attention(query, key, value, Documents(tuple(map(tuple, rows))))
    return run


def calls(ratio: float, rows: list[list[int]]) -> int:
    """SDPA calls (document groups) per layer of the document kernel at GROUP_RATIO `ratio`."""
    attention.GROUP_RATIO = ratio
    return len(Documents(tuple(map(tuple, rows))).groups("cpu"))


def measure(length: int, heads: int, kv_heads: int, repeats: int) -> list[tuple[str, float, int]]:
    """(kernel, median CPU seconds of forward + backward, SDPA calls) for 8 packed rows of `length` positions."""
    rows = packed_rows(length, 8)
    torch.manual_seed(0)
    query = torch.randn(8, heads, length, 64)
    key, value = (torch.randn(8, kv_heads, length, 64) for _ in range(2))
    upstream = torch.randn(8, length, heads, 64)
    kernels = {"masked": masked, **{f"documents, GROUP_RATIO {r}": documents(r, rows) for r in RATIOS}}
    reference = None
    for kernel in kernels.values():
        q, k, v = (x.clone().requires_grad_() for x in (query, key, value))
        out = kernel(q, k, v, rows)
        grads = torch.autograd.grad((out * upstream).sum(), (q, k, v))
        if reference is None:
            reference = (out.detach(), grads)
            continue
        torch.testing.assert_close(out, reference[0], rtol=1e-4, atol=1e-5)
        for got, want in zip(grads, reference[1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(repeats):
        for name, kernel in kernels.items():
            q, k, v = (x.clone().requires_grad_() for x in (query, key, value))
            started = time.process_time()
            out = kernel(q, k, v, rows)
            torch.autograd.grad((out * upstream).sum(), (q, k, v))
            times[name].append(time.process_time() - started)
    counts = {"masked": 1, **{f"documents, GROUP_RATIO {r}": calls(r, rows) for r in RATIOS}}
    attention.GROUP_RATIO = GROUP_RATIO
    return [(name, statistics.median(values), counts[name]) for name, values in times.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[256, 2048])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| positions per row | heads (q / kv) | kernel | SDPA calls | forward + backward (median CPU ms) | × masked |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        for heads, kv_heads in ((4, 4), (8, 2)):
            rows = measure(length, heads, kv_heads, args.repeats)
            base = rows[0][1]
            for name, seconds, count in rows:
                print(f"| {length} | {heads} / {kv_heads} | {name} | {count} | {seconds * 1e3:.1f} | "
                      f"{base / seconds:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
