"""Tiny models and tokenizers built locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

WORDS = ["12+35=47", "hello world", "the cat sat on the mat", "fine tuning", "0123456789", "+-=*/"]


def make_tokenizer(directory: Path, vocab_size: int = 128) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|pad|>", "<|bos|>", "<|eos|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(WORDS * 10, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    fast.save_pretrained(directory)
    return str(directory)


def word_level_tokenizer(directory: Path, vocab_size: int) -> None:
    """Save a whitespace word-level tokenizer: `<pad>` = 0, `<eos>` = 1, then `t2` … `t{vocab_size - 1}`, so
    that rows written as token ids need no trained vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>").save_pretrained(directory)


# The tiny shape of each model family the tests train: 2 layers, hidden 32, 4 heads, 64 positions, dropout
# off (a run's numbers then do not depend on the RNG's order). `tiny_config` adds the vocabulary and overrides.
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)),
    # ties its embeddings, learned positions, LayerNorm with biases
    "gpt2": ("GPT2Config", dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                                attn_pdrop=0.0)),
    # fused qkv, partial rotary, parallel residual
    "gpt_neox": ("GPTNeoXConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.25,
                                       hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False)),
    # q/k/v biases
    "qwen2": ("Qwen2Config", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)),
}


def tiny_config(family: str, vocab_size: int, **fields: Any) -> Any:
    """The tiny `family` config (`FAMILIES`) with `vocab_size`; `fields` override or add config fields."""
    import transformers

    class_name, shape = FAMILIES[family]
    return getattr(transformers, class_name)(**{**shape, "vocab_size": vocab_size, **fields})


def make_model(directory: Path, tokenizer_dir: str, seed: int = 0, hidden: int = 32, positions: int = 128) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = tiny_config("llama", len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
                         max_position_embeddings=positions, pad_token_id=tok.pad_token_id,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return str(directory)


def fake_hub_repo(hf_home: Path, repo_id: str, commit: str, repo_type: str = "model", branch: str = "main") -> Path:
    """An empty snapshot `<hf_home>/hub/<type>s--ORG--NAME/snapshots/<commit>/` with `refs/<branch>` naming
    it, as huggingface_hub lays out its cache; fill it, then use `repo_id` offline (HF_HUB_OFFLINE=1)."""
    root = Path(hf_home) / "hub" / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = root / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / branch).write_text(commit)
    return snapshot


def fake_hub_model(hf_home: Path, repo_id: str, commit: str, seed: int = 0, branch: str = "main",
                   hidden: int = 32) -> Path:
    """A tiny Llama checkpoint and its tokenizer in the Hugging Face cache under `repo_id`, with the
    4096 positions of the real checkpoints it stands in for (data.max_length may not exceed them)."""
    snapshot = fake_hub_repo(hf_home, repo_id, commit, branch=branch)
    make_model(snapshot, make_tokenizer(snapshot), seed=seed, hidden=hidden, positions=4096)
    return snapshot
