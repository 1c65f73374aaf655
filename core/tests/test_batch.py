"""What `Batch` computes from the document lengths, against the direct definitions: each token's document by
`repeat_interleave`, its position as its offset from its document's start (plus the cached tokens, when generating)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from blockzoo.layers.base import Batch

documents = st.lists(st.integers(1, 40), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(lengths=documents, data=st.data())
def test_documents_and_positions_follow_the_lengths(lengths, data):
    past = data.draw(st.none() | st.lists(st.integers(0, 50), min_size=len(lengths), max_size=len(lengths)))
    batch = Batch(lengths, past_lengths=past)
    documents = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    starts = [sum(lengths[:index]) for index in range(len(lengths))]
    positions = [
        token - starts[document] + (0 if past is None else past[document])
        for token, document in enumerate(documents.tolist())
    ]
    assert batch.document_index.tolist() == documents.tolist()
    assert batch.positions.tolist() == positions
    assert batch.cu_seqlens.tolist() == [*starts, sum(lengths)]
    assert batch.cu_seqlens.dtype == torch.int32
    assert batch.document_index.dtype == batch.positions.dtype == torch.int64
    assert (batch.num_tokens, batch.max_length, batch.num_documents) == (sum(lengths), max(lengths), len(lengths))


def test_a_cleared_batch_takes_a_forward_pass_again_as_a_new_one():
    # What a CUDA graph capture that stopped midway leaves on the batches: losses, and preprocessed tensors whose
    # values were never computed (here: a wrong value, which only clearing keeps out of the next pass).
    batch = Batch([3, 2])
    batch.add_loss("layer.aux", torch.tensor(1.0))
    batch.preprocessed("key", lambda: torch.tensor(-1))
    with pytest.raises(ValueError, match=r"two layers add a loss named 'layer\.aux'"):
        batch.add_loss("layer.aux", torch.tensor(2.0))
    batch.clear_forward_state()
    batch.add_loss("layer.aux", torch.tensor(2.0))
    assert batch.losses == {"layer.aux": torch.tensor(2.0)}
    assert batch.preprocessed("key", lambda: torch.tensor(7)).item() == 7
    assert batch.statistics == {}
