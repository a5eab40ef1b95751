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


def test_the_plan_counts_the_host_ram_of_the_tokenized_data(tmp_path: Path, capsys) -> None:
    import json

    from fulltune.cli import main
    from fulltune.memory.process import DATA_ROW_BYTES
    from fulltune.stages import pin_hub_revisions, resolve_pipeline, tokenize_key, with_budget
    from fulltune.stages.tokenize import tokenize

    from pipelines_fixture import tiny_pipeline

    path = tiny_pipeline(tmp_path, data={"packing": True})
    p = with_budget(pin_hub_revisions(resolve_pipeline(str(path), "tiny")))  # as `fulltune run` resolves it
    data, _ = tokenize(p, tokenize_key(p))  # the tokenize stage, as a run starts
    assert main(["plan", "tiny", "-f", str(path), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    host = plan["data_host"]
    assert host["mapped"] == Path(data.train_rows_file).stat().st_size > 0
    assert host["row_index"] == data.num_train_rows * DATA_ROW_BYTES
    assert host["total"] == host["mapped"] + host["row_index"] + host["batches"] and host["ranks_per_node"] == 1
    assert main(["plan", "tiny", "-f", str(path)]) == 0
    assert "host RAM per machine for the training data:" in capsys.readouterr().out
