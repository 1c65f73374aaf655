"""The whole transformer language model (attention + MLP plugins in the core's decoder) on one process: against a
float64 reference written from the definitions, packed documents against separate runs, KV-cache generation
against argmax over the full forward, seeded sampling, and two differently configured attention blocks whose
precomputed tables must not collide."""

import pytest
import torch
from transformer_reference import MODELS, VOCAB, build, greedy_by_full_forward, reference_logits

from blockzoo.layers.base import Batch

LENGTHS = [5, 1, 7, 4]
PROMPTS = [[3, 14, 15, 9, 2, 6], [5], [35, 8, 9]]


def _documents(seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    tokens = torch.randint(0, VOCAB, (sum(LENGTHS),), generator=torch.Generator().manual_seed(seed))
    return tokens, list(tokens.split(LENGTHS))


@pytest.mark.parametrize("case", MODELS)
def test_matches_a_float64_reference(case):
    model = build(MODELS[case])
    tokens, documents = _documents()
    with torch.no_grad():
        logits = model.forward_packed(tokens, Batch(LENGTHS))
    expected = torch.cat([reference_logits(model, document) for document in documents])
    torch.testing.assert_close(logits.double(), expected, atol=1e-5, rtol=1e-5)


def test_two_attention_blocks_keep_their_own_tables():
    """A pattern [local (theta 50, window 3), global (theta 10000, no window)] over 3 layers: each block must use its
    own rotary tables and mask, although both are computed once per Batch. The output equals the blocks run one by
    one with fresh Batches, and the float64 reference, from which sharing either tables or mask would be far."""
    model = build(MODELS["pattern-two-attentions"])
    tokens, documents = _documents()
    batch = Batch(LENGTHS)
    with torch.no_grad():
        shared_batch = model.forward_packed(tokens, batch)
        # The same blocks run one by one, each with a fresh Batch (nothing to collide with).
        hidden = model.embeddings(tokens, batch)
        for layer in model.decoder:
            hidden = layer(hidden, Batch(LENGTHS))
        per_block = model.head(hidden)
    torch.testing.assert_close(shared_batch, per_block, atol=0, rtol=0)

    document = documents[2]  # 7 tokens: longer than the window
    expected = reference_logits(model, document)
    torch.testing.assert_close(shared_batch.split(LENGTHS)[2].double(), expected, atol=1e-5, rtol=1e-5)
    # Had the blocks shared their rotary tables or their masks, the logits would be far from these.
    for shared in [{"thetas": [50.0] * 3}, {"thetas": [10000.0] * 3}, {"windows": [3] * 3}, {"windows": [None] * 3}]:
        assert not torch.allclose(reference_logits(model, document, **shared), expected, atol=1e-3), shared


@pytest.mark.parametrize("case", MODELS)
def test_packed_documents_equal_separate_runs(case):
    """Logits and every parameter gradient: no document sees another."""
    model = build(MODELS[case])
    tokens, documents = _documents()
    weights = torch.randn(len(tokens), VOCAB, generator=torch.Generator().manual_seed(1))

    packed = model.forward_packed(tokens, Batch(LENGTHS))
    (packed * weights).sum().backward()
    packed_gradients = {name: parameter.grad.clone() for name, parameter in model.named_parameters()}

    model.zero_grad()
    separate = []
    for document, document_weights in zip(documents, weights.split(LENGTHS)):
        logits = model.forward_packed(document, Batch([len(document)]))
        (logits * document_weights).sum().backward()  # gradients accumulate over the documents
        separate.append(logits.detach())
    torch.testing.assert_close(packed.detach(), torch.cat(separate), atol=1e-5, rtol=1e-5)
    assert packed_gradients
    for name, parameter in model.named_parameters():
        # fp32 sums over many tokens in another order: the tolerance follows the gradient's largest entry.
        scale = float(parameter.grad.abs().max())
        torch.testing.assert_close(packed_gradients[name], parameter.grad, atol=1e-6 * scale, rtol=1e-4, msg=name)


@pytest.mark.parametrize("case", MODELS)
def test_greedy_generation_equals_argmax_of_the_full_forward(case):
    """Prompts of different lengths in one batch; the window of the pattern model (3) is shorter than them."""
    model = build(MODELS[case])
    expected = [greedy_by_full_forward(model, prompt, 7) for prompt in PROMPTS]
    assert model.generate(PROMPTS, 7) == expected


def test_generation_stops_each_sequence_at_the_stop_token():
    model = build(MODELS["gqa-untied"])
    free = [greedy_by_full_forward(model, prompt, 6) for prompt in PROMPTS]
    stop = free[0][2]
    expected = [greedy_by_full_forward(model, prompt, 6, stop_tokens=(stop,)) for prompt in PROMPTS]
    assert expected[0] == free[0][:3]
    assert model.generate(PROMPTS, 6, stop_token=stop) == expected
    # Any of several (Hugging Face configs list several `eos_token_id`s).
    stops = (free[1][1], stop)
    expected = [greedy_by_full_forward(model, prompt, 6, stop_tokens=stops) for prompt in PROMPTS]
    assert expected[1] == free[1][:2]
    assert model.generate(PROMPTS, 6, stop_token=list(stops)) == expected


def test_seeded_sampling_is_reproducible_and_stays_in_the_top_k():
    model = build(MODELS["gqa-tied"])

    def sample(seed: int, **options) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        return model.generate(PROMPTS, 8, temperature=2.0, generator=generator, **options)

    first = sample(7, top_k=3)
    assert sample(7, top_k=3) == first
    assert sample(8, top_k=3) != first
    # Every sampled token is among the 3 likeliest of the full forward at its step.
    with torch.no_grad():
        for prompt, output in zip(PROMPTS, first):
            for step, token in enumerate(output):
                logits = model(torch.tensor([prompt + output[:step]]))[0, -1]
                assert token in logits.topk(3).indices.tolist(), (prompt, step)
    # top_k=1 leaves one candidate: the greedy choice.
    assert sample(9, top_k=1) == model.generate(PROMPTS, 8)
