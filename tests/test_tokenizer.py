"""Tokenizer resolution and the BPE tokenizer trained on the training data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fulltune.data import tokenizer as tokenizer_module
from fulltune.errors import ConfigError, DataError
from fulltune.spec import DataSpec, ModelSpec, TrainTokenizer
from fulltune.data.tokenizer import BOS, CHAT_TEMPLATE, EOS, PAD, prepare_tokenizer

from tiny import fake_hub_repo

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "data" / "demo"


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def trained(vocab_size: int = 300) -> ModelSpec:
    return ModelSpec(from_config=str(DEMO / "model_config.json"), tokenizer=TrainTokenizer(vocab_size=vocab_size))


TEXTS = [{"text": t} for t in ["hello world", "the cat sat on the mat", "fine tuning is fun", "naïve café ☕"] * 25]


def test_trained_tokenizer_is_deterministic_and_reused(tmp_path: Path, monkeypatch) -> None:
    data = DataSpec(train=write_jsonl(tmp_path / "train.jsonl", TEXTS))
    first = Path(prepare_tokenizer(trained(), data, tmp_path / "a"))
    second = Path(prepare_tokenizer(trained(), data, tmp_path / "b"))
    assert first.parent == tmp_path / "a" / "tokenizers" and first.name == second.name
    files = sorted(p.name for p in first.iterdir())
    assert files == sorted(p.name for p in second.iterdir())
    assert "tokenizer.json" in files and "tokenizer_config.json" in files
    assert all((first / f).read_bytes() == (second / f).read_bytes() for f in files)
    assert [p.name for p in (tmp_path / "a" / "tokenizers").iterdir()] == [first.name]  # no temp dir left

    with monkeypatch.context() as patch:
        patch.setattr(tokenizer_module, "build_tokenizer", lambda *a: pytest.fail("a trained tokenizer is reused"))
        assert Path(prepare_tokenizer(trained(), data, tmp_path / "a")) == first

    # The key follows the data bytes and the options.
    assert Path(prepare_tokenizer(trained(vocab_size=280), data, tmp_path / "a")).name != first.name
    write_jsonl(tmp_path / "train.jsonl", TEXTS[:-1])
    assert Path(prepare_tokenizer(trained(), data, tmp_path / "a")).name != first.name


def test_trained_tokenizer_round_trips_text_and_loads_with_auto_tokenizer(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    data = DataSpec(train=write_jsonl(tmp_path / "train.jsonl", TEXTS))
    tok = AutoTokenizer.from_pretrained(prepare_tokenizer(trained(), data, tmp_path))
    assert (tok.pad_token, tok.bos_token, tok.eos_token, tok.pad_token_id) == (PAD, BOS, EOS, 0)
    assert 256 < len(tok) <= 300
    samples = ["hello world", "the mat, the cat!", "naïve café ☕ 日本語", "  spaces\tand\nnewlines ", "x" * 50]
    for text in samples:
        ids = tok(text)["input_ids"]
        assert ids[0] == tok.bos_token_id and tok.unk_token_id not in ids
        assert tok.decode(ids, skip_special_tokens=True) == text
    # Digits are single tokens, so numbers are spelled the same way everywhere.
    assert tok.convert_ids_to_tokens(tok("12+345=", add_special_tokens=False)["input_ids"]) == list("12+345=")
    assert tok("hello world", add_special_tokens=False)["input_ids"] == tok("hello world")["input_ids"][1:]


def test_trained_tokenizer_chat_template_marks_assistant_turns(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    chats = [{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]}] * 20
    data = DataSpec(train=write_jsonl(tmp_path / "chat.jsonl", chats), format="chat")
    tok = AutoTokenizer.from_pretrained(prepare_tokenizer(trained(), data, tmp_path))
    assert tok.chat_template == CHAT_TEMPLATE
    messages = chats[0]["messages"]
    rendered = tok.apply_chat_template(messages, tokenize=False)
    assert rendered == "<|bos|><|user|>hi there<|end|><|assistant|>hello<|eos|>"
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|end|><|assistant|>")
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert marked == tok("hello", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]


def test_tokenizer_references(tmp_path: Path, hf_home: Path) -> None:
    data = DataSpec(train=str(DEMO / "train.jsonl"), format="prompt_completion")
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    (tok_dir / "tokenizer.json").write_text("{}")
    local = ModelSpec(name_or_path="org/model", tokenizer=str(tok_dir))
    assert prepare_tokenizer(local, data, tmp_path) == str(tok_dir)
    # A hub id, dots and all, is used from its snapshot in the cache (offline), at model.revision.
    main = fake_hub_repo(hf_home, "Org/Tok-1.5B.v2", "1" * 40)
    (main / "tokenizer.json").write_text("{}")
    (main / "model.safetensors").write_text("weights")
    other = fake_hub_repo(hf_home, "Org/Tok-1.5B.v2", "2" * 40, branch="v2")
    (other / "tokenizer.json").write_text("{}")
    assert prepare_tokenizer(ModelSpec(name_or_path="Org/Tok-1.5B.v2"), data, tmp_path) == str(main)
    assert prepare_tokenizer(ModelSpec(name_or_path="Org/Tok-1.5B.v2", revision="v2"), data, tmp_path) == str(other)
    separate = ModelSpec(name_or_path="org/model", tokenizer="Org/Tok-1.5B.v2", revision="v9")
    assert prepare_tokenizer(separate, data, tmp_path) == str(main), "model.revision is the model's, not the tokenizer's"
    with pytest.raises(ConfigError, match=r"model\.name_or_path: 'org/model' is not a local directory .* not in the "
                                          r"Hugging Face cache"):
        prepare_tokenizer(ModelSpec(name_or_path="org/model"), data, tmp_path)
    with pytest.raises(ConfigError, match=r"model\.tokenizer: directory \./no/such/tokenizer not found"):
        prepare_tokenizer(ModelSpec(name_or_path="org/model", tokenizer="./no/such/tokenizer"), data, tmp_path)
    with pytest.raises(ConfigError, match=r"model\.name_or_path: .* holds no tokenizer files"):
        prepare_tokenizer(ModelSpec(name_or_path=str(tmp_path)), data, tmp_path)
    with pytest.raises(DataError, match=r"data\.train: .*missing\.jsonl not found"):
        prepare_tokenizer(trained(), DataSpec(train=str(tmp_path / "missing.jsonl")), tmp_path)
    assert not (tmp_path / "tokenizers").exists()
    with pytest.raises(DataError, match=r"has no column 'text'"):
        prepare_tokenizer(trained(), DataSpec(train=str(DEMO / "train.jsonl")), tmp_path)


def test_demo_data_is_reproducible_and_fits_the_demo_model(tmp_path: Path) -> None:
    import subprocess
    import sys

    subprocess.run([sys.executable, str(DEMO / "make_demo_data.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("train.jsonl", "eval.jsonl"):
        assert (tmp_path / name).read_bytes() == (DEMO / name).read_bytes(), f"{name} differs from the script's output"
    train = [json.loads(line) for line in (DEMO / "train.jsonl").read_text().splitlines()]
    evaluation = [json.loads(line) for line in (DEMO / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(evaluation)) == (2000, 200)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    config = json.loads((DEMO / "model_config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"]) == ("llama", 2, 64)
    assert config["tie_word_embeddings"] is True
