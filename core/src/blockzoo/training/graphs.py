"""A training step replayed as one CUDA graph (`training.cuda_graphs`).

A small model's step is bound by the host: the GPU waits while Python launches its several hundred kernels (the
hybrid example: 850 per step, mamba_ssm's Triton launches among them). Captured once, the whole forward and backward
pass, the gradient reductions and the clipping are queued by one launch.

A graph replays the kernels of the step it was captured from, on the same addresses, so it holds only for steps of
the same shapes: the same micro-batches' document lengths (`signature`). A step whose signature is the previous
step's is captured (that previous step ran eagerly, so every lazy set-up is done: compilation, Triton autotuning,
library workspaces), and every later step of that signature replays it, its tokens and labels copied into the
captured step's. A step of another signature drops the graph (and its memory) and runs eagerly; data whose documents
change length every step therefore never replays, and the run says so once. A step that cannot be captured (a layer
that reads the device on the host, as the MoE's looped experts do) ends the graphs for the run, said once; the step
itself then runs eagerly.

The optimizer's update stays outside the graph: it reads the gradients the replay leaves in the parameters' `.grad`
(which keep their captured tensors between replays) and takes its learning rate from the host as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from blockzoo.layers.base import Batch
from blockzoo.training.step import PlacedMicroBatch

Figures = tuple[torch.Tensor, tuple[str, ...]]


def signature(micro_batches: Sequence[PlacedMicroBatch]) -> tuple:
    """What a step must share with the captured one to replay its graph: each micro-batch's token count and its
    documents (lengths, and the tokens a slice's first piece continues)."""
    found = []
    for micro in micro_batches:
        pieces = tuple((tuple(batch.host_lengths.tolist()), batch.continued) for batch in _batches(micro))
        found.append((micro.tokens.shape[0], pieces))
    return tuple(found)


def _batches(micro: PlacedMicroBatch) -> tuple[Batch, ...]:
    return micro.batch if isinstance(micro.batch, tuple) else (micro.batch,)


class StepGraph:
    """Runs `compute` (a step's gradients: zeroes the old ones, leaves the new ones in `.grad`, returns the step's
    figures on the device and their names) eagerly or as a replayed CUDA graph, as the module's docstring says.
    `replays` counts the steps served by a graph."""

    def __init__(self, compute: Callable[[list[PlacedMicroBatch]], Figures], parameters: Sequence[nn.Parameter], log):
        self._compute = compute
        self._parameters = list(parameters)
        self._log = log
        self._previous: tuple | None = None  # the last step's signature
        self._graph: torch.cuda.CUDAGraph | None = None
        self._captured: tuple[tuple, list[PlacedMicroBatch], Figures] | None = None
        self._failed = False
        self._told_of_changes = False
        self.replays = 0

    def __call__(self, micro_batches: list[PlacedMicroBatch]) -> Figures:
        key = signature(micro_batches)
        if self._captured is not None:
            captured_key, inputs, (values, names) = self._captured
            if key == captured_key:
                for static, micro in zip(inputs, micro_batches):
                    static.tokens.copy_(micro.tokens)
                    static.labels.copy_(micro.labels)
                self._graph.replay()
                self.replays += 1
                return values.clone(), names  # the next replay overwrites the captured figures
            self._release()
        repeated, previous, self._previous = key == self._previous, self._previous, key
        if not repeated and previous is not None and not self._told_of_changes and not self._failed:
            self._told_of_changes = True
            self._log(
                "training.cuda_graphs: the document lengths changed between steps; a step replays a graph only after "
                "a step of the same lengths, the others run eagerly (data of whole rows or fixed lengths replays "
                "every step)"
            )
        if self._failed or not repeated:
            return self._compute(micro_batches)
        return self._capture(key, micro_batches)

    def _capture(self, key: tuple, micro_batches: list[PlacedMicroBatch]) -> Figures:
        self._clear_gradients()
        # The eager steps' cached blocks go back, or the graph's own pool would need as much memory again.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's calls are checked (a checkpoint's hashing threads do no CUDA work).
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                figures = self._compute(micro_batches)
        except Exception as error:  # noqa: BLE001 - whatever stops a capture, the step runs eagerly
            reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            failure = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
        else:
            self._graph = graph
            self._captured = (key, micro_batches, figures)
            graph.replay()  # capturing queued nothing: this step's work
            self.replays += 1
            return figures[0].clone(), figures[1]
        # Out of the `except`, whose traceback would keep the half-captured pass alive.
        self._failed = True
        del graph
        self._clear_gradients()
        for micro in micro_batches:  # the half-captured pass left tensors without values on the batches
            for batch in _batches(micro):
                batch.clear_forward_state()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        self._log(
            f"training.cuda_graphs: the step cannot be captured as a CUDA graph ({failure}); the run goes on "
            "without graphs (set training.cuda_graphs=false to skip trying)"
        )
        return self._compute(micro_batches)

    def _release(self) -> None:
        """Drop the graph, its memory and the gradients in it."""
        self._clear_gradients()
        self._graph = None
        self._captured = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

    def _clear_gradients(self) -> None:
        for parameter in self._parameters:
            parameter.grad = None


def check_cuda_graphs_possible(device: torch.device, world_size: int) -> str | None:
    """Why `training.cuda_graphs` cannot run here, or None."""
    if device.type != "cuda":
        return f"training.cuda_graphs needs a CUDA device; this run's is {device.type} (set training.cuda_graphs=false)"
    if world_size > 1:
        return (
            f"training.cuda_graphs runs in one process; this run has {world_size} (its collectives are not "
            "captured; set training.cuda_graphs=false)"
        )
    return None
