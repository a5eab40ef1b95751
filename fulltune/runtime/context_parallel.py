"""Context parallel: the sequence of every micro-batch split over the "cp" processes, attention computed over the
whole sequence all the same (`distributed.context_parallel: N`).

Each of the N processes of a "cp" group trains on the same rows (fulltune/degrees.py `data_rank`) and keeps 1/N of
their positions: every layer's norms, projections, MLP and the loss head run on its positions only, so its
activations are 1/N of the row's. Only attention needs every position, in one of two ways:

- **Ulysses** (DeepSpeed-Ulysses, arXiv 2309.14509; ALST): around attention an all-to-all turns the
  sequence-sharded (b, H, s/N, d) queries, keys and values into head-sharded (b, H/N, s, d) ones, so each process
  attends over the whole sequence for H/N heads with the configured attention (sdpa, eager, or the per-document
  attention of packed rows), and a second all-to-all turns the output back. N must divide the attention heads;
  key/value heads are split when N divides them too, else each is repeated just enough (grouped-query models).
  Runs on CPU with gloo and on GPU with NCCL (`torch.distributed._functional_collectives.all_to_all_single_autograd`,
  whose backward is the reverse all-to-all).
- **Ring attention** (PyTorch's `torch.distributed.tensor.experimental.context_parallel`) where N does not divide
  the heads: the keys and values travel round the group while each process keeps its queries. CUDA only (its
  CPU attention kernel has no sharding rule), refused on CPU at validate (fulltune/levers.py).

Causal load balance (zigzag): each row, padded to a multiple of 2N, is cut into 2N chunks and process r keeps chunks
r and 2N − 1 − r, so every process attends over the same number of (query, key) pairs. After Ulysses' all-to-all a
process holds the chunks in rank order and puts them back in sequence order before attention (one index_select),
and out of it after. Every position keeps its own position id (the rotary embedding is the whole row's), and
packed rows' documents attend alone over the whole rows (fulltune/attention.py `sdpa_documents`, given the whole
rows' documents, no (S × S) tensor); any mask an attention still needs — causal, per document where position ids
restart — is built from the whole row's position ids, which every process of the group has (`Shard.position_ids`),
never from its share.

The loss: each process sums the token losses of its own positions' targets (`shard` splits the targets with the
positions); the step divides the sum over every process by the step's target tokens (fulltune/runtime/step.py),
which counts each row once, so the gradients are those of one process training on the whole rows.

Torch is imported inside the functions (the module is imported where the job is read).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

from fulltune.attention import IMPLEMENTATION as DOCUMENTS
from fulltune.errors import ConfigError

FIELD = "distributed.context_parallel"
# The attention implementations registered with transformers (`install`): Ulysses' all-to-alls around the configured
# attention; sdpa under ring attention's dispatcher. Neither has transformers build a mask over a rank's share.
ULYSSES = "fulltune_ulysses"
RING = "fulltune_ring"


def ulysses_problem(heads: int, degree: int) -> str | None:
    """Why Ulysses cannot split `heads` attention heads over `degree` processes (None: it can)."""
    if degree > 1 and heads % degree:
        return f"{degree} does not divide the model's {heads} attention heads"
    return None


def kv_repeats(kv_heads: int, degree: int) -> int:
    """How many times each key/value head is repeated so that `degree` divides them: 1 when it does already,
    else degree / gcd(kv_heads, degree), the least that makes kv_heads × repeats a multiple of `degree` (which
    divides the query heads whenever `degree` does: grouped-query attention keeps whole groups)."""
    return degree // math.gcd(kv_heads, degree)


def zigzag_order(length: int, degree: int, rank: int) -> list[int]:
    """The positions of a row of `length` (a multiple of 2 × `degree`) that process `rank` keeps: chunks `rank` and
    2·degree − 1 − `rank` of the 2·degree equal chunks."""
    chunk = length // (2 * degree)
    first, second = rank * chunk, (2 * degree - 1 - rank) * chunk
    return [*range(first, first + chunk), *range(second, second + chunk)]


def padded_length(length: int, degree: int) -> int:
    """A row's length padded to a multiple of 2 × `degree` (the zigzag's chunks)."""
    return -(-length // (2 * degree)) * (2 * degree)


@dataclass
class Shard:
    """One micro-batch as a process of the group sees it: its positions of every row, and the whole rows' position
    ids in sequence order (the attention mask's source). `gathered_order[i]` is the sequence position of the i-th
    position an all-to-all gathers (the group's shares in rank order)."""

    position_ids: Any  # (b, S) the whole rows', S padded to a multiple of 2N
    gathered_order: Any  # (S,) int64
    sequence_order: Any  # (S,) int64: where each sequence position is among the gathered ones (the inverse)
    packed: bool  # position ids restart inside a row: documents attend alone
    masks: dict  # the attention masks built from `position_ids`, by (kind, dtype), kept for the micro-batch
    documents: Any = None  # packed rows: their documents over the whole (padded) rows (fulltune.attention.Documents)


class ContextParallel:
    """A group of `degree` processes (`group`: their 1-D device mesh, this process `rank` in it) splitting each
    micro-batch's sequence; `method` "ulysses" or "ring". `shard(inputs, targets)` makes this process's share of a
    micro-batch and sets it as the one the attention reads. Under ring attention `install` opens PyTorch's
    `context_parallel` dispatcher for the process (every SDPA call is then ring attention over `group`, the shares
    in its head-tail order, which is `zigzag_order`) until `remove`."""

    def __init__(self, group: Any, degree: int, rank: int, method: str = "ulysses") -> None:
        self.group, self.degree, self.rank, self.method = group, degree, rank, method
        self.current: Shard | None = None
        self.inner: dict[type, tuple[str, Any]] = {}  # attention module class → its configured attention
        self.configured = "sdpa"  # the model's own attention implementation (`install`)
        self._dispatcher: Any = None  # ring attention's open `context_parallel` context (`install`)

    # -- the micro-batch ---------------------------------------------------------------------------------

    def shard(self, inputs: dict[str, Any], targets: Any) -> tuple[dict[str, Any], Any]:
        """This process's share of a micro-batch (`fulltune.data.batching.micro_batch_inputs`' inputs and
        targets): every row padded to a multiple of 2N (pad tokens with no target, position ids continuing),
        its zigzag chunks kept; the targets at its positions, indexed in its (b, S / N) share."""
        import torch
        import torch.nn.functional as F

        from fulltune.data.targets import Targets

        ids = inputs["input_ids"]
        b, s = ids.shape
        S, N = padded_length(s, self.degree), self.degree
        positions = inputs.get("position_ids")
        if positions is None:
            positions = torch.arange(s, device=ids.device).expand(b, s)
        if S > s:
            extra = torch.arange(1, S - s + 1, device=ids.device)
            positions = torch.cat([positions, positions[:, -1:] + extra], dim=1)
            ids = F.pad(ids, (0, S - s), value=0)
        keep = torch.tensor(zigzag_order(S, N, self.rank), device=ids.device)
        gathered = torch.tensor([p for r in range(N) for p in zigzag_order(S, N, r)], device=ids.device)
        in_order = torch.empty_like(gathered)
        in_order[gathered] = torch.arange(S, device=ids.device)
        # Targets: a (b, S) map of each position's target token (−1: none), then this process's positions of it.
        dense = torch.full((b * S,), -1, dtype=torch.long, device=ids.device)
        rows, cols = targets.index // s, targets.index % s
        dense[rows * S + cols] = targets.tokens
        local = dense.view(b, S).index_select(1, keep).reshape(-1)
        index = (local >= 0).nonzero().squeeze(1)
        # Packed rows' documents, found on the host by collate (fulltune/data/batches.py), over the padded rows;
        # without them (rows built elsewhere), one sync point per micro-batch: whether the position ids restart.
        documents = inputs.get("documents")
        if documents is not None:
            documents, packed = documents.padded(S - s), True
        else:
            packed = bool((positions[:, 1:] <= positions[:, :-1]).any())
        if packed and self.method == "ring":
            raise ConfigError(f"{FIELD}: ring attention is causal over whole rows and keeps no per-document mask, "
                              "and these rows are packed; set data.packing: false, or a context_parallel that divides "
                              "the attention heads (Ulysses)")
        self.current = Shard(positions, gathered, in_order, packed, {}, documents)
        # A padding mask is not passed on: rows are right-padded (fulltune/data/batching.py), and a causal position
        # never attends to a later one; the attention builds its own mask from the whole rows' position ids.
        shared = {name: value for name, value in inputs.items()
                  if name not in ("input_ids", "position_ids", "attention_mask", "documents")}
        return ({"input_ids": ids.index_select(1, keep), "position_ids": positions.index_select(1, keep), **shared},
                Targets(index=index, tokens=local.index_select(0, index)))

    # -- Ulysses ---------------------------------------------------------------------------------------------

    def _all_to_all(self, x: Any) -> Any:
        import torch.distributed._functional_collectives as funcol

        return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), None, None, self.group))

    def to_heads(self, x: Any) -> Any:
        """(b, H, s/N, d) sequence-sharded → (b, H/N, S, d) head-sharded, the sequence in its order."""
        b, H, s, d = x.shape
        N = self.degree
        x = x.reshape(b, N, H // N, s, d).transpose(0, 1)  # (N: the process that gets these heads, b, H/N, s, d)
        x = self._all_to_all(x)  # (N: the process whose positions these are, b, H/N, s, d)
        x = x.permute(1, 2, 0, 3, 4).reshape(b, H // N, N * s, d)  # the group's shares in rank order
        return x.index_select(2, self.current.sequence_order)

    def to_sequence(self, x: Any) -> Any:
        """(b, S, H/N, d) head-sharded, in sequence order → (b, s/N, H, d) sequence-sharded (this process's
        positions)."""
        b, S, h, d = x.shape
        N = self.degree
        x = x.index_select(1, self.current.gathered_order)  # back to the group's shares in rank order
        x = x.reshape(b, N, S // N, h, d).transpose(0, 1)  # (N: whose positions, b, s/N, H/N, d)
        x = self._all_to_all(x)  # (N: whose heads, b, s/N, H/N, d)
        return x.permute(1, 2, 0, 3, 4).reshape(b, S // N, N * h, d)

    def mask(self, kind: str, dtype: Any) -> Any:
        """The whole sequence's attention mask as the inner attention `kind` takes it: None for sdpa over unpacked
        rows (its causal kernel) and for the per-document attention over packed rows whose documents are known
        (`fulltune.attention.sdpa_documents`: each attends to itself, no (S × S) tensor); a boolean (b, 1, S, S)
        mask for sdpa over other packed rows (a position attends to the earlier ones of its own document); an
        additive one of `dtype` for eager attention."""
        import torch

        shard = self.current
        if kind in ("sdpa", DOCUMENTS) and (not shard.packed or (kind == DOCUMENTS and shard.documents is not None)):
            return None
        key = (kind, dtype)
        if key not in shard.masks:
            positions = shard.position_ids
            S = positions.shape[1]
            causal = torch.ones(S, S, dtype=torch.bool, device=positions.device).tril()
            document = (positions == 0).long().cumsum(1) if shard.packed else torch.zeros_like(positions)
            allowed = causal & (document[:, :, None] == document[:, None, :])
            allowed = allowed[:, None]
            if kind not in ("sdpa", DOCUMENTS):
                allowed = torch.zeros(allowed.shape, dtype=dtype, device=positions.device).masked_fill_(
                    ~allowed, torch.finfo(dtype).min)
            shard.masks[key] = allowed
        return shard.masks[key]

    def attention(self, module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any
                  ) -> tuple[Any, None]:
        """The attention function registered as `ULYSSES`: the all-to-alls around the module's configured
        attention (`install`), which sees H/N heads over the whole sequence in order. Returns (b, s/N, H, d)."""
        name, inner = self.inner[type(module)]
        repeats = kv_repeats(key.shape[1], self.degree)
        if repeats > 1:  # each key/value head repeated so that the group splits them (whole query groups stay)
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
        q, k, v = self.to_heads(query), self.to_heads(key), self.to_heads(value)
        kwargs["position_ids"] = self.current.position_ids
        kwargs.pop("is_causal", None)
        mask = self.mask(name, q.dtype)
        if mask is None and self.current.documents is not None:  # the per-document attention's (no device sync)
            kwargs["documents"] = self.current.documents
        # The inner attention repeats each key/value head for its group of query heads; with the heads repeated
        # above a process's groups are smaller than the model's.
        groups = module.num_key_value_groups
        module.num_key_value_groups = q.shape[1] // k.shape[1]
        try:
            out, _ = inner(module, q, k, v, mask, is_causal=mask is None, **kwargs)
        finally:
            module.num_key_value_groups = groups
        return self.to_sequence(out), None

    def _open_ring(self) -> None:
        """Open ring attention's dispatcher for this process: SDPA over `group`, load-balanced (head-tail: the
        layout `shard` makes). PyTorch reads the balance from the length of a buffer it shards (any multiple of
        2N: every row `shard` makes is one)."""
        import torch
        from torch.distributed.tensor.experimental import context_parallel

        whole = torch.empty((1, 2 * self.degree), device=self.group.device_type)
        self._dispatcher = context_parallel(self.group, buffers=[whole], buffer_seq_dims=[1],
                                            no_restore_buffers={whole})
        self._dispatcher.__enter__()

    def install(self, model: Any) -> None:
        """Make every attention module of `model` run `attention` around the attention function it is configured
        with (sdpa, eager, or a registered one), or under ring attention sdpa with no mask (ring attention is
        causal over whole rows: no per-document mask, no eager); transformers builds no mask of its own for it
        (the shares' position ids are not a row's).

        Raises:
            ConfigError: ring attention asked of a model configured with another attention than sdpa."""
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        from transformers.masking_utils import AttentionMaskInterface

        from fulltune.runtime.checkpointing import decoder_layers

        configured = model.config._attn_implementation
        self.configured = configured
        _ACTIVE[0] = self
        if self.method == "ring":
            if configured != "sdpa":
                raise ConfigError(f"{FIELD}: ring attention (context_parallel not dividing the attention heads) runs "
                                  f"sdpa only; set model.attn_implementation to sdpa")
            AttentionInterface.register(RING, sdpa_attention_forward)
            AttentionMaskInterface.register(RING, _no_mask)
            model.set_attn_implementation(RING)
            self._open_ring()
            return
        for layer in decoder_layers(model):
            attention = getattr(layer, "self_attn", None)
            if attention is None:
                raise ConfigError(f"{FIELD}: {type(model).__name__}'s decoder layers have no self_attn to split")
            eager = getattr(sys.modules[type(attention).__module__], "eager_attention_forward", None)
            inner = AttentionInterface.get_interface(AttentionInterface(), configured, eager)
            self.inner[type(attention)] = (configured, inner)
        AttentionInterface.register(ULYSSES, _dispatch)
        AttentionMaskInterface.register(ULYSSES, _no_mask)
        self.configured = configured
        model.set_attn_implementation(ULYSSES)

    def remove(self, model: Any) -> None:
        """`model` attends as it was configured again, over whole rows (the evaluate stage's generation)."""
        if self._dispatcher is not None:
            self._dispatcher.__exit__(None, None, None)
            self._dispatcher = None
        model.set_attn_implementation(self.configured)
        _ACTIVE[0] = None


def active() -> ContextParallel | None:
    """This process's context parallel (installed on its model), or None."""
    return _ACTIVE[0]


# The context parallel of this process (one per trainer process): transformers calls the registered function by
# name, so it finds the group here.
_ACTIVE: list[ContextParallel | None] = [None]


def _dispatch(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> tuple[Any, None]:
    context = _ACTIVE[0]
    if context is None or context.current is None:
        raise RuntimeError(f"{ULYSSES}: no context-parallel micro-batch is set (ContextParallel.shard)")
    return context.attention(module, query, key, value, attention_mask, **kwargs)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    return None
