"""The backend against lm-eval's own Hugging Face backend (`HFLM`) on the same model exported to a Hugging Face
directory: every request of a multiple-choice, a generation and a perplexity task (loglikelihood,
generate_until, loglikelihood_rolling) gets the same answer, and the tasks the same metrics, for a transformer and a
Mamba 2 + attention hybrid (transformers' plain PyTorch path: mamba_ssm is not installed)."""

from __future__ import annotations

import math

import lm_eval.evaluator
import pytest
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
from lm_eval_tasks import GENERATION_TASK, MC_TASK, PERPLEXITY_TASK

from blockzoo.api import FileTokenizer
from blockzoo_lm_eval.backend import BlockzooLM

TASKS = [MC_TASK, GENERATION_TASK, PERPLEXITY_TASK]
RELATIVE = 1e-4


def evaluate(lm, task_dir) -> dict:
    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.evaluator.simple_evaluate(
        model=lm, tasks=TASKS, task_manager=manager, log_samples=True, bootstrap_iters=0, verbosity="ERROR"
    )


def answers(results: dict, task: str) -> list:
    return [sample["resps"] for sample in sorted(results["samples"][task], key=lambda sample: sample["doc_id"])]


def close(ours: float, theirs: float) -> bool:
    return math.isclose(ours, theirs, rel_tol=RELATIVE, abs_tol=1e-6)


@pytest.mark.parametrize("kind", ["transformer", "hybrid"])
def test_every_request_and_metric_as_lm_evals_huggingface_backend(kind, task_dir, request):
    model, exported = request.getfixturevalue(kind)
    ours = evaluate(
        BlockzooLM(model, FileTokenizer(exported / "tokenizer.json"), model.distributed, batch_size=4),
        task_dir,
    )
    # One request per forward pass on the Hugging Face side: left padding is not what is tested here.
    theirs = evaluate(HFLM(pretrained=str(exported), batch_size=1, device="cpu", dtype="float32"), task_dir)

    choices = 0
    for our_document, their_document in zip(answers(ours, MC_TASK), answers(theirs, MC_TASK), strict=True):
        for [(our_value, our_greedy)], [(their_value, their_greedy)] in zip(our_document, their_document, strict=True):
            assert close(our_value, their_value), (our_value, their_value)
            assert our_greedy == their_greedy
            choices += 1
    assert choices == 30
    generated = answers(ours, GENERATION_TASK)
    assert generated == answers(theirs, GENERATION_TASK)
    assert any(text != [""] for text in generated)  # the model did generate something to compare
    for [[our_value]], [[their_value]] in zip(answers(ours, PERPLEXITY_TASK), answers(theirs, PERPLEXITY_TASK)):
        assert close(our_value, their_value), (our_value, their_value)

    for task in TASKS:
        our_metrics, their_metrics = ours["results"][task], theirs["results"][task]
        assert our_metrics.keys() == their_metrics.keys()
        for name, value in their_metrics.items():
            if isinstance(value, float):
                assert close(our_metrics[name], value), (task, name, our_metrics[name], value)
            else:
                assert our_metrics[name] == value, (task, name)
    # The accuracies are not all at chance: the comparison saw different choices win.
    assert 0 < ours["results"][MC_TASK]["acc,none"] < 1 or ours["results"][MC_TASK]["acc_norm,none"] > 0
