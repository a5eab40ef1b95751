"""Faults a user meets before any training: odd YAML, an unusable workdir, broken data files, a model whose
weights do not fit its config. Each is one message naming the field or the file and line, exit 2 at the
command line, and nothing written. (Damaged checkpoints are in tests/test_train.py, damaged stage
caches and held-out data with nothing to score in tests/test_flow.py.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from fulltune.cli import main
from fulltune.data import tokenize_dataset
from fulltune.errors import ConfigError, DataError
from fulltune.spec import DataSpec

from pipelines_fixture import TINY_LLAMA, tiny_pipeline
from tiny import make_model, make_tokenizer


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tests' BPE tokenizer with the chat template fulltune trains tokenizers with."""
    from transformers import AutoTokenizer

    from fulltune.data.tokenizer import CHAT_TEMPLATE

    directory = tmp_path_factory.mktemp("chat-tokenizer")
    make_tokenizer(directory)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


def write_jsonl(path: Path, records: list) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def exits_2(capsys: pytest.CaptureFixture, *args: str) -> str:
    """Run the CLI in this process; it must exit 2 with one message and no traceback. Returns stderr."""
    assert main(list(args)) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("error: "), err
    return err


# ---------------------------------------------------------------------------------------------------
# YAML: alias bombs and the numbers people write


def test_a_yaml_alias_bomb_is_refused_when_the_file_is_read(tmp_path: Path, capsys) -> None:
    path = tiny_pipeline(tmp_path)
    lines = ["lol0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"lol{n}: &a{n} [{', '.join([f'*a{n - 1}'] * 10)}]" for n in range(1, 9)]  # 10^9 values
    text = path.read_text().replace("        tie_word_embeddings: true",
                                    "        tie_word_embeddings: true\n        extra:\n" +
                                    "".join(f"          {line}\n" for line in lines))
    path.write_text(text)
    err = exits_2(capsys, "validate", str(path))
    assert "pipelines.yaml: line" in err and "expands to more than 100,000 values" in err
    (tmp_path / "clean").mkdir()
    clean = tiny_pipeline(tmp_path / "clean")
    err = exits_2(capsys, "plan", "tiny", "-f", str(clean),
                  "--set", "model.from_config.extra={" + ", ".join(lines) + ", top: *a8}")
    assert "--set model.from_config.extra" in err and "aliases" in err


def test_floats_in_exponent_notation_are_floats_inside_an_inline_config(tmp_path: Path, capsys) -> None:
    path = tiny_pipeline(tmp_path)
    path.write_text(path.read_text().replace("        tie_word_embeddings: true",
                                             "        tie_word_embeddings: true\n        rms_norm_eps: 1e-6"))
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["fits"]
    from fulltune.stages import resolve_pipeline

    assert resolve_pipeline(str(path), "tiny").spec.model.from_config["rms_norm_eps"] == 1e-6


# ---------------------------------------------------------------------------------------------------
# Workdir and model


def test_a_workdir_that_cannot_be_created_exits_2_before_anything_starts(tmp_path: Path, capsys, monkeypatch) -> None:
    path = tiny_pipeline(tmp_path)
    monkeypatch.setenv("FULLTUNE_WORKDIR", "/proc/fulltune-cannot-be-here")
    err = exits_2(capsys, "run", "tiny", "-f", str(path))
    assert "FULLTUNE_WORKDIR: cannot create or write the workdir /proc/fulltune-cannot-be-here" in err


def test_max_length_beyond_the_models_positions_is_refused_at_plan(tmp_path: Path, capsys) -> None:
    path = tiny_pipeline(tmp_path)
    positions = TINY_LLAMA["max_position_embeddings"]
    err = exits_2(capsys, "plan", "tiny", "-f", str(path), "--set", f"data.max_length={positions + 1}")
    assert f"pipelines.tiny.data.max_length: {positions + 1} is more than the {positions} positions" in err


def test_weights_that_do_not_fit_their_config_are_refused(tmp_path: Path) -> None:
    from fulltune.models import load_model

    model = Path(make_model(tmp_path / "model", make_tokenizer(tmp_path / "tok")))
    wider, deeper = tmp_path / "wider", tmp_path / "deeper"
    for target, change in ((wider, {"hidden_size": 64, "intermediate_size": 128}), (deeper, {"num_hidden_layers": 3})):
        shutil.copytree(model, target)
        config = json.loads((target / "config.json").read_text())
        (target / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=r"model\.name_or_path: .*wider: the weights do not fit its config\.json: "
                                          r"\d+ tensor\(s\) of another shape .*checkpoint \[\d+(, \d+)?\], config"):
        load_model(str(wider))
    with pytest.raises(ConfigError, match=r"deeper: .* 9 weight\(s\) the config needs are not in the checkpoint "
                                          r"\(model\.layers\.2\."):
        load_model(str(deeper))


# ---------------------------------------------------------------------------------------------------
# Data files: where the broken record is, and records nothing can be learned from


PAIR = {"prompt": "1+1=", "completion": "2"}


def test_a_wrong_typed_row_deep_in_a_jsonl_file_is_reported_at_its_line(tmp_path: Path, chat_tokenizer: str) -> None:
    records = [PAIR] * 1000 + [{"prompt": "2+2=", "completion": 4}]
    train = write_jsonl(tmp_path / "train.jsonl", records)
    with pytest.raises(DataError, match=r"data\.train: .*train\.jsonl line 1001: column 'completion' is a number "
                                        r"here but a string on line 1"):
        tokenize_dataset(DataSpec(train=train, format="prompt_completion"), chat_tokenizer, tmp_path / "w", 0)
    # With blank lines in between, the line is still the file's line, not the record's number.
    (tmp_path / "gaps.jsonl").write_text(json.dumps(PAIR) + "\n\n\n" + json.dumps({"prompt": "3+3="}) + "\n")
    with pytest.raises(DataError, match=r"gaps\.jsonl line 4: column 'completion' must be a string, got missing"):
        tokenize_dataset(DataSpec(train=str(tmp_path / "gaps.jsonl"), eval=train, format="prompt_completion"),
                         chat_tokenizer, tmp_path / "w", 0)


@pytest.mark.parametrize(("messages", "problem"), [
    ([{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "yo"}],
     r"message 1 has role 'usr'; roles are system, user, assistant, tool"),
    ([{"role": "assistant", "content": "hi"}, {"role": "user", "content": "yo"}],
     r"message 1 \(assistant\) comes before any user message"),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "c"}],
     r"message 3 \(system\) is not the first"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}],
     r"messages 1 and 2 are both user messages"),
    ([{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}, {"role": "assistant", "content": "c"}],
     r"message 2 \(tool\) follows a user message"),
], ids=["unknown-role", "assistant-first", "late-system", "two-users", "tool-after-user"])
def test_chat_roles_must_be_known_and_in_order(tmp_path: Path, chat_tokenizer: str, messages: list,
                                               problem: str) -> None:
    good = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "1+1="},
                         {"role": "assistant", "content": "call"}, {"role": "tool", "content": "2"},
                         {"role": "assistant", "content": "2"}]}
    train = write_jsonl(tmp_path / "chat.jsonl", [good] * 3 + [{"messages": messages}])
    with pytest.raises(DataError, match=rf"data\.train: .*chat\.jsonl line 4: column 'messages': {problem}"):
        tokenize_dataset(DataSpec(train=train, format="chat"), chat_tokenizer, tmp_path / "w", 0)


def test_a_parquet_file_of_the_wrong_schema_names_the_column_and_row(tmp_path: Path, chat_tokenizer: str) -> None:
    pq.write_table(pa.table({"question": ["1+1="] * 4, "answer": ["2"] * 4}), tmp_path / "renamed.parquet")
    with pytest.raises(DataError, match=r"renamed\.parquet has no column 'prompt' \(columns: question, answer\)"):
        tokenize_dataset(DataSpec(train=str(tmp_path / "renamed.parquet"), format="prompt_completion"),
                         chat_tokenizer, tmp_path / "w", 0)
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "completion": [[1], [2], [3]]}), tmp_path / "lists.parquet")
    with pytest.raises(DataError, match=r"lists\.parquet row 1: column 'completion' must be a string, got a list"):
        tokenize_dataset(DataSpec(train=str(tmp_path / "lists.parquet"), format="prompt_completion"),
                         chat_tokenizer, tmp_path / "w", 0)


def test_held_out_data_whose_targets_are_all_empty_is_refused(tmp_path: Path, chat_tokenizer: str) -> None:
    train = write_jsonl(tmp_path / "train.jsonl", [PAIR] * 8)
    empty = write_jsonl(tmp_path / "eval.jsonl", [{"prompt": "", "completion": ""}, {"prompt": "1+1=", "completion": " "}])
    with pytest.raises(DataError, match=r"data\.eval: no example in .*eval\.jsonl has a target to score: every "
                                        r"'completion' is empty"):
        tokenize_dataset(DataSpec(train=train, eval=empty, format="prompt_completion"), chat_tokenizer, tmp_path / "w", 0)
    assert not list((tmp_path / "w" / "tokenized").glob("[!.]*"))


def test_a_huge_record_is_cut_to_what_max_length_can_hold(tmp_path: Path, chat_tokenizer: str) -> None:
    """A 20 MB record: only as much text as max_length tokens can come from is tokenized; the tokens kept
    are the record's first max_length tokens, and the example counts as truncated."""
    from fulltune.data.formats import make_encoder
    from fulltune.models import load_tokenizer

    huge = "hello world " * (20 * 2**20 // 12)
    train = write_jsonl(tmp_path / "train.jsonl", [{"text": huge}] + [{"text": "the cat sat on the mat"}] * 7)
    data = DataSpec(train=train, eval=train, format="text", max_length=64)
    tokenized = tokenize_dataset(data, chat_tokenizer, tmp_path / "w", 0)
    assert tokenized.truncated_examples == 2  # the huge record, in train and in eval
    tokenizer = load_tokenizer(chat_tokenizer)
    encoder = make_encoder(tokenizer, data, train, chat_tokenizer)
    assert encoder.max_chars is not None and encoder.max_chars < 2**20
    row = pq.read_table(tokenized.eval_file)["input_ids"][0].as_py()
    expected = tokenizer(huge[:10_000], add_special_tokens=False)["input_ids"]
    assert row == (encoder.bos + expected)[:64]


# ---------------------------------------------------------------------------------------------------
# Registration


@pytest.mark.slow
def test_a_failed_registration_leaves_no_version_and_no_copy_of_the_model(tmp_path: Path, monkeypatch) -> None:
    """The registry fails after the weights were uploaded (a dropped connection): no version and no copy of
    the weights may stay behind, or every retry (Prefect makes two) adds another full copy."""
    from mlflow.tracking import MlflowClient

    from fulltune.tracking import gates, registry

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    registry.configure(tmp_path)
    model = make_model(tmp_path / "model", make_tokenizer(tmp_path / "tok"))
    run = registry.start_pipeline_run("p", {}, {}, tmp_path)

    def unreachable(self, *args, **kwargs):
        raise ConnectionError("the registry went away")

    monkeypatch.setattr(MlflowClient, "set_registered_model_alias", unreachable)
    with pytest.raises(ConnectionError):
        registry.register_model(model, "tiny", run, {registry.TAG_TRAIN_KEY: "k"}, {"eval_loss": 1.0},
                                gates.GateDecision(True, "no champion yet"))
    assert MlflowClient().search_model_versions("name='tiny'") == []
    assert not list(tmp_path.glob("mlartifacts/**/model.safetensors"))


def test_two_pipelines_sharing_a_workdir_never_share_an_evaluation_against_their_champions(tmp_path: Path) -> None:
    """The same weights and held-out data, each pipeline's own champion "version 1": the evaluations
    compare against different models, so their cache keys differ."""
    from fulltune.stages import resolve_pipeline

    from pipelines_fixture import evaluate_key

    path = tiny_pipeline(tmp_path)
    config = yaml.safe_load(path.read_text())
    other = {**config["pipelines"]["tiny"], "register": {"model_name": "other-model"}}
    config["pipelines"]["other"] = other
    path.write_text(yaml.safe_dump(config))
    tiny, second = resolve_pipeline(str(path), "tiny"), resolve_pipeline(str(path), "other")
    assert tiny.workdir == second.workdir
    assert evaluate_key(tiny, "k", "d", "1") != evaluate_key(second, "k", "d", "1")
    assert evaluate_key(tiny, "k", "d", None) == evaluate_key(tiny, "k", "d", None)


# ---------------------------------------------------------------------------------------------------
# A full disk


@pytest.mark.slow
@pytest.mark.server
def test_a_full_disk_while_tokenizing_exits_2_once_naming_the_filesystem(tmp_path: Path, capsys, monkeypatch) -> None:
    import errno
    import os

    from fulltune.data import store

    calls = []

    def full(data, tokenizer, seed, fingerprint, out, *args):
        calls.append(out)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out / "train.parquet"))

    monkeypatch.setattr(store, "_build", full)
    path = tiny_pipeline(tmp_path)
    assert main(["run", "tiny", "-f", str(path)]) == 2
    err = capsys.readouterr().err  # the run's log, then one line
    assert len(calls) == 1, "a full disk is not retried"
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert line.startswith("error: /") and "the filesystem is full" in line and "train.parquet" in line
    assert line.endswith("free some space, then rerun: it tokenizes again")
    assert not list((tmp_path / "work" / "tokenized").iterdir()), "nothing half-written stays"
