"""The sources of `data.train` and `data.eval`: one reference, or a list of them with per-source options.

A list item is a reference (file, directory, hub id) or a mapping `{path, weight, split, format,
<field>_field}`; what a mapping leaves out comes from the pipeline's `data.` options, so a chat source and a
prompt/completion source mix in one run. Each `Source` carries the `DataSpec` it is formatted with (the
pipeline's options with the item's overrides, `train` set to the item's reference), so the code that
formats one source (fulltune/data/formats.py) needs no notion of lists, and the YAML path (`what`) that
every message about it names: `data.train` for a single reference, `data.train[2]` for a list item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fulltune.errors import DataError
from fulltune.spec import DataSpec, EvalSource

OVERRIDES = ("format", "text_field", "prompt_field", "completion_field", "messages_field")


@dataclass(frozen=True)
class Source:
    """One source of a split: where its records are, how they are formatted, and how often they count."""

    what: str  # the YAML path in messages: data.train, data.train[2]
    reference: str  # a local path or a hub id (with `:split`)
    data: DataSpec  # the options this source is formatted with; data.train is `reference`
    weight: float = 1.0


def sources(data: DataSpec, split: Literal["train", "eval"]) -> list[Source]:
    """The sources of `data.train` or `data.eval` (none when data.eval is absent), in list order.

    Raises DataError when a list item names a `split` of a local file or directory (only a hub dataset
    has splits).
    """
    value = getattr(data, split)
    if value is None:
        return []
    if isinstance(value, str):
        return [Source(f"data.{split}", value, data.model_copy(update={"train": value, "eval": None}))]
    return [_item_source(data, item, f"data.{split}[{n}]") for n, item in enumerate(value)]


def _item_source(data: DataSpec, item: EvalSource, what: str) -> Source:
    reference = item.path
    if item.split is not None:
        if Path(item.path).expanduser().exists():
            raise DataError(f"{what}.split: {item.path} is a local file or directory; only a hub dataset has "
                            "splits — remove split or point path at a hub dataset")
        reference = f"{item.path}:{item.split}"
    overrides = {name: getattr(item, name) for name in OVERRIDES if getattr(item, name) is not None}
    spec = data.model_copy(update={"train": reference, "eval": None, **overrides})
    return Source(what, reference, spec, float(getattr(item, "weight", 1.0)))


def is_single(value: Any) -> bool:
    """Whether a `data.train`/`data.eval` value is one reference (absent counts as one: nothing to mix)."""
    return not isinstance(value, list)


def option_path(what: str, option: str) -> str:
    """The YAML path of a formatting option as it applies to source `what`: `data.messages_field` for
    the single source, `data.train[2].messages_field` for a list item (which may set it there)."""
    return f"{what}.{option}" if what.endswith("]") else f"data.{option}"


def map_references(value: Any, function: Callable[[str], str]) -> Any:
    """`value` (a reference, a list of sources, or None) with every reference replaced by `function(it)`."""
    if value is None:
        return None
    if isinstance(value, str):
        return function(value)
    return [item.model_copy(update={"path": function(item.path)}) for item in value]


def describe(value: Any) -> str:
    """A `data.train`/`data.eval` value for people: the reference, or the list with weights other than 1."""
    if isinstance(value, str):
        return value
    parts = []
    for item in value:
        weight = getattr(item, "weight", 1.0)
        name = item.path + (f":{item.split}" if item.split else "")
        parts.append(name if weight == 1 else f"{name} (weight {weight:g})")
    return ", ".join(parts)


def eval_source_names(data: DataSpec) -> list[str]:
    """The names per-source metrics carry (`eval_loss/<name>`), one per item of a `data.eval` list, in order: the
    file's or dataset's name without directory and extension (with `-<split>` for a hub split, however it is
    written), in the characters MLflow accepts in a metric name (`spec_gates.metric_part`), and `-<n>` (its list
    position) added to every name two items share, until none is shared. None for a single data.eval or none
    (one source: the total)."""
    if not isinstance(data.eval, list):
        return []
    names = [_source_name(item) for item in data.eval]
    while len(set(names)) < len(names):
        names = [f"{name}-{n}" if names.count(name) > 1 else name for n, name in enumerate(names)]
    return names


def _source_name(item: EvalSource) -> str:
    from fulltune import hub
    from fulltune.data.files import SUFFIX_BUILDERS
    from fulltune.spec_gates import metric_part

    path, split = item.path, item.split
    if split is None and ":" in path and not hub.looks_local(path, data_suffixes=tuple(SUFFIX_BUILDERS)):
        path, split = hub.split_dataset_id(path)  # `org/name:split`, as `{path: org/name, split: …}` is named
    return metric_part(Path(path.rstrip("/")).stem + (f"-{split}" if split else ""))


def generating_sources(data: DataSpec) -> list[bool]:
    """For each per-source name (`eval_source_names`, one item for a single or absent data.eval: the total),
    whether its rows carry a completion to compare a generation with: a `prompt_completion` source does, a chat or
    text one does not. Without data.eval the held-out rows come from every train source."""
    value = data.eval if data.eval is not None else data.train
    formats = [(item.format or data.format) for item in value] if isinstance(value, list) else [data.format]
    if isinstance(data.eval, list):
        return [f == "prompt_completion" for f in formats]
    return [any(f == "prompt_completion" for f in formats)]
