"""Training data: load files, format and tokenize them, pack them into Parquet, batch them.

- `fulltune.data.files`: loading local files and hub datasets, and saying which file and line is broken;
- `fulltune.data.formats`: one function per `data.format`, the label convention, `tokenize_split`;
- `fulltune.data.store`: the tokenize stage (`tokenize_dataset`): fingerprints, packing, Parquet, reading
  it back (`load_tokenized`);
- `fulltune.data.batches`: collation and length-grouped batches for the trainer and the evaluator.

Heavy libraries (datasets, pyarrow, transformers, torch) are imported inside the functions that use
them so that importing this package stays cheap (`fulltune validate` imports the engine).
"""

from fulltune.data.batches import collate, iter_length_grouped_batches, read_row_lengths
from fulltune.data.files import SUFFIX_BUILDERS, load_records, local_data_files
from fulltune.data.formats import IGNORE_INDEX, adds_bos, encode_prompt, pad_token_id_of, tokenize_split
from fulltune.data.store import (
    TokenizedData,
    fingerprint_data,
    load_tokenized,
    row_target_counts,
    tokenize_dataset,
)

__all__ = [
    "IGNORE_INDEX", "SUFFIX_BUILDERS", "TokenizedData", "adds_bos", "collate", "encode_prompt", "fingerprint_data",
    "iter_length_grouped_batches", "load_records", "load_tokenized", "local_data_files", "pad_token_id_of",
    "read_row_lengths", "row_target_counts", "tokenize_dataset", "tokenize_split",
]
