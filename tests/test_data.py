"""Data stage: loading, formatting, label masks, packing, collate, fingerprints, the tokenized cache.

Everything is built locally: a tokenizer trained in a second on a few strings, tiny JSONL files.
"""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from fulltune.data import files as data_files
from fulltune.data import store as data_store
from fulltune.data import (
    IGNORE_INDEX,
    collate,
    encode_prompt,
    fingerprint_data,
    iter_length_grouped_batches,
    load_records,
    load_tokenized,
    read_row_lengths,
    tokenize_dataset,
)
from fulltune.errors import DataError
from fulltune.spec import DataSpec, TrainTokenizer
from fulltune.data.tokenizer import build_tokenizer

TEXTS = ["hello world", "the cat sat on the mat", "12+35=47", "fine tuning is fun", "user asks, model answers"]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    directory = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(iter(TEXTS * 20), TrainTokenizer(vocab_size=300)).save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def tok(tok_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def write_jsonl(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def rows(path: str) -> list[dict]:
    return pq.read_table(path).to_pylist()


PAIRS = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a, b in [(12, 35), (7, 8), (40, 2), (99, 1), (3, 30)]]


# --- formats and label masks ------------------------------------------------------------------------


def test_prompt_completion_masks_exactly_the_prompt(tmp_path: Path, tok_dir: str, tok) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    evaluation = write_jsonl(tmp_path / "eval.jsonl", PAIRS[:2])
    spec = DataSpec(train=train, eval=evaluation, format="prompt_completion", max_length=64)
    result = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)

    assert result.num_train_examples == len(PAIRS) and result.num_eval_examples == 2
    for record, row in zip(PAIRS, rows(result.train_file)):
        prompt = [tok.bos_token_id] + tok(record["prompt"], add_special_tokens=False)["input_ids"]
        completion = tok(record["completion"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert row["input_ids"] == prompt + completion
        assert row["labels"] == [IGNORE_INDEX] * len(prompt) + completion
        assert row["position_ids"] == list(range(len(prompt) + len(completion)))
        trained = [t for t in row["labels"] if t != IGNORE_INDEX]
        assert tok.decode(trained, skip_special_tokens=True) == record["completion"]
        # Generation starts from exactly the tokens training masked.
        assert encode_prompt(tok, record["prompt"]) == prompt
    eval_rows = rows(result.eval_file)
    assert [(r["prompt"], r["completion"]) for r in eval_rows] == [(p["prompt"], p["completion"]) for p in PAIRS[:2]]
    labelled = sum(sum(t != IGNORE_INDEX for t in r["labels"]) for r in rows(result.train_file))
    assert result.train_label_tokens == labelled
    # Loss terms per row: a row's first label is never predicted. The most in one row bounds the output
    # head's rows in the memory plan.
    assert result.max_row_targets == max(sum(t != IGNORE_INDEX for t in r["labels"][1:]) for r in rows(result.train_file))
    # The memory plan: micro-batches padded to the longest row, the head's share bounded by the data.
    from types import SimpleNamespace

    from fulltune.stages.budget import planned_rows

    pipeline = SimpleNamespace(spec=SimpleNamespace(data=spec))
    seq_len, share, documents = planned_rows(pipeline, result)
    assert seq_len == result.max_row_length and documents == 0  # one example per row: the row is its document
    assert share == pytest.approx(result.max_row_targets / (result.max_row_length - 1)) and 0 < share < 1


def test_text_format_trains_every_token_but_the_first(tmp_path: Path, tok_dir: str, tok) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [{"body": t} for t in TEXTS])
    spec = DataSpec(train=train, eval=train, format="text", text_field="body", max_length=64)
    result = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    for text, row in zip(TEXTS, rows(result.train_file)):
        ids = [tok.bos_token_id] + tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert row["input_ids"] == ids
        assert row["labels"] == [IGNORE_INDEX] + ids[1:]
    assert pq.read_table(result.eval_file)["prompt"].null_count == len(TEXTS)


CHATS = [
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"},
                  {"role": "assistant", "content": "hello world"}, {"role": "user", "content": "12+35="},
                  {"role": "assistant", "content": "47"}]},
    {"messages": [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat on the mat"}]},
]


def assistant_labels(tok, messages: list[dict]) -> list[int]:
    """The tokens chat training must learn: each assistant reply and the eos that ends it."""
    expected = []
    for message in messages:
        if message["role"] == "assistant":
            expected += tok(message["content"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return expected


def test_chat_trains_only_assistant_tokens(tmp_path: Path, tok_dir: str, tok) -> None:
    train = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    spec = DataSpec(train=train, eval=train, format="chat", max_length=128)
    result = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    for chat, row in zip(CHATS, rows(result.train_file)):
        rendered = tok.apply_chat_template(chat["messages"], tokenize=True, return_dict=True)
        assert row["input_ids"] == rendered["input_ids"]
        assert [t for t in row["labels"] if t != IGNORE_INDEX] == assistant_labels(tok, chat["messages"])
        # Masked positions are the rest: system/user turns and the role markers.
        trained = [i for i, t in enumerate(row["labels"]) if t != IGNORE_INDEX]
        assert all(row["labels"][i] == row["input_ids"][i] for i in trained)
        assert tok.convert_ids_to_tokens(row["input_ids"][trained[0] - 1]) == "<|assistant|>"


def test_chat_without_generation_markers_finds_the_same_assistant_tokens(tmp_path: Path, tok_dir: str, tok) -> None:
    from transformers import AutoTokenizer

    plain_dir = tmp_path / "plain-template"
    plain = AutoTokenizer.from_pretrained(tok_dir)
    plain.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    plain.save_pretrained(plain_dir)
    train = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    spec = DataSpec(train=train, eval=train, format="chat", max_length=128)
    marked = rows(tokenize_dataset(spec, tok_dir, tmp_path / "a", seed=0).train_file)
    rendered = rows(tokenize_dataset(spec, str(plain_dir), tmp_path / "b", seed=0).train_file)
    assert marked == rendered


def test_truncation_is_counted_and_examples_without_labels_are_dropped(tmp_path: Path, tok_dir: str) -> None:
    long_prompt = {"prompt": "the cat sat on the mat " * 4, "completion": "47"}  # prompt alone > max_length
    long_answer = {"prompt": "12+35=", "completion": "hello world " * 4}  # completion cut short
    train = write_jsonl(tmp_path / "train.jsonl", [long_prompt, long_answer, *PAIRS])
    spec = DataSpec(train=train, eval=train, format="prompt_completion", max_length=12)
    result = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    assert result.truncated_examples == 4  # both long records, in train and in eval
    assert result.dropped_examples == 2  # the long prompt, in train and in eval
    assert result.num_train_examples == len(PAIRS) + 1
    assert max(len(r["input_ids"]) for r in rows(result.train_file)) == 12 == result.max_row_length


def test_eval_split_is_seeded_disjoint_and_never_empty(tmp_path: Path, tok_dir: str) -> None:
    records = [{"prompt": f"{a}+{a}=", "completion": str(2 * a)} for a in range(10, 40)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    spec = DataSpec(train=train, format="prompt_completion", eval_split=0.2, max_length=32)
    first = tokenize_dataset(spec, tok_dir, tmp_path / "a", seed=3)
    again = tokenize_dataset(spec, tok_dir, tmp_path / "b", seed=3)
    other = tokenize_dataset(spec, tok_dir, tmp_path / "c", seed=4)
    prompts = [r["prompt"] for r in rows(first.eval_file)]
    assert len(prompts) == 6 and first.num_train_examples == 24
    assert prompts == [r["prompt"] for r in rows(again.eval_file)]
    assert prompts != [r["prompt"] for r in rows(other.eval_file)]
    train_ids = {tuple(r["input_ids"]) for r in rows(first.train_file)}
    assert not train_ids & {tuple(r["input_ids"]) for r in rows(first.eval_file)}
    # A tiny split still holds one example out and keeps one for training.
    two = write_jsonl(tmp_path / "two.jsonl", records[:2])
    tiny_spec = DataSpec(train=two, format="prompt_completion", eval_split=0.01)
    tiny = tokenize_dataset(tiny_spec, tok_dir, tmp_path / "d", 0)
    assert (tiny.num_train_examples, tiny.num_eval_examples) == (1, 1)


# --- packing ------------------------------------------------------------------------------------------


def documents(row: dict) -> list[tuple[list[int], list[int]]]:
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["input_ids"])]
    return [(row["input_ids"][a:b], row["labels"][a:b]) for a, b in zip(starts, starts[1:])]


def test_packing_keeps_documents_whole_and_restarts_positions(tmp_path: Path, tok_dir: str) -> None:
    records = [{"text": " ".join(TEXTS[: 1 + i % 5])} for i in range(40)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    unpacked = tokenize_dataset(DataSpec(train=train, eval=train, max_length=48), tok_dir, tmp_path / "u", seed=0)
    packed_spec = DataSpec(train=train, eval=train, max_length=48, packing=True)
    packed = tokenize_dataset(packed_spec, tok_dir, tmp_path / "p", 0)

    packed_rows = rows(packed.train_file)
    assert packed.num_train_rows == len(packed_rows) < packed.num_train_examples == 40
    assert all(len(r["input_ids"]) <= 48 for r in packed_rows)
    docs = [doc for row in packed_rows for doc in documents(row)]
    # Every example appears whole, exactly once; positions restart at 0 for each.
    originals = sorted((r["input_ids"], r["labels"]) for r in rows(unpacked.train_file))
    assert sorted(docs) == originals
    for row in packed_rows:
        for (ids, labels), start in zip(documents(row), [i for i, p in enumerate(row["position_ids"]) if p == 0]):
            assert row["position_ids"][start:start + len(ids)] == list(range(len(ids)))
            assert labels[0] == IGNORE_INDEX  # no document's first token is predicted from the previous one
    assert packed.train_label_tokens == unpacked.train_label_tokens
    assert packed.train_tokens == unpacked.train_tokens
    assert packed.max_row_targets == max(sum(t != IGNORE_INDEX for t in r["labels"][1:]) for r in packed_rows)
    assert packed.max_row_targets > unpacked.max_row_targets
    assert all(r["position_ids"] == list(range(len(r["input_ids"]))) for r in rows(packed.eval_file))  # never packed


def test_packed_batch_attends_and_predicts_within_documents(tmp_path: Path, tok_dir: str, tok) -> None:
    """The model sees a packed row exactly as it sees its documents one by one (transformers' SDPA mask
    from position_ids), and the loss covers the same targets.

    transformers builds that mask only without a KV cache: with the default use_cache=True (even in
    train mode) it silently attends across documents, so training must call the model with
    use_cache=False.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=128)).eval()
    docs = [[1, 40, 41, 42, 2], [1, 50, 51, 2], [1, 60, 61, 62, 63, 2]]
    labelled = [[IGNORE_INDEX] + d[1:] for d in docs]
    packed_row = {"input_ids": sum(docs[:2], []), "labels": sum(labelled[:2], []),
                  "position_ids": [p for d in docs[:2] for p in range(len(d))]}
    single_row = {"input_ids": docs[2], "labels": labelled[2], "position_ids": list(range(len(docs[2])))}
    batch = collate([packed_row, single_row], pad_token_id=0)
    assert "attention_mask" not in batch  # the packed-sequence mask needs attention_mask=None

    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
        alone = [model(input_ids=torch.tensor([d])).logits[0] for d in docs]
        packed_loss = model(**batch, use_cache=False).loss
        leaky = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        per_doc = [model(input_ids=torch.tensor([d]), labels=torch.tensor([lab])).loss
                   for d, lab in zip(docs, labelled)]
    torch.testing.assert_close(logits[0, :5], alone[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits[0, 5:9], alone[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits[1, :6], alone[2], atol=1e-5, rtol=1e-4)
    assert not torch.allclose(leaky[0, 5:9], alone[1], atol=1e-3)  # the use_cache trap, pinned
    targets = [len(d) - 1 for d in docs]
    expected = sum(loss * n for loss, n in zip(per_doc, targets)) / sum(targets)
    torch.testing.assert_close(packed_loss, expected, atol=1e-5, rtol=1e-4)


# --- collate ------------------------------------------------------------------------------------------


def test_collate_pads_right_with_attention_mask_only_when_needed() -> None:
    import torch

    short = {"input_ids": [1, 5, 6], "labels": [-100, 5, 6], "position_ids": [0, 1, 2]}
    long = {"input_ids": [1, 7, 8, 9, 2], "labels": [-100, -100, 8, 9, 2], "position_ids": [0, 1, 2, 3, 4]}
    batch = collate([short, long], pad_token_id=0)
    assert set(batch) == {"input_ids", "labels", "position_ids", "attention_mask"}
    assert all(t.dtype == torch.int64 and t.shape == (2, 5) for t in batch.values())
    assert batch["input_ids"][0].tolist() == [1, 5, 6, 0, 0]
    assert batch["labels"][0].tolist() == [-100, 5, 6, -100, -100]
    assert batch["position_ids"][0].tolist() == [0, 1, 2, 3, 4]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]

    same = collate([long, long], pad_token_id=0)
    assert "attention_mask" not in same and same["input_ids"].tolist() == [long["input_ids"]] * 2

    packed = {"input_ids": [1, 5, 2, 1, 6, 2], "labels": [-100, 5, 2, -100, 6, 2], "position_ids": [0, 1, 2, 0, 1, 2]}
    mixed = collate([packed, short], pad_token_id=0)
    assert "attention_mask" not in mixed
    # The padding of a packed batch is a document of its own (positions restart), trained on nothing.
    assert mixed["position_ids"][1].tolist() == [0, 1, 2, 0, 1, 2]
    assert mixed["labels"][1].tolist() == [-100, 5, 6, -100, -100, -100]


def test_length_grouped_batches_cover_every_row_once_longest_first() -> None:
    lengths = [(i * 37) % 101 + 1 for i in range(1000)]
    batches = list(iter_length_grouped_batches(lengths, 8, seed=1, mega_batch_factor=4))
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert max(lengths[i] for i in batches[0]) == max(lengths)
    assert batches == list(iter_length_grouped_batches(lengths, 8, seed=1, mega_batch_factor=4))
    assert batches != list(iter_length_grouped_batches(lengths, 8, seed=2, mega_batch_factor=4))
    # Grouping pays: a batch spans far less than the whole length range.
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)
    assert spread < 40  # random batches of 8 over lengths 1..101 span about 78
    assert all(len(b) == 8 for b in iter_length_grouped_batches(lengths[:21], 8, seed=0, drop_last=True))


# --- fingerprint and cache ----------------------------------------------------------------------------


def test_the_seed_is_in_the_fingerprint_only_where_it_shapes_the_rows(tmp_path: Path, tok_dir: str) -> None:
    # One example a row, a held-out file of its own: the seed changes nothing in the tokenized data, so neither in
    # its fingerprint (what the UIs show for "the same train.jsonl"). Packing shuffles the rows with it.
    from fulltune.data.store import fingerprint_covers

    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    held_out = write_jsonl(tmp_path / "eval.jsonl", PAIRS[:2])
    spec = DataSpec(train=train, eval=held_out, format="prompt_completion", max_length=64, packing=False)
    assert fingerprint_data(spec, tok_dir, seed=0) == fingerprint_data(spec, tok_dir, seed=1)
    assert "train.seed" not in fingerprint_covers(spec)
    packed = spec.model_copy(update={"packing": True})
    assert fingerprint_data(packed, tok_dir, seed=0) != fingerprint_data(packed, tok_dir, seed=1)
    assert "train.seed (packing shuffles the examples into rows with it)" in fingerprint_covers(packed)
    first, second = (tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=seed) for seed in (0, 1))
    assert first.path == second.path, "the same rows, the same directory"


def test_fingerprint_is_stable_and_tracks_every_input(tmp_path: Path, tok_dir: str) -> None:
    import shutil

    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    spec = DataSpec(train=train, format="prompt_completion", max_length=64)
    base = fingerprint_data(spec, tok_dir, seed=0)
    assert base == fingerprint_data(spec, tok_dir, seed=0)
    # Content-addressed: the same bytes under another name give the same fingerprint.
    moved = tmp_path / "copy" / "renamed.jsonl"
    moved.parent.mkdir()
    shutil.copy(train, moved)
    assert fingerprint_data(spec.model_copy(update={"train": str(moved)}), tok_dir, 0) == base

    changed = {
        fingerprint_data(spec.model_copy(update={"max_length": 32}), tok_dir, 0),
        fingerprint_data(spec.model_copy(update={"format": "text"}), tok_dir, 0),
        fingerprint_data(spec.model_copy(update={"packing": True}), tok_dir, 0),
        fingerprint_data(spec.model_copy(update={"eval_split": 0.2}), tok_dir, 0),
        fingerprint_data(spec, tok_dir, seed=1),
        fingerprint_data(spec, "some-org/some-tokenizer", 0),
    }
    assert base not in changed and len(changed) == 6
    other_tok = tmp_path / "tok"
    shutil.copytree(tok_dir, other_tok)
    assert fingerprint_data(spec, str(other_tok), 0) == base
    config = other_tok / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"<|pad|>"', '"<|eos|>"'))
    assert fingerprint_data(spec, str(other_tok), 0) != base
    (other_tok / "model.safetensors").write_bytes(b"weights are not hashed")
    with_weights = fingerprint_data(spec, str(other_tok), 0)
    assert with_weights == fingerprint_data(spec, str(other_tok), 0)

    write_jsonl(Path(train), PAIRS[:-1] + [{"prompt": "1+1=", "completion": "3"}])
    assert fingerprint_data(spec, tok_dir, 0) != base


def test_tokenized_cache_is_reused_and_rebuilt_when_broken(tmp_path: Path, tok_dir: str, monkeypatch) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    spec = DataSpec(train=train, format="prompt_completion", max_length=64, packing=False)  # as the stage resolves it
    work = tmp_path / "work"
    # A build killed half way by a dead process: its temp dir must not be mistaken for data, and goes away.
    fingerprint = fingerprint_data(spec, tok_dir, 0)
    stale = work / "tokenized" / dead_writers_temp_dir(fingerprint)
    stale.mkdir(parents=True)
    (stale / "train.parquet").write_bytes(b"half written")

    first = tokenize_dataset(spec, tok_dir, work, seed=0)
    assert Path(first.path) == work / "tokenized" / fingerprint and not stale.exists()
    assert sorted(p.name for p in (work / "tokenized").iterdir()) == [fingerprint]
    mtimes = {p.name: p.stat().st_mtime_ns for p in Path(first.path).iterdir()}

    def no_work(*args, **kwargs):
        raise AssertionError("a cache hit must not rebuild")

    with monkeypatch.context() as patch:
        patch.setattr(data_store, "_build", no_work)
        assert tokenize_dataset(spec, tok_dir, work, seed=0) == first
    assert {p.name: p.stat().st_mtime_ns for p in Path(first.path).iterdir()} == mtimes
    assert load_tokenized(first.path) == first

    (Path(first.path) / "eval.parquet").unlink()  # files gone: the cache entry is not used
    with pytest.raises(DataError, match="eval.parquet"):
        load_tokenized(first.path)
    assert tokenize_dataset(spec, tok_dir, work, seed=0) == first
    assert read_row_lengths(first.train_file).tolist() == [len(r["input_ids"]) for r in rows(first.train_file)]


def dead_writers_temp_dir(key: str) -> str:
    """The build directory name (storage.temp_dir_name) a process that has since ended wrote under."""
    import subprocess
    import sys

    script = f"from fulltune.storage import temp_dir_name; print(temp_dir_name({key!r}))"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.strip()


# --- loading and user errors --------------------------------------------------------------------------


def test_load_records_reads_every_supported_file_type(tmp_path: Path) -> None:
    import pyarrow as pa

    write_jsonl(tmp_path / "a.jsonl", PAIRS)
    (tmp_path / "b.json").write_text(json.dumps(PAIRS, indent=2))
    csv_lines = "".join(f"{p['prompt']},{p['completion']}\n" for p in PAIRS)
    (tmp_path / "c.csv").write_text("prompt,completion\n" + csv_lines)
    pq.write_table(pa.Table.from_pylist(PAIRS), tmp_path / "d.parquet")
    (tmp_path / "e.txt").write_text("first line\n\n  \nsecond line\n")
    for name in ("a.jsonl", "b.json", "c.csv", "d.parquet"):
        loaded = load_records(str(tmp_path / name), what="data.train", cache_dir=tmp_path / "cache")
        assert [str(r["completion"]) for r in loaded] == [p["completion"] for p in PAIRS], name
    assert load_records(str(tmp_path / "e.txt"), what="data.train")["text"] == ["first line", "second line"]
    shards = tmp_path / "shards"
    shards.mkdir()
    write_jsonl(shards / "0.jsonl", PAIRS[:2])
    write_jsonl(shards / "1.jsonl", PAIRS[2:])
    assert len(load_records(str(shards), what="data.train")) == len(PAIRS)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, r"data\.train: .*missing\.jsonl not found"),
        ("", r"data\.train: .*train\.jsonl is empty"),
        ('{"prompt": "a", "completion": "b"}\n{"prompt": "c", "completion": \n{"prompt": "e"}\n',
         r"train\.jsonl line 2: broken JSON"),
        ('{"prompt": "a", "completion": "b"}\n\n["not", "an", "object"]\n',
         r"train\.jsonl line 3: expected one JSON object"),
        ('{"prompt": "a", "completion": "b"}\n{"prompt": {"x": 1}, "completion": "d"}\n',
         r"data\.train: .*train\.jsonl line 2: column 'prompt' is a object here but a string on line 1"),
        ('{"question": "a", "completion": "b"}\n',
         r"train\.jsonl has no column 'prompt' \(columns: question, completion\)"),
        ('{"prompt": "a", "completion": "b"}\n{"prompt": 7, "completion": "d"}\n',
         r"data\.train: .*train\.jsonl line 2: column 'prompt' is a number here but a string on line 1"),
        ('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n',
         r"data\.train: .*train\.jsonl line 2: column 'completion' must be a string, got missing"),
        ('{"prompt": "a", "completion": "b"}\n', r"only 1 usable example; .* set data\.eval"),
    ],
    ids=["missing", "empty", "broken-line", "not-an-object", "type-change", "no-column", "wrong-type", "null", "one"],
)
def test_every_data_problem_is_a_data_error(tmp_path: Path, tok_dir: str, content: str | None, message: str) -> None:
    path = tmp_path / ("missing.jsonl" if content is None else "train.jsonl")
    if content is not None:
        path.write_text(content)
    spec = DataSpec(train=str(path), format="prompt_completion", max_length=32)
    with pytest.raises(DataError, match=message):
        tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    # Nothing half-built is left behind.
    tokenized = tmp_path / "work" / "tokenized"
    assert not tokenized.exists() or not any(tokenized.iterdir())


def test_more_data_errors(tmp_path: Path, tok_dir: str) -> None:
    broken_json = tmp_path / "doc.json"
    broken_json.write_text('[\n  {"text": "a"},\n  {"text": "b" "c"}\n]\n')
    with pytest.raises(DataError, match=r"doc\.json line 3: broken JSON"):
        load_records(str(broken_json), what="data.eval")
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(DataError, match=r"unsupported file type"):
        load_records(str(tmp_path / "notes.md"), what="data.train")
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    with pytest.raises(DataError, match=r"holds no data files"):
        load_records(str(empty_dir), what="data.train")
    with pytest.raises(DataError, match=r"data\.train: .*no examples"):
        (tmp_path / "blank.txt").write_text("\n \n")
        load_records(str(tmp_path / "blank.txt"), what="data.train")
    (tmp_path / "blank.jsonl").write_text("\n  \n")
    with pytest.raises(DataError, match=r"blank\.jsonl is empty"):
        load_records(str(tmp_path / "blank.jsonl"), what="data.train")
    with pytest.raises(DataError, match=r"no meta\.json"):
        load_tokenized(str(tmp_path))
    # Not a local path: a hub dataset id, which cannot load offline (tests run with HF_HUB_OFFLINE=1).
    with pytest.raises(DataError, match=r"data\.train: 'someorg/no-such-dataset' is not a local file .* Hub dataset"):
        load_records("someorg/no-such-dataset", what="data.train")
    with pytest.raises(DataError, match=r"not found"):
        load_records("data/no-such-file.jsonl", what="data.train")

    chat = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"from": "human", "value": "hi"}]}])
    with pytest.raises(DataError, match=r"chat\.jsonl line 1: message 1 in 'messages' needs string 'role'"):
        tokenize_dataset(DataSpec(train=chat, eval=chat, format="chat"), tok_dir, tmp_path / "w", 0)
    no_answer = write_jsonl(tmp_path / "q.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 3)
    with pytest.raises(DataError, match=r"no example .* has a target to train on: no 'assistant' message"):
        tokenize_dataset(DataSpec(train=no_answer, format="chat"), tok_dir, tmp_path / "w", 0)
    long_prompts = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "hello world " * 10, "completion": "x"}] * 3)
    with pytest.raises(DataError, match=r"raise it"):
        spec = DataSpec(train=long_prompts, format="prompt_completion", max_length=8)
        tokenize_dataset(spec, tok_dir, tmp_path / "w", 0)


def test_tokenized_data_written_without_the_target_count_gets_it_on_load(tmp_path: Path, tok_dir: str) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", PAIRS)
    spec = DataSpec(train=train, eval=train, format="prompt_completion", max_length=64)
    result = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    meta_file = Path(result.path) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["max_row_targets"]  # as an earlier fulltune wrote it
    meta_file.write_text(json.dumps(meta))
    assert load_tokenized(result.path).max_row_targets == result.max_row_targets > 0
    train_file = Path(result.train_file)
    train_file.write_bytes(b"\0" * train_file.stat().st_size)  # same size, not Parquet
    with pytest.raises(DataError, match="train.parquet: unreadable"):
        load_tokenized(result.path)


def test_csv_cells_are_text_as_written(tmp_path: Path) -> None:
    # Digit strings stay strings ("035", not 35); a completion "NA" or "null" is text; only an empty cell is missing.
    (tmp_path / "r.csv").write_text('prompt,completion\n"reverse 530=","035"\nreverse 12=,21\nsay NA=,NA\n'
                                    'say null=,null\n"a, b=",\n')
    loaded = load_records(str(tmp_path / "r.csv"), what="data.train", cache_dir=tmp_path / "cache")
    assert [r["completion"] for r in loaded] == ["035", "21", "NA", "null", None]
    assert loaded[4]["prompt"] == "a, b="


@pytest.mark.parametrize("name,head", [("t.jsonl", b'{"text": "ok"}\n'), ("t.csv", b"text\nok\n"), ("t.txt", b"ok\n"),
                                       ("t.json", b'[{"text": "ok"},\n')])
def test_text_that_is_not_utf8_names_the_file_line_and_byte(tmp_path: Path, monkeypatch, name: str, head: bytes) -> None:
    path = tmp_path / name
    bad = b'{"text": "caf\xe9"}\n' if name.endswith("jsonl") else b"caf\xe9\n"
    path.write_bytes(head + bad)
    line, byte = head.count(b"\n") + 1, len(head) + bad.index(0xE9)
    with pytest.raises(DataError, match=rf"data\.train: .*{name} line {line} \(byte {byte}\): not UTF-8"):
        load_records(str(path), what="data.train", cache_dir=tmp_path / "cache")
    # A character cut by the reader's chunk boundary is not an error; a truncated last character is.
    monkeypatch.setattr(data_files, "_READ_CHUNK", 5)
    path.write_bytes(head + "naïve ☕\n".encode() * 3)
    assert data_files._find_utf8_problem(path) is None
    path.write_bytes(head + "☕".encode()[:2])
    assert f"line {line} (byte {len(head)}): not UTF-8" in data_files._find_utf8_problem(path)
