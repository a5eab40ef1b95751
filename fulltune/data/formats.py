"""Formats: how a record becomes tokens and a label mask, one function per `data.format` (see FORMATS).

Label convention (one rule for every format, packed or not): `labels[i] != -100` exactly when token i is
a training target. transformers' `ForCausalLMLoss` shifts labels left (`labels[..., 1:]`), so token i is
predicted from position i-1; the first token of every document therefore always gets -100 (it has no
in-document predecessor: in a packed row it would be predicted from the previous document's last
token). `train_label_tokens` is then exactly the number of loss terms.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Any

from fulltune.data.files import RecordLocator
from fulltune.data.sources import option_path
from fulltune.errors import ConfigError, DataError
from fulltune.spec import DataSpec

if TYPE_CHECKING:
    import datasets
    import numpy as np
    import pyarrow as pa

IGNORE_INDEX = -100
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")

# The DataSpec options naming the columns each format reads.
FORMAT_FIELDS = {
    "text": ("text_field",),
    "prompt_completion": ("prompt_field", "completion_field"),
    "chat": ("messages_field",),
}
# What to check when no example of a split is left with a target.
_NO_LABELS_HINTS = {
    "text": "check that column '{data.text_field}' holds text",
    "prompt_completion": "prompts may fill all of data.max_length ({data.max_length}) — raise it",
    "chat": "conversations need an 'assistant' turn within data.max_length tokens",
}


# What a split whose every target is empty holds: nothing but the end-of-sequence (or end-of-turn) tokens
# to learn or score, and an exact match of 1.0 for any model that stops at once.
_NO_TARGET_TEXT = {
    "text": "every '{data.text_field}' is empty",
    "prompt_completion": "every '{data.completion_field}' is empty",
    "chat": "no 'assistant' message has any content",
}
# The roles a chat message may have; a conversation is an optional system message, then user and
# assistant turns taking turns, tool results answering the assistant message before them.
CHAT_ROLES = ("system", "user", "assistant", "tool")


def format_columns(data: DataSpec) -> dict[str, str]:
    """{option: column} of the columns `data.format` reads, e.g. {"text_field": "text"}."""
    return {option: getattr(data, option) for option in FORMAT_FIELDS[data.format]}


def require_columns(dataset: datasets.Dataset, data: DataSpec, *, source: str, what: str) -> None:
    """Raise DataError when the columns the format needs are missing."""
    for option, column in format_columns(data).items():
        if column not in dataset.column_names:
            have = ", ".join(dataset.column_names) or "none"
            raise DataError(
                f"{what}: {source} has no column '{column}' (columns: {have}); format {data.format} reads "
                f"{option_path(what, option)} — set it to the column that holds the data"
            )


def no_labels_message(what: str, source: str, data: DataSpec) -> str:
    """The DataError text for a split where no example has a token to train on."""
    hint = _NO_LABELS_HINTS[data.format].format(data=data)
    return f"{what}: no example in {source} has a token to train on after truncation; {hint}"


def no_target_text_message(what: str, source: str, data: DataSpec) -> str:
    """The DataError text for a split where no example has any text in its target."""
    verb = "score" if what == "data.eval" else "train on"
    return (f"{what}: no example in {source} has a target to {verb}: {_NO_TARGET_TEXT[data.format].format(data=data)}; "
            f"fix the data or point {what} at another file")


def adds_bos(tokenizer: Any) -> bool:
    """Whether the tokenizer puts a bos token in front of plain text (as the model saw in pretraining)."""
    if tokenizer.bos_token_id is None:
        return False
    return tokenizer("a", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id]


def encode_prompt(tokenizer: Any, prompt: str) -> list[int]:
    """Token ids of a prompt exactly as training saw it (`bos?` + prompt): what generation starts from."""
    bos = [tokenizer.bos_token_id] if adds_bos(tokenizer) else []
    return bos + tokenizer(prompt, add_special_tokens=False)["input_ids"]


def pad_token_id_of(tokenizer: Any) -> int:
    """The id collate pads with: the pad token, else eos (padding is never attended to or trained)."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if token_id is not None:
            return int(token_id)
    return 0


# ---------------------------------------------------------------------------------------------------
# One function per format: (encoder, batch of records, their indices) → examples, prompts, completions.
# An example is (token ids, targets): targets is the index where the trained part starts, or a
# per-token 0/1 mask (chat). A batch's examples are `Tokens`: their ids one after another, in numpy.

Example = tuple[list[int], Any]


@dataclass(frozen=True)
class Tokens:
    """A batch's examples: every example's token ids one after another, and where each one's targets are."""

    ids: np.ndarray  # int32, the examples' tokens concatenated
    lengths: np.ndarray  # int64, tokens per example
    start: np.ndarray | None = None  # int64 per example: the index where its trained part starts, or
    mask: np.ndarray | None = None  # bool per token: whether it is trained (chat)

    @staticmethod
    def of(examples: list[Example]) -> Tokens:
        """The Tokens of (ids, targets) pairs."""
        import numpy as np

        lengths = np.fromiter((len(ids) for ids, _ in examples), np.int64, len(examples))
        total = int(lengths.sum())
        ids = np.fromiter(chain.from_iterable(ids for ids, _ in examples), np.int32, total)
        if examples and isinstance(examples[0][1], list):  # a per-token mask
            return Tokens(ids, lengths, mask=np.fromiter(chain.from_iterable(m for _, m in examples), bool, total))
        return Tokens(ids, lengths, start=np.fromiter((t for _, t in examples), np.int64, len(examples)))


@dataclass(frozen=True)
class Encoder:
    """What every format function needs: the tokenizer, its special tokens, and where records come from."""

    tok: Any
    data: DataSpec
    source: str  # the file or hub dataset, for messages
    reference: str  # the tokenizer reference, for messages
    bos: list[int]
    eos: list[int]
    marks_assistant: bool  # the chat template wraps assistant turns in {% generation %}
    what: str = ""  # the YAML field the records come from (data.train), for messages
    locate: RecordLocator | None = None  # record index → file and line, for messages
    max_chars: int | None = None  # texts are cut to this many characters before tokenizing (see _max_chars)

    def where(self, index: int) -> str:
        """`data.train: train.jsonl line 1001` (or `<source>: record N` where no file is known)."""
        place = self.locate(index) if self.locate is not None else f"{self.source}: record {index + 1}"
        return f"{self.what}: {place}" if self.what else place

    def strings(self, batch: dict[str, list[Any]], column: str, indices: list[int]) -> list[str]:
        """The column's values, which must all be strings."""
        values = batch[column]
        if set(map(type, values)) <= {str}:  # every one a string (the common case, checked without a loop)
            if self.max_chars is None or max(map(len, values), default=0) <= self.max_chars:
                return values
            return [self.cut(value) for value in values]
        for value, index in zip(values, indices):
            if not isinstance(value, str):
                # A JSON column whose type changes may have been converted for every record by the
                # loader: then the line where it changes is the one to fix, not this record.
                problem = self.locate.type_problem() if self.locate is not None and value is not None else None
                if problem:
                    raise DataError(f"{self.what}: {problem}" if self.what else problem)
                got = "missing (null)" if value is None else f"a {type(value).__name__}"
                raise DataError(f"{self.where(index)}: column '{column}' must be a string, got {got}; fix the record")
        return [self.cut(value) for value in values]

    def cut(self, text: str) -> str:
        """`text`, or its first `max_chars` characters: all that max_length tokens can be cut from."""
        return text if self.max_chars is None or len(text) <= self.max_chars else text[: self.max_chars]


def make_encoder(tokenizer: Any, data: DataSpec, source: str, reference: str, what: str = "",
                 locate: RecordLocator | None = None) -> Encoder:
    """An Encoder for `data.format`; ConfigError when the tokenizer lacks what the format needs."""
    template = tokenizer.chat_template if data.format == "chat" else None
    if data.format == "chat" and not template:
        raise ConfigError(
            f"tokenizer {reference!r} has no chat template; format chat needs one — use a chat "
            "tokenizer, or model.tokenizer: {vocab_size: N} to train one with a template"
        )
    if data.format != "chat" and tokenizer.eos_token_id is None:
        raise ConfigError(
            f"tokenizer {reference!r} has no eos token; formats text and prompt_completion end every "
            "example with it — use a tokenizer that has one"
        )
    return Encoder(
        tok=tokenizer, data=data, source=source, reference=reference,
        bos=[tokenizer.bos_token_id] if adds_bos(tokenizer) else [],
        eos=[tokenizer.eos_token_id] if data.format != "chat" else [],
        marks_assistant=bool(template and _GENERATION_TAG.search(str(template))),
        what=what, locate=locate, max_chars=_max_chars(tokenizer, data.max_length),
    )


def _max_chars(tokenizer: Any, max_length: int) -> int | None:
    """How many characters of a text can end up in its first max_length tokens: max_length + 1 tokens of
    the vocabulary's longest entry (an entry never covers more characters than it is long), and a margin
    for merges across the cut. Tokenizing only that much keeps a 200 MB record from taking minutes and
    gigabytes for the few thousand tokens kept; the example is counted as truncated all the same."""
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=0)
    except (AttributeError, NotImplementedError, TypeError):
        return None
    return (max_length + 1) * max(longest, 1) + 4096


def _encode(enc: Encoder, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, no special tokens: the fast tokenizer's backend directly (what
    `tokenizer(texts)` runs, without building its BatchEncoding), a slow tokenizer through its call."""
    backend = getattr(enc.tok, "backend_tokenizer", None)
    if backend is None:
        return enc.tok(texts, add_special_tokens=False)["input_ids"]
    return [encoding.ids for encoding in backend.encode_batch_fast(texts, add_special_tokens=False)]


def _joined(enc: Encoder, pieces: list[list[list[int]]]) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
    """bos + pieces[0][i] + pieces[1][i] + ... + eos for every example i, assembled in numpy rather than as a
    Python list per example: (the examples' ids one after another, their lengths, where each piece starts)."""
    import numpy as np

    n = len(pieces[0])
    piece_lengths = [np.fromiter(map(len, piece), np.int64, n) for piece in pieces]
    lengths = len(enc.bos) + len(enc.eos) + sum(piece_lengths, np.zeros(n, np.int64))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    ids = np.empty(int(lengths.sum()), np.int32)
    for k, token in enumerate(enc.bos):
        ids[starts + k] = token
    at, piece_starts = starts + len(enc.bos), []
    for piece, length in zip(pieces, piece_lengths):
        total = int(length.sum())
        within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(length) - length, length)
        ids[np.repeat(at, length) + within] = np.fromiter(chain.from_iterable(piece), np.int32, total)
        piece_starts.append(at - starts)
        at = at + length
    for k, token in enumerate(enc.eos):
        ids[at + k] = token
    return ids, lengths, piece_starts


def _text(enc: Encoder, batch: dict[str, list[Any]], indices: list[int]) -> tuple[Tokens, list, list]:
    """bos? + text + eos, every token a target."""
    import numpy as np

    texts = enc.strings(batch, enc.data.text_field, indices)
    ids, lengths, _ = _joined(enc, [_encode(enc, texts)])
    nothing = [None] * len(texts)
    return Tokens(ids, lengths, start=np.zeros(len(texts), np.int64)), nothing, nothing


def _prompt_completion(enc: Encoder, batch: dict[str, list[Any]],
                       indices: list[int]) -> tuple[Tokens, list, list]:
    """bos? + prompt + completion + eos, the completion and eos the targets."""
    prompts = enc.strings(batch, enc.data.prompt_field, indices)
    completions = enc.strings(batch, enc.data.completion_field, indices)
    # Separately tokenized, then concatenated: the prompt/completion boundary is exact and matches
    # generation, which starts from the prompt's tokens.
    ids, lengths, (_, completion_start) = _joined(enc, [_encode(enc, prompts), _encode(enc, completions)])
    return Tokens(ids, lengths, start=completion_start), prompts, completions


def _chat(enc: Encoder, batch: dict[str, list[Any]], indices: list[int]) -> tuple[Tokens, list, list]:
    """The conversation through the chat template, the assistant turns the targets."""
    from jinja2.exceptions import TemplateError

    conversations = [_messages(enc, m, i) for m, i in zip(batch[enc.data.messages_field], indices)]
    nothing = [None] * len(conversations)
    if enc.marks_assistant:
        try:
            out = enc.tok.apply_chat_template(
                conversations, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return Tokens.of(list(zip(out["input_ids"], out["assistant_masks"]))), nothing, nothing
        except TemplateError:
            pass  # find the record the template rejects, below
    return (Tokens.of([_chat_one(enc, messages, index) for messages, index in zip(conversations, indices)]),
            nothing, nothing)


FORMATS: dict[str, Callable[[Encoder, dict[str, list[Any]], list[int]], tuple[Tokens, list, list]]] = {
    "text": _text,
    "prompt_completion": _prompt_completion,
    "chat": _chat,
}


def _messages(enc: Encoder, value: Any, index: int) -> list[dict[str, str]]:
    column = enc.data.messages_field
    if not isinstance(value, list) or not value:
        got = "missing (null)" if value is None else f"a {type(value).__name__}" if value != [] else "empty"
        raise DataError(
            f"{enc.where(index)}: column '{column}' must be a non-empty list of "
            f"{{role, content}} messages, got {got}; fix the record"
        )
    messages = []
    for n, message in enumerate(value, 1):
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise DataError(
                f"{enc.where(index)}: message {n} in '{column}' needs string 'role' and 'content' "
                f"keys, got {message!r:.80}; fix the record"
            )
        messages.append({"role": message["role"], "content": enc.cut(message["content"])})
    problem = _conversation_problem([m["role"] for m in messages])
    if problem:
        raise DataError(f"{enc.where(index)}: column '{column}': {problem}; fix the record")
    return messages


def _conversation_problem(roles: list[str]) -> str | None:
    """What is wrong with a conversation's order of roles (see CHAT_ROLES), or None.

    Templates render whatever they are given: an unknown role (`asistant`) or a reply without its
    question would train the model on a conversation no user will ever have.
    """
    previous = None
    for n, role in enumerate(roles, 1):
        if role not in CHAT_ROLES:
            return f"message {n} has role {role!r}; roles are {', '.join(CHAT_ROLES)}"
        if role == "system" and n > 1:
            return f"message {n} (system) is not the first; only the first message may be a system message"
        if role != "system" and previous in (None, "system") and role != "user":
            return f"message {n} ({role}) comes before any user message; a conversation starts with one"
        if role == previous and role in ("user", "assistant"):
            return f"messages {n - 1} and {n} are both {role} messages; user and assistant take turns"
        if role == "tool" and previous not in ("assistant", "tool"):
            return f"message {n} (tool) follows a {previous} message; a tool result answers an assistant message"
        previous = role
    return None


def _chat_one(enc: Encoder, messages: list[dict[str, str]], index: int) -> tuple[list[int], list[int]]:
    from jinja2.exceptions import TemplateError

    try:
        if enc.marks_assistant:
            out = enc.tok.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            return out["input_ids"], out["assistant_masks"]
        text, spans = _assistant_spans(enc, messages)
    except TemplateError as exc:
        raise DataError(f"{enc.where(index)}: the chat template rejects this conversation: {exc}") from None
    encoded = enc.tok(text, add_special_tokens=False, return_offsets_mapping=True)
    mask = [0] * len(encoded["input_ids"])
    # A token is an assistant token when it overlaps an assistant span (as transformers does for
    # `{% generation %}` templates).
    for n, (start, end) in enumerate(encoded["offset_mapping"]):
        if any(start < span_end and end > span_start for span_start, span_end in spans):
            mask[n] = 1
    return encoded["input_ids"], mask


def _assistant_spans(enc: Encoder, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """Character spans of the assistant turns, by rendering the conversation's prefixes.

    For templates without `{% generation %}`: turn i spans from the end of
    render(messages[:i], add_generation_prompt=True) to the end of render(messages[:i+1]), so the
    template's end-of-turn tokens are trained and the assistant header is not.
    """
    render = enc.tok.apply_chat_template
    full = render(messages, tokenize=False)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = render(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        upto = render(messages[: i + 1], tokenize=False)
        if not (full.startswith(upto) and upto.startswith(prefix)):
            raise ConfigError(
                f"the chat template of tokenizer {enc.reference!r} does not render conversations "
                "prefix by prefix, so the assistant turns cannot be located; use a template with "
                "{% generation %} markers"
            )
        spans.append((len(prefix), len(upto)))
    return full, spans


# ---------------------------------------------------------------------------------------------------
# Labels and truncation, the same for every format


def _labelled(tokens: Tokens, max_length: int) -> tuple[pa.Array, pa.Array, np.ndarray, np.ndarray]:
    """(input_ids, labels, targets per example, truncated per example): list<int32> arrays cut to max_length.

    One flat numpy pass over the batch's tokens rather than a Python list per example."""
    import numpy as np
    import pyarrow as pa

    ids, lengths = tokens.ids, tokens.lengths
    n, total = len(lengths), len(ids)
    starts = np.repeat(np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64), lengths)
    position = np.arange(total, dtype=np.int64) - starts
    if tokens.mask is not None:  # a per-token mask
        trained = tokens.mask.copy()
    else:  # the index where the trained part starts
        assert tokens.start is not None
        trained = position >= np.repeat(tokens.start, lengths)
    trained &= position > 0  # never predicted: see the module docstring
    kept = position < max_length
    cut = np.minimum(lengths, max_length)
    offsets = pa.array(np.concatenate([[0], np.cumsum(cut)]).astype(np.int32))
    labels = np.where(trained, ids, IGNORE_INDEX).astype(np.int32)[kept]
    targets = np.bincount(np.repeat(np.arange(n), cut), weights=trained[kept], minlength=n)
    return (pa.ListArray.from_arrays(offsets, pa.array(ids[kept])), pa.ListArray.from_arrays(offsets, pa.array(labels)),
            targets.astype(np.int64), lengths > max_length)


def has_target_text(data: DataSpec, batch: dict[str, list[Any]]) -> list[bool]:
    """Whether each (validated) record's target holds text: a non-blank text or completion, an assistant
    message with content. Without it the only targets are the end-of-sequence or end-of-turn tokens."""
    if data.format == "text":
        return [bool(text.strip()) for text in batch[data.text_field]]
    if data.format == "prompt_completion":
        return [bool(completion.strip()) for completion in batch[data.completion_field]]
    return [any(m["role"] == "assistant" and m["content"].strip() for m in messages)
            for messages in batch[data.messages_field]]


@dataclass(frozen=True)
class Encoded:
    """Records formatted and tokenized: the examples with a target (EXAMPLE_COLUMNS), and what was counted."""

    table: pa.Table
    truncated: int  # examples cut to max_length
    dropped: int  # examples left with no target after truncation
    has_target_text: bool  # some record's target holds text (see `has_target_text`)


# The columns of tokenized examples: list<int32> ids and labels, the record's target-text flag, and the
# prompt and completion strings (format prompt_completion; null for the others).
EXAMPLE_COLUMNS = ("input_ids", "labels", "has_target_text", "prompt", "completion")
BATCH = 1000  # records formatted and tokenized at a time


def encode_range(encoder: Encoder, records: datasets.Dataset, start: int, stop: int) -> Encoded:
    """Records `start`..`stop` as examples, BATCH at a time; an example's content does not depend on the
    batches, so ranges tokenized apart and concatenated equal the whole tokenized at once."""
    import pyarrow as pa

    data, tables, truncated, dropped, any_text = encoder.data, [], 0, 0, False
    for first in range(start, stop, BATCH):
        batch = records[first:min(first + BATCH, stop)]
        indices = list(range(first, min(first + BATCH, stop)))
        tokens, prompts, completions = FORMATS[data.format](encoder, batch, indices)
        input_ids, labels, targets, cut = _labelled(tokens, data.max_length)
        text = has_target_text(data, batch)
        table = pa.Table.from_arrays([input_ids, labels, pa.array(text, pa.bool_()),
                                      pa.array(list(prompts), pa.string()), pa.array(list(completions), pa.string())],
                                     schema=example_schema())
        keep = targets > 0
        tables.append(table if keep.all() else table.filter(pa.array(keep)))
        truncated, dropped, any_text = truncated + int(cut.sum()), dropped + int((~keep).sum()), any_text or any(text)
    return Encoded(pa.concat_tables(tables) if tables else example_schema().empty_table(), truncated, dropped,
                   any_text)


def example_schema() -> pa.Schema:
    """The Arrow schema of EXAMPLE_COLUMNS."""
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    return pa.schema(list(zip(EXAMPLE_COLUMNS, (ids, ids, pa.bool_(), pa.string(), pa.string()))))


def check_target_text(has_text: bool, data: DataSpec, *, source: str, what: str) -> None:
    """DataError when no record of a split has any text in its target (`Encoded.has_target_text`: an eval
    set of empty completions would score every model 1.0)."""
    if not has_text:
        raise DataError(no_target_text_message(what, source, data))


def start_encoding(records: datasets.Dataset, tokenizer: Any, data: DataSpec, *, source: str, what: str,
                   reference: str | None = None, locate: RecordLocator | None = None) -> Encoder:
    """The Encoder for `records`, once their columns are checked (DataError) and the tokenizer has what the
    format needs (ConfigError)."""
    encoder = make_encoder(tokenizer, data, source, reference or getattr(tokenizer, "name_or_path", "tokenizer"),
                           what=what, locate=locate)
    require_columns(records, data, source=source, what=what)
    return encoder


def tokenize_split(records: datasets.Dataset | list[dict[str, Any]], tokenizer: Any, data: DataSpec, *,
                   source: str, what: str, reference: str | None = None,
                   locate: RecordLocator | None = None) -> tuple[pa.Table, int, int]:
    """Format and tokenize records as `data.format` reads them (never packed), in this process.

    Returns (table, truncated, dropped): the EXAMPLE_COLUMNS of the examples left with a target.
    `source` and `what` (the YAML field) name the data in errors, `locate` the file and line of a record;
    `reference` the tokenizer. (The tokenize stage runs the same on every core: fulltune/data/workers.py.)

    Raises DataError for missing columns, malformed records, or records none of which has any text in its
    target; ConfigError for a tokenizer that lacks what the format needs.
    """
    import datasets

    if isinstance(records, list):
        records = datasets.Dataset.from_list(records)
    encoder = start_encoding(records, tokenizer, data, source=source, what=what, reference=reference, locate=locate)
    encoded = encode_range(encoder, records, 0, len(records))
    check_target_text(encoded.has_target_text, data, source=source, what=what)
    return encoded.table, encoded.truncated, encoded.dropped
