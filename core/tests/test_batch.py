"""What `Batch` computes from the document lengths, against the direct definitions: each token's document by
`repeat_interleave`, its position as its offset from its document's start (plus the cached tokens, when generating)."""

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
