"""Documents attend alone (fulltune/attention.py): packed rows without an (s × s) mask, the same numbers as the mask.

The CPU kernel against SDPA over each document on its own; a packed micro-batch through the trainer's step
(`TargetHead.loss_sum`, as `fulltune.runtime.step` runs it) against transformers' own masked SDPA path and against
the same documents one per row, loss and every gradient to 1e-5 relative in fp32; no tensor of the row's (s × s)
shape made in forward or backward; generation and padded batches unchanged; eager attention refused with packing.
"""

from __future__ import annotations

import copy

import pytest
import torch

from fulltune.attention import IMPLEMENTATION, Documents, _grouped_sdpa, dense_mask_reason, document_attention, kernel
from fulltune.data import collate
from fulltune.data.formats import IGNORE_INDEX
from fulltune.data.targets import Targets
from fulltune.runtime.loss import TargetHead
from tiny import tiny_config

# Two rows of 40 positions: documents of 9, 14, 1 and 16 tokens, and of 23 and 17 (the last row ends on a
# one-token document: positions 0 only). Lengths differ by more than GROUP_RATIO, so several groups run.
ROWS = [[9, 14, 1, 16], [23, 17]]
S = 40


def positions(rows: list[list[int]]) -> list[list[int]]:
    return [[p for n in row for p in range(n)] for row in rows]


def per_document(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, rows: list[list[int]]) -> torch.Tensor:
    """SDPA over each document's slice on its own: what document attention must equal, (b, s, heads, d)."""
    out = []
    for r, row in enumerate(rows):
        start, parts = 0, []
        for n in row:
            piece = slice(start, start + n)
            parts.append(torch.nn.functional.scaled_dot_product_attention(
                query[r:r + 1, :, piece], key[r:r + 1, :, piece], value[r:r + 1, :, piece], is_causal=True,
                enable_gqa=True)[0].transpose(0, 1))
            start += n
        out.append(torch.cat(parts))
    return torch.stack(out)


def test_documents_come_from_the_position_ids() -> None:
    documents = Documents.from_positions(positions(ROWS))
    assert documents.rows == ((9, 14, 1, 16), (23, 17)) and documents.shape == (2, S)
    assert documents.max_length == 23
    assert documents.cu_seqlens("cpu").tolist() == [0, 9, 23, 24, 40, 63, 80]
    assert documents.padded(3).rows == ((9, 14, 1, 19), (23, 20))
    assert Documents.from_positions([list(range(7)), list(range(7))]) is None  # one example per row
    # Every token is gathered exactly once over the groups.
    tokens = torch.cat([group.tokens for group in documents.groups("cpu")]).sort().values
    assert tokens.tolist() == list(range(2 * S))


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_cpu_kernels_equal_sdpa_over_each_document(kv_heads: int) -> None:
    torch.manual_seed(0)
    documents = Documents.from_positions(positions(ROWS))
    query = torch.randn(2, 4, S, 8, requires_grad=True)
    key, value = (torch.randn(2, kv_heads, S, 8, requires_grad=True) for _ in range(2))
    upstream = torch.randn(2, S, 4, 8)
    expected = per_document(query, key, value, ROWS)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (query, key, value))
    got = document_attention(query, key, value, documents)
    grads = torch.autograd.grad((got * upstream).sum(), (query, key, value))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
    # The autograd fallback (fp32 on a GPU, attention dropout) computes the same.
    tokens = [x.transpose(1, 2).reshape(2 * S, x.shape[1], 8) for x in (query, key, value)]
    fallback = _grouped_sdpa(*tokens, documents.groups("cpu"), None, 0.0).view(2, S, 4, 8)
    torch.testing.assert_close(fallback, expected, rtol=1e-5, atol=1e-6)


def test_the_cuda_kernel_is_called_with_the_documents_offsets() -> None:
    """varlen_attn runs on CUDA only; under FakeTensorMode its registered shape function checks the call the GPU
    path makes (flattened tokens, int32 offsets, causal window, GQA) on CPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fulltune.attention import _varlen

    documents = Documents.from_positions(positions(ROWS))
    with FakeTensorMode():
        query = torch.randn(2 * S, 4, 8, dtype=torch.bfloat16, requires_grad=True)
        key, value = (torch.randn(2 * S, 2, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        out = _varlen(query, key, value, documents, None)
        out.sum().backward()
        assert out.shape == (2 * S, 4, 8) and key.grad.shape == key.shape


# The documents of a packed micro-batch's rows: the second row is shorter, so collate pads it (a document of 5).
BATCH_ROWS = [[9, 14, 1, 16], [23, 12]]


def packed_rows(vocab: int) -> tuple[list[dict], list[dict]]:
    """The rows of BATCH_ROWS (and their documents as rows of their own), tokens and labels by formula."""
    rows, singles = [], []
    for r, row in enumerate(BATCH_ROWS):
        ids, labels = [], []
        for d, n in enumerate(row):
            tokens = [2 + (5 * r + 11 * d + 3 * k) % (vocab - 2) for k in range(n)]
            ids += tokens
            labels += [IGNORE_INDEX] + tokens[1:]
            singles.append({"input_ids": tokens, "labels": [IGNORE_INDEX] + tokens[1:], "position_ids": list(range(n))})
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions([row])[0]})
    return rows, singles


def packed_batch(vocab: int) -> tuple[dict, list[dict]]:
    """A packed micro-batch of BATCH_ROWS (and its documents as rows of their own)."""
    rows, singles = packed_rows(vocab)
    return collate(rows, pad_token_id=0), singles


def loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The step's loss (`TargetHead.loss_sum`: the trainer's) over `batch` and every parameter's gradient."""
    batch = dict(batch)
    targets = Targets.from_labels(batch.pop("labels"))
    batch.pop("attention_mask", None)  # right padding of unpacked rows needs no mask (fulltune/data/batching.py)
    head = TargetHead(model)
    try:
        model.zero_grad(set_to_none=True)
        loss = head.loss_sum(model, batch, targets)
        loss.backward()
    finally:
        head.remove()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("family", ["llama", "gpt2", "gpt_neox", "qwen2"])
def test_a_packed_micro_batch_trains_as_the_mask_and_as_one_document_per_row(family: str) -> None:
    from transformers import AutoModelForCausalLM

    vocab = 50
    config = tiny_config(family, vocab, max_position_embeddings=64) if family != "gpt2" else tiny_config(family, vocab)
    torch.manual_seed(0)
    documents_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=kernel("sdpa"))
    masked_model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa")
    masked_model.load_state_dict(documents_model.state_dict())
    assert documents_model.config._attn_implementation == IMPLEMENTATION
    batch, singles = packed_batch(vocab)
    assert isinstance(batch["documents"], Documents)

    loss, grads = loss_and_grads(documents_model, batch)
    masked_loss, masked_grads = loss_and_grads(masked_model, {k: v for k, v in batch.items() if k != "documents"})
    # Without `documents`, the same attention reads them from the position_ids (a pipeline stage calls it so).
    inferred_loss, inferred_grads = loss_and_grads(documents_model, {k: v for k, v in batch.items() if k != "documents"})
    # One document per row: right-padded rows, no packing at all.
    alone_loss, alone_grads = loss_and_grads(documents_model, collate(singles, pad_token_id=0))
    # The rows laid end to end, no padding (the trainer's micro-batches under document attention).
    free = collate(packed_rows(vocab)[0], pad_token_id=0, padding_free=True)
    assert batch["documents"].rows == ((9, 14, 1, 16), (23, 12, 5))
    assert free["input_ids"].shape == (1, 75) and free["documents"].rows == ((9, 14, 1, 16, 23, 12),)
    free_loss, free_grads = loss_and_grads(documents_model, free)
    for other_loss, other_grads in ((masked_loss, masked_grads), (inferred_loss, inferred_grads),
                                    (alone_loss, alone_grads), (free_loss, free_grads)):
        torch.testing.assert_close(loss, other_loss, rtol=1e-5, atol=0)
        for grad, other in zip(grads, other_grads):  # each parameter's gradient, relative to its norm
            assert float((grad - other).norm() / other.norm()) < 1e-5


def test_no_tensor_of_the_rows_square_is_made() -> None:
    """Forward and backward of a packed micro-batch make no tensor with an (s, s) pair of dimensions; transformers'
    masked path makes them (the mask, its additive copy) in every layer."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM

    class Shapes(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.square = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and list(tensor.shape[-2:]) == [S, S]:
                    self.square += 1
            return out

    vocab = 50
    config = tiny_config("llama", vocab)
    batch, _ = packed_batch(vocab)
    counts = {}
    for name, implementation, inputs in (("documents", kernel("sdpa"), batch),
                                         ("masked", "sdpa", {k: v for k, v in batch.items() if k != "documents"})):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
        with Shapes() as shapes:
            loss_and_grads(model, inputs)
        counts[name] = shapes.square
    assert counts["documents"] == 0
    assert counts["masked"] > 0


def test_padded_batches_and_generation_take_transformers_sdpa_unchanged() -> None:
    from transformers import AutoModelForCausalLM

    vocab = 50
    config = tiny_config("llama", vocab, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    ours = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=kernel("sdpa")).eval()
    theirs = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa").eval()
    theirs.load_state_dict(ours.state_dict())
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    attention_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    with torch.no_grad():
        torch.testing.assert_close(ours(input_ids=input_ids, attention_mask=attention_mask).logits,
                                   theirs(input_ids=input_ids, attention_mask=attention_mask).logits)
        generated = [model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6,
                                    do_sample=False, pad_token_id=0) for model in (ours, theirs)]
    assert generated[0].tolist() == generated[1].tolist()


def test_models_load_with_document_attention_for_sdpa_only(tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from fulltune.models import load_model

    config = tiny_config("llama", 50)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert load_model(str(tmp_path)).config._attn_implementation == IMPLEMENTATION
    assert load_model(str(tmp_path), attn_implementation="eager").config._attn_implementation == "eager"
    # What is saved names no implementation: the exported model loads anywhere with transformers' default.
    assert "attn_implementation" not in (tmp_path / "config.json").read_text()


def test_a_sliding_window_shorter_than_the_row_keeps_the_dense_mask() -> None:
    mistral = tiny_config("llama", 50)
    assert dense_mask_reason(mistral, 4096) is None
    windowed = copy.deepcopy(mistral)
    windowed.sliding_window, windowed.layer_types = 512, ["sliding_attention"] * 2
    assert "sliding-window attention (512 positions)" in dense_mask_reason(windowed, 4096)
    assert dense_mask_reason(windowed, 512) is None


def test_packing_with_eager_attention_is_refused_at_validate() -> None:
    from fulltune.errors import ConfigError
    from fulltune.pipelines_file import validate_pipelines

    pipeline = {"model": {"name_or_path": "some/model", "attn_implementation": "eager"},
                "data": {"train": "train.jsonl", "packing": True}}
    with pytest.raises(ConfigError, match=r"pipelines\.a: data\.packing: true needs model\.attn_implementation: sdpa"):
        validate_pipelines({"pipelines": {"a": pipeline}})
    for packing in (False, "auto"):
        validate_pipelines({"pipelines": {"a": {**pipeline, "data": {"train": "train.jsonl", "packing": packing}}}})


def test_packing_auto_trains_one_example_per_row_under_eager_attention(tmp_path) -> None:
    from pipelines_fixture import tiny_pipeline

    from fulltune.stages import budget, resolve_pipeline

    p = resolve_pipeline(str(tiny_pipeline(tmp_path, model={"attn_implementation": "eager"},
                                           data={"max_length": 64})), "tiny")
    pack, why = budget.choose_packing(p, "unused: decided before tokenizing")
    assert pack is False and "model.attn_implementation: sdpa" in why


def test_tensor_parallel_padding_continues_each_rows_last_document() -> None:
    """Tensor parallel pads a micro-batch to a multiple of its degree (fulltune/runtime/parallel.py): the documents
    grow with it, the padding part of each row's last document (after its tokens, so no real query sees it)."""
    from fulltune.runtime.parallel import _SequencePadding

    batch, _ = packed_batch(50)
    args, kwargs = _SequencePadding(16).pad(None, (), {k: v for k, v in batch.items() if k != "labels"})
    assert kwargs["input_ids"].shape == (2, 48) and kwargs["position_ids"].shape == (2, 48)
    assert kwargs["documents"].rows == ((9, 14, 1, 24), (23, 12, 13)) and kwargs["documents"].shape == (2, 48)
