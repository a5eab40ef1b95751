"""Held-out evaluation: the eval loss is the token-weighted mean over every labelled token."""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from fulltune.evaluate import evaluate_model
from tests.tiny import make_model, make_tokenizer


def test_eval_loss_is_the_mean_over_labelled_tokens_and_generation_still_works(tmp_path: Path) -> None:
    tokenizer_dir = make_tokenizer(tmp_path / "tok")
    model_dir = make_model(tmp_path / "model", tokenizer_dir)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rows = []
    for prompt, completion in [("12+35=", "47"), ("the cat ", "sat on the mat"), ("hello ", "world")]:
        p, c = tokenizer(prompt)["input_ids"], tokenizer(completion)["input_ids"] + [tokenizer.eos_token_id]
        rows.append({"input_ids": p + c, "labels": [-100] * len(p) + c, "position_ids": list(range(len(p + c))),
                     "prompt": prompt, "completion": completion})

    metrics = evaluate_model(model_dir, tokenizer_dir, rows, batch_size=2, generate_examples=3, max_new_tokens=4,
                             device="cpu", load_kwargs={})

    # Reference: full logits, one row at a time (no padding), position t predicting label t + 1.
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    total, tokens = 0.0, 0
    with torch.no_grad():
        for row in rows:
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
            labels = torch.tensor(row["labels"][1:])
            total += float(F.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="sum"))
            tokens += int((labels != -100).sum())
    assert metrics.eval_tokens == tokens == sum(len(r["labels"]) - r["labels"].count(-100) for r in rows)
    assert math.isclose(metrics.eval_loss, total / tokens, rel_tol=1e-5)
    assert math.isclose(metrics.perplexity, math.exp(total / tokens), rel_tol=1e-5)
    assert metrics.generated_examples == 3 and metrics.exact_match is not None
    # Generation sees the whole (b, s, V) logits again: the same greedy text as the plain model.
    prompt = torch.tensor([tokenizer("hello ")["input_ids"]])
    plain = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=4,
                           do_sample=False, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    assert metrics.samples[2][2] == tokenizer.decode(plain[0, prompt.shape[1]:], skip_special_tokens=True).strip()
