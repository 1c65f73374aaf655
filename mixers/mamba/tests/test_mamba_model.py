"""A hybrid model (`blockzoo.build`): attention and Mamba blocks in a pattern. Its generation, which keeps each
Mamba layer's state between steps, picks the same tokens as greedy decoding that re-reads the whole sequence."""

import torch

import blockzoo

ATTENTION = {
    "mixer": {"type": "attention", "heads": 2, "head_size": 8},
    "mlp": {"type": "mlp", "intermediate_size": 32},
}
MAMBA = {"mixer": {"type": "mamba", "state_size": 4, "convolution": {"kernel_size": 3}}, "mlp": {"type": "none"}}
GROUPED = {"mixer": {"type": "mamba", "state_size": 4, "xb_size": 8, "repeat_xb_before_convolution": False}}
MODEL = {
    "hidden_size": 16,
    "embeddings": {"vocab_size": 32},
    "decoder": {
        "type": "pattern",
        "blocks": {"mamba": MAMBA, "attention": ATTENTION, "grouped": {**GROUPED, "mlp": {"type": "none"}}},
        "pattern": ["mamba", "attention", "grouped"],
    },
}


def test_hybrid_generation_equals_greedy_decoding_of_the_whole_sequence():
    model = blockzoo.build({"model": MODEL, "distributed": {"seed": 7}})
    prompts = [[1, 5, 9, 2, 7], [3, 3]]
    generated = model.generate(prompts, max_new_tokens=6)
    assert [len(tokens) for tokens in generated] == [6, 6]
    for prompt, tokens in zip(prompts, generated):
        sequence = list(prompt)
        with torch.no_grad():
            for _ in range(6):
                sequence.append(int(model(torch.tensor([sequence]))[0, -1].argmax()))
        assert sequence[len(prompt) :] == tokens
