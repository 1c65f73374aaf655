"""The causal depthwise convolution over packed documents as Triton kernels, forward and backward.

For every token t (at `position[t]` in its document) and channel c, with K taps:

    pre[t, c] = bias[c] + Σ_{j < K, j <= position[t]} weight[c, K - 1 - j] · x[t - j, c]
    y[t, c] = silu(pre[t, c])  (or pre, without the activation)

The taps that would reach before the document's first token read nothing, so no document sees the previous one.
x is read where it lies: any row stride (a slice of in_proj's output, the channels contiguous), never copied.

Forward: one program per tile of BLOCK_T tokens × BLOCK_C channels loads the K shifted tiles of x (cached: each
row is read once from memory), accumulates in fp32, applies the activation and writes y in x's dtype.

Backward: dx[t] = Σ_s weight[K - 1 - s] · g[t + s] over the taps s that stay in the document, with
g = dy · silu'(pre); pre is recomputed from x (never saved). Each program walks ROWS_PER_PROGRAM tokens of a block
of channels and keeps its sums of dweight = Σ_t g[t] · x[t - j] and dbias = Σ_t g[t] in registers; it writes them
as one row of partial sums, which torch adds up afterwards. No atomics.

The tile shapes are autotuned on CUDA per (channels, kernel size, bias, activation, dtypes), the results cached on
disk between runs where Triton can (`triton.autotune(cache_results=True)`, triton >= 3.4; docs/ssm.md). Under
TRITON_INTERPRET=1 (CPU tensors, the tests) fixed tile shapes are used.

Used by `blockzoo_ssm.causal_conv1d` on CUDA; imports triton, so import it only there (or under the interpreter).
"""

import inspect

import torch
import triton
import triton.language as tl

# Tokens each backward program walks (in tiles of BLOCK_T, which divides it): one row of dweight / dbias partial
# sums per ROWS_PER_PROGRAM tokens.
ROWS_PER_PROGRAM = 256

_FORWARD_CONFIGS = [
    triton.Config({"BLOCK_T": 32, "BLOCK_C": 128}, num_warps=4),
    triton.Config({"BLOCK_T": 64, "BLOCK_C": 128}, num_warps=4),
    triton.Config({"BLOCK_T": 16, "BLOCK_C": 256}, num_warps=4),
    triton.Config({"BLOCK_T": 64, "BLOCK_C": 256}, num_warps=8),
]
_BACKWARD_CONFIGS = [
    triton.Config({"BLOCK_T": 32, "BLOCK_C": 64}, num_warps=4),
    triton.Config({"BLOCK_T": 32, "BLOCK_C": 128}, num_warps=4),
    triton.Config({"BLOCK_T": 64, "BLOCK_C": 128}, num_warps=8),
    triton.Config({"BLOCK_T": 16, "BLOCK_C": 256}, num_warps=4),
]
# The interpreter's tiles and rows per backward program: small, so that the tests' few tokens and channels span
# several programs (and the interpreter does not walk hundreds of empty rows).
_INTERPRETER_CONFIG = {"BLOCK_T": 8, "BLOCK_C": 8}
_INTERPRETER_ROWS_PER_PROGRAM = 16
_TUNING_KEY = ["channels", "KERNEL_SIZE", "HAS_BIAS", "SILU"]


@triton.jit
def _preactivation(
    x_pointer,
    weight_pointer,
    bias_pointer,
    rows,
    position,
    row_mask,
    channel,
    channel_mask,
    x_stride,
    KERNEL_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """bias + Σ_j weight[:, K - 1 - j] · x[rows - j] over the taps inside each row's document, [rows, channels]."""
    total = tl.zeros([rows.shape[0], channel.shape[0]], dtype=tl.float32)
    if HAS_BIAS:
        total += tl.load(bias_pointer + channel, mask=channel_mask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(KERNEL_SIZE):
        weight = tl.load(weight_pointer + channel * KERNEL_SIZE + (KERNEL_SIZE - 1 - j), mask=channel_mask, other=0.0)
        inside = row_mask & (position >= j)
        offsets = (rows - j).to(tl.int64)[:, None] * x_stride + channel[None, :]
        x = tl.load(x_pointer + offsets, mask=inside[:, None] & channel_mask[None, :], other=0.0)
        total += x.to(tl.float32) * weight.to(tl.float32)[None, :]
    return total


@triton.jit
def _conv_forward_kernel(
    x_pointer,
    weight_pointer,
    bias_pointer,
    position_pointer,
    y_pointer,
    tokens,
    channels,
    x_stride,
    KERNEL_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    row_mask = rows < tokens
    channel_mask = channel < channels
    position = tl.load(position_pointer + rows, mask=row_mask, other=0)
    y = _preactivation(
        x_pointer,
        weight_pointer,
        bias_pointer,
        rows,
        position,
        row_mask,
        channel,
        channel_mask,
        x_stride,
        KERNEL_SIZE,
        HAS_BIAS,
    )
    if SILU:
        y = y * tl.sigmoid(y)
    offsets = rows.to(tl.int64)[:, None] * channels + channel[None, :]
    tl.store(y_pointer + offsets, y.to(y_pointer.dtype.element_ty), mask=row_mask[:, None] & channel_mask[None, :])


@triton.jit
def _conv_backward_kernel(
    x_pointer,
    weight_pointer,
    bias_pointer,
    position_pointer,
    dy_pointer,
    dx_pointer,
    dweight_partial_pointer,
    dbias_partial_pointer,
    tokens,
    channels,
    x_stride,
    dy_stride,
    KERNEL_SIZE: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    TAPS: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    program = tl.program_id(0)
    channel = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    channel_mask = channel < channels
    taps = tl.arange(0, TAPS)  # row k of dweight: the tap weight[:, k]
    dweight = tl.zeros([TAPS, BLOCK_C], dtype=tl.float32)
    dbias = tl.zeros([BLOCK_C], dtype=tl.float32)
    for tile in range(0, ROWS, BLOCK_T):
        rows = program * ROWS + tile + tl.arange(0, BLOCK_T)
        row_mask = rows < tokens
        dx = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
        # x[rows] is read by tap `shift` of the output rows + shift: gather what flows back through each.
        for shift in tl.static_range(KERNEL_SIZE):
            out_rows = rows + shift
            out_mask = out_rows < tokens
            position = tl.load(position_pointer + out_rows, mask=out_mask, other=0)
            dy_offsets = out_rows.to(tl.int64)[:, None] * dy_stride + channel[None, :]
            grad = tl.load(dy_pointer + dy_offsets, mask=out_mask[:, None] & channel_mask[None, :], other=0.0)
            grad = grad.to(tl.float32)
            if SILU:  # the pre-activation recomputed: silu'(p) = sigmoid(p) · (1 + p · (1 - sigmoid(p)))
                pre = _preactivation(
                    x_pointer,
                    weight_pointer,
                    bias_pointer,
                    out_rows,
                    position,
                    out_mask,
                    channel,
                    channel_mask,
                    x_stride,
                    KERNEL_SIZE,
                    HAS_BIAS,
                )
                sigmoid = tl.sigmoid(pre)
                grad = grad * sigmoid * (1.0 + pre * (1.0 - sigmoid))
            weight = tl.load(weight_pointer + channel * KERNEL_SIZE + (KERNEL_SIZE - 1 - shift), mask=channel_mask)
            reaches = out_mask & (position >= shift)  # that tap stays inside the output row's document
            dx += tl.where(reaches[:, None], grad * weight.to(tl.float32)[None, :], 0.0)
            if shift == 0:  # grad of these rows' own outputs: the parameters' gradients
                dbias += tl.sum(grad, axis=0)
                for j in tl.static_range(KERNEL_SIZE):
                    inside = row_mask & (position >= j)
                    x_offsets = (rows - j).to(tl.int64)[:, None] * x_stride + channel[None, :]
                    x = tl.load(x_pointer + x_offsets, mask=inside[:, None] & channel_mask[None, :], other=0.0)
                    contribution = tl.sum(grad * x.to(tl.float32), axis=0)
                    dweight += tl.where(taps[:, None] == KERNEL_SIZE - 1 - j, contribution[None, :], 0.0)
        dx_offsets = rows.to(tl.int64)[:, None] * channels + channel[None, :]
        tl.store(
            dx_pointer + dx_offsets, dx.to(dx_pointer.dtype.element_ty), mask=row_mask[:, None] & channel_mask[None, :]
        )
    # Partial sums [programs, channels, kernel_size] and [programs, channels].
    partial = program.to(tl.int64) * channels
    dweight_offsets = (partial + channel[None, :]) * KERNEL_SIZE + taps[:, None]
    tl.store(
        dweight_partial_pointer + dweight_offsets, dweight, mask=(taps[:, None] < KERNEL_SIZE) & channel_mask[None, :]
    )
    tl.store(dbias_partial_pointer + partial + channel, dbias, mask=channel_mask)


def _autotuned(kernel, configs):
    """`kernel` autotuned over `configs`, the results cached on disk where this triton can (`cache_results`)."""
    options = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=_TUNING_KEY, **options)(kernel)


_forward_autotuned = _autotuned(_conv_forward_kernel, _FORWARD_CONFIGS)
_backward_autotuned = _autotuned(_conv_backward_kernel, _BACKWARD_CONFIGS)


def _launch(plain, autotuned, grid, *arguments, **constants) -> None:
    """The autotuned kernel on CUDA; the plain one with the interpreter's tiles on CPU tensors."""
    x = arguments[0]
    if x.is_cuda:
        with torch.cuda.device(x.device):
            autotuned[grid](*arguments, **constants)
    else:
        plain[grid](*arguments, **constants, **_INTERPRETER_CONFIG)


def conv_forward(x, weight, bias, positions, silu: bool) -> torch.Tensor:
    """y [tokens, channels] in x's dtype (see `causal_conv1d_triton`), not differentiable: the kernel alone."""
    tokens, channels = x.shape
    y = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    if tokens > 0:

        def grid(meta):
            return triton.cdiv(tokens, meta["BLOCK_T"]), triton.cdiv(channels, meta["BLOCK_C"])

        _launch(
            _conv_forward_kernel,
            _forward_autotuned,
            grid,
            x,
            weight,
            weight if bias is None else bias,
            positions,
            y,
            tokens,
            channels,
            x.stride(0),
            KERNEL_SIZE=weight.shape[1],
            HAS_BIAS=bias is not None,
            SILU=silu,
        )
    return y


def conv_backward(x, weight, bias, positions, silu: bool, dy: torch.Tensor) -> tuple:
    """(dx, dweight, dbias or None) of `conv_forward`'s y given its gradient `dy`, each in its input's dtype."""
    tokens, channels = x.shape
    kernel_size = weight.shape[1]
    if dy.stride(1) != 1:
        dy = dy.contiguous()
    rows_per_program = ROWS_PER_PROGRAM if x.is_cuda else _INTERPRETER_ROWS_PER_PROGRAM
    programs = triton.cdiv(tokens, rows_per_program)
    dx = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    dweight_partial = torch.empty((programs, channels, kernel_size), dtype=torch.float32, device=x.device)
    dbias_partial = torch.empty((programs, channels), dtype=torch.float32, device=x.device)
    if tokens > 0:

        def grid(meta):
            return programs, triton.cdiv(channels, meta["BLOCK_C"])

        _launch(
            _conv_backward_kernel,
            _backward_autotuned,
            grid,
            x,
            weight,
            weight if bias is None else bias,
            positions,
            dy,
            dx,
            dweight_partial,
            dbias_partial,
            tokens,
            channels,
            x.stride(0),
            dy.stride(0),
            KERNEL_SIZE=kernel_size,
            HAS_BIAS=bias is not None,
            SILU=silu,
            TAPS=triton.next_power_of_2(kernel_size),
            ROWS=rows_per_program,
        )
    dweight = dweight_partial.sum(0).to(weight.dtype)
    dbias = None if bias is None else dbias_partial.sum(0).to(bias.dtype)
    return dx, dweight, dbias


class _CausalConv1d(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, positions, silu):
        ctx.save_for_backward(x, weight, bias, positions)
        ctx.silu = silu
        return conv_forward(x, weight, bias, positions, silu)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, positions = ctx.saved_tensors
        return *conv_backward(x, weight, bias, positions, ctx.silu, dy), None, None


def causal_conv1d_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    *,
    activation: str | None = None,
) -> torch.Tensor:
    """`blockzoo_ssm.causal_conv1d` without a state: differentiable in x, weight and bias.

    x [tokens, channels] (any row stride, channels contiguous; fp32, bf16 or fp16); weight [channels, kernel_size]
    and bias [channels] or None in any float dtype (read in fp32); positions [tokens] int32, each token's position in
    its document (0 at the first token); activation None or "silu". Returns y [tokens, channels] in x's dtype,
    accumulated in fp32; each gradient has its input's dtype. Shapes are checked by the caller.
    """
    if x.stride(1) != 1:
        x = x.contiguous()
    return _CausalConv1d.apply(x, weight.contiguous(), bias, positions, activation == "silu")
