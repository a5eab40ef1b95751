"""Several sources in data.train / data.eval: per-source formats and fields, exact weights, per-source
caching, and messages that name the list item."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from fulltune.data import mix, tokenize_dataset
from fulltune.errors import DataError
from fulltune.spec import DataSpec, PipelinesFile

from test_data import PAIRS, rows, tok_dir, write_jsonl  # noqa: F401  (tok_dir is a fixture)

CHATS = [{"msgs": [{"role": "user", "content": f"say {word}"}, {"role": "assistant", "content": word}]}
         for word in ("hello", "world", "cat", "mat", "fun", "fine")]


def mixed_spec(tmp_path: Path, *, chat_weight: float = 2, pair_weight: float = 0.5, **data) -> DataSpec:
    """A chat source (its own format and field) and a prompt/completion source (the pipeline's), weighted."""
    chat = write_jsonl(tmp_path / "chat.jsonl", CHATS)
    pairs = write_jsonl(tmp_path / "pairs.jsonl", PAIRS + [{"prompt": f"{n}+{n}=", "completion": str(2 * n)}
                                                           for n in range(5)])  # 10 examples
    held_out = write_jsonl(tmp_path / "held-out.jsonl", PAIRS[:2])
    return DataSpec(train=[{"path": chat, "format": "chat", "messages_field": "msgs", "weight": chat_weight},
                           {"path": pairs, "weight": pair_weight}],
                    eval=[held_out, {"path": chat, "format": "chat", "messages_field": "msgs"}],
                    format="prompt_completion", max_length=64, packing=False, **data)


def test_sources_mix_formats_and_weights_exactly(tmp_path: Path, tok_dir: str) -> None:
    spec = mixed_spec(tmp_path)
    data = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)

    seen = Counter(tuple(row["input_ids"]) for row in rows(data.train_file))
    chat_rows = [key for key in seen if seen[key] == 2]
    pair_rows = [key for key in seen if seen[key] == 1]
    # Weight 2: each of the 6 conversations twice; weight 0.5: a seeded half of the 10 pairs, once each.
    assert len(chat_rows) == 6 and len(pair_rows) == 5 and data.num_train_examples == 17
    assert data.format == "chat+prompt_completion"
    # The eval sources follow each other: the 2 held-out pairs, then the 6 conversations.
    assert data.num_eval_examples == 8
    evaluation = rows(data.eval_file)
    assert [row["completion"] for row in evaluation[:2]] == [p["completion"] for p in PAIRS[:2]]
    assert all(row["completion"] is None for row in evaluation[2:])
    meta = json.loads((Path(data.path) / "meta.json").read_text())
    assert [(s["what"], s["examples"], s["per_epoch"]) for s in meta["sources"]["train"]] == [
        ("data.train[0]", 6, 12), ("data.train[1]", 10, 5)]

    # Deterministic: another workdir builds the same bytes.
    again = tokenize_dataset(spec, tok_dir, tmp_path / "other", seed=0)
    assert Path(again.train_file).read_bytes() == Path(data.train_file).read_bytes()
    reseeded = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=1)
    assert Counter(tuple(r["input_ids"]) for r in rows(reseeded.train_file)) != seen, "the half is seeded"


def test_each_source_is_tokenized_once_whatever_the_mix(tmp_path: Path, tok_dir: str, monkeypatch) -> None:
    tokenized: list[str] = []
    build = mix._tokenize_into
    monkeypatch.setattr(mix, "_tokenize_into", lambda out, source, *a: (tokenized.append(source.what),
                                                                        build(out, source, *a))[1])
    work = tmp_path / "work"
    spec = mixed_spec(tmp_path)
    first = tokenize_dataset(spec, tok_dir, work, seed=0)
    assert tokenized == ["data.train[0]", "data.train[1]", "data.eval[0]"], "the chat source is shared by train and eval"

    tokenized.clear()
    reweighted = tokenize_dataset(mixed_spec(tmp_path, pair_weight=1.5), tok_dir, work, seed=0)
    assert tokenized == [] and reweighted.path != first.path and reweighted.num_train_examples == 12 + 15

    extra = write_jsonl(tmp_path / "extra.jsonl", [{"prompt": "2+2=", "completion": "4"}] * 3)
    grown = spec.model_copy(update={"train": [*spec.train, spec.train[1].model_copy(update={"path": extra})]})
    assert tokenize_dataset(grown, tok_dir, work, seed=0).num_train_examples == 17 + 2
    assert tokenized == ["data.train[2]"]


def test_one_source_eval_split_holds_out_of_every_source(tmp_path: Path, tok_dir: str) -> None:
    spec = mixed_spec(tmp_path, chat_weight=1, pair_weight=1).model_copy(update={"eval": None, "eval_split": 0.25})
    data = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    assert (data.num_train_examples, data.num_eval_examples) == (12, 4)
    train = {tuple(r["input_ids"]) for r in rows(data.train_file)}
    assert train.isdisjoint(tuple(r["input_ids"]) for r in rows(data.eval_file))


def test_a_broken_record_names_the_list_item_file_and_line(tmp_path: Path, tok_dir: str) -> None:
    spec = mixed_spec(tmp_path)
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1=", "completion": "2"}\n{"prompt": "2+2=", "completion": 4}\n')
    spec = DataSpec.model_validate({**spec.model_dump(), "train": [*spec.model_dump()["train"], str(broken)]})
    with pytest.raises(DataError, match=r"^data\.train\[2\]: .*broken\.jsonl line 2: column 'completion' is a number"):
        tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    assert not any((tmp_path / "work" / "tokenized").glob("[!.]*"))

    renamed = tmp_path / "renamed.jsonl"
    renamed.write_text(broken.read_text().replace("prompt", "question"))
    spec = DataSpec.model_validate({**spec.model_dump(), "train": [*spec.model_dump()["train"][:2],
                                                                  {"path": str(renamed), "prompt_field": "q"}]})
    with pytest.raises(DataError, match=r"data\.train\[2\]: .*renamed\.jsonl has no column 'q' .* reads "
                                        r"data\.train\[2\]\.prompt_field"):
        tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)


def test_validation_names_the_list_item(tmp_path: Path) -> None:
    from fulltune.errors import ConfigError
    from fulltune.pipelines_file import validate_pipelines

    def problems(data: dict) -> str:
        raw = {"workdir": "w", "pipelines": {"p": {"model": {"name_or_path": "m"}, "data": data}}}
        with pytest.raises(ConfigError) as caught:
            validate_pipelines(raw)
        return str(caught.value)

    message = problems({"train": ["a.jsonl", {"path": "b.jsonl", "messages_feld": "m", "weight": 0}],
                        "eval": [{"path": "c.jsonl", "weight": 2}]})
    assert "pipelines.p.data.train[1].messages_feld: unknown key" in message
    assert "pipelines.p.data.train[1].weight: must be > 0" in message
    assert "pipelines.p.data.eval[0].weight: unknown key" in message
    assert "data.train: " in problems({"train": []})
    local = write_jsonl(tmp_path / "local.jsonl", PAIRS)
    with pytest.raises(DataError, match=r"data\.train\[1\]\.split: .*local\.jsonl is a local file"):
        tokenize_dataset(DataSpec(train=[local, {"path": local, "split": "validation"}]), "unused", tmp_path, 0)
    ok = validate_pipelines({"workdir": "w", "pipelines": {"p": {"model": {"name_or_path": "m"},
                                                                 "data": {"train": "a.jsonl"}}}})
    assert isinstance(ok, PipelinesFile) and ok.pipelines["p"].data.train == "a.jsonl"


def test_every_worker_count_writes_the_same_bytes_and_reports_the_same_record(tmp_path: Path, tok_dir: str) -> None:
    """2,100 records: one process, and three workers on shards of 1,000, 1,000 and 100 records."""
    records = [{"prompt": f"{n % 97}+{n % 13}=", "completion": str(n % 97 + n % 13)} for n in range(2100)]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    written = []
    for workers in (1, 3):
        spec = DataSpec(train=train, format="prompt_completion", max_length=16, packing=True, num_workers=workers)
        data = tokenize_dataset(spec, tok_dir, tmp_path / f"w{workers}", 0)
        written.append([Path(f).read_bytes() for f in (data.train_file, data.eval_file)])
        assert data.num_train_examples + data.num_eval_examples == 2100
    assert written[0] == written[1]

    records[1500] = {"prompt": "1+1=", "completion": None}
    records[2050] = {"prompt": None, "completion": "2"}
    broken = DataSpec(train=write_jsonl(tmp_path / "broken.jsonl", records), format="prompt_completion", num_workers=3)
    with pytest.raises(DataError, match=r"broken\.jsonl line 1501: column 'completion' must be a string"):
        tokenize_dataset(broken, tok_dir, tmp_path / "b", 0)


def test_unused_source_caches_are_pruned_but_not_recent_or_in_progress_ones(tmp_path: Path, tok_dir: str,
                                                                           monkeypatch) -> None:
    """A source whose file changed leaves its old cache; after a build, caches not used for an hour beyond the
    KEEP_SOURCES most recent go, unless a build in progress lists them."""
    import os
    import time

    from fulltune.storage import temp_dir_name

    work, caches = tmp_path / "work", tmp_path / "work" / "tokenized-sources"
    files = [write_jsonl(tmp_path / f"v{n}.jsonl", [{"prompt": f"{n}+{k}=", "completion": str(n + k)} for k in range(6)])
             for n in range(4)]
    shared = write_jsonl(tmp_path / "shared.jsonl", PAIRS)

    def build(version: int) -> set[str]:
        tokenize_dataset(DataSpec(train=[shared, files[version]], format="prompt_completion"), tok_dir, work, 0)
        return {p.name for p in caches.iterdir()}

    def cache_of(reference: str) -> str:
        return next(p.name for p in caches.iterdir() if json.loads((p / "meta.json").read_text())["reference"] == reference)

    for version in range(3):  # the second source's file is replaced twice: two stale caches
        build(version)
    fingerprint = {version: cache_of(files[version]) for version in range(3)}
    assert len(list(caches.iterdir())) == 4, "used in the last hour: nothing is pruned"

    hours_ago = time.time() - 2 * mix.IN_USE_SECONDS
    for n, fp in fingerprint.items():  # versions 0, 1, 2 last used 2 h ago, in that order
        os.utime(caches / fp / "meta.json", (hours_ago + n, hours_ago + n))
    in_progress = work / "tokenized" / temp_dir_name("0" * 64)  # another (live) run's build reads version 0
    in_progress.mkdir()
    (in_progress / mix.SOURCES_FILE).write_text(json.dumps([fingerprint[0]]))
    monkeypatch.setattr(mix, "KEEP_SOURCES", 3)
    left = build(3)
    # Kept: shared and version 3 (just used), version 2 (the third most recent), version 0 (in progress).
    assert left == {cache_of(shared), cache_of(files[3]), fingerprint[0], fingerprint[2]}

    (in_progress / mix.SOURCES_FILE).unlink()
    in_progress.rmdir()
    assert mix.prune_source_caches(work) == [fingerprint[0]]
    data = tokenize_dataset(DataSpec(train=[shared, files[0]], format="prompt_completion"), tok_dir, work, 0)
    assert data.num_train_examples > 0, "the tokenized dataset does not need its sources' caches"
