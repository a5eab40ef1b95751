"""Reading YAML written by people: safe, bounded, and with the numbers they mean.

Every YAML fulltune reads (pipelines files and `--set` values) goes through `load`, which is
`yaml.safe_load` (no Python objects, no code) plus two things PyYAML's YAML 1.1 rules get wrong for a
config file:

- **Aliases are bounded.** `&a [x, x]` / `&b [*a, *a]` / ... doubles with each line: ten lines of
  aliases ("billion laughs") become a billion values once anything walks the tree (merging defaults,
  validation, hashing the config). PyYAML shares aliased nodes, so the document itself loads small;
  `load` counts the values the document holds with every alias expanded, in time linear in its size,
  and refuses it past `MAX_VALUES` (or when an alias contains itself), before anything walks it.
- **A key appears once in a mapping.** YAML 1.1 lets a later `train:` replace an earlier one in the same
  mapping without a word: a pipeline with two `train:` blocks (or two pipelines of one name) trained with
  the second only. `load` refuses a mapping that repeats a key, naming both lines and the key's path.
- **Floats are read as YAML 1.2 reads them.** YAML 1.1 makes `1e-6`, `3e5` and `1.0e6` strings (it
  wants a dot and a signed exponent); a user writing `rms_norm_eps: 1e-6` means a float. Inside an
  inline `model.from_config`, where no schema converts the string, it reached transformers as `'1e-6'`.
"""

from __future__ import annotations

import re
from typing import Any

import yaml

# Values (scalars, lists, mappings) a document may hold with its aliases expanded: a pipelines file
# with an inline model config holds a few hundred, an alias bomb billions.
MAX_VALUES = 100_000

# Exponent floats YAML 1.1 leaves as strings: `1e-6`, `3E5`, `1.0e6`, `.5e3` (those with a dot and a
# signed exponent, `1.0e-6`, it already reads as floats).
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)[eE][-+]?[0-9]+$")


class YamlError(ValueError):
    """The text is not YAML, or is YAML fulltune refuses to expand; the message says where."""


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads exponent floats without a dot or an exponent sign as floats."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def load(text: str) -> Any:
    """Safe-load one YAML document (see the module docstring). Raises YamlError naming the line."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node)
        _check_unique_keys(node)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        raise YamlError(f"{where}malformed YAML: {getattr(exc, 'problem', None) or exc}") from None
    except RecursionError:
        raise YamlError("malformed YAML: nested too deeply") from None
    finally:
        loader.dispose()


def _check_expansion(root: yaml.Node) -> None:
    """Raise YamlError when `root` with its aliases expanded holds more than MAX_VALUES values, or
    an alias refers to a node that contains it."""
    sizes: dict[int, int] = {}  # expanded size of each node seen, by identity: aliased nodes count once each
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in open_nodes:
            raise YamlError(f"line {node.start_mark.line + 1}: an alias refers to a value that contains it; "
                            "write the value out instead")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(child) for child in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_VALUES:
            raise YamlError(f"line {node.start_mark.line + 1}: this value expands to more than {MAX_VALUES:,} "
                            "values through YAML aliases (&anchor / *alias); write it out or use fewer aliases")
        sizes[key] = total
        return total

    size(root)


def _check_unique_keys(node: yaml.Node, path: str = "") -> None:
    """Raise YamlError at the first mapping that holds a key twice (`<<` merges excepted: a key the mapping
    writes beside a merge overrides the merged one, as YAML means). Walks the document with its aliases
    expanded, which `_check_expansion` bounded."""
    if isinstance(node, yaml.SequenceNode):
        for index, child in enumerate(node.value):
            _check_unique_keys(child, f"{path}[{index}]")
    elif isinstance(node, yaml.MappingNode):
        seen: dict[tuple[str, str], yaml.Node] = {}
        for key, value in node.value:
            name = key.value if isinstance(key, yaml.ScalarNode) else "?"
            where = f"{path}.{name}" if path else name
            if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                first = seen.setdefault((key.tag, name), key)
                if first is not key:
                    raise YamlError(f"line {key.start_mark.line + 1}: {where} appears twice in one mapping (first at "
                                    f"line {first.start_mark.line + 1}); YAML would keep only the last, so merge the "
                                    "two into one or rename one")
            _check_unique_keys(value, where)
