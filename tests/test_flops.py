"""One FLOP formula (fulltune/memory/flops.py): counted from a built model and from the memory model's shape, the
coefficients are the same, and they are what a hand count gives."""

from __future__ import annotations

import pytest

from fulltune.memory import flops
from fulltune.memory.shapes import model_shape


def tiny_configs():
    from transformers import GPT2Config, GPTNeoXConfig, LlamaConfig

    llama = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    return {
        "llama-untied": LlamaConfig(**llama, tie_word_embeddings=False),
        "llama-tied": LlamaConfig(**llama, tie_word_embeddings=True),
        "llama-head-dim": LlamaConfig(**llama, head_dim=16, tie_word_embeddings=False),
        "gpt2-tied": GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64),
        "gpt2-untied": GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  tie_word_embeddings=False),
        "gpt-neox": GPTNeoXConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4),
        "gpt-neox-tied": GPTNeoXConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, tie_word_embeddings=True),
    }


def built(config):
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("name", list(tiny_configs()))
def test_the_model_and_its_shape_give_the_same_coefficients(name: str) -> None:
    config = tiny_configs()[name]
    assert flops.from_model(built(config)) == flops.from_shape(model_shape(config))


def test_a_hand_count_of_a_tiny_untied_llama() -> None:
    config = tiny_configs()["llama-untied"]  # V 96, h 32, I 64, L 2, 4 heads of 8, 2 key/value heads
    layer = 2 * 32 + 32 * 32 + 2 * (16 * 32) + 32 * 32 + 3 * 64 * 32  # norms, q, k and v, o, gate/up/down
    body = 2 * layer + 32  # the final norm; the token table is a lookup, the head counts per target
    expected = flops.FlopCoefficients(per_token=6.0 * body, per_target=6.0 * 96 * 32, per_pair=12.0 * 2 * 32)
    assert flops.from_model(built(config)) == expected
    # A tied head is the token table: the same FLOPs, one table fewer parameters.
    assert flops.from_model(built(tiny_configs()["llama-tied"])) == expected
    assert expected.training_flops(tokens=10, targets=4, pairs=100) == 10 * 6.0 * body + 4 * 6.0 * 3072 + 100 * 768.0


def test_the_gpu_peak_table_matches_the_most_specific_name() -> None:
    assert flops.peak_flops("NVIDIA H100 PCIe") == 756e12
    assert flops.peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert flops.peak_flops("NVIDIA A10") == 125e12 and flops.peak_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert flops.peak_flops("NVIDIA L4") == 121e12 and flops.peak_flops("NVIDIA L40S") == 362e12
    assert flops.peak_flops("cpu") is None
