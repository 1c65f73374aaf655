"""A training step replayed as one CUDA graph (`training.cuda_graphs`).

A small model's step is bound by the host: the GPU waits while Python launches its several hundred kernels (the
hybrid example: 850 per step, mamba_ssm's Triton launches among them). Captured once, the whole forward and backward
pass, the gradient reductions and the clipping are queued by one launch.

A graph replays the kernels of the step it was captured from, on the same addresses, so it holds only for steps of
the same shapes (`signature`). The trainer places whole micro-batches as `Batch.bucketed` ones: documents of
random lengths padded with empty documents to a power of two, their `max_length` raised to one, so that steps of
documents of changing lengths fall in a few shapes. The second step of a shape is captured (the first ran eagerly, so
every lazy set-up is done: compilation, Triton autotuning, library workspaces) and every later step of that shape
replays it, its tokens, labels and documents copied into the captured step's. Up to `GRAPHS` shapes keep a graph, all
in one memory pool (one graph runs at a time, and only the last replayed one's gradients are read); steps of further
shapes run eagerly, and the run says so once. A step that cannot be captured (a layer that reads the device on the
host, as the MoE's looped experts do) ends the graphs for the run, said once; the step itself then runs eagerly.

The optimizer's update stays outside the graph: it reads the gradients the replay leaves in its own tensors, which
become the parameters' `.grad`, and takes its learning rate from the host as before.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch
from torch import nn

from blockzoo.layers.base import Batch
from blockzoo.training.step import PlacedMicroBatch

Figures = tuple[torch.Tensor, tuple[str, ...]]
GRAPHS = 4  # shapes that keep a graph; each holds its own gradients (the pool's working memory is shared)
_REMEMBERED = 64  # shapes remembered (seen once, not captured yet), the oldest forgotten first


def signature(micro_batches: Sequence[PlacedMicroBatch]) -> tuple:
    """What a step must share with the captured one to replay its graph: each micro-batch's token count and its
    documents' shapes: a padded batch's capacity and length bound, or else the documents' lengths (and the tokens a
    slice's first piece continues)."""
    found = []
    for micro in micro_batches:
        pieces = tuple(_shape(batch) for batch in _batches(micro))
        found.append((micro.tokens.shape[0], pieces))
    return tuple(found)


def _shape(batch: Batch) -> tuple:
    if batch.padded:
        return ("padded", batch.num_documents, batch.max_length)
    return (tuple(batch.host_lengths.tolist()), batch.continued)


def _batches(micro: PlacedMicroBatch) -> tuple[Batch, ...]:
    return micro.batch if isinstance(micro.batch, tuple) else (micro.batch,)


@attrs.frozen
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: list[PlacedMicroBatch]  # the captured step's micro-batches: each replay's are copied into them
    figures: Figures
    gradients: list[torch.Tensor | None]  # the graph's, by parameter


class StepGraph:
    """Runs `compute` (a step's gradients: zeroes the old ones, leaves the new ones in `.grad`, returns the step's
    figures on the device and their names) eagerly or as a replayed CUDA graph, as the module's docstring says.
    `replays` counts the steps served by a graph."""

    def __init__(self, compute: Callable[[list[PlacedMicroBatch]], Figures], parameters: Sequence[nn.Parameter], log):
        self._compute = compute
        self._parameters = list(parameters)
        self._log = log
        self._graphs: dict[tuple, _Captured] = {}
        self._seen: dict[tuple, None] = {}  # shapes of eager steps, oldest first
        self._pool = None  # the graphs' shared memory pool
        self._failed = False
        self._told_of_shapes = False
        self.replays = 0

    def __call__(self, micro_batches: list[PlacedMicroBatch]) -> Figures:
        key = signature(micro_batches)
        captured = self._graphs.get(key)
        if captured is not None:
            return self._replay(captured, micro_batches)
        if self._failed:
            return self._compute(micro_batches)
        if key in self._seen and len(self._graphs) < GRAPHS:
            del self._seen[key]
            return self._capture(key, micro_batches)
        self._seen[key] = None
        if len(self._seen) > _REMEMBERED:
            del self._seen[next(iter(self._seen))]
        if len(self._graphs) + len(self._seen) > GRAPHS and not self._told_of_shapes:
            self._told_of_shapes = True
            self._log(
                f"training.cuda_graphs: the steps come in more than {GRAPHS} shapes (micro-batches of other token "
                "counts, or slices of documents of changing lengths); steps of the shapes that have no graph run "
                "eagerly (the first of each shape does)"
            )
        return self._compute(micro_batches)

    def _replay(self, captured: _Captured, micro_batches: list[PlacedMicroBatch]) -> Figures:
        for static, micro in zip(captured.inputs, micro_batches):
            static.tokens.copy_(micro.tokens)
            static.labels.copy_(micro.labels)
            for static_batch, batch in zip(_batches(static), _batches(micro)):
                static_batch.copy_documents_(batch)
        captured.graph.replay()
        for parameter, gradient in zip(self._parameters, captured.gradients):
            parameter.grad = gradient
        self.replays += 1
        values, names = captured.figures
        return values.clone(), names  # the next replay overwrites the captured figures

    def _capture(self, key: tuple, micro_batches: list[PlacedMicroBatch]) -> Figures:
        self._clear_gradients()
        # The eager steps' cached blocks go back, or the graphs' pool would need as much memory again.
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: only this thread's calls are checked (a checkpoint's hashing threads do no CUDA work).
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                figures = self._compute(micro_batches)
        except Exception as error:  # noqa: BLE001 - whatever stops a capture, the step runs eagerly
            reason = str(error).strip().splitlines()[0][:300] if str(error).strip() else ""
            failure = f"{type(error).__name__}: {reason}" if reason else type(error).__name__
        else:
            self._pool = graph.pool() if self._pool is None else self._pool
            gradients = [parameter.grad for parameter in self._parameters]
            captured = self._graphs[key] = _Captured(graph, micro_batches, figures, gradients)
            graph.replay()  # capturing queued nothing: this step's work
            self.replays += 1
            return captured.figures[0].clone(), captured.figures[1]
        # Out of the `except`, whose traceback would keep the half-captured pass alive.
        self._failed = True
        del graph
        self._graphs.clear()
        self._pool = None
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

    def _clear_gradients(self) -> None:
        for parameter in self._parameters:
            parameter.grad = None


def check_cuda_graphs_possible(device: torch.device, world_size: int) -> str | None:
    """Why `training.cuda_graphs` cannot run here, or None."""
    if device.type != "cuda":
        return (
            f"training.cuda_graphs needs a CUDA device, and this run's is {device.type}: this config is made for a GPU "
            "(training.cuda_graphs=false runs it here, as slowly as a GPU-sized model trains on a CPU)"
        )
    if world_size > 1:
        return (
            f"training.cuda_graphs runs in one process; this run has {world_size} (its collectives are not "
            "captured; set training.cuda_graphs=false)"
        )
    return None
