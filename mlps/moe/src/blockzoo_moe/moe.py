"""The mixture of experts: a router, top-k routing, dropless experts, optional shared experts.

Dropless computation: the (token, expert) pairs are sorted by expert, so each expert's tokens are contiguous; each
projection is then one matrix product per expert (CPU, fp32) or one grouped GEMM over all experts (`torch._grouped_mm`,
CUDA bf16); the outputs are weighted by the routing scores and summed back per token (`dispatch`: no scatter-add, no
host sync on the CUDA path without expert parallelism). The router and the top-k run in float32 whatever the compute
dtype (close scores choose differently in bf16).

Tensor parallelism splits every expert's intermediate dim, as in the dense MLP: each rank computes a partial sum of
every expert's output, reduced once after the per-token sum. The router is replicated and sees all tokens, so every rank
computes the same logits, routing and losses; the scores enter the tensor-parallel region (their gradient is summed over
the ranks' partial outputs).

Sequence-data parallelism and micro-sequences need nothing of the experts (each token is routed alone); the load-
balancing and z losses are functions of sums over the tokens (routings and probabilities per expert, squared router
log-sum-exps, the token count), added as statistics (`Batch.add_statistics_loss`), so over slices the engine sums them
over every slice of the micro-batch first: the losses equal the single process's.

Expert parallelism (`expert_parallel`) splits the experts between the data-parallel ranks: their weights are parameters
sharded over the data group (`create_parameter(data_parallel_dims=...)`: not all-reduced over it, the checkpoint holds
the global tensor). Each rank routes its own tokens, sends each (token, expert) pair to the rank holding the expert (an
all-to-all), runs its experts and sends the results back (the reverse all-to-all); the backward exchanges the gradients
the same way, so an expert's gradient holds every rank's tokens.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch import nn

from blockzoo.api import (
    ACTIVATIONS,
    MLP,
    ZEROS,
    Batch,
    CompositeTensorDim,
    ConcatenatedTensorDim,
    ConfigFieldError,
    Distributed,
    Linear,
    NormalInitializationConfig,
    ParameterConfig,
    TensorDim,
    UsageError,
    copy_to_tensor_region,
    create_parameter,
    reduce_from_tensor_region,
    scaled_lr,
)
from blockzoo_moe.config import MoEMLPConfig
from blockzoo_moe.dispatch import Combine, Dispatch, ExpertOrder, compiled_piece, gated, products_on_expert_ranks


class ExpertProjection(nn.Module):
    """One projection of all the experts, as one `weight` of dims `weight_dims` (and a `bias` of dims `bias_dims`).

    `configs`: one `LinearConfig`, or one per component of a concatenated first dim (gate‖up), each honoured for
    its rows. Not callable: the experts' loop reads the weights through views.
    """

    def __init__(
        self,
        name: str,
        configs: list,
        weight_dims: tuple[TensorDim, TensorDim],
        bias_dims: tuple[TensorDim],
        distributed: Distributed,
        *,
        data_parallel_dims: tuple[tuple[TensorDim, ...], tuple[TensorDim, ...]] | None,
        initialization: NormalInitializationConfig,
        default_bias: bool,
        lr_scale: float,
    ):
        super().__init__()
        weight_settings = [c.resolve_weight(initialization=initialization, lr_scale=lr_scale) for c in configs]
        weight_split, bias_split = data_parallel_dims or (None, None)
        self.weight = create_parameter(
            f"{name}.weight", weight_dims, weight_settings, distributed, data_parallel_dims=weight_split
        )
        bias_settings = [c.resolve_bias(enabled=default_bias, lr_scale=lr_scale) for c in configs]
        self.bias = (
            None
            if bias_settings[0] is None
            else create_parameter(f"{name}.bias", bias_dims, bias_settings, distributed, data_parallel_dims=bias_split)
        )


class MoEMLP(MLP):
    def __init__(
        self, config: MoEMLPConfig, *, name: str, hidden_dim: TensorDim, distributed: Distributed, lr_scale: float
    ):
        lr_scale = scaled_lr(lr_scale, config.lr_scale)
        super().__init__(config, name=name, hidden_dim=hidden_dim, distributed=distributed, lr_scale=lr_scale)
        try:
            config.check_expert_parallel(distributed.data_size, distributed.tensor_size)
        except ConfigFieldError as error:  # Known only now (the world size): a usage error naming the layer's field.
            raise UsageError(f"{name}.{error.field_name}: {error.message}") from None
        self._data_group = distributed.data_group if config.expert_parallel and distributed.data_size > 1 else None
        self._local_experts = config.experts if self._data_group is None else config.experts // distributed.data_size
        self._activation = ACTIVATIONS[config.activation]
        self._tensor_group = distributed.tensor_group
        self._local_intermediate = TensorDim("intermediate", config.intermediate_size, parallel=True).local_size(
            distributed.tensor_size
        )
        initialization = NormalInitializationConfig(std=hidden_dim.global_size**-0.5)
        experts = TensorDim("experts", config.experts)
        linear_options = {"default_initialization": initialization, "lr_scale": lr_scale}
        self.router = Linear(f"{name}.router", config.router, hidden_dim, experts, distributed, **linear_options)
        self.score_correction_bias = None
        if config.score_correction_bias:  # frozen: only a checkpoint sets it
            frozen = ParameterConfig().resolve(initialization=ZEROS, lr_scale=0.0, weight_decay=False)
            self.score_correction_bias = create_parameter(
                f"{name}.score_correction_bias", (experts,), frozen, distributed
            )

        # Expert weights, rows expert-major: gate_up is [gate of every expert ‖ up of every expert] x hidden, each
        # part split over the intermediate dim; down is stored transposed, (expert, intermediate) x hidden.
        parts = ["gate", "up"] if config.gated else ["up"]

        def projection_dims(experts: TensorDim, split_intermediate: bool) -> dict[str, tuple]:
            """(weight dims, bias dims) of gate_up and down."""

            def per_expert(part: str) -> CompositeTensorDim:
                intermediate = TensorDim(part, config.intermediate_size, parallel=split_intermediate)
                return CompositeTensorDim(f"expert_{part}", [experts, intermediate])

            gate_up = ConcatenatedTensorDim("gate_up", [per_expert(part) for part in parts])
            return {
                "gate_up": ((gate_up, hidden_dim), (gate_up,)),
                "down": (
                    (per_expert("intermediate"), hidden_dim),
                    (CompositeTensorDim("expert_hidden", [experts, hidden_dim]),),
                ),
            }

        # With expert parallelism, the tensors hold this rank's experts, split over the data group out of all.
        local_dims = projection_dims(TensorDim("experts", self._local_experts), split_intermediate=True)
        split_dims = (
            None
            if self._data_group is None
            else projection_dims(TensorDim("experts", config.experts, parallel=True), split_intermediate=False)
        )
        expert_options = {
            "initialization": initialization,
            "default_bias": config.add_linear_biases,
            "lr_scale": lr_scale,
        }
        for projection, configs in (("gate_up", [getattr(config, part) for part in parts]), ("down", [config.down])):
            weight_dims, bias_dims = local_dims[projection]
            module = ExpertProjection(
                f"{name}.{projection}",
                configs,
                weight_dims,
                bias_dims,
                distributed,
                data_parallel_dims=None if split_dims is None else split_dims[projection],
                **expert_options,
            )
            setattr(self, projection, module)

        if config.shared_experts:
            # All the shared experts are one MLP of their summed width (the sum of their outputs), or of its own.
            width = config.shared_width
            shared_dims = [TensorDim(f"shared_{part}", width, parallel=True) for part in parts]
            shared_options = {**linear_options, "default_bias": config.add_linear_biases}
            self.shared_gate_up = Linear(
                f"{name}.shared_gate_up",
                [getattr(config, part) for part in parts],
                hidden_dim,
                ConcatenatedTensorDim("shared_gate_up", shared_dims),
                distributed,
                **shared_options,
            )
            self.shared_down = Linear(
                f"{name}.shared_down",
                config.down,
                TensorDim("shared_intermediate", width, parallel=True),
                hidden_dim,
                distributed,
                **shared_options,
            )
        if config.shared_expert_gate is not None:
            self.shared_expert_gate = Linear(
                f"{name}.shared_expert_gate",
                config.shared_expert_gate,
                hidden_dim,
                TensorDim("shared_expert_gate", 1),
                distributed,
                **linear_options,
            )
        # Jitter noise must be the same on the tensor-parallel ranks (they share the router's input), and differ
        # between data-parallel ranks.
        self._jitter_seed = zlib.crc32(f"{name}.router_jitter".encode(), distributed.config.seed % 2**32)
        self._jitter_seed += distributed.data_rank
        # Made here, not at the first forward: a resumed run restores its state (blockzoo.training.random_state).
        # Not on the meta device (a model built for its shapes only), which has no generator.
        self._jitter_generator: torch.Generator | None = None
        if config.router_jitter and distributed.device.type != "meta":
            self._jitter_generator = torch.Generator(distributed.device).manual_seed(self._jitter_seed)

    def forward(self, hidden: torch.Tensor, batch: Batch, state: Any = None) -> torch.Tensor:
        logits = self.router(self._jittered(hidden).float())
        scores, selected = self.route(logits)
        order = ExpertOrder.of(selected, self.config.experts)
        self._add_losses(logits, order.counts, batch)
        output = self._routed_experts(hidden, scores.to(hidden.dtype), selected, order)
        if self.config.shared_experts:
            output = output + self._shared_experts(hidden)
        return output

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(scores, experts), each [tokens, experts_per_token], from the router's float32 logits."""
        config = self.config
        top_k = config.experts_per_token
        if config.routing == "top_k_softmax":
            top_logits, selected = logits.topk(top_k, dim=-1)
            return top_logits.softmax(dim=-1) * config.routed_scale, selected
        if config.routing == "sigmoid_top_k":
            all_scores = logits.sigmoid()
            selected = self._choice(all_scores).topk(top_k, dim=-1).indices
            scores = all_scores.gather(-1, selected)
            if config.norm_topk_prob:  # the epsilon guards all-zero scores, as DeepSeek's and transformers' do
                scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        else:
            scores, selected = logits.softmax(dim=-1).topk(top_k, dim=-1)
            if config.norm_topk_prob:
                scores = scores / scores.sum(dim=-1, keepdim=True)
        return scores * config.routed_scale, selected

    def _choice(self, scores: torch.Tensor) -> torch.Tensor:
        """What sigmoid routing chooses the experts by: the scores plus the correction bias, -inf outside the
        groups each token chooses from."""
        config = self.config
        if self.score_correction_bias is not None:
            scores = scores + self.score_correction_bias.float()
        if config.routing_groups == 1:
            return scores
        grouped = scores.unflatten(-1, (config.routing_groups, config.group_size))
        best = grouped.topk(2, dim=-1).values.sum(dim=-1).topk(config.routing_groups_per_token, dim=-1).indices
        allowed = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(-1, best, True)
        return grouped.masked_fill(~allowed.unsqueeze(-1), float("-inf")).flatten(-2)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Each expert's share of a token, [tokens, experts], for the load-balancing loss: the softmax, or the
        sigmoid scores normalized to sum to 1 (DeepSeek-V3's balance loss)."""
        if self.config.routing != "sigmoid_top_k":
            return logits.softmax(dim=-1)
        scores = logits.sigmoid()
        return scores / scores.sum(dim=-1, keepdim=True)

    def _jittered(self, hidden: torch.Tensor) -> torch.Tensor:
        jitter = self.config.router_jitter
        if not (self.training and jitter):
            return hidden
        if self._jitter_generator is None or self._jitter_generator.device != hidden.device:
            self._jitter_generator = torch.Generator(hidden.device).manual_seed(self._jitter_seed)
        noise = torch.empty_like(hidden).uniform_(1 - jitter, 1 + jitter, generator=self._jitter_generator)
        return hidden * noise

    def _add_losses(self, logits: torch.Tensor, counts: torch.Tensor, batch: Batch) -> None:
        """`counts`: the (token, expert) pairs routed to each expert. Both losses are functions of sums over the
        tokens (`Batch.add_statistics_loss`): over slices of sequences they cover the whole micro-batch."""
        config = self.config
        tokens = logits.new_full((), float(len(logits)))  # a fill on the device, no host copy
        if config.auxiliary_loss_coefficient:
            # Fraction of the routings that go to each expert (not differentiable) · mean probability of each expert.
            statistics = {"routed": counts.float(), "probability": self.probabilities(logits).sum(dim=0)}
            batch.add_statistics_loss(
                f"{self.name}.load_balancing", {**statistics, "tokens": tokens}, self._load_balancing_loss
            )
        if config.z_loss_coefficient:
            z_squares = torch.logsumexp(logits, dim=-1).square().sum()
            batch.add_statistics_loss(
                f"{self.name}.router_z_loss", {"z_squares": z_squares, "tokens": tokens}, self._z_loss
            )

    def _load_balancing_loss(self, statistics: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = statistics["tokens"]
        routed_fraction, mean_probability = statistics["routed"] / tokens, statistics["probability"] / tokens
        return self.config.auxiliary_loss_coefficient * self.config.experts * (routed_fraction * mean_probability).sum()

    def _z_loss(self, statistics: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.config.z_loss_coefficient * statistics["z_squares"] / statistics["tokens"]

    def _routed_experts(
        self, hidden: torch.Tensor, scores: torch.Tensor, selected: torch.Tensor, order: ExpertOrder | None = None
    ) -> torch.Tensor:
        group, top_k = self._tensor_group, self.config.experts_per_token
        if order is None:
            order = ExpertOrder.of(selected, self.config.experts)
        # Each expert's tokens one contiguous block of rows.
        routed = Dispatch.apply(copy_to_tensor_region(hidden, group), order.tokens, order.inverse, top_k)
        if self._data_group is not None:
            outputs = self._exchanged_expert_products(routed, order.counts)
        else:
            outputs = self._expert_products(routed, order.counts, order.sorted_experts)
        region_scores = copy_to_tensor_region(scores, group)
        combined = Combine.apply(outputs, region_scores, order.tokens, order.inverse)
        combined = reduce_from_tensor_region(combined, group)
        if self.down.bias is not None and self._data_group is None:
            # Each expert's bias weighted by the token's score for it; replicated, so added after the reduction.
            weights = scores.new_zeros(len(hidden), self.config.experts).scatter(1, selected, scores)
            combined = combined + weights @ self.down.bias.to(hidden.dtype).view(self.config.experts, -1)
        return combined

    def _expert_products(
        self, routed: torch.Tensor, counts: torch.Tensor, sorted_experts: torch.Tensor
    ) -> torch.Tensor:
        """This rank's experts over `routed`, sorted by (local) expert: `counts` rows each."""
        if self.uses_grouped_mm(routed):
            return self._grouped_expert_products(routed, counts, sorted_experts)
        return self._looped_expert_products(routed, counts.tolist())

    def _exchanged_expert_products(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: each of `routed` (sorted by expert, `counts` per global expert) goes to the rank
        holding its expert and its output (down bias included) comes back, in the same order."""
        bias = None if self.down.bias is None else self.down.bias.view(self._local_experts, -1)
        return products_on_expert_ranks(routed, counts, self._data_group, self._expert_products, bias)

    def _expert_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """gate_up [part, expert, intermediate, hidden], its bias [part, expert, intermediate] or None, and
        down [expert, intermediate, hidden]: views of this rank's shards, in the compute dtype."""
        experts, intermediate = self._local_experts, self._local_intermediate
        parts = 2 if self.config.gated else 1
        gate_up = self.gate_up.weight.to(dtype).view(parts, experts, intermediate, -1)
        gate_up_bias = None if self.gate_up.bias is None else self.gate_up.bias.to(dtype).view(parts, experts, -1)
        return gate_up, gate_up_bias, self.down.weight.to(dtype).view(experts, intermediate, -1)

    def _activate(self, projected: list[torch.Tensor]) -> torch.Tensor:
        if not self.config.gated:
            return self._activation(projected[0])
        # Compiled: one kernel each way, and only gate and up are kept for the backward.
        return compiled_piece(gated, projected[0])(projected[0], projected[1], self._activation)

    def _looped_expert_products(self, routed: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each expert's MLP (without the down bias) over its block of `routed`: one matrix product per expert."""
        gate_up, gate_up_bias, down = self._expert_weights(routed.dtype)
        outputs = []
        for expert, block in enumerate(routed.split(counts)):
            projected = [
                block @ gate_up[part, expert].t() + (0 if gate_up_bias is None else gate_up_bias[part, expert])
                for part in range(len(gate_up))
            ]
            outputs.append(self._activate(projected) @ down[expert])
        return torch.cat(outputs)

    def uses_grouped_mm(self, routed: torch.Tensor) -> bool:
        """Whether the experts run as grouped GEMMs (`torch._grouped_mm`): on CUDA in bf16, with the 16-byte
        aligned rows it needs. Otherwise one product per expert."""
        aligned = self.hidden_dim.global_size % 8 == 0 and self._local_intermediate % 8 == 0
        return routed.is_cuda and routed.dtype == torch.bfloat16 and aligned and hasattr(torch, "_grouped_mm")

    def _grouped_expert_products(
        self, routed: torch.Tensor, counts: torch.Tensor, sorted_experts: torch.Tensor
    ) -> torch.Tensor:
        """As `_looped_expert_products`, each projection one grouped GEMM over all experts, with no host sync."""
        gate_up, gate_up_bias, down = self._expert_weights(routed.dtype)
        offsets = counts.cumsum(0).to(torch.int32)
        projected = [
            torch._grouped_mm(routed, gate_up[part].transpose(1, 2), offs=offsets)
            + (0 if gate_up_bias is None else gate_up_bias[part][sorted_experts])
            for part in range(len(gate_up))
        ]
        return torch._grouped_mm(self._activate(projected), down, offs=offsets)

    def _shared_experts(self, hidden: torch.Tensor) -> torch.Tensor:
        projected = self.shared_gate_up(hidden)
        if self.config.gated:
            gate, up = projected.chunk(2, dim=-1)
            intermediate = self._activation(gate) * up
        else:
            intermediate = self._activation(projected)
        output = self.shared_down(intermediate)
        if self.config.shared_expert_gate is not None:
            output = output * torch.sigmoid(self.shared_expert_gate(hidden))
        return output

    def flops(self, batch: Batch) -> tuple[int, int]:
        """Matrix products of the active experts only (experts_per_token routed + the shared ones), the router and
        the shared-expert gate; elementwise work, the sort and the combine are negligible beside them."""
        config, tokens = self.config, batch.num_tokens
        routed = tokens * config.experts_per_token
        hidden = self.hidden_dim.global_size
        parts = 2 if config.gated else 1
        counts = [
            (2 * routed * hidden * config.intermediate_size * parts, self.gate_up.weight.requires_grad),
            (2 * routed * config.intermediate_size * hidden, self.down.weight.requires_grad),
        ]
        linears = [self.router]
        if config.shared_experts:
            linears += [self.shared_gate_up, self.shared_down]
        if config.shared_expert_gate is not None:
            linears.append(self.shared_expert_gate)
        forward = sum(f for f, _ in counts) + sum(linear.forward_flops(tokens) for linear in linears)
        backward = sum(f * (2 if trained else 1) for f, trained in counts)
        backward += sum(linear.backward_flops(tokens) for linear in linears)
        return forward, backward
