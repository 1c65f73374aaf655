"""The checks of the layer on one process and in a model: shapes and dtypes, the meta device, module transforms,
packed documents and padded batches, gradients, a checkpoint round trip, FLOPs."""

from __future__ import annotations

import copy
import typing
from pathlib import Path
from typing import Any

import torch

import blockzoo
from blockzoo.config import to_dict
from blockzoo.layers.base import Batch
from blockzoo.layers.parameter import materialize
from blockzoo_testing.conformance.base import _DTYPES, ConformanceBase, _fail
from blockzoo_testing.layers import check_packed_documents, check_padded_batch
from blockzoo_testing.runs import single_process


class LayerChecks(ConformanceBase):
    """The conformance kit's checks of the layer on one process and in a model."""

    # -- the layer on one process ------------------------------------------------------------------------------------

    def test_output_shape_and_dtype(self) -> None:
        for dtype_name, dtype in _DTYPES.items():
            layer = self._build(self._config(), self._single_process(dtype_name))
            for name, parameter in layer.named_parameters():
                if parameter.dtype != torch.float32:
                    _fail(f"parameter {name!r} is {parameter.dtype}: master weights are fp32 (cast in forward)")
            for lengths in (self.lengths, (1,)):
                hidden = self._inputs(sum(lengths))[0].to(dtype)
                with torch.no_grad():
                    output = layer(hidden, Batch(lengths))
                expected = (sum(lengths), self.hidden_size)
                if not isinstance(output, torch.Tensor) or tuple(output.shape) != expected:
                    shape = tuple(output.shape) if isinstance(output, torch.Tensor) else type(output).__name__
                    _fail(
                        f"the output of a batch of documents {list(lengths)} has shape {shape}, expected {expected} = "
                        "[tokens, hidden]: a layer returns one hidden-size vector for each token it receives (project "
                        "back to the hidden size, e.g. with an output Linear to `hidden_dim`)"
                    )
                if output.dtype != dtype:
                    _fail(
                        f"{dtype} input gave a {output.dtype} output: compute in the input's dtype (cast weights with "
                        "`.to(hidden.dtype)`, as Linear does) and return it"
                    )
                if not bool(torch.isfinite(output).all()):
                    _fail(f"the {dtype} output of documents {list(lengths)} is not finite")

    def test_meta_device_construction(self) -> None:
        config = self._config()
        distributed = self._single_process()
        direct = self._build(config, distributed)
        meta_distributed = self._single_process()
        meta_distributed.device = torch.device("meta")
        try:
            with torch.device("meta"):
                lazy = self._build(config, meta_distributed)
        except Exception as error:  # noqa: BLE001
            _fail(
                f"building the layer on the meta device failed ({type(error).__name__}: {error}): a layer's __init__ "
                "creates parameters (on `distributed.device`) and computes nothing from tensor values"
            )
        allocated = [name for name, tensor in [*lazy.named_parameters(), *lazy.named_buffers()] if not tensor.is_meta]
        if allocated:
            _fail(
                f"built on the meta device, {', '.join(allocated)} still got memory: create every tensor on "
                "`distributed.device` (create_parameter and Linear do), so a large model can be built without memory "
                "and materialized shard by shard"
            )
        without_meta = [name for name, parameter in lazy.named_parameters() if not hasattr(parameter, "meta")]
        if without_meta:
            _fail(
                f"parameters {', '.join(without_meta)} were not made by blockzoo's parameter factory (no `.meta`): "
                "make every parameter with blockzoo.api.create_parameter or Linear, so it is initialized reproducibly, "
                "split between tensor-parallel ranks and checkpointed as a global tensor"
            )
        constants = [
            f"{module_name}.{attribute}" if module_name else attribute
            for module_name, module in lazy.named_modules()
            for attribute, value in vars(module).items()
            if isinstance(value, torch.Tensor)  # parameters and buffers live in their own dicts, not in vars()
        ]
        if constants:
            plural = len(constants) > 1
            _fail(
                f"tensor attribute{'s' if plural else ''} {', '.join(constants)} (not a parameter) "
                f"{'were' if plural else 'was'} computed in __init__: built on the meta device (as a large or sharded "
                "model is) it holds no values, and moving the model to a device leaves it behind. Keep constants as "
                "Python numbers in __init__, or compute it in forward from the config (cached per batch with "
                "batch.preprocessed(key, compute)); a value to train or checkpoint is a parameter (create_parameter)"
            )
        buffers = [name for name, _ in lazy.named_buffers()]
        if buffers:
            _fail(
                f"buffers {', '.join(buffers)} are not restored by materialize: compute constant tensors in forward "
                "(cached with batch.preprocessed) instead of registering buffers"
            )
        materialize(lazy, distributed)
        for (name, parameter), expected in zip(lazy.named_parameters(), direct.parameters(), strict=True):
            if not torch.equal(parameter, expected):
                _fail(
                    f"parameter {name!r} materialized from the meta device differs from a direct build: initialize "
                    "only through create_parameter's settings (its initialization runs again in materialize)"
                )
        hidden, _ = self._inputs(sum(self.lengths))
        with torch.no_grad():
            self._assert_close(
                lazy(hidden, Batch(self.lengths)),
                direct(hidden, Batch(self.lengths)),
                "the output of the materialized layer",
                "keep no state outside parameters created by the factory",
            )

    def test_survives_module_transforms(self) -> None:
        """What torch users do to any module: copy it, cast it, move it, save and load its state."""
        layer = self._build(self._config())
        hidden, _ = self._inputs(sum(self.lengths))
        with torch.no_grad():
            expected = layer(hidden, Batch(self.lengths))
        copied = _transformed("copy.deepcopy(layer)", copy.deepcopy, layer)
        for dtype in (torch.float64, torch.float32):  # fp32 -> fp64 -> fp32 is exact
            copied = _transformed(f".to({dtype})", lambda module, dtype=dtype: module.to(dtype), copied)
            if wrong := [name for name, p in copied.named_parameters() if p.is_floating_point() and p.dtype != dtype]:
                _fail(f"after .to({dtype}), parameters {', '.join(wrong)} are not {dtype}")
        with torch.no_grad():
            self._assert_close(
                copied(hidden, Batch(self.lengths)),
                expected,
                "the output of the layer deep-copied and cast to fp64 and back",
                "keep all state in parameters (a copy holds them; casts convert them)",
            )
        on_meta = _transformed('.to("meta")', lambda module: module.to("meta"), copied)
        if left := [
            name for name, tensor in [*on_meta.named_parameters(), *on_meta.named_buffers()] if not tensor.is_meta
        ]:
            _fail(f'after .to("meta"), {", ".join(left)} are not on the meta device: keep tensors as parameters')
        other = self._build(self._config(), single_process(self.seed + 1))  # other initial weights
        _transformed("load_state_dict(state_dict())", lambda module: module.load_state_dict(layer.state_dict()), other)
        with torch.no_grad():
            self._assert_close(
                other(hidden, Batch(self.lengths)),
                expected,
                "the output of a second build loaded with the layer's state_dict",
                "every value the forward uses must be in state_dict (a parameter)",
            )

    def test_packed_documents_equal_separate_runs(self) -> None:
        check_packed_documents(self._build(self._config()), lengths=self.lengths, tolerance=self.tolerance)

    def test_padded_batches_equal_exact_ones(self) -> None:
        check_padded_batch(self._build(self._config()), lengths=self.lengths, tolerance=self.tolerance)

    def test_gradients_reach_every_parameter(self) -> None:
        layer = self._build(self._config())
        hidden, weights = self._inputs(sum(self.lengths))
        hidden.requires_grad_()
        batch = Batch(self.lengths)
        loss = (layer(hidden, batch) * weights).sum() + sum(batch.losses.values(), torch.zeros(()))
        loss.backward()
        for name, parameter in layer.named_parameters():
            if parameter.requires_grad and (parameter.grad is None or not bool(parameter.grad.any())):
                _fail(
                    f"parameter {name!r} received no gradient from a loss on the output: it is unused, or detached "
                    "(.detach(), .data, torch.no_grad) in forward. Remove it, use it, or freeze it (lr_scale 0)"
                )
        if hidden.grad is None or not bool(hidden.grad.any()):
            _fail("the input received no gradient: the output must depend on the input differentiably")

    # -- in a model --------------------------------------------------------------------------------------------------

    def test_checkpoint_round_trip(self, tmp_path: Path) -> None:
        other = {"type": "none"}
        block = {"mixer": self._data(), "mlp": other} if self.kind == "mixer" else {"mixer": other, "mlp": self._data()}
        run_config = {
            "model": {
                "hidden_size": self.hidden_size,
                "embeddings": {"vocab_size": 32},
                "decoder": {"type": "fixed", "num_blocks": 2, "block": block},
            },
            "distributed": {"seed": self.seed, "backend": "gloo"},
        }
        distributed = self._single_process()
        model = blockzoo.build(run_config, distributed=distributed)
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():  # Away from the initialization, which a fresh build would give back anyway.
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.1)
        blockzoo.save(model, tmp_path / "checkpoint")
        loaded = blockzoo.load(tmp_path / "checkpoint", distributed=distributed)
        if to_dict(loaded.config) != to_dict(model.config):
            _fail("the model config read back from the checkpoint differs from the saved one")
        loaded_parameters = dict(loaded.named_parameters())
        for name, parameter in model.named_parameters():
            if name not in loaded_parameters or not torch.equal(loaded_parameters[name], parameter):
                _fail(
                    f"parameter {name!r} did not survive a checkpoint save and load: make it with create_parameter or "
                    "Linear under a name that does not depend on the run (it is stored by name as a global tensor)"
                )
        tokens = torch.randint(0, 32, (2, 7), generator=generator)
        with torch.no_grad():
            self._assert_close(loaded(tokens), model(tokens), "the logits of the reloaded model", "")

    def test_flops_are_reported_and_scale_with_tokens(self) -> None:
        layer = self._build(self._config())
        once, twice = layer.flops(Batch(self.lengths)), layer.flops(Batch(list(self.lengths) * 2))
        if not (isinstance(once, tuple) and len(once) == 2 and all(type(value) is int for value in once)):
            _fail(f"flops(batch) returned {once!r}: return (forward, backward) as two Python ints")
        if min(once) <= 0:
            _fail(
                f"flops(batch) returned {once}: count the forward and backward floating-point operations (MFU is "
                "computed from them); Linear.forward_flops / backward_flops count the projections"
            )
        if twice != (2 * once[0], 2 * once[1]):
            _fail(
                f"flops(batch) is {once} for the test batch and {twice} for the batch with every document twice, "
                f"expected exactly {(2 * once[0], 2 * once[1])}: count the whole batch (every document, every "
                "tensor-parallel rank together) from batch.lengths"
            )
        short, long = layer.flops(Batch([4])), layer.flops(Batch([8]))
        if not (long[0] > short[0] and long[1] > short[1]):
            _fail(f"a document of 8 tokens costs {long}, one of 4 costs {short}: more tokens must cost more")


def _transformed(what: str, transform: typing.Callable[[Any], Any], module: Any) -> Any:
    try:
        return transform(module)
    except Exception as error:  # noqa: BLE001
        _fail(
            f"{what} raised {type(error).__name__}: {error}. A layer must survive torch's module transforms: do not "
            "override nn.Module's methods by accident (a helper named `_apply` hides the one that `.to(...)`, "
            "`.cuda()` and `.double()` call), and keep no state that copying or moving cannot handle"
        )
