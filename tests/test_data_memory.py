"""Memory that does not grow with the data: training maps train.arrow and reads only the rows it trains on,
evaluation reads eval.parquet a row group at a time."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fulltune.data import tokenize_dataset
from fulltune.data.batching import TokenizedRows
from fulltune.data.eval_rows import EvalRows
from fulltune.spec import DataSpec

from test_data import PAIRS, rows, tok_dir, write_jsonl  # noqa: F401  (tok_dir is a fixture)


@pytest.mark.parametrize("packing", [True, False])
def test_training_reads_the_mapped_rows_as_the_parquet_rows(tmp_path: Path, tok_dir: str, packing: bool) -> None:
    pairs = PAIRS + [{"prompt": f"{n}*{n}=", "completion": str(n * n)} for n in range(40)]
    spec = DataSpec(train=write_jsonl(tmp_path / "train.jsonl", pairs), format="prompt_completion", max_length=32,
                    packing=packing)
    data = tokenize_dataset(spec, tok_dir, tmp_path / "work", seed=0)
    mapped, parquet = TokenizedRows(data.train_rows_file), TokenizedRows(data.train_file)
    assert len(mapped) == len(parquet) == data.num_train_rows
    for name in ("lengths", "targets", "attention_pairs"):
        assert np.array_equal(getattr(mapped, name), getattr(parquet, name)), name
    every = np.arange(len(mapped))[::-1]
    assert mapped.rows(every) == parquet.rows(every) == [
        {k: r[k] for k in ("input_ids", "labels", "position_ids")} for r in reversed(rows(data.train_file))]
    assert int(mapped.targets.sum()) == data.train_label_tokens


def test_eval_rows_are_read_a_row_group_at_a_time_and_read_as_a_list(tmp_path: Path) -> None:
    table = pa.table({"input_ids": pa.array([[i, i + 1] for i in range(25)], pa.list_(pa.int32())),
                      "prompt": [f"p{i}" for i in range(25)]})
    pq.write_table(table, tmp_path / "eval.parquet", row_group_size=7)
    whole = table.to_pylist()
    eval_rows = EvalRows(str(tmp_path / "eval.parquet"))
    assert len(eval_rows) == 25 and list(eval_rows) == whole
    assert eval_rows[5:16] == whole[5:16] and eval_rows[20:99] == whole[20:] and eval_rows[::6] == whole[::6]
    assert eval_rows[0] == whole[0] and eval_rows[-1] == whole[-1]
    first = EvalRows(str(tmp_path / "eval.parquet"), max_examples=9)
    assert len(first) == 9 and list(first) == whole[:9] and first[:100] == whole[:9]
    with pytest.raises(IndexError):
        first[9]
    # Three sources of 10, 5 and 10 rows: max_examples keeps the first 4 of each, across row groups.
    table = table.append_column("completion", pa.array([None if 10 <= i < 15 else f"c{i}" for i in range(25)]))
    pq.write_table(table, tmp_path / "eval.parquet", row_group_size=7)
    whole = table.to_pylist()
    each = EvalRows(str(tmp_path / "eval.parquet"), max_examples=4, counts=[10, 5, 10])
    assert list(each) == whole[0:4] + whole[10:14] + whole[15:19] and each[3:6] == whole[3:4] + whole[10:12]
    assert each.has_completion(2, 10) == [True, True, False, False, False, False, True, True]


def test_the_plan_counts_the_host_ram_of_the_tokenized_data(tmp_path: Path, capsys) -> None:
    import json

    from fulltune.cli import main
    from fulltune.memory.process import DATA_ROW_BYTES
    from fulltune.stages import pin_hub_revisions, resolve_pipeline, tokenize, with_budget
    from fulltune.stages.runner import Inputs, key_of, run_stage

    from pipelines_fixture import tiny_pipeline

    path = tiny_pipeline(tmp_path, data={"packing": True})
    p = with_budget(pin_hub_revisions(resolve_pipeline(str(path), "tiny")))  # as `fulltune run` resolves it
    inputs = Inputs(p)
    data = run_stage(tokenize.STAGE, inputs, key_of(tokenize.STAGE, inputs)).data  # the stage, as a run starts
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    host = plan["data_host"]
    assert host["mapped"] == Path(data.train_rows_file).stat().st_size > 0
    assert host["row_index"] == data.num_train_rows * DATA_ROW_BYTES
    assert host["total"] == host["mapped"] + host["row_index"] + host["batches"] and host["ranks_per_node"] == 1
    assert main(["plan", "tiny", "-f", str(path)]) == 0
    assert "host RAM per machine for the training data:" in capsys.readouterr().out


# About 3M and 12M tokens: reading the whole train.parquet into every process (the trainer before
# train.arrow) grew the training process from 663 to 896 MiB here (+35%), more than the target allows.
SMALL_TOKENS, GROWTH = 3_000_000, 4


@pytest.mark.slow
def test_the_training_process_grows_at_most_25_percent_when_the_data_grows_4x(tmp_path: Path) -> None:
    """Through the real training child (fulltune/runtime/launch.py), a tiny model on the rows the tokenize
    stage's writer makes (measuring/memory_runs.py, as benchmarks/data_memory.py trains them): the peak RSS (the
    kernel's high-water mark) of the largest process on 4× the tokens is within 25% of that on 1×."""
    from measuring import measure

    from measuring import memory_runs

    model_dir = memory_runs.build_tiny_model(tmp_path)
    peaks = {}
    for tokens in (SMALL_TOKENS, GROWTH * SMALL_TOKENS):
        files = memory_runs.write_train_files(tmp_path / f"data-{tokens}", tokens)
        job = memory_runs.rows_job(model_dir, files["arrow"], tmp_path / f"run-{tokens}")
        peaks[tokens] = measure.training_memory("ranks", job)["ru_maxrss_bytes"]
    small, large = peaks[SMALL_TOKENS], peaks[GROWTH * SMALL_TOKENS]
    assert large <= 1.25 * small, f"peak RSS {small / 2**20:.0f} MiB → {large / 2**20:.0f} MiB on {GROWTH}× the data"


def test_a_cached_hub_dataset_of_several_shards_reads_every_shard_offline(tmp_path: Path, tok_dir: str,
                                                                        hf_home: Path) -> None:
    """A hub dataset is read from its cached snapshot, downloaded whole (README: "Checkpoints and datasets
    from the Hugging Face Hub"): a split kept as several Parquet shards trains on all of them, in shard
    order, as the same files in a local directory do."""
    from tiny import fake_hub_repo

    snapshot = fake_hub_repo(hf_home, "Org/Sharded.v1", "d" * 40, repo_type="dataset")
    (snapshot / "data").mkdir()
    local = tmp_path / "local" / "data"
    local.mkdir(parents=True)
    shards = [[{"prompt": f"{s}-{n}+1=", "completion": f"{s}{n}"} for n in range(4 + s)] for s in range(3)]
    for s, records in enumerate(shards):
        for root in (snapshot / "data", local):
            pq.write_table(pa.Table.from_pylist(records), root / f"train-{s:05d}-of-00003.parquet")
    options = {"format": "prompt_completion", "max_length": 32, "packing": False}
    hub_data = tokenize_dataset(DataSpec(train="Org/Sharded.v1", eval=str(local.parent), **options), tok_dir,
                                tmp_path / "work", seed=0)
    local_data = tokenize_dataset(DataSpec(train=str(local.parent), eval=str(local.parent), **options), tok_dir,
                                  tmp_path / "work", seed=0)
    assert hub_data.num_train_examples == sum(map(len, shards)) == 15
    assert hub_data.fingerprint != local_data.fingerprint  # the hub dataset counts by its commit
    assert Path(hub_data.train_rows_file).read_bytes() == Path(local_data.train_rows_file).read_bytes()
