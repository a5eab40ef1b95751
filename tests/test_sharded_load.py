"""FSDP2 sharded loading (fulltune.runtime.sharding.load_sharded_model): every process builds the model on the
meta device, shards it and reads only its own shards from the checkpoint, and gets the same model as
loading it whole and sharding it afterwards (`load_model` + `shard_model`, what every process did before).

Each test is one torchrun of tests/sharding_worker.py (2 processes, gloo) running its two loads one after
the other; ~20 s each on 2 cores, hence `slow`. Every comparison is bit for bit: both paths hold the same
fp32 values in the same shards and run the same sums.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from test_sharding import result, two_sharded_from, weights

pytestmark = pytest.mark.slow
STEPS = 3


def save_checkpoint(directory: Path, *, tied: bool, dtype: str, safetensors: bool = True) -> Path:
    """A tiny Llama (the worker's shape) saved the way a hub checkpoint is: bf16 or fp32, tied or not."""
    import torch
    from transformers import AutoModelForCausalLM

    from sharding_worker import tiny_config

    config = tiny_config()
    config.tie_word_embeddings = tied
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    model.save_pretrained(directory)
    if not safetensors:  # a pickled checkpoint: the HF storage reader cannot read it, rank 0 loads and broadcasts
        state = {name: tensor.clone() for name, tensor in model.state_dict().items()}
        (directory / "model.safetensors").unlink()
        torch.save(state, directory / "pytorch_model.bin")
    return directory


def assert_same(got: dict, want: dict) -> None:
    import torch

    assert got.keys() == want.keys()
    assert [name for name in want if not torch.equal(got[name], want[name])] == []


def test_tied_fp32_checkpoint_loads_bit_exact_and_trains_like_load_then_shard(tmp_path: Path) -> None:
    checkpoint = save_checkpoint(tmp_path / "tied", tied=True, dtype="float32")
    new, old = tmp_path / "new", tmp_path / "old"
    two_sharded_from((new, checkpoint, ("--sharded-load", "--export-loaded")), (old, checkpoint, ()), steps=STEPS)
    assert_same(weights(new / "loaded"), weights(checkpoint))
    assert result(new)["losses"] == result(old)["losses"]
    assert_same(weights(new / "model"), weights(old / "model"))


def test_untied_bf16_checkpoint_loads_as_fp32_masters_from_safetensors_and_from_a_pickle(tmp_path: Path) -> None:
    import torch

    safetensors = save_checkpoint(tmp_path / "st", tied=False, dtype="bfloat16")
    pickled = save_checkpoint(tmp_path / "bin", tied=False, dtype="bfloat16", safetensors=False)
    read, broadcast = tmp_path / "read", tmp_path / "broadcast"
    options = ("--sharded-load", "--export-loaded")
    two_sharded_from((read, safetensors, options), (broadcast, pickled, options), steps=STEPS)
    expected = {name: tensor.float() for name, tensor in weights(tmp_path / "st").items()}
    assert "lm_head.weight" in expected
    assert_same(weights(read / "loaded"), expected)  # bf16 → fp32 is exact
    assert_same(weights(broadcast / "loaded"), expected)
    assert result(read)["losses"] == result(broadcast)["losses"]
    assert result(read)["losses"][-1] < result(read)["losses"][0]
    assert_same(weights(read / "model"), weights(broadcast / "model"))
    assert all(tensor.dtype == torch.float32 for tensor in weights(read / "model").values())
