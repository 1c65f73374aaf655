"""The embedded corpus: deterministic in every process, byte-tokenized stories, predictable enough to learn."""

import hashlib
import math
import os
import subprocess
import sys

import torch

from blockzoo.data.config import EmbeddedDatasetConfig
from blockzoo.data.corpus import stories
from blockzoo.data.embedded import EmbeddedDataset, embedded_store
from blockzoo.data.tokenizer import ByteTokenizer

HASH = """
import hashlib, sys
from blockzoo.data.corpus import stories
assert "torch" not in sys.modules
print(hashlib.sha256("\\0".join(stories({count})).encode()).hexdigest())
"""


def test_the_corpus_is_the_same_in_every_process():
    """The stories hash alike in processes whose string hashing differs (the tokens are their bytes, below)."""
    count = EmbeddedDatasetConfig().num_documents
    here = hashlib.sha256("\0".join(stories(count)).encode()).hexdigest()
    for hash_seed in ("1", "2"):  # string hashing differs between these processes
        environment = {**os.environ, "PYTHONHASHSEED": hash_seed}
        result = subprocess.run(
            [sys.executable, "-c", HASH.format(count=count)], env=environment, capture_output=True, text=True
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == here


def test_documents_are_the_stories_bytes_each_ended_by_the_end_of_document_token():
    texts = stories(50)
    assert stories(20) == texts[:20], "the first stories do not depend on how many are asked for"
    store = embedded_store(50)
    tokenizer = ByteTokenizer()
    offsets = store.offsets.tolist()
    assert offsets[0] == 0 and offsets[-1] == len(store.tokens) and store.num_documents == 50
    for number, text in enumerate(texts):
        document = store.tokens[offsets[number] : offsets[number + 1]].tolist()
        assert document == [*text.encode("utf-8"), tokenizer.eod_token_id]
        assert text.endswith("The end.") and text.isascii()
    assert len(set(texts)) == 50


def test_the_default_corpus_is_a_few_megabytes_with_an_evaluation_split():
    dataset = EmbeddedDataset(EmbeddedDatasetConfig(sequence_length=512, micro_batch_size=4), seed=0)
    assert len(dataset.store.tokens) > 2_000_000
    assert dataset.vocab_size == 257
    evaluation = list(dataset.evaluation_batches())
    assert len(evaluation) * 4 * 512 > 100_000  # the last 5% of the stories, in whole micro-batches
    text = dataset.tokenizer.decode(evaluation[0].tokens.tolist())
    assert "The end." in text


def test_the_corpus_is_predictable_a_bigram_model_halves_the_uniform_loss():
    """A structure check: byte bigram counts of the training stories predict the held-out ones at well under
    the uniform loss ln(257) = 5.55 nats (2.1 when written)."""
    store = embedded_store(2000)
    split = int(store.offsets[1900])
    tokens = store.tokens.to(torch.int64)
    training, held_out = tokens[:split], tokens[split:]
    counts = torch.bincount(training[:-1] * 257 + training[1:], minlength=257 * 257).view(257, 257).double() + 0.01
    log_probabilities = (counts / counts.sum(1, keepdim=True)).log()
    loss = -log_probabilities[held_out[:-1], held_out[1:]].mean().item()
    assert loss < math.log(257) / 2, loss
