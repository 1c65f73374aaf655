"""Harness tasks over local JSON files, written by the tests (nothing is downloaded): a multiple-choice task
(`loglikelihood`), a generation task (`generate_until`) and a perplexity task (`loglikelihood_rolling`), and a
byte-level BPE tokenizer trained on their texts."""

from __future__ import annotations

import json
import random
from pathlib import Path

import tokenizers

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "quiet",
    "amber",
    "seven",
    "lantern",
    "orbit",
    "willow",
    "copper",
    "meadow",
    "pixel",
    "harbor",
    "violet",
]
END_OF_TEXT = "<|endoftext|>"
MC_TASK, GENERATION_TASK, PERPLEXITY_TASK = "blockzoo_test_mc", "blockzoo_test_gen", "blockzoo_test_ppl"


def _sentence(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def documents(seed: int = 0, count: int = 10) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    multiple_choice = [
        {
            "question": f"{_sentence(rng, rng.randint(3, 9))}?",
            # One-word choices (one token each: several share their input) and longer ones.
            "choices": [f" {rng.choice(WORDS)}", f" {_sentence(rng, 2)}", f" {rng.choice(WORDS)}"],
            "answer": rng.randrange(3),
        }
        for _ in range(count)
    ]
    generation = [
        {"prompt": f"{_sentence(rng, rng.randint(2, 7))}:", "answer": f" {rng.choice(WORDS)}"} for _ in range(count)
    ]
    perplexity = [{"text": _sentence(rng, rng.randint(5, 40))} for _ in range(count)]
    return {"mc": multiple_choice, "gen": generation, "ppl": perplexity}


TASKS = {
    MC_TASK: (
        "mc",
        """output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    ),
    GENERATION_TASK: (
        "gen",
        """output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{answer}}"
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 6
  do_sample: false
metric_list:
  - metric: exact_match
""",
    ),
    PERPLEXITY_TASK: (
        "ppl",
        """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    ),
}


def write_tasks(directory: Path, seed: int = 0) -> Path:
    """The three tasks' data (JSON lines) and YAML files in `directory` (absolute paths: lm-eval reads `data_files`
    from the working directory)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, rows in documents(seed).items():
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    for task, (data, body) in TASKS.items():
        header = (
            f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {directory.resolve() / f'{data}.jsonl'}\ntest_split: test\n"
        )
        (directory / f"{task}.yaml").write_text(header + body)
    return directory


def train_tokenizer(path: Path, vocab_size: int = 320) -> tokenizers.Tokenizer:
    """A byte-level BPE of about `vocab_size` ids trained on the tasks' texts, saved at `path` (tokenizer.json)."""
    texts = [json.dumps(rows) for rows in documents().values()] + [" ".join(WORDS)]
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE())
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    tokenizer.save(str(path))
    return tokenizer
