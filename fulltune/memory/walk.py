"""The one walk of a training step: forward, head, decoder layers last to first, embeddings, optimizer step.

Every layout's step is this walk over `timeline.StepTerms`, driven by a `Layout` that says what differs:

- which layers this rank owns and whether it runs the embedding and the head (a pipeline stage: some);
- where a unit's gradient goes (`Gradients`): into `.grad`, layer by layer, on a replicated process
  (one process, DDP, a pipeline stage), or, under FSDP2, into an unsharded gradient that its post-backward
  reduce-scatters (`fsdp.Units`);
- what a unit gathers while it computes and which buffers the collectives hold (the all-gather copies kept,
  the prefetch of the next unit, the reduce-scatter buffer kept until the next one): `fsdp.Units`;
- the head's phases (`head.py` on a replicated process, FSDP2's in `fsdp.py`, the vocabulary-parallel one in
  `tensor_parallel.py`) and the few tensors a layout adds to the forward and the embedding (tensor parallel's
  whole stream, its masked lookup);
- the units a layout keeps gathered beside every phase (FSDP beside pipeline stages: `fsdp.StageUnits`).

The descriptions live beside the code that knows each layout: `replicated.replicated`, `fsdp.fsdp_layout`,
`tensor_parallel.tp_layout`, `pipeline` (a stage); each kind of parallelism names its own
(fulltune/memory/parallelism.py). A new parallelism is a new `Layout`, not a new walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

from fulltune.memory.timeline import Timeline


class Gradients(Protocol):
    """Where a unit's gradient goes as the backward makes it, and what that holds in each phase.

    `partial(tl, i, first)` is the keyword arguments of `Timeline.add` for layer `i`'s backward (the gradients,
    the one a hook is about to take, `temp`: what the gradient adds to the working set, FSDP2's unsharded
    parameters and gradients) once the down projection's weight gradient is made (`first`) or the whole MLP's;
    `finish(tl, name, i, acts)` ends the layer's backward (under FSDP2 its post-backward phase);
    `embeddings(tl, acts)` and `step(tl)` record the last phases."""

    def partial(self, tl: Timeline, i: int, first: bool) -> dict: ...

    def finish(self, tl: Timeline, name: str, i: int, acts: int) -> None: ...

    def embeddings(self, tl: Timeline, acts: int) -> None: ...

    def step(self, tl: Timeline) -> None: ...


@dataclass(frozen=True)
class Layout:
    """What one rank's step does beside the computation the walk counts (see the module docstring).

    `head(tl, gradients)` records the head's phases and returns the activations saved once its backward is
    done; None: the head runs on another rank (its gradients are then the layers' own only)."""

    layers: tuple[int, int]  # [start, end) of the decoder layers this rank owns, in the model's numbering
    embedding: bool  # this rank runs the input embedding
    head: Callable[[Timeline, Gradients], int] | None
    gradients: Gradients
    gathered_embedding: int = 0  # FSDP2: the embedding's gathered weights in its forward (0: nothing gathered)
    gathered_layer: int = 0  # FSDP2: the last layer's gathered weights in its forward
    lookup: int = 1  # (b, s, h) stream tensors of the embedding's forward (TP: partial sums and their all-reduce)
    forward_stream: int = 0  # stream bytes alive through the forward beside the saved ones (TP: the whole stream)
    # Units whose gathered weights every phase adds (`Timeline.gathered`): FSDP beside pipeline stages, whose
    # schedule keeps a unit gathered from its backward to its next forward (`fsdp.StageUnits`).
    gathered: Any = None


def walk(tl: Timeline, layout: Layout) -> None:
    """Record every phase of one micro-batch's step and the optimizer step on `tl`."""
    x = tl.terms
    start, end = layout.layers
    tl.gathered = layout.gathered
    if layout.gathered_embedding:
        tl.add("forward", x.grads_before, 0, 0, layout.lookup * x.bsh4, backward=False,
               unsharded=(layout.gathered_embedding, 0))
    # The last layer's forward peak with everything below it saved.
    tl.add("forward", x.grads_before, x.acts.below_head + layout.forward_stream, 0,
           x.layer.forward_transient + x.acts.mask_bool, backward=False, unsharded=(layout.gathered_layer, 0))
    acts_now = layout.head(tl, layout.gradients) if layout.head else x.acts.below_head
    for i in reversed(range(start, end)):
        acts_now = _layer_backward(tl, layout.gradients, i, i - start, acts_now)
    if layout.embedding:
        layout.gradients.embeddings(tl, max(acts_now, 0))
    layout.gradients.step(tl)


def _layer_backward(tl: Timeline, gradients: Gradients, i: int, local: int, acts_now: int) -> int:
    """Layer `i`'s backward (the rank's `local`-th layer); returns the activations saved below it.

    Two peaks: the MLP backward (everything of the layer still saved, plus the gradients of its (b, s, I)
    tensors, the down projection's weight gradient made) and the attention backward (the MLP part freed, its
    weight gradients made, the gradients of q, k, v). A checkpointed layer first rebuilds the same activations
    (non-reentrant checkpoint with early stop: its output is not rebuilt); an offloaded input comes back first."""
    x = tl.terms
    layer, settings = x.layer, x.settings
    below = acts_now - x.acts.saved_by_layer[local]
    k = min(settings.gradient_checkpointing, len(x.acts.saved_by_layer))
    back = layer.checkpoint_saved if settings.offload_activations and local < k and settings.device != "cpu" else 0
    name = f"backward of layer {i}"
    mlp = gradients.partial(tl, i, first=True)
    tl.add(name, acts=below + back, logits=0, temp=layer.saved + layer.mlp_backward + mlp.pop("temp"), **mlp)
    attn = gradients.partial(tl, i, first=False)
    tl.add(name, acts=below + back, logits=0, temp=layer.attn_saved + layer.attn_backward + attn.pop("temp"), **attn)
    gradients.finish(tl, name, i, below)
    return below
