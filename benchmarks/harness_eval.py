"""Benchmark requests through lm-evaluation-harness: blockzoo-lm-eval's backend (`BlockzooLM`, packed batches of
documents, no padding) against lm-eval's own Hugging Face backend (`HFLM`, padded batches) on the same model,
exported with `blockzoo.save(..., format="llama")` with a BPE tokenizer trained here, on the same task.

    python benchmarks/harness_eval.py [--documents 200] [--batch-size 16] [--repeats 3]
    python benchmarks/harness_eval.py --tiny        # a check of the script (seconds)

The task (written here, local JSON, nothing downloaded): `--documents` multiple-choice questions of 8-120 words of
generated text, 4 choices each (one word, or 2-6 words), scored by `loglikelihood` (4 requests per document), and as
many `loglikelihood_rolling` texts of 20-300 words (a perplexity task). The model: a Llama-style transformer
(`--hidden`, `--blocks`, heads of 64, gated MLP of 8/3 × hidden), fp32, randomly initialized. Both contenders run in
this process, one after the other, `--repeats` times each in turn (best time kept), through `simple_evaluate` with
the same task index, `limit`, batch size, `bootstrap_iters=0`, no sample logs: measured is the wall time of the
whole evaluation (request building, tokenization, model, metrics). Printed: requests/s of each, the ratio (> 1:
blockzoo is faster), and each task's metrics for both (they must agree: the same computation). Target: >= 1.0.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

# benchmarks/kernels.py would stand for the `kernels` package transformers looks for.
sys.path = [entry for entry in sys.path if Path(entry or ".").resolve() != Path(__file__).resolve().parent]
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in ("a", "e", "i", "o", "u")]
END_OF_TEXT = "<|endoftext|>"
MC, PPL = "harness_eval_mc", "harness_eval_ppl"


def _words(rng: random.Random, lexicon: list[str], count: int) -> str:
    return " ".join(rng.choice(lexicon) for _ in range(count))


def write_tasks(directory: Path, documents: int, seed: int = 20261205) -> list[str]:
    """The two tasks' JSON lines and YAML files in `directory`; returns every text (to train the tokenizer)."""
    rng = random.Random(seed)
    lexicon = ["".join(rng.choice(SYLLABLES) for _ in range(rng.randint(1, 3))) for _ in range(400)]
    questions = [
        {
            "question": _words(rng, lexicon, rng.randint(8, 120)) + "?",
            "choices": [" " + _words(rng, lexicon, rng.choice([1, 1, rng.randint(2, 6)])) for _ in range(4)],
            "answer": rng.randrange(4),
        }
        for _ in range(documents)
    ]
    texts = [{"text": _words(rng, lexicon, rng.randint(20, 300))} for _ in range(documents)]
    for name, rows in (("mc", questions), ("ppl", texts)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    common = "dataset_path: json\ntest_split: test\ndataset_kwargs:\n  data_files:\n"
    (directory / f"{MC}.yaml").write_text(
        f"task: {MC}\n{common}    test: {directory / 'mc.jsonl'}\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: "{{answer}}"\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (directory / f"{PPL}.yaml").write_text(
        f"task: {PPL}\n{common}    test: {directory / 'ppl.jsonl'}\noutput_type: loglikelihood_rolling\n"
        'doc_to_text: ""\ndoc_to_target: "{{text}}"\n'
        "metric_list:\n  - metric: word_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
    )
    return [row["question"] + "".join(row["choices"]) for row in questions] + [row["text"] for row in texts]


def export_model(directory: Path, texts: list[str], hidden: int, blocks: int, vocabulary: int) -> tuple:
    import tokenizers
    import transformers

    import blockzoo

    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocabulary,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    heads = max(1, hidden // 64)
    config = {
        "hidden_size": hidden,
        "embeddings": {"vocab_size": tokenizer.get_vocab_size()},
        "decoder": {
            "num_blocks": blocks,
            "block": {
                "mixer": {"type": "attention", "heads": heads, "head_groups": heads, "head_size": hidden // heads},
                "mlp": {"type": "mlp", "intermediate_size": 8 * hidden // 3, "gated": True, "activation": "silu"},
                "normalization": {"type": "rms_norm"},
            },
        },
    }
    model = blockzoo.build({"model": config}).eval()
    exported = directory / "llama"
    blockzoo.save(model, exported, format="llama")
    tokenizer.save(str(exported / "tokenizer.json"))
    transformers.PreTrainedTokenizerFast(
        tokenizer_file=str(exported / "tokenizer.json"), eos_token=END_OF_TEXT
    ).save_pretrained(exported)
    return model, exported


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--vocabulary", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--tiny", action="store_true", help="a few documents, a small model: a check of the script")
    arguments = parser.parse_args()
    if arguments.tiny:
        arguments.documents, arguments.hidden, arguments.blocks, arguments.vocabulary = 6, 64, 1, 400
        arguments.repeats = 1

    import lm_eval.evaluator
    import torch
    from lm_eval.models.huggingface import HFLM

    from blockzoo.api import FileTokenizer
    from blockzoo_lm_eval.backend import BlockzooLM
    from blockzoo_lm_eval.benchmark import flat_metrics, task_manager

    if arguments.threads:
        torch.set_num_threads(arguments.threads)
    with tempfile.TemporaryDirectory() as temporary:
        directory = Path(temporary)
        texts = write_tasks(directory, arguments.documents)
        model, exported = export_model(directory, texts, arguments.hidden, arguments.blocks, arguments.vocabulary)
        manager = task_manager([MC, PPL], [str(directory)])
        contenders = {
            "blockzoo": BlockzooLM(
                model,
                FileTokenizer(exported / "tokenizer.json"),
                model.distributed,
                batch_size=arguments.batch_size,
            ),
            "lm-eval HFLM": HFLM(
                pretrained=str(exported), batch_size=arguments.batch_size, device="cpu", dtype="float32"
            ),
        }
        best: dict[str, float] = {}
        metrics: dict[str, dict[str, float]] = {}
        requests = 0
        for _ in range(arguments.repeats):
            for name, lm in contenders.items():
                started = time.perf_counter()
                with torch.no_grad():
                    results = lm_eval.evaluator.simple_evaluate(
                        model=lm, tasks=[MC, PPL], task_manager=manager, bootstrap_iters=0, log_samples=False
                    )
                seconds = time.perf_counter() - started
                best[name] = min(best.get(name, float("inf")), seconds)
                metrics[name] = flat_metrics(results)
                requests = 4 * int(metrics[name][f"harness/{MC}/sample_len"]) + int(
                    metrics[name][f"harness/{PPL}/sample_len"]
                )
    print(
        f"model: hidden {arguments.hidden}, {arguments.blocks} blocks, vocabulary {model.vocab_size}; "
        f"{requests} requests ({arguments.documents} documents × 4 choices + {arguments.documents} texts), "
        f"batch size {arguments.batch_size}, torch threads {torch.get_num_threads()}, best of {arguments.repeats}"
    )
    for name, seconds in best.items():
        print(f"{name:>14}: {seconds:8.2f} s  {requests / seconds:8.1f} requests/s  {metrics[name]}")
    print(f"ratio (blockzoo / HFLM requests/s): {best['lm-eval HFLM'] / best['blockzoo']:.2f}")
    ours, theirs = metrics.values()
    if ours.keys() != theirs.keys() or any(not math.isclose(ours[k], theirs[k], rel_tol=1e-4) for k in ours):
        raise SystemExit("the two backends' metrics differ: they did not compute the same thing")
    print("metrics agree (relative 1e-4)")


if __name__ == "__main__":
    main()
