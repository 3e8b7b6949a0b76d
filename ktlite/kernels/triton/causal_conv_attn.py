"""Depthwise causal conv1d + SiLU over a packed batch with per-sequence rolling state: Triton twin of
reference.causal_conv1d_batch_torch (the short conv in front of Gated DeltaNet's linear attention).

One program per (sequence, channel block) walks its tokens BLOCK_T at a time. Tap j of output t reads
input position t + j - (W-1): from x when >= 0, else from the sequence's state row (the previous W-1
inputs; zeros when reset). The program then writes the new state, the last W-1 inputs of
[state, x], in place. Its reads of that state row all come before the barrier in front of the
writes, and no other program touches the row's channels, so updating in place is safe. As in the
reference, state values pass through x's dtype, the sum runs in fp32 and SiLU is applied before
rounding to x's dtype. No host sync (CUDA-graph friendly).
"""

import logging

import torch
import triton
import triton.language as tl

logger = logging.getLogger(__name__)


@triton.jit
def _inputs(X, s_ptr, pos, start, offs_c, use, first, stride_xn, stride_sw, WIDTH: tl.constexpr):
    """Inputs at sequence positions pos [P] for channels offs_c -> [P, BLOCK_C] in x's dtype: x when
    pos >= 0, else state column pos + W-1 when pos >= first (first = 0 for a reset sequence: zeros).
    `use` masks rows/channels."""
    from_x = (pos >= 0)[:, None]
    xv = tl.load(X + (start + pos)[:, None] * stride_xn + offs_c[None, :], mask=use & from_x, other=0.0)
    from_state = ((pos < 0) & (pos >= first))[:, None]
    sv = tl.load(s_ptr[None, :] + (pos + (WIDTH - 1))[:, None] * stride_sw, mask=use & from_state, other=0.0)
    return tl.where(from_x, xv, sv.to(xv.dtype))


@triton.jit
def _conv_kernel(
    X, States, Weight, Rows, Starts, Lens, Reset, Out,
    stride_xn, stride_sr, stride_sc, stride_sw, stride_wc, stride_on,
    C: tl.constexpr, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    n = tl.load(Lens + b)
    if n > 0:  # an empty sequence leaves its state alone, reset or not (like the reference)
        start = tl.load(Starts + b).to(tl.int64)
        row = tl.load(Rows + b).to(tl.int64)
        # first position the state provides: a bound rather than `mask & flag` (the interpreter turns a
        # tensor & scalar-bool into ints, which it then refuses as a mask)
        first = tl.where(tl.load(Reset + b) == 0, 1 - WIDTH, 0)
        offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask_c = offs_c < C
        s_ptr = States + row * stride_sr + offs_c * stride_sc  # [BLOCK_C], state column 0
        for t0 in range(0, n, BLOCK_T):
            offs_t = t0 + tl.arange(0, BLOCK_T)
            use = (offs_t < n)[:, None] & mask_c[None, :]
            acc = tl.zeros([BLOCK_T, BLOCK_C], tl.float32)
            for j in tl.static_range(WIDTH):
                pos = offs_t + (j - (WIDTH - 1))
                x_in = _inputs(X, s_ptr, pos, start, offs_c, use, first, stride_xn, stride_sw, WIDTH)
                w = tl.load(Weight + offs_c * stride_wc + j, mask=mask_c, other=0.0).to(tl.float32)
                acc += x_in.to(tl.float32) * w[None, :]
            y = acc * tl.sigmoid(acc)
            tl.store(Out + (start + offs_t)[:, None] * stride_on + offs_c[None, :], y.to(Out.dtype.element_ty),
                     mask=use)
        offs_s = tl.arange(0, BLOCK_S)
        use = (offs_s < WIDTH - 1)[:, None] & mask_c[None, :]
        new_state = _inputs(X, s_ptr, n + offs_s - (WIDTH - 1), start, offs_c, use, first, stride_xn, stride_sw, WIDTH)
        tl.debug_barrier()  # every read of the old state row is done before it is overwritten
        tl.store(s_ptr[None, :] + offs_s[:, None] * stride_sw, new_state.to(States.dtype.element_ty), mask=use)


def causal_conv1d_triton(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, rows: torch.Tensor,
                         extend_lens: torch.Tensor, reset: torch.Tensor, block_t: int = 16, block_c: int = 128,
                         num_warps: int = 4) -> torch.Tensor:
    """Triton twin of reference.causal_conv1d_batch_torch: x [N, C], conv_states [R, C, W-1] (updated in
    place at rows [B], zeros first where reset), weight [C, W], extend_lens [B] -> [N, C] in x's dtype."""
    num_tokens, channels = x.shape
    width = weight.shape[1]
    assert weight.shape[0] == channels and conv_states.shape[1:] == (channels, width - 1), \
        f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_states {tuple(conv_states.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1
    out = torch.empty_like(x)
    batch = extend_lens.shape[0]
    if width < 2:
        raise ValueError(f"causal_conv1d needs a kernel width >= 2, got {width}")
    if num_tokens == 0 or batch == 0:
        return out
    starts = torch.cumsum(extend_lens, 0) - extend_lens
    block_c = min(block_c, triton.next_power_of_2(channels))
    _conv_kernel[(batch, triton.cdiv(channels, block_c))](
        x, conv_states, weight, rows, starts, extend_lens, reset.to(torch.int32), out,
        x.stride(0), conv_states.stride(0), conv_states.stride(1), conv_states.stride(2), weight.stride(0),
        out.stride(0),
        C=channels, WIDTH=width, BLOCK_T=block_t, BLOCK_C=block_c, BLOCK_S=triton.next_power_of_2(width - 1),
        num_warps=num_warps,
    )
    return out
