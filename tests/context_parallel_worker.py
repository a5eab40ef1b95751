"""Context parallel against one process, for tests/test_context_parallel.py and benchmarks/device_check.py.

    torchrun --standalone --nproc_per_node 2 tests/context_parallel_worker.py OUT.json          # CPU, gloo: Ulysses
    torchrun --standalone --nproc_per_node 2 tests/context_parallel_worker.py OUT.json --cuda   # NCCL: Ulysses, ring

Each case builds the same `from_config` Llama (seed 0) twice in every process: once as one process trains it
(whole rows), once split over the 2 processes (`ContextParallel`: its attention installed, each micro-batch's share
of the rows' positions and targets). Both take a forward and backward of the same micro-batch through the trainer's
loss head (`TargetHead.loss_sum`); the group's summed loss and gradients are compared with the one process's.
Rank 0 writes {case: {"loss": relative difference, "grads": the largest relative difference of a parameter's
gradient}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (attention, packed rows, key/value heads, row length): sdpa's causal kernel and its masked path (packed rows:
# documents attend alone through the whole rows' mask), the per-document attention the trainer loads for sdpa
# (fulltune/attention.py `sdpa_documents`: packed rows given their documents, no mask at all), eager attention, key/value heads split (2 of 4 over 2 processes) and repeated (1), a
# length the zigzag pads (27 → 28).
CASES = {
    "sdpa-gqa2": ("sdpa", False, 2, 27),
    "sdpa-packed-gqa2": ("sdpa", True, 2, 27),
    "sdpa-packed-kv1": ("sdpa", True, 1, 32),
    "documents-packed-gqa2": ("sdpa_documents", True, 2, 27),
    "documents-packed-kv1": ("sdpa_documents", True, 1, 32),
    "eager-packed-kv1": ("eager", True, 1, 27),
    "eager-mha": ("eager", False, 4, 24),
}
# On CUDA also ring attention: 3 heads do not split over 2 processes (PyTorch's context_parallel, CUDA only).
CUDA_CASES = {**CASES, "ring-sdpa-3-heads": ("sdpa", False, 3, 32)}


def run_case(attention: str, packed: bool, kv_heads: int, length: int, device: str = "cpu") -> dict[str, float]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    from fulltune.attention import Documents, register
    from fulltune.data.targets import Targets
    from fulltune.runtime.context_parallel import ContextParallel
    from fulltune.runtime.loss import TargetHead

    if attention == "sdpa_documents":
        register()
    heads = 3 if kv_heads == 3 else 4  # 3: ring attention (the heads do not split over 2 processes)
    config = LlamaConfig(num_hidden_layers=2, hidden_size=32 * heads, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, intermediate_size=128, vocab_size=256,
                         attn_implementation=attention)

    def build() -> LlamaForCausalLM:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(device)
        model.config.use_cache = False
        return model

    b = 2
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (b, length), generator=generator)
    split = length // 3
    positions = (torch.cat([torch.arange(split), torch.arange(length - split)]) if packed
                 else torch.arange(length)).expand(b, length).clone()
    labels = ids.clone()
    labels[:, :3] = -100  # a prompt without targets
    targets = Targets.from_labels(labels).to(device)
    # The trainer's packed micro-batches carry their documents, found on the host (fulltune/data/batches.py).
    documents = Documents.from_positions(positions.tolist()) if attention == "sdpa_documents" else None
    batch = {"input_ids": ids.to(device), "position_ids": positions.to(device),
             **({"documents": documents} if documents is not None else {})}

    whole = build()  # one process: before any ring dispatcher is open
    head = TargetHead(whole)
    reference = head.loss_sum(whole, batch, targets)
    reference.backward()

    model = build()
    world = dist.get_world_size()
    method = "ulysses" if heads % world == 0 else "ring"
    context = ContextParallel(init_device_mesh(device, (world,)), world, dist.get_rank(), method)
    context.install(model)
    inputs, local = context.shard(batch, targets)
    loss = TargetHead(model).loss_sum(model, inputs, local)
    loss.backward()
    masks = len(context.current.masks)  # (S × S) masks built for the micro-batch
    total = loss.detach().clone()
    dist.all_reduce(total)
    worst = 0.0
    for (_, p), (_, q) in zip(model.named_parameters(), whole.named_parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad)
        worst = max(worst, float((grad - q.grad).abs().max() / q.grad.abs().max()))
    context.remove(model)
    return {"loss": abs(float(total) / float(reference.detach()) - 1), "grads": worst, "masks": masks}


def main() -> int:
    import os

    import torch
    import torch.distributed as dist

    cuda = "--cuda" in sys.argv
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = "cuda" if cuda else "cpu"
    results = {name: run_case(*case, device=device) for name, case in (CUDA_CASES if cuda else CASES).items()}
    if dist.get_rank() == 0:
        Path(sys.argv[1]).write_text(json.dumps(results))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
