"""The replicated layout: a process that holds every parameter it trains (one process, DDP, a pipeline stage),
nothing gathered, its gradients into `.grad` (`fulltune/memory/walk.py` walks the step it describes)."""

from __future__ import annotations

from fulltune.memory.head import chunked_head_phases, head_gradient, head_phases
from fulltune.memory.timeline import Timeline
from fulltune.memory.walk import Layout


class ReplicatedGradients:
    """Gradients into `.grad` on a process holding every parameter it trains (one process, DDP, a pipeline
    stage): with `zero_grad(set_to_none=True)` and no accumulation they appear layer by layer; accumulating,
    they exist through the step and each new one is a temporary added into them; with the gradient hooks
    (step in backward, optimizer offload) a hook takes each one as it is made."""

    def __init__(self, tl: Timeline) -> None:
        x = tl.terms
        shape, wb = x.shape, x.levers.weight_bytes
        self.first = x.layer.mlp_first_grad * wb // 4  # the down/output projection's weight gradient
        head_grad = head_gradient(tl)  # 0 on a rank without the head (its vocabulary is 0)
        # After the head's backward: its weight gradient and the final norm's.
        norms = wb * sum(p[0] for p in shape.other_params if len(p) == 1)
        self.grads = x.grads_before if x.accumulating else head_grad + norms
        # Tied: the head's weight gradient waits in autograd's input buffer for the embedding's share
        # (when accumulating it is not yet added into .grad, so it is extra; with the gradient hooks it
        # is not a .grad yet, so the hook has not taken it).
        self.waiting = head_grad if shape.tied and (x.accumulating or x.hooks) else 0
        self.grads += self.waiting if not x.hooks else 0

    def partial(self, tl: Timeline, i: int, first: bool) -> dict:
        x = tl.terms
        if first:
            # Made before the MLP backward peak; when accumulating, a new tensor added into the existing .grad.
            made = int(self.first * x.grad_shard)
            return {"grads": self.grads + (0 if x.accumulating else made), "now": self.waiting + made,
                    "temp": self.first if x.new_grad_added else 0}
        mlp = 0 if x.accumulating else int(x.layer.mlp_grads * x.grad_shard * x.levers.weight_bytes // 4)
        return {"grads": self.grads + mlp, "now": self.waiting, "temp": 0}

    def finish(self, tl: Timeline, name: str, i: int, acts: int) -> None:
        x = tl.terms
        self.grads += 0 if x.accumulating else int(x.layer.grads * x.grad_shard * x.levers.weight_bytes // 4)

    def embeddings(self, tl: Timeline, acts: int) -> None:
        """A dense (V, h) gradient. Tied, autograd then sums it with the waiting head gradient out of place
        (three (V, h) tensors at once, .grad not yet among them unless accumulating); untied and accumulating,
        it is added into the existing .grad. At the end of backward every gradient exists."""
        x = tl.terms
        shape, settings = x.shape, x.settings
        rows = next(p[0] for p in shape.other_params if len(p) == 2)  # the embedding table's
        emb_grad = int(x.levers.weight_bytes * rows * shape.hidden * x.grad_shard)
        if shape.tied:
            emb_tmp = (3 if x.new_grad_added else 2) * emb_grad
        else:
            emb_tmp = emb_grad if x.new_grad_added else 0
        # With the hooks: the embedding's gradient (tied: the sum) is the one the hook takes; stepping
        # inside backward adds the optimizer's own temporaries there.
        hook_tmp = x.levers.states_temp if settings.optimizer_in_backward else 0
        tl.add("backward of the embeddings", x.grads_total, acts, 0,
               emb_tmp if not x.hooks else (emb_tmp if shape.tied else 0) + hook_tmp,
               now=0 if shape.tied else emb_grad)

    def step(self, tl: Timeline) -> None:
        """All gradients, states, the optimizer's own temporaries (on the host when offloaded; nothing left to
        do when stepped in backward)."""
        x = tl.terms
        settings = x.settings
        if not settings.optimizer_in_backward:
            step_temp = x.levers.host_temp if settings.offload_optimizer else x.levers.states_temp
            tl.add("optimizer step", x.grads_total, 0, 0,
                   step_temp if (settings.device == "cpu" or not settings.offload_optimizer) else 0)


def replicated(tl: Timeline, layers: tuple[int, int] | None = None, embedding: bool = True,
               head: bool = True) -> Layout:
    """The walk of a process that holds every parameter it trains: nothing gathered, gradients into `.grad`.
    A pipeline stage owns `layers` and the embedding or the head or neither."""
    x = tl.terms
    return Layout(layers=layers or (0, x.shape.num_layers), embedding=embedding,
                  head=_replicated_head if head else None, gradients=ReplicatedGradients(tl))


def _replicated_head(tl: Timeline, gradients: object) -> int:
    (chunked_head_phases if tl.terms.settings.chunked_loss else head_phases)(tl)
    return tl.terms.acts.below_head
