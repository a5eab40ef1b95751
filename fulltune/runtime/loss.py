"""The training loss: summed next-token cross-entropy, with the output head run only where there is a target.

A causal LM's output head (lm_head) turns every position's hidden state into V logits, and the loss then
ignores the positions without a target: prompt tokens of prompt/completion data, user turns of chat
data, padding, the last token of each row. fulltune gathers the positions that have a target *before*
the head, so neither the (positions × V) logits nor the head's matmuls are computed for the others:

    positions with a target   t ≤ b·s          (known on the host from the labels: no device sync)
    head input                (b, s, h) → (t, h)   index_select in a forward pre-hook on lm_head
    logits                    (t, V) instead of (b, s, V)

The loss and every gradient are the same as with full logits (the ignored positions contribute zero);
only the floating-point summation order of the head's matmuls differs. The hook sits on the output
embedding of the unwrapped model, so it runs inside DDP/FSDP wrappers and torch.compile, and
anything the model applies to the logits afterwards (Gemma's soft-capping, Cohere's scale) is elementwise
and unchanged. For a Llama-3.2-1B-shaped model (vocabulary 128k, hidden 2048) the head is ~40% of the
FLOPs and its fp32 logits 512 KiB per position, so a half-prompt batch saves a fifth of the compute and
half the logits memory; `fulltune.memory` counts the logits at t positions.

Chunked head (`TargetHead(model, chunked=True)`): even at t positions the head's backward holds ~3 fp32
(t, V) tensors (logits, softmax, its gradient): 1.5 GiB per 1k targets at V = 128k. The chunked head
computes the loss in (rows × vocabulary) tiles with `ChunkedLinearCrossEntropy`, which keeps only a
per-row logsumexp from forward and recomputes each tile's logits in backward, so no (t, V) tensor exists;
its memory is `chunked_head_bytes`. Same loss and gradients as the whole head (the summation order over
vocabulary tiles differs). Written here rather than taken from cut-cross-entropy, whose package requires
triton (a GPU compiler) even for its CPU path and whose CPU path needs torch.compile; torchtune's
`CEWithChunkedOutputLoss` chunks the logits but autograd still keeps every chunk for backward, and Liger's
fused kernel is Triton (GPU) only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from fulltune.data.targets import Targets  # noqa: F401 (the micro-batch's targets, re-exported beside the head)
# The tile sizes and their bytes are the memory model's (fulltune/memory/head.py), re-exported beside the head.
from fulltune.memory.head import ROW_CHUNK, VOCAB_CHUNK, chunked_head_bytes  # noqa: F401


def _compute_dtype(weight: torch.Tensor) -> torch.dtype:
    """The matmul dtype autocast would pick for the head, or the weight's own without autocast."""
    device = weight.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Σ_rows cross_entropy(post(hidden @ weightᵀ + bias), targets) in (rows × vocabulary) tiles.

    `post` is what models apply to their logits after the head: a scale (Cohere's logit_scale,
    Granite's 1/logits_scaling) and Gemma's tanh soft-capping. The matmuls run in the compute dtype
    (autocast's, else the weight's) and the softmax in fp32, as the unchunked head with logits upcast.
    """

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, scale: float, softcap: float | None, row_chunk: int, vocab_chunk: int) -> torch.Tensor:
        dtype = _compute_dtype(weight)
        rows, vocab = hidden.shape[0], weight.shape[0]
        lse = torch.full((rows,), -math.inf, dtype=torch.float32, device=hidden.device)
        target_logit = torch.zeros((rows,), dtype=torch.float32, device=hidden.device)
        with torch.autocast(hidden.device.type, enabled=False):
            for v0 in range(0, vocab, vocab_chunk):
                w = weight[v0 : v0 + vocab_chunk].to(dtype)
                b = None if bias is None else bias[v0 : v0 + vocab_chunk].to(dtype)
                for r0 in range(0, rows, row_chunk):
                    logits = _tile_logits(hidden[r0 : r0 + row_chunk].to(dtype), w, b, scale, softcap)
                    torch.logaddexp(lse[r0 : r0 + row_chunk], logits.logsumexp(dim=1), out=lse[r0 : r0 + row_chunk])
                    local = targets[r0 : r0 + row_chunk] - v0
                    inside = (local >= 0) & (local < w.shape[0])
                    picked = logits.gather(1, local.clamp(0, w.shape[0] - 1).unsqueeze(1)).squeeze(1)
                    target_logit[r0 : r0 + row_chunk] += torch.where(inside, picked, 0.0)
        ctx.save_for_backward(hidden, weight, bias, targets, lse)
        ctx.options = (dtype, scale, softcap, row_chunk, vocab_chunk)
        return (lse - target_logit).sum()

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        dtype, scale, softcap, row_chunk, vocab_chunk = ctx.options
        rows, vocab = hidden.shape[0], weight.shape[0]
        grad_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        grad_bias = None if bias is None else torch.empty_like(bias)
        with torch.autocast(hidden.device.type, enabled=False):
            for v0 in range(0, vocab, vocab_chunk):
                w = weight[v0 : v0 + vocab_chunk].to(dtype)
                b = None if bias is None else bias[v0 : v0 + vocab_chunk].to(dtype)
                tile_weight = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
                tile_bias = None if bias is None else torch.zeros(w.shape[0], dtype=torch.float32, device=w.device)
                for r0 in range(0, rows, row_chunk):
                    h = hidden[r0 : r0 + row_chunk].to(dtype)
                    logits = _tile_logits(h, w, b, scale, softcap)
                    # d loss / d logits = softmax − onehot(target), times the incoming gradient.
                    grad = (logits - lse[r0 : r0 + row_chunk, None]).exp_()
                    local = targets[r0 : r0 + row_chunk] - v0
                    inside = ((local >= 0) & (local < w.shape[0])).nonzero().squeeze(1)
                    grad[inside, local[inside]] -= 1.0
                    grad.mul_(grad_loss)
                    if softcap is not None:  # d/dx c·tanh(x/c) = 1 − (y/c)²
                        grad.mul_(1.0 - (logits / softcap).square_())
                    if scale != 1.0:
                        grad.mul_(scale)
                    del logits
                    if tile_bias is not None:
                        tile_bias += grad.sum(0)
                    grad = grad.to(dtype)
                    tile_weight += (grad.T @ h).float()
                    grad_hidden[r0 : r0 + row_chunk] += (grad @ w).float()
                grad_weight[v0 : v0 + vocab_chunk] = tile_weight
                if grad_bias is not None:
                    grad_bias[v0 : v0 + vocab_chunk] = tile_bias
        return grad_hidden.to(hidden.dtype), grad_weight, grad_bias, None, None, None, None, None


def _tile_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, scale: float,
                 softcap: float | None) -> torch.Tensor:
    logits = torch.nn.functional.linear(hidden, weight, bias)
    if scale != 1.0:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits.float()


def logit_postprocessing(config: Any) -> tuple[float, float | None]:
    """(scale, soft-cap) a model applies to its head's output, read from its config."""
    scale = float(getattr(config, "logit_scale", None) or 1.0)  # Cohere multiplies
    scaling = getattr(config, "logits_scaling", None)  # Granite divides
    if scaling:
        scale /= float(scaling)
    softcap = getattr(config, "final_logit_softcapping", None)
    return scale, (float(softcap) if softcap else None)


class TargetHead:
    """Makes `model`'s output head run on the hidden states of the target positions only.

    Install it on the unwrapped model, before torch.compile or accelerator.prepare. While `loss_sum`
    runs, the head's input (b, s, h) is replaced by its rows at `Targets.index`; otherwise (generation,
    evaluation) the hook does nothing.

    `chunked=True`: while `loss_sum` runs, the head module computes the loss itself in tiles
    (`ChunkedLinearCrossEntropy`) and hands the model an empty (t, 0) logits tensor computed from that loss.
    The recompute reads the head's weight (and backward the final norm's) after the forward: under FSDP2 the
    returned loss depends on the model's output, whose pre-backward hooks gather those units again first, tied
    embedding or not (fulltune/runtime/sharding.py). A model that bypasses its head module falls back to whole logits.
    """

    def __init__(self, model: torch.nn.Module, chunked: bool = False, row_chunk: int = ROW_CHUNK,
                 vocab_chunk: int = VOCAB_CHUNK) -> None:
        head = model.get_output_embeddings()
        if head is None:
            raise ValueError(f"{type(model).__name__} has no output embedding (lm_head) to compute a loss with")
        self.index: torch.Tensor | None = None
        self.chunked = chunked
        self._head = head
        self._chunks = (row_chunk, vocab_chunk)
        self._post = logit_postprocessing(getattr(model, "config", None))
        self._tokens: torch.Tensor | None = None
        self._loss: torch.Tensor | None = None
        self._handle = head.register_forward_pre_hook(self._gather)

    def _gather(self, _module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self.index is None:
            return None
        hidden = args[0]
        return (hidden.reshape(-1, hidden.shape[-1]).index_select(0, self.index), *args[1:])

    def remove(self) -> None:
        self._handle.remove()

    def _chunked_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._head
        loss = ChunkedLinearCrossEntropy.apply(hidden, head.weight, getattr(head, "bias", None), self._tokens,
                                               *self._post, *self._chunks)
        self._loss = loss
        # The (t, 0) stand-in for the logits is computed from the loss (a broadcast add, not a view), so the
        # model's output depends on the loss and `loss_sum` can route backward through it (see there).
        return hidden.new_zeros((hidden.shape[0], 0), dtype=loss.dtype) + loss

    @staticmethod
    def compile(model: torch.nn.Module, **options: Any) -> torch.nn.Module:
        """torch.compile for a model with a TargetHead: the gather index changes length with every
        micro-batch, and dynamo, which reaches it through a module's hook, would otherwise take its
        shape as static and recompile for each length (giving up after its recompile limit)."""
        torch._dynamo.config.force_nn_module_property_static_shapes = False
        return torch.compile(model, **options)

    def loss_sum(self, model: torch.nn.Module, inputs: dict[str, torch.Tensor], targets: Targets) -> torch.Tensor:
        """Σ over the target positions of the fp32 cross-entropy; the logits are freed on return."""
        self.index = targets.index
        if self.chunked:
            self._tokens, self._loss = targets.tokens, None
            self._head.forward = self._chunked_forward  # the instance attribute shadows the class's forward
        try:
            # fp32 as Accelerate's convert_outputs_to_fp32 leaves them under mixed precision; the
            # 16-bit logits are freed here, before the loss.
            logits = model(**inputs, use_cache=False).logits.float()  # (t, V), or (t, 0) when chunked
        finally:
            self.index = None
            if self.chunked:
                del self._head.forward
                self._tokens = None
        if self._loss is not None:
            loss, self._loss = self._loss, None
            # + the empty logits' sum, exactly 0: backward then reaches the chunked head through the head's and
            # the model's outputs, where FSDP2 registers its pre-backward hooks, so the units whose weights the
            # recompute reads (the head, and the root: the final norm, a tied embedding) are gathered again
            # before it runs. Taken aside, the loss would reach the head first and read resharded weights.
            return loss + logits.sum()
        if logits.dim() == 3:  # a model that bypasses its output-embedding module: select after the head
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, targets.index)
        return F.cross_entropy(logits, targets.tokens, reduction="sum")
