"""Benchmark evaluation (the `benchmark` kind): a backend plugin (lm-evaluation-harness: `blockzoo-lm-eval`) scores
a model on benchmark tasks, during training (`training.evaluation.harness`) or from a checkpoint (`blockzoo
evaluate`). `base.py` is torch-free; `run.py` runs a backend on a model."""
