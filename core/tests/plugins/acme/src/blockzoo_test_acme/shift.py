import torch


class ShiftMixer(torch.nn.Module):
    def __init__(self, config, **context):  # name, hidden_size, distributed...: not needed by this toy
        super().__init__()
        self.shift = config.shift

    def forward(self, hidden):
        return torch.nn.functional.pad(hidden, (0, 0, self.shift, 0))[: hidden.shape[0]]
