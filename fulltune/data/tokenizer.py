"""Resolve the tokenizer a pipeline uses, or train one on its training data.

`model.tokenizer` is a path or hub id, absent (the checkpoint's own tokenizer), or `{vocab_size: N}`: a
byte-level BPE trained here on the training texts, for models built from a config. A hub tokenizer is
fetched as a snapshot of its repository without the weights (at `model.revision` when it is the model's
own, with the token of `model.token_env`; offline from the cache) and used from that directory, so every
stage loads the same files.
A trained tokenizer is content-addressed like every other output: `<workdir>/tokenizers/<key>/`, where
the key hashes the training file bytes and the options, and the same inputs give identical files.

The trained tokenizer:
- is byte-level (any UTF-8 text round-trips, no unknown token) and splits digits one by one, as the
  Llama 3 and Qwen tokenizers do, so numbers tokenize the same way wherever they appear;
- has the special tokens <|pad|> (id 0), <|bos|>, <|eos|> and the chat role tokens <|system|>,
  <|user|>, <|assistant|>, <|end|>; plain text is encoded as <|bos|> + text (like Llama);
- carries a chat template whose assistant turns are wrapped in `{% generation %}` so that
  `apply_chat_template(..., return_assistant_tokens_mask=True)` finds the tokens to train on:
  `<|bos|><|user|>hi<|end|><|assistant|>hello<|eos|>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from fulltune.data.files import load_records, local_data_files
from fulltune.data.formats import format_columns, require_columns
from fulltune.data.sources import Source, sources
from fulltune.data.files import update_hash_with_source
from fulltune import hub
from fulltune.errors import ConfigError
from fulltune.spec import DataSpec, ModelSpec, TrainTokenizer
from fulltune.storage import FileHashes, atomic_dir, hash_parts, remove_stale_temp_dirs

# Bump when the trained tokenizer changes (pre-tokenizer, special tokens, template): retrains it.
TOKENIZER_FORMAT_VERSION = 1
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
SPECIAL_TOKENS = (PAD, BOS, EOS, *ROLE_TOKENS)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|end|>' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def prepare_tokenizer(model: ModelSpec, data: DataSpec, workdir: str | Path) -> str:
    """Return a directory or hub id that `AutoTokenizer.from_pretrained` loads.

    - `model.tokenizer` is a string: a local directory (it must exist and hold tokenizer files) is
      returned as-is, a hub id as the directory of its snapshot;
    - `model.tokenizer` is absent: `model.name_or_path`, the same way;
    - `model.tokenizer` is `{vocab_size, min_frequency}`: a BPE tokenizer trained on `data.train`
      (formatted as `data.format` reads it), saved to `<workdir>/tokenizers/<key>/` and reused after.

    Raises ConfigError for a missing tokenizer directory or hub tokenizer, DataError for unusable
    training data.
    """
    from fulltune.models import hub_token

    token = hub_token(model.token_env)
    if isinstance(model.tokenizer, TrainTokenizer):
        return str(train_tokenizer(data, model.tokenizer, workdir, token=token))
    reference = model.tokenizer if model.tokenizer is not None else model.name_or_path
    if reference is None:  # the spec requires model.tokenizer with model.from_config
        raise ConfigError("model.tokenizer is required with model.from_config (a path, or {vocab_size: N})")
    field = "model.tokenizer" if model.tokenizer is not None else "model.name_or_path"
    return _check_reference(reference, field, tokenizer_revision(model), token)


def tokenizer_revision(model: ModelSpec) -> str | None:
    """`model.revision` applies to the tokenizer when it comes from the model's own repository."""
    same = model.tokenizer is None or model.tokenizer == model.name_or_path
    return model.revision if same else None


def _check_reference(reference: str, field: str, revision: str | None = None, token: str | None = None) -> str:
    path = Path(reference).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ConfigError(f"{field}: {reference} is a file; point it at the directory holding the tokenizer files")
        if not any((path / name).is_file() for name in TOKENIZER_FILES):
            raise ConfigError(
                f"{field}: {reference} holds no tokenizer files ({', '.join(TOKENIZER_FILES)}); "
                "point model.tokenizer at a tokenizer directory"
            )
        return reference
    if hub.looks_local(reference):
        raise ConfigError(f"{field}: directory {reference} not found (resolved to {path.resolve()}); check the path")
    try:
        return str(hub.snapshot(reference, revision, "model", token, ignore_patterns=hub.WEIGHT_PATTERNS))
    except hub.HubError as exc:
        raise ConfigError(f"{field}: {reference!r} is not a local directory ({path.resolve()} does not exist), "
                          f"and as a hub tokenizer: {exc}") from None


def tokenizer_key(data: DataSpec, options: TrainTokenizer, token: str | None = None,
                  workdir: str | Path | None = None) -> str:
    """sha256 of the training file bytes and every option that changes the trained tokenizer (file
    digests remembered in `workdir` when given)."""
    h = hashlib.sha256()
    hash_parts(h, "fulltune-tokenizer", str(TOKENIZER_FORMAT_VERSION))
    with FileHashes(workdir) as hashes:
        for source in sources(data, "train"):  # one source keys as data.train alone always has
            update_hash_with_source(h, source.reference, what=source.what, token=token, hashes=hashes)
            settings = {"format": source.data.format, "fields": list(format_columns(source.data).values()),
                        "vocab_size": options.vocab_size, "min_frequency": options.min_frequency}
            hash_parts(h, json.dumps(settings, sort_keys=True))
    return h.hexdigest()


def training_texts(data: DataSpec, cache_dir: str | Path | None = None, token: str | None = None) -> Iterator[str]:
    """The strings the tokenizer is trained on, as tokenize_dataset will tokenize them: texts; prompts and
    completions separately; chat message contents (role markers are special tokens). Every source of
    data.train once, whatever its weight."""
    for source in sources(data, "train"):
        yield from _source_texts(source, cache_dir, token)


def _source_texts(source: Source, cache_dir: str | Path | None, token: str | None) -> Iterator[str]:
    records = load_records(source.reference, what=source.what, cache_dir=cache_dir, token=token)
    require_columns(records, source.data, source=source.reference, what=source.what)
    columns = list(format_columns(source.data).values())
    # Only a record's first max_length tokens are ever trained on; a 200 MB record would otherwise cost
    # the BPE trainer minutes and tens of GB. 64 characters a token is more than a learned vocabulary holds.
    most = (source.data.max_length + 1) * 64 + 4096
    for batch in records.select_columns(columns).iter(batch_size=1000):
        for column in columns:
            for value in batch[column]:
                if isinstance(value, str):
                    yield value[:most]
                elif isinstance(value, list):  # chat messages; tokenize_dataset reports malformed ones
                    for message in value:
                        if isinstance(message, dict) and isinstance(message.get("content"), str):
                            yield message["content"][:most]


def train_tokenizer(data: DataSpec, options: TrainTokenizer, workdir: str | Path, token: str | None = None) -> Path:
    """Train (or reuse) the byte-level BPE tokenizer for `data`; returns its directory."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Checks data.train exists before anything is created (DataError otherwise).
    for source in sources(data, "train"):
        local_data_files(source.reference, source.what)
    root = Path(workdir) / "tokenizers"
    final = root / tokenizer_key(data, options, token, workdir)
    if _is_intact(final):
        return final
    root.mkdir(parents=True, exist_ok=True)
    remove_stale_temp_dirs(root)
    with atomic_dir(final, _is_intact) as tmp:
        texts = training_texts(data, cache_dir=tmp / "datasets-cache", token=token)
        tokenizer = build_tokenizer(texts, options)
        shutil.rmtree(tmp / "datasets-cache", ignore_errors=True)
        tokenizer.save_pretrained(str(tmp))
    return final


def build_tokenizer(texts: Iterable[str], options: TrainTokenizer) -> Any:
    """Train a byte-level BPE on `texts` and wrap it as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=options.vocab_size,
        min_frequency=options.min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # every byte: no unknown tokens
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    bos_id = bpe.token_to_id(BOS)
    bpe.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
    )


def _is_intact(path: Path) -> bool:
    return (path / "tokenizer.json").is_file() and (path / "tokenizer_config.json").is_file()
