"""The training loss: the output head at target positions only gives the full-logits loss and gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from fulltune.runtime.loss import TargetHead, Targets


def _model(kind: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Gemma2Config, GPT2Config, GPTNeoXConfig, LlamaConfig

    configs = {
        "llama": LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "gpt2": GPT2Config(vocab_size=97, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0, embd_pdrop=0.0,
                           attn_pdrop=0.0, bos_token_id=0, eos_token_id=0),
        "gpt_neox": GPTNeoXConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4),
        # Soft-capped logits: what the model does after the head still applies.
        "gemma2": Gemma2Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                               final_logit_softcapping=5.0),
    }
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(configs[kind], attn_implementation="eager").train()


def _full_loss_and_grads(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=input_ids, use_cache=False).logits
    shifted = F.pad(labels[:, 1:], (0, 1), value=-100)
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1), reduction="sum")
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox", "gemma2"])
def test_head_at_target_positions_matches_the_full_logits_loss(kind: str) -> None:
    model = _model(kind)
    input_ids = torch.randint(0, 97, (3, 11))
    labels = input_ids.clone()
    labels[0, :6] = -100  # a prompt
    labels[1, 8:] = -100  # padding
    labels[2, :] = -100  # a row without targets
    expected, expected_grads = _full_loss_and_grads(model, input_ids, labels)

    targets = Targets.from_labels(labels)
    assert len(targets) == 5 + 7  # shifted: row 0 predicts labels 6..10, row 1 labels 1..7
    head = TargetHead(model)
    model.zero_grad(set_to_none=True)
    loss = head.loss_sum(model, {"input_ids": input_ids}, targets)
    loss.backward()

    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-5)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_that_bypasses_its_head_module_gets_the_same_loss() -> None:
    model = _model("llama")
    input_ids = torch.randint(0, 97, (2, 9))
    labels = input_ids.clone()
    labels[:, :4] = -100
    expected, _ = _full_loss_and_grads(model, input_ids, labels)
    head = TargetHead(model)
    head.remove()  # as if the model multiplied by the weight itself: the hook never runs
    torch.testing.assert_close(head.loss_sum(model, {"input_ids": input_ids}, Targets.from_labels(labels)).detach(),
                               expected)


def test_the_head_is_untouched_outside_the_loss() -> None:
    model = _model("llama").eval()
    input_ids = torch.randint(0, 97, (2, 7))
    before = model(input_ids=input_ids).logits
    head = TargetHead(model)
    assert model(input_ids=input_ids).logits.shape == (2, 7, 97)
    torch.testing.assert_close(model(input_ids=input_ids).logits, before)
    head.remove()
    assert not model.get_output_embeddings()._forward_pre_hooks


def test_targets_are_the_shifted_labels() -> None:
    labels = torch.tensor([[5, -100, 7, 8], [-100, -100, 3, -100]])
    targets = Targets.from_labels(labels)
    # Position i predicts label i + 1; flat positions over the (2, 4) batch.
    assert targets.index.tolist() == [1, 2, 5]
    assert targets.tokens.tolist() == [7, 8, 3]


def test_compiled_model_does_not_recompile_for_every_target_count() -> None:
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    model = _model("llama")
    head = TargetHead(model)
    counter = CompileCounter()
    compiled = head.compile(model, backend=counter)
    for length in range(8, 20):  # 12 different (b, s) and target counts
        input_ids = torch.randint(0, 97, (2, length))
        labels = input_ids.clone()
        labels[:, : length // 2] = -100
        expected, _ = _full_loss_and_grads(model, input_ids, labels)
        loss = head.loss_sum(compiled, {"input_ids": input_ids}, Targets.from_labels(labels))
        torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-4)
    assert counter.frame_count <= 3
    torch._dynamo.reset()


# ---------------------------------------------------------------------------------------------------
# Chunked head: the loss in (rows × vocabulary) tiles, recomputed in backward


def _labels_with_gaps(input_ids: torch.Tensor) -> torch.Tensor:
    labels = input_ids.clone()
    labels[0, :6] = -100  # a prompt
    labels[1, 8:] = -100  # padding
    labels[2, :] = -100  # a row without targets
    return labels


@pytest.mark.parametrize("kind", ["llama", "gpt2", "gpt_neox", "gemma2"])
def test_chunked_head_matches_the_full_logits_loss(kind: str) -> None:
    model = _model(kind)
    input_ids = torch.randint(0, 97, (3, 11))
    labels = _labels_with_gaps(input_ids)
    expected, expected_grads = _full_loss_and_grads(model, input_ids, labels)

    # Tiles that do not divide the 12 targets or the 97-token vocabulary.
    head = TargetHead(model, chunked=True, row_chunk=5, vocab_chunk=20)
    model.zero_grad(set_to_none=True)
    loss = head.loss_sum(model, {"input_ids": input_ids}, Targets.from_labels(labels))
    loss.backward()

    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-5)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-5, atol=1e-5, msg=name)
    # Outside the loss the head is the model's own again.
    assert model(input_ids=input_ids).logits.shape == (3, 11, 97)


def test_chunked_head_under_bf16_autocast_matches_the_whole_head() -> None:
    model = _model("llama")
    input_ids = torch.randint(0, 97, (3, 11))
    targets = Targets.from_labels(_labels_with_gaps(input_ids))
    results = []
    for chunked in (False, True):
        head = TargetHead(model, chunked=chunked, row_chunk=4, vocab_chunk=32)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = head.loss_sum(model, {"input_ids": input_ids}, targets)
        loss.backward()
        head.remove()
        results.append((loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}))
    (whole, whole_grads), (chunked_loss, chunked_grads) = results
    assert chunked_loss.dtype == torch.float32
    torch.testing.assert_close(chunked_loss, whole, rtol=1e-3, atol=1e-3)
    for name, grad in chunked_grads.items():
        # bf16 matmuls, summed in another order: within a few bf16 roundings of the gradient's scale.
        scale = whole_grads[name].abs().max()
        torch.testing.assert_close(grad, whole_grads[name], rtol=0, atol=float(2e-2 * scale), msg=name)


def _matrix_shapes(run) -> set[tuple[int, ...]]:
    """The shapes of every 2-D tensor an op returns while `run` runs (forward and backward)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    shapes: set[tuple[int, ...]] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes.update(tuple(t.shape) for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 2)
            return out

    with Record():
        run()
    return shapes


def test_chunked_head_never_holds_the_whole_targets_by_vocabulary_logits() -> None:
    model = _model("gpt_neox")  # untied head: the (V, h) weight gradient is the only vocabulary-sized matrix
    input_ids = torch.randint(0, 97, (3, 11))
    targets = Targets.from_labels(_labels_with_gaps(input_ids))

    def step(head: TargetHead) -> None:
        model.zero_grad(set_to_none=True)
        head.loss_sum(model, {"input_ids": input_ids}, targets).backward()

    whole = TargetHead(model)
    assert (12, 97) in _matrix_shapes(lambda: step(whole))  # the whole head's (t, V) logits
    whole.remove()
    chunked = TargetHead(model, chunked=True, row_chunk=4, vocab_chunk=60)
    shapes = _matrix_shapes(lambda: step(chunked))
    assert not [shape for shape in shapes if shape[1] == 97]  # no (rows, V) tensor of any row count
    assert {(4, 60), (4, 37)} <= shapes  # (rows × vocabulary) tiles instead


def test_chunked_head_bytes_count_one_tile() -> None:
    from fulltune.runtime.loss import chunked_head_bytes

    # 16k targets of a 128k vocabulary: the whole head's fp32 logits alone would be 8 GiB.
    counted = chunked_head_bytes(targets=16384, hidden=4096, vocab=128256, compute_bytes=2)
    assert counted["saved"] == 4 * 16384
    tile = 4096 * 8192 * (4 + 4 + 2)
    assert counted["backward"] == 4 * 16384 * 4096 + 8192 * 4096 * 6 + tile
    assert counted["backward"] < 1 << 30
