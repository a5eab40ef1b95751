"""The evaluate stage's engine: base, fine-tuned and champion on the same held-out examples
(`evaluate.evaluate_candidates`), lm-evaluation-harness tasks and metric functions (`harness`)."""
