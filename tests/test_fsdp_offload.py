"""`train.offload_optimizer` under `strategy: fsdp`: FSDP2's CPU offload, on CUDA only.

FSDP2's `CPUOffloadPolicy` refuses to run without an accelerator, so on CPU this checks what can run here:
the lever table (validate refuses it on a CPU device naming budget.device, accepts it on cuda), the wiring
(every unit `fully_shard`s with `CPUOffloadPolicy(pin_memory=True)`, checked with `fully_shard` patched;
loading refuses a CPU device before reading anything), and the memory model (no shard on the device,
every rank's shards in host RAM, a machine's host RAM counts all its ranks and rank 0's export). The CUDA
step itself is benchmarks/device_check.py's host-parameter case (`fsdp_offload_case`), which
`python -m benchmarks.device_check --out device_check.json` runs with the other GPU checks, each variant in a
child process of its own; one alone: `python -m benchmarks.host_params_check adamw --out adamw.json`.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import transformers

from fulltune.runtime import sharding
from fulltune.errors import ConfigError
from fulltune.memory import Settings, estimate_memory
from fulltune.memory.lever_bytes import lever_bytes
from fulltune.memory.process import node_host_bytes
from fulltune.memory.shapes import model_shape
from fulltune.pipelines_file import validate_pipelines

TINY = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)


def pipelines(device: str, strategy: str = "fsdp", processes: int = 2) -> dict:
    return {"pipelines": {"t": {
        "model": {"name_or_path": "local/model"}, "data": {"train": "train.jsonl"}, "budget": {"device": device},
        "train": {"effective_batch_size": 4, "offload_optimizer": True, "mixed_precision": "bf16"},
        "distributed": {"strategy": strategy, "num_processes": processes}}}}


def test_validate_refuses_fsdp_offload_on_a_cpu_device_naming_budget_device() -> None:
    with pytest.raises(ConfigError, match=r"train.offload_optimizer with budget.device"):
        validate_pipelines(pipelines("cpu"))


def test_validate_accepts_fsdp_offload_on_cuda_and_still_refuses_ddp_offload() -> None:
    validate_pipelines(pipelines("cuda"))
    with pytest.raises(ConfigError, match=r"train.offload_optimizer with distributed.num_processes"):
        validate_pipelines(pipelines("cuda", strategy="ddp"))


def _policies(monkeypatch: pytest.MonkeyPatch, offload: bool) -> list:
    """The offload policy of every `fully_shard` call `shard_model` makes (fully_shard patched: nothing sharded)."""
    import torch.distributed.fsdp as fsdp

    calls = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)))
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(TINY)
    sharding.shard_model(model, device="cuda", mixed_precision="bf16", mesh=object(), offload=offload)
    # embedding, 2 layers, head, root
    assert [type(m).__name__ for m, _ in calls] == ["Embedding", "LlamaDecoderLayer", "LlamaDecoderLayer",
                                                   "Linear", "LlamaForCausalLM"]
    return [kwargs["offload_policy"] for _, kwargs in calls]


def test_every_fsdp_unit_is_sharded_with_a_pinned_cpu_offload_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.distributed.fsdp import CPUOffloadPolicy

    policies = _policies(monkeypatch, offload=True)
    assert all(isinstance(p, CPUOffloadPolicy) and p.pin_memory for p in policies)
    assert not any(isinstance(p, CPUOffloadPolicy) for p in _policies(monkeypatch, offload=False))


def test_loading_with_offload_on_a_cpu_device_is_refused_before_sharding(tmp_path, monkeypatch) -> None:
    transformers.LlamaForCausalLM(TINY).save_pretrained(tmp_path)
    monkeypatch.setattr(sharding, "shard_model", lambda *a, **k: pytest.fail("sharded on a CPU device"))
    with pytest.raises(ValueError, match="CUDA"):
        sharding.load_sharded_model(tmp_path, device="cpu", offload=True)


LLAMA_70B = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                                     tie_word_embeddings=False)
STEP = Settings(micro_batch_size=1, seq_len=4096, gradient_accumulation_steps=8, gradient_checkpointing=80,
                mixed_precision="bf16", device="cuda", strategy="fsdp", num_processes=8, attention_mask=False)


def test_offloaded_fsdp_keeps_no_shard_on_the_device_and_every_shard_in_host_ram() -> None:
    shape = model_shape(LLAMA_70B)
    P, n = shape.num_params, 8
    sharded = estimate_memory(LLAMA_70B, STEP)
    offloaded = estimate_memory(LLAMA_70B, replace(STEP, offload_optimizer=True))
    # On the device: no optimizer state, no persistent parameter or gradient shard; the step's activations
    # and the gathered units are those of the run without offload.
    assert offloaded.breakdown["optimizer_states"] == 0
    assert sharded.breakdown["activations"] == offloaded.breakdown["activations"]
    saved = sharded.peak_bytes - offloaded.peak_bytes
    # Accumulating, the gradient shards exist all step: fp32 parameter and gradient shards, AdamW's two states.
    assert saved == pytest.approx((4 + 4 + 8) * P / n, rel=0.01)
    # In host RAM, per rank: the fp32 parameter and gradient shards and AdamW's states over them.
    assert offloaded.host_bytes == pytest.approx((4 + 4 + 8) * P / n, rel=0.01)
    assert sharded.host_bytes == 0
    # Pure bf16: bf16 shards, AdamW's bf16 states and the Kahan buffer on the host.
    pure = estimate_memory(LLAMA_70B, replace(STEP, offload_optimizer=True, pure_bf16=True))
    assert pure.host_bytes == pytest.approx((2 + 2 + 6) * P / n, rel=0.01)
    # The load reads into host RAM; a save passes one parameter at a time through the device.
    assert offloaded.phases["load"] < sharded.phases["load"] / 10
    assert offloaded.phases["final export"] < 2 * 2**30 + offloaded.phases["load"] + 2 * 4 * shape.vocab * shape.hidden


def test_a_machines_host_ram_counts_all_its_ranks_and_the_streamed_export() -> None:
    shape = model_shape(LLAMA_70B)
    settings = replace(STEP, offload_optimizer=True)
    rank = estimate_memory(LLAMA_70B, settings).host_bytes
    one_machine = node_host_bytes(shape, settings, rank, ranks_per_node=8)
    two_machines = node_host_bytes(shape, settings, rank, ranks_per_node=4)
    # The export streams: one safetensors file's fp32 tensors on rank 0 (here the 4.2 GB output embedding, larger
    # than a file) and, the shards being in host RAM, every rank's all-gather buffers (twice that tensor).
    largest = 4 * shape.vocab * shape.hidden
    assert one_machine["export"] == largest + 8 * 2 * largest and two_machines["export"] == largest + 4 * 2 * largest
    assert one_machine["export"] < 4 * shape.num_params / 3  # never the whole model
    assert one_machine["total"] == pytest.approx(8 * rank + one_machine["export"], rel=0.01)
    assert two_machines["total"] == pytest.approx(4 * rank + two_machines["export"], rel=0.01)
    assert one_machine["pinned"] == 8 * 8 * shape.num_params // 8  # fp32 parameter + gradient shards
    assert lever_bytes(shape, settings).sharded_offload and not lever_bytes(shape, STEP).sharded_offload
