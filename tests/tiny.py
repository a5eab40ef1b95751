"""Tiny models and tokenizers built locally (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path

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


def make_model(directory: Path, tokenizer_dir: str, seed: int = 0, hidden: int = 32, positions: int = 128) -> str:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
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
