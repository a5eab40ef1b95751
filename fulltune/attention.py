"""Attention that keeps the documents of a packed row apart, with no (s × s) mask.

A packed row holds several documents one after another, each with position_ids restarting at 0. Left to
itself, transformers keeps them apart with a dense block-causal mask built from those position_ids
(`masking_utils.find_packed_sequence_indices`): a (b, 1, s, s) tensor in every forward, an additive copy of it
kept for backward in every layer, key/value heads repeated (SDPA gets `enable_gqa` only without a mask), and
attention computed between every pair of positions in the row before the mask throws most of it away. Here each
document attends to itself only:

    CUDA, 16-bit, no attention dropout   torch.nn.attention.varlen.varlen_attn over the flattened (b·s) tokens
                                         with cu_seqlens at the documents' starts (flash attention's
                                         variable-length kernel; GQA without repeating k/v)
    CPU                                  `_grouped_function`: the documents regrouped by length into a few
                                         padded batches, each one call of SDPA's CPU flash kernel with
                                         is_causal (padding comes after a document's tokens, so no real query
                                         sees it); only the unpadded q, k, v, output and the small logsumexps
                                         are kept for backward, which regroups them again
    anything else (fp32 CUDA, dropout)   the same regrouping through F.scaled_dot_product_attention

The same semantics as the dense mask, to float rounding (tests/test_attention.py), and no tensor larger than the
tokens: the CPU path is faster than the masked one from the first document on (BENCHMARKS.md, "Documents attend
alone"). It is registered with transformers' attention interface as `sdpa_documents` (`kernel`): models load with
it where `model.attn_implementation` is `sdpa`, so the trainer, the evaluator and the memory trace all run it.
Rows that are not packed take transformers' own SDPA path unchanged, and so does anything given a padding mask
(evaluation batches, generation).

Which documents: the `documents` keyword of the model's forward (`Documents`, built by `fulltune.data.collate`
from the rows' position_ids, with no device sync), or, when a caller passes none, the position_ids every
decoder layer hands its attention, read once per forward. `document_attention` is the kernel alone, over
(b, heads, s, d) tensors, for a wrapper that splits heads or sequences across processes before it.

The mask builder is kept from making the (s × s) mask by registering `sdpa_documents` with transformers'
`AttentionMaskInterface` (`_mask`): a forward with no padding mask and as many keys as queries gets no mask
(transformers' flash-attention implementations get None the same way, `masking_utils.flash_attention_mask`);
anything else (padding, a KV cache's decoding, a sliding window shorter than the row) gets transformers' SDPA mask
and, with it, transformers' SDPA attention.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

IMPLEMENTATION = "sdpa_documents"
# Documents whose lengths differ by at most this factor share one padded SDPA call on the CPU path. Fewer, larger
# groups pad more; more, smaller groups pay more calls. Measured on 8 packed rows of Zipf-length documents
# (fp32, one thread, forward + backward, benchmarks/document_attention.py): 1.1 and 1.2 within 4% of each other
# at 256 and 2,048 positions per row (1.2 with a third fewer calls), 1.5 9-11% and 2.0 19-27% slower
# (BENCHMARKS.md, "Documents attend alone").
GROUP_RATIO = 1.2


@dataclass(frozen=True, eq=False)
class Documents:
    """The documents of a micro-batch: each row's document lengths, in order (each row's sum is the row length).

    Built on the host from position_ids (`from_positions`: a document starts where a position is 0, or at a
    row's start), so nothing is read back from the device. What the kernels need is derived from it once per
    device and kept (`cu_seqlens`, `groups`).
    """

    rows: tuple[tuple[int, ...], ...]
    _derived: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_positions(cls, positions: Sequence[Sequence[int]]) -> Documents | None:
        """The documents of rows with these position ids (equal-length rows); None when no row holds more than
        one (one example per row: plain causal attention)."""
        rows = []
        for row in positions:
            starts = [i for i, p in enumerate(row) if p == 0 or i == 0]
            rows.append(tuple(b - a for a, b in zip(starts, [*starts[1:], len(row)])))
        if all(len(r) <= 1 for r in rows):
            return None
        return cls(tuple(rows))

    @property
    def lengths(self) -> list[int]:
        """Every document's length, row after row: the flattened (b·s) token stream's documents."""
        return [n for row in self.rows for n in row]

    @property
    def max_length(self) -> int:
        return max(self.lengths)

    @property
    def shape(self) -> tuple[int, int]:
        """(rows, positions per row)."""
        return len(self.rows), sum(self.rows[0])

    def padded(self, extra: int) -> Documents:
        """The documents of the rows padded with `extra` positions on the right that continue each row's last
        document (as tensor parallel pads a micro-batch to a multiple of its degree): still causal, so the real
        tokens do not see them."""
        if extra == 0:
            return self
        return Documents(tuple((*row[:-1], row[-1] + extra) for row in self.rows))

    def cu_seqlens(self, device: Any) -> torch.Tensor:
        """int32 (documents + 1,) offsets of the documents in the flattened tokens, on `device` (varlen_attn's)."""
        import torch

        key = ("cu_seqlens", str(device))
        if key not in self._derived:
            offsets = [0]
            for n in self.lengths:
                offsets.append(offsets[-1] + n)
            self._derived[key] = torch.tensor(offsets, dtype=torch.int32, device=device)
        return self._derived[key]

    def groups(self, device: Any) -> list[DocumentGroup]:
        """The documents regrouped by length (`GROUP_RATIO`), with the indices that gather and scatter them."""
        key = ("groups", str(device))
        if key not in self._derived:
            self._derived[key] = _groups(self.lengths, device)
        return self._derived[key]


@dataclass(frozen=True)
class DocumentGroup:
    """Documents padded to one length for one SDPA call.

    `gather` (count·length,) indexes the flattened tokens: a document's tokens, then as padding its first token
    again (any token would do: padding comes after a document's tokens, so no real query sees it, and its own
    outputs are dropped); `padding` are the padded positions in the group, `slots` the real ones and `tokens`
    their flattened indices.
    """

    count: int
    length: int
    gather: torch.Tensor
    padding: torch.Tensor
    slots: torch.Tensor
    tokens: torch.Tensor


def _groups(lengths: list[int], device: Any) -> list[DocumentGroup]:
    import torch

    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    members: list[list[int]] = []
    for i in order:
        if members and lengths[i] * GROUP_RATIO >= lengths[members[-1][0]]:
            members[-1].append(i)
        else:
            members.append([i])
    groups = []
    for docs in members:
        length = lengths[docs[0]]
        gather: list[int] = []
        padding: list[int] = []
        slots: list[int] = []
        for j, i in enumerate(docs):
            gather += [*range(starts[i], starts[i + 1]), *[starts[i]] * (length - lengths[i])]
            slots += range(j * length, j * length + lengths[i])
            padding += range(j * length + lengths[i], (j + 1) * length)
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        groups.append(DocumentGroup(len(docs), length, as_tensor(gather), as_tensor(padding), as_tensor(slots),
                                    as_tensor([gather[s] for s in slots])))
    return groups


# ---------------------------------------------------------------------------------------------------
# The kernels


def document_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: Documents, *,
                       scale: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Causal attention of each document with itself: query (b, heads, s, d), key and value (b, kv heads, s, d)
    with heads a multiple of kv heads (GQA); returns (b, s, heads, d), the layout transformers' attention
    functions return. `documents` describes the b rows of s positions."""
    import torch

    b, heads, s, d = query.shape
    if documents.shape != (b, s):
        raise ValueError(f"the documents describe {documents.shape[0]} rows of {documents.shape[1]} positions; "
                         f"the attention got {b} of {s}")
    # In autocast's dtype, as SDPA (on autocast's lower-precision list) would cast them: rotary embeddings in fp32
    # make q and k fp32 even where the projections ran in bf16.
    device = query.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else query.dtype
    tokens = [x.to(dtype).transpose(1, 2).reshape(b * s, x.shape[1], d) for x in (query, key, value)]  # (b·s, heads, d)
    if query.is_cuda and dropout == 0.0 and _varlen_ready(query):
        out = _varlen(*tokens, documents, scale)
    elif query.device.type == "cpu" and dropout == 0.0:
        out = _grouped_function().apply(*tokens, documents.groups(query.device), scale)
    else:
        out = _grouped_sdpa(*tokens, documents.groups(query.device), scale, dropout)
    return out.view(b, s, heads, d)


def _varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, documents: Documents,
            scale: float | None) -> torch.Tensor:
    """torch's variable-length flash attention over the flattened tokens (tokens, heads, d): each document causal
    (window (-1, 0)), k/v heads shared by their query heads as they are (GQA)."""
    from torch.nn.attention.varlen import varlen_attn

    cu_seqlens = documents.cu_seqlens(query.device)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, documents.max_length, documents.max_length,
                       scale=scale, window_size=(-1, 0), enable_gqa=key.shape[1] != query.shape[1])


def _varlen_ready(query: torch.Tensor) -> bool:
    """Whether flash attention's variable-length kernel takes these queries: 16-bit, head width a multiple of 8
    up to 256, a GPU of compute capability 8.0 or later."""
    import torch

    d = query.shape[-1]
    return (query.dtype in (torch.float16, torch.bfloat16) and d % 8 == 0 and d <= 256
            and torch.cuda.get_device_capability(query.device)[0] >= 8)


def _gather(x: torch.Tensor, group: DocumentGroup, zero_padding: bool = False) -> torch.Tensor:
    """A group's documents of the flattened tokens `x` (tokens, heads, d) as (count, heads, length, d); with
    `zero_padding` the padded positions are zeros (an output gradient there must add nothing)."""
    grouped = x.index_select(0, group.gather)
    if zero_padding and group.padding.numel():
        grouped.index_fill_(0, group.padding, 0)
    return grouped.view(group.count, group.length, *x.shape[1:]).transpose(1, 2)


def _scatter(into: torch.Tensor, grouped: torch.Tensor, group: DocumentGroup) -> None:
    """Write a group's (count, heads, length, d) result into `into` (tokens, heads, d) at its real tokens."""
    rows = grouped.transpose(1, 2).reshape(group.count * group.length, grouped.shape[1], grouped.shape[3])
    into.index_copy_(0, group.tokens, rows.index_select(0, group.slots))


@functools.lru_cache(maxsize=1)
def _grouped_function() -> Any:
    """The CPU kernel as an autograd function (made on first use: this module imports no torch until then):
    SDPA's CPU flash kernel, forward and backward, per group of documents, keeping only the unpadded q, k, v,
    output and each group's logsumexp for backward, which regroups them. A padded query's output gradient is
    made zero, so it adds nothing to any gradient."""
    import torch

    forward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward_op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    class GroupedDocuments(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    groups: list[DocumentGroup], scale: float | None) -> torch.Tensor:
            out = torch.empty_like(query)
            logsumexps = []
            for group in groups:
                grouped, logsumexp = forward_op(_gather(query, group), _gather(key, group), _gather(value, group),
                                                0.0, True, scale=scale)
                _scatter(out, grouped, group)
                logsumexps.append(logsumexp)
            ctx.save_for_backward(query, key, value, out, *logsumexps)
            ctx.groups, ctx.scale = groups, scale
            return out

        @staticmethod
        def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
            query, key, value, out, *logsumexps = ctx.saved_tensors
            grad_out = grad_out.contiguous()
            grads = [torch.empty_like(x) for x in (query, key, value)]
            for group, logsumexp in zip(ctx.groups, logsumexps):
                parts = backward_op(_gather(grad_out, group, zero_padding=True), _gather(query, group),
                                    _gather(key, group), _gather(value, group), _gather(out, group), logsumexp, 0.0,
                                    True, scale=ctx.scale)
                for into, part in zip(grads, parts):
                    _scatter(into, part, group)
            return (*grads, None, None)

    return GroupedDocuments


def _grouped_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, groups: list[DocumentGroup],
                  scale: float | None, dropout: float) -> torch.Tensor:
    """The regrouped documents through F.scaled_dot_product_attention under autograd (any device, dropout)."""
    import torch
    import torch.nn.functional as F

    parts = []
    for group in groups:
        grouped = F.scaled_dot_product_attention(_gather(query, group), _gather(key, group), _gather(value, group),
                                                 dropout_p=dropout, is_causal=True, scale=scale,
                                                 enable_gqa=key.shape[1] != query.shape[1])
        rows = grouped.transpose(1, 2).reshape(group.count * group.length, grouped.shape[1], grouped.shape[3])
        parts.append(rows.index_select(0, group.slots))
    # The groups' tokens, concatenated, are a permutation of all tokens: its inverse puts them back in order.
    order = torch.cat([group.tokens for group in groups]).argsort()
    return torch.cat(parts).index_select(0, order)


# ---------------------------------------------------------------------------------------------------
# transformers' side: the attention function, the mask function, the registration


def sdpa_documents(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                   documents: Documents | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: each document of a packed row attends to itself
    (`document_attention`); everything else goes to transformers' own SDPA attention, unchanged."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    s = query.shape[2]
    causal = kwargs.get("is_causal")
    if (attention_mask is None and s > 1 and key.shape[2] == s and kwargs.get("position_bias") is None
            and (causal if causal is not None else getattr(module, "is_causal", True))):
        found = documents if documents is not None else _documents_of(kwargs.get("position_ids"), query)
        if found is not None:
            return document_attention(query, key, value, found, scale=scaling, dropout=dropout), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  **kwargs)


# The documents read from the last position_ids seen: the same tensor reaches every layer of one forward.
_last_read: list[Any] = [None, None]


def _documents_of(position_ids: torch.Tensor | None, query: torch.Tensor) -> Documents | None:
    """The documents `position_ids` (b or 1, s) describe, read from the device once per forward; None without
    them, for rows that are not packed, and under FakeTensorMode (a fake tensor has no values: its rows are
    taken as one document each, which the memory trace's unpacked rows are)."""
    from torch._subclasses.fake_tensor import is_fake

    if position_ids is None or is_fake(position_ids) or position_ids.shape[-1] != query.shape[2]:
        return None
    reference, documents = _last_read
    if reference is not None and reference() is position_ids:
        return documents
    rows = position_ids.expand(query.shape[0], -1).tolist()  # sync point: once per forward, as transformers' own
    documents = Documents.from_positions(rows)
    _last_read[:] = [weakref.ref(position_ids), documents]
    return documents


def _mask(*, batch_size: int, q_length: int, kv_length: int, q_offset: Any = 0, kv_offset: Any = 0,
          attention_mask: torch.Tensor | None = None, config: Any = None, **kwargs: Any) -> torch.Tensor | None:
    """transformers' mask function for `sdpa_documents`: no mask where the attention function keeps documents
    apart itself (no padding mask, as many keys as queries from position 0, no sliding window shorter than the
    keys); transformers' SDPA mask otherwise."""
    from transformers.masking_utils import sdpa_mask

    plain = (attention_mask is None and q_length == kv_length and isinstance(q_offset, int) and q_offset == 0
             and isinstance(kv_offset, int) and kv_offset == 0)
    if plain and dense_mask_reason(config, kv_length) is None:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, config=config, **kwargs)


def dense_mask_reason(config: Any, length: int) -> str | None:
    """Why packed rows of `length` positions of a model with `config` still need transformers' dense mask, or None:
    a sliding window or attention chunks shorter than the row (the kernels here attend to a whole document)."""
    if config is None:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None)
    window = getattr(config, "sliding_window", None)
    windowed = ("sliding_attention" in layer_types if layer_types
                else window is not None and getattr(config, "use_sliding_window", True) is not False)
    if windowed and window is not None and window < length:
        return f"its sliding-window attention ({window} positions) is shorter than the row ({length})"
    chunk = getattr(config, "attention_chunk_size", None)
    if chunk is not None and chunk < length:
        return f"its chunked attention ({chunk} positions) is shorter than the row ({length})"
    return None


def attends_alone(config: Any, length: int) -> bool:
    """Whether a model loaded with `config` keeps the documents of rows of `length` positions apart with no mask
    (`sdpa_documents`, no window shorter than the row): then the rows of a packed micro-batch can be laid end to
    end with no padding (`fulltune.data.collate(padding_free=True)`)."""
    return getattr(config, "_attn_implementation", None) == IMPLEMENTATION and dense_mask_reason(config, length) is None


def register() -> str:
    """Register `sdpa_documents` with transformers (its attention function and its mask function); its name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, sdpa_documents)
    AttentionMaskInterface.register(IMPLEMENTATION, _mask)
    return IMPLEMENTATION


def kernel(attn_implementation: str) -> str:
    """The implementation a model is loaded with for `model.attn_implementation`: `sdpa_documents` (registered
    first) for `sdpa`, which it is for rows that are not packed; any other (eager) as it is."""
    return register() if attn_implementation == "sdpa" else attn_implementation
