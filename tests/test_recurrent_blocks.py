"""``RecurrentState.steps``: a block of tokens at once equals its steps one by one.

Tolerances: float64 max relative error ≤ 1e-12, float32 ≤ 1e-5 (the sums in another order);
float16/bfloat16 relative RMS error ≤ 1e-2 against float64 on the same rounded inputs.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import kernelstudy as ks
from kernelstudy.core.backends import Backend, register_backend, unregister_backend
from kernelstudy.core.chunked import causal_dot_product_chunked

from .conftest import close_in_dtype, rel_err, stepped

# (B, H, N, F, M): one token, N not a multiple of the torch backend's chunk, F≠M, batch of 1
SHAPES = [(1, 1, 1, 3, 2), (2, 3, 23, 8, 5), (1, 2, 70, 16, 40)]


def _inputs(b, h, n, f, m, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(b, h, n, f, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.rand(b, h, n, f, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(b, h, n, m, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


def _tol(dtype):
    return 1e-12 if dtype == torch.float64 else 1e-5


@pytest.mark.parametrize("backend", ["torch", "reference", "cpu"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_a_block_equals_its_steps_from_a_state(backend, dtype, shape):
    """From a state that has read 9 tokens already: the block's outputs and the state after
    it equal N steps', on every backend that runs here."""
    if backend not in ks.backends():
        pytest.skip(f"backend {backend!r} does not run here")
    b, h, n, f, m = shape
    q, k, v = _inputs(b, h, n + 9, f, m, dtype)
    head, tail = ([t[:, :, :9] for t in (q, k, v)], [t[:, :, 9:] for t in (q, k, v)])
    _, state = stepped(ks.RecurrentState.zeros(b, h, f, m, dtype=dtype), *head)
    held = state.S.clone()
    want, want_state = stepped(state, *tail)
    got, got_state = state.steps(*tail, backend=backend)
    assert got.shape == (b, h, n, m) and got.dtype == dtype
    assert rel_err(got, want) <= _tol(dtype)
    assert rel_err(got_state.S, want_state.S) <= _tol(dtype)
    assert rel_err(got_state.Z, want_state.Z) <= _tol(dtype)
    assert got_state.S.dtype == state.S.dtype and got_state.log_scale is None
    assert torch.equal(state.S, held)  # the state it started from is unchanged


def test_segments_equal_the_batch_attention():
    """A sequence read in segments of 37, 1 and 62 tokens, each starting from the state the
    one before left: the causal attention of the whole, and the state holds Σ φk vᵀ, Σ φk."""
    b, h, n, f, m = 2, 3, 100, 12, 7
    q, k, v = _inputs(b, h, n, f, m)
    state, outs, start = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64), [], 0
    for size in (37, 1, 62):
        out, state = state.steps(*(t[:, :, start : start + size] for t in (q, k, v)))
        outs.append(out)
        start += size
    assert rel_err(torch.cat(outs, 2), ks.linear_attention(q, k, v, causal=True)) <= 1e-12
    assert rel_err(state.S, k.transpose(-1, -2) @ v) <= 1e-12
    assert rel_err(state.Z, k.sum(2)) <= 1e-12


def test_scaled_blocks_equal_the_batch_on_rescaled_keys():
    """Keys φ̂·exp(s) with s from 25 to 60, beyond float32's safe exponents: float32 blocks of a
    scaled state given (φ̂, s) shift them, and equal the float64 batch output on the keys
    themselves; the state's log scale is the largest s so far, as after steps."""
    b, h, n, f, m = 2, 3, 17, 8, 5
    q, k_hat, v = _inputs(b, h, n, f, m)
    log_scale = 25 + 35 * torch.rand(b, h, n, dtype=torch.float64)
    batch = ks.linear_attention(q, k_hat * log_scale.exp()[..., None], v, causal=True, eps=1e-300)
    state = ks.RecurrentState.zeros(b, h, f, m, scaled=True, eps=1e-30)
    for part in (slice(0, 5), slice(5, n)):
        inputs = (t[:, :, part].float() for t in (q, k_hat, v))
        out, state = state.steps(*inputs, k_log_scale=log_scale[:, :, part])
        assert torch.isfinite(out).all()
        assert rel_err(out, batch[:, :, part]) <= 1e-5
        torch.testing.assert_close(state.log_scale, log_scale[:, :, : part.stop].amax(-1).float())
    assert state.log_scale.min() > 20  # the shift acted
    # where eps weighs (no tiny eps): each row is normalized at its own prefix's shift, as
    # the steps' running maximum has it, although a later key of the block sets the sums'
    start = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64, scaled=True, eps=1e-3)
    log_scale = 25 + 10 * torch.rand(b, h, n, dtype=torch.float64)
    log_scale[..., -1] = 40  # the block's largest, last
    want, want_state = stepped(start, q, k_hat, v, log_scale)
    got, got_state = start.steps(q, k_hat, v, k_log_scale=log_scale)
    assert rel_err(got, want) <= 1e-12 and rel_err(got_state.S, want_state.S) <= 1e-12
    shared = ks.RecurrentState(start.S, start.Z, 1e-3)  # one shift and one eps for all rows
    assert rel_err(got, shared.steps(q, k_hat * (log_scale - 40).exp()[..., None], v)[0]) > 1e-3
    # inside the safe range the shift is 0: a block gives its steps' outputs and sums
    small = log_scale / 30
    start = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64, scaled=True)
    want, want_state = stepped(start, q, k_hat, v, small)
    got, got_state = start.steps(q, k_hat, v, k_log_scale=small)
    assert rel_err(got, want) <= 1e-12 and rel_err(got_state.S, want_state.S) <= 1e-12
    assert torch.equal(got_state.log_scale, want_state.log_scale)


def test_padded_tokens_add_nothing():
    """Padded tokens (NaN and a huge log scale in them) leave the sums as the real tokens
    alone make them, and the real tokens' outputs are the padded causal attention's."""
    b, h, n, f, m = 3, 2, 29, 6, 4
    q, k, v = _inputs(b, h, n, f, m)
    mask = torch.rand(b, n, generator=torch.Generator().manual_seed(1)) < 0.7
    mask[0] = True
    mask[1, :3] = False  # the block opens with padding
    k, v = (
        k.masked_fill(~mask[:, None, :, None], torch.nan),
        v.masked_fill(~mask[:, None, :, None], torch.inf),
    )
    start = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64)
    out, state = start.steps(q, k, v, key_padding_mask=mask)
    want = ks.linear_attention(q, k, v, causal=True, key_padding_mask=mask)
    real = mask[:, None, :].expand(b, h, n)
    assert rel_err(out[real], want[real]) <= 1e-12
    keep = mask[:, None, :, None]
    k0, v0 = torch.where(keep, k, 0.0), torch.where(keep, v, 0.0)
    assert rel_err(state.S, k0.transpose(-1, -2) @ v0) <= 1e-12
    assert rel_err(state.Z, k0.sum(2)) <= 1e-12
    # a scaled state: the padded tokens' log scales take no part in its maximum
    scaled = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64, scaled=True)
    log_scale = torch.randn(b, h, n, dtype=torch.float64).masked_fill(~mask[:, None, :], 1e4)
    _, state = scaled.steps(q, k, v, k_log_scale=log_scale, key_padding_mask=mask)
    assert torch.isfinite(state.S).all()
    want_max = log_scale.masked_fill(~mask[:, None, :], -torch.inf).amax(-1)
    assert torch.equal(state.log_scale, want_max)


def test_block_gradients_reach_the_inputs_and_the_state():
    """gradcheck in float64 through a block, w.r.t. φq, φk, v and the state's S and Z (a
    segment's gradient flows back into the segment before it), plain and scaled."""
    b, h, n, f, m = 1, 2, 7, 3, 4
    q, k, v = (t.requires_grad_() for t in _inputs(b, h, n, f, m))
    s = torch.rand(b, h, f, m, dtype=torch.float64, requires_grad=True)
    z = torch.rand(b, h, f, dtype=torch.float64, requires_grad=True)

    def block(q, k, v, s, z):
        out, state = ks.RecurrentState(s, z).steps(q, k, v)
        return out, state.S, state.Z

    assert torch.autograd.gradcheck(block, (q, k, v, s, z))
    log_scale = torch.randn(b, h, n, dtype=torch.float64)

    def scaled(q, k, v):
        state = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64, scaled=True)
        out, state = state.steps(q, k, v, k_log_scale=log_scale)
        return out, state.S

    assert torch.autograd.gradcheck(scaled, (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_blocks_within_tolerance(dtype):
    b, h, n, f, m = 2, 2, 90, 16, 8
    q, k, v = _inputs(b, h, n, f, m, dtype)
    start = ks.RecurrentState.zeros(b, h, f, m)
    out, state = start.steps(q[:, :, :40], k[:, :, :40], v[:, :, :40])
    out2, _ = state.steps(q[:, :, 40:], k[:, :, 40:], v[:, :, 40:])
    assert out.dtype == dtype
    want = ks.linear_attention(*(t.double() for t in (q, k, v)), causal=True)
    assert close_in_dtype(torch.cat([out, out2], 2), want, dtype)


def test_float16_sums_past_its_range_on_a_rounding_backend():
    """A backend with a fused attention may return its product in the inputs' dtype (the
    CUDA backend does): float16's normalizer overflows at 65504, so such a block runs its
    product in float32. Here a stand-in backend that rounds, and a block's sums up to 8e4."""
    name = "rounding_stand_in"

    def rounded(q, k, v):
        return causal_dot_product_chunked(q, k, v).to(q.dtype)

    register_backend(Backend(name, rounded, attention=lambda *args: None, priority=0))
    try:
        b, h, n, f, m = 1, 1, 600, 16, 4
        q, k = torch.ones(b, h, n, f, dtype=torch.float16), torch.ones(b, h, n, f)
        k = (10 * k).half()  # q·k = 160 a key: the block's normalizer passes 65504 at 410
        v = torch.randn(b, h, n, m).half()
        start = ks.RecurrentState.zeros(b, h, f, m)
        _, state = start.steps(q[:, :, :100], k[:, :, :100], v[:, :, :100], backend=name)
        out, _ = state.steps(q[:, :, 100:], k[:, :, 100:], v[:, :, 100:], backend=name)
        assert torch.isfinite(out).all()
        want = ks.linear_attention(*(t.double() for t in (q, k, v)), causal=True)[:, :, 100:]
        assert close_in_dtype(out, want, torch.float16)
        # and the stand-in does overflow where it is given float16 sums to round
        ones = torch.ones_like(v[:, :, 100:, :1])
        assert not torch.isfinite(rounded(q[:, :, 100:], k[:, :, 100:], ones)).all()
    finally:
        unregister_backend(name)


def test_autocast_does_not_reach_the_sums():
    q, k, v = _inputs(1, 2, 40, 8, 5, torch.float32)
    start = ks.RecurrentState.zeros(1, 2, 8, 5)
    want, want_state = start.steps(q, k, v)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, got_state = start.steps(q, k, v)
    assert got.dtype == torch.float32
    assert rel_err(got, want) <= 1e-6 and rel_err(got_state.S, want_state.S) <= 1e-6


@pytest.mark.parametrize("dtype, scale", [(torch.bfloat16, 1.0), (torch.float16, 2.0**16)])
def test_a_backward_inside_autocast_runs_the_state_products_in_float32(dtype, scale):
    """autocast_off covered the block's read-out (q @ [S|Z]) and update (kᵀv) in the forward
    only: a backward() inside autocast ran them in half precision (bf16: the query gradient
    76% off after a 2000-key prompt), where step() and the core's sums keep float32."""
    gen = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.rand(*shape, generator=gen)  # noqa: E731
    _, state = ks.RecurrentState.zeros(1, 1, 8, 8).steps(
        rand(1, 1, 2000, 8), rand(1, 1, 2000, 8), rand(1, 1, 2000, 8)
    )
    q0, k, v = rand(1, 1, 16, 8), rand(1, 1, 16, 8), torch.randn(1, 1, 16, 8, generator=gen)
    grads = []
    for inside in (True, False):
        q = q0.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            loss = state.steps(q, k, v)[0].float().sum() * scale
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        grads.append(q.grad)
    assert rel_err(grads[0], grads[1]) <= 1e-6


def test_an_empty_block_leaves_the_state():
    state = ks.RecurrentState.zeros(2, 3, 4, 5)
    q = torch.rand(2, 3, 0, 4)
    out, same = state.steps(q, q, torch.rand(2, 3, 0, 5))
    assert out.shape == (2, 3, 0, 5) and same is state


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda s, q, v: s.steps(q[..., :3], q, v), ValueError, "phi_q"),
        (lambda s, q, v: s.steps(q, q[:, :, :5], v), ValueError, "phi_k"),
        (lambda s, q, v: s.steps(q, q, v[..., :2]), ValueError, "v must have shape"),
        (lambda s, q, v: s.steps(q[0], q[0], v[0]), ValueError, "phi_q must have 4"),
        (lambda s, q, v: s.steps(q, q.double(), v), TypeError, "dtype"),
        (lambda s, q, v: s.steps(q, q, v, k_log_scale=torch.zeros(1, 2, 6)), ValueError, "scaled"),
        (lambda s, q, v: s.steps(q, q, v, key_padding_mask=torch.ones(1, 5)), TypeError, "bool"),
        (
            lambda s, q, v: s.steps(q, q, v, key_padding_mask=torch.ones(1, 5, dtype=torch.bool)),
            ValueError,
            "key_padding_mask must have shape",
        ),
        (lambda s, q, v: s.steps(q, q, v, backend="nope"), ValueError, "backend"),
        (
            lambda s, q, v: s.steps(q.to("meta"), q.to("meta"), v.to("meta")),
            ValueError,
            "state is on",
        ),
    ],
)
def test_bad_blocks_are_refused(call, error, match):
    state = ks.RecurrentState.zeros(1, 2, 4, 3)
    q, v = torch.rand(1, 2, 6, 4), torch.rand(1, 2, 6, 3)
    with pytest.raises(error, match=match):
        call(state, q, v)


def test_scaled_blocks_need_their_log_scales():
    state = ks.RecurrentState.zeros(1, 2, 4, 3, scaled=True)
    q, v = torch.rand(1, 2, 6, 4), torch.rand(1, 2, 6, 3)
    with pytest.raises(ValueError, match="k_log_scale must be given"):
        state.steps(q, q, v)
    with pytest.raises(ValueError, match=r"k_log_scale must have shape \(1, 2, 6\)"):
        state.steps(q, q, v, k_log_scale=torch.zeros(1, 2))


def test_blocks_work_under_torch_func():
    """vmap over a stack of blocks equals each block alone; jacrev and jvp equal autograd's
    Jacobian (float64, from a non-empty state)."""
    from torch.func import jacrev, jvp, vmap

    q, k, v = _inputs(1, 2, 5, 3, 4)
    gen = torch.Generator().manual_seed(2)
    state = ks.RecurrentState(
        torch.rand(1, 2, 3, 4, generator=gen, dtype=torch.float64),
        torch.rand(1, 2, 3, generator=gen, dtype=torch.float64),
    )

    def block(q):
        return state.steps(q, k, v)[0]

    many = torch.rand(4, 1, 2, 5, 3, generator=gen, dtype=torch.float64)
    mapped = vmap(block)(many)
    assert all(rel_err(mapped[i], block(many[i])) <= 1e-12 for i in range(4))
    want = torch.autograd.functional.jacobian(block, q)
    assert rel_err(jacrev(block)(q), want) <= 1e-12
    tangent = torch.randn(q.shape, generator=gen, dtype=torch.float64)
    assert rel_err(jvp(block, (q,), (tangent,))[1], (want * tangent).sum((-4, -3, -2, -1))) <= 1e-12


def test_steps_and_blocks_take_dual_tensors_of_inputs_that_require_grad():
    """Forward-mode AD on dual tensors whose primals require grad (a parameter, or an input
    under training): the state's autocast-free read-out ran ``torch.func.jvp``, which refuses
    to nest in a dual level ("nested forward mode AD"); a step, a block and a layer's step
    now give the tangent ``torch.func.jvp`` gives (float64, ≤ 1e-12)."""
    q, k, v = _inputs(1, 2, 5, 3, 4)
    gen = torch.Generator().manual_seed(2)
    state = ks.RecurrentState(
        torch.rand(1, 2, 3, 4, generator=gen, dtype=torch.float64),
        torch.rand(1, 2, 3, generator=gen, dtype=torch.float64),
    )
    tangent = torch.randn(v.shape, generator=gen, dtype=torch.float64)
    cases = {
        "step": (lambda v: state.step(q[:, :, 0], k[:, :, 0], v[:, :, 0])[0], v),
        "steps": (lambda v: state.steps(q, k, v)[0], v),
    }
    layer = ks.nn.KernelAttention(4, 1, feature_map="elu", causal=True).double()
    x = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    cases["layer step"] = (lambda x: layer.step(x)[0], x)
    for name, (fn, primal) in cases.items():
        d = tangent if primal is v else torch.randn(x.shape, generator=gen, dtype=x.dtype)
        want = torch.func.jvp(fn, (primal,), (d,))[1]
        with fwAD.dual_level():
            got = fwAD.unpack_dual(fn(fwAD.make_dual(primal.clone().requires_grad_(), d)))
        assert rel_err(got.tangent, want) <= 1e-12, name


@pytest.mark.parametrize("scaled", [False, True])
def test_a_float64_state_sums_float32_blocks_in_float64(scaled):
    """A plain float64 state's block was summed in the inputs' float32 (a scaled one's in
    float64), while step() sums in the state's dtype: steps() differed from stepping by
    2e-6 at N = 4000. Now its float32 outputs are the exact ones rounded once."""
    b, h, n, f, m = 1, 1, 2000, 8, 3
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.rand(b, h, n, f, generator=gen) for _ in "qk")
    v = torch.randn(b, h, n, m, generator=gen) + 3
    state = ks.RecurrentState.zeros(b, h, f, m, dtype=torch.float64, scaled=scaled)
    out, after = state.steps(q, k, v, torch.zeros(b, h, n) if scaled else None)
    exact = ks.linear_attention(q.double(), k.double(), v.double(), causal=True)
    assert out.dtype == torch.float32 and after.S.dtype == torch.float64
    ulp = torch.finfo(torch.float32).eps * exact.abs()
    assert ((out.double() - exact).abs() <= ulp).all()  # within float32's rounding


def test_a_scaled_block_whose_shift_climbs_far_is_summed_in_segments():
    """A block took all its keys at the shift of its largest log scale: keys e^100 below a
    later one underflowed in float32, and rows before that key read their own keys as 0
    (0.011 off stepping for a trig_rf layer, and more where eps swamps them). The block is
    split where a row's shift climbs by more than SEGMENT_SPREAD, in every (batch, head)."""
    from kernelstudy.core.recurrent import SEGMENT_SPREAD

    torch.manual_seed(0)
    b, h, n, f, m = 2, 2, 16, 6, 5
    q, k = torch.rand(b, h, n, f) + 0.1, torch.rand(b, h, n, f) + 0.1
    v = torch.randn(b, h, n, m)
    log_scale = torch.randn(b, h, n)
    log_scale[0, :, 5] = 70.0  # climbs at 5 in the first sequence, at 9 and 12 in the second
    log_scale[1, :, 9] = 60.0  # a shift of 40: the excess over the safe range (20)
    log_scale[1, 1, 12] = 120.0
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 14:] = False
    empty = ks.RecurrentState.zeros(b, h, f, m, scaled=True)
    assert empty.segment_bounds(log_scale) == [0, 5, 9, 12, n]
    assert empty.segment_bounds(torch.randn(b, h, n)) == [0, n]  # no climb: one block
    assert SEGMENT_SPREAD < 40
    padded = log_scale.masked_fill(~mask[:, None, :], -torch.inf)
    want, want_state = stepped(empty, q, k.masked_fill(~mask[:, None, :, None], 0), v, padded)
    for split in (n, 7):  # one block, and two with the state carried over
        first, state = empty.steps(
            q[:, :, :split],
            k[:, :, :split],
            v[:, :, :split],
            log_scale[:, :, :split],
            key_padding_mask=mask[:, :split],
        )
        rest, state = state.steps(
            q[:, :, split:],
            k[:, :, split:],
            v[:, :, split:],
            log_scale[:, :, split:],
            key_padding_mask=mask[:, split:],
        )
        got = torch.cat([first, rest], dim=2)
        assert rel_err(got, want) <= 1e-5, split
        assert torch.equal(state.log_scale, want_state.log_scale)
        assert rel_err(state.S, want_state.S) <= 1e-5 and rel_err(state.Z, want_state.Z) <= 1e-5
    # gradients through the segments, against float64 stepping
    x = [t.double().requires_grad_() for t in (q, k, v, log_scale)]
    y, _ = empty.steps(*(t.float() for t in x[:3]), x[3].float(), key_padding_mask=mask)
    wx = [t.detach().clone().requires_grad_() for t in x]
    state64 = ks.RecurrentState.zeros(b, h, f, m, torch.float64, scaled=True)
    k64 = wx[1].masked_fill(~mask[:, None, :, None], 0)
    y64, _ = stepped(state64, wx[0], k64, wx[2], wx[3].masked_fill(~mask[:, None, :], -torch.inf))
    w = torch.randn_like(y64)
    got = torch.autograd.grad((y.double() * w).sum(), x)
    want = torch.autograd.grad((y64 * w).sum(), wx)
    for g, g64 in zip(got, want, strict=True):
        assert torch.isfinite(g).all() and rel_err(g, g64, floor=1e-3) <= 1e-4


def test_segments_are_the_fewest_within_the_spread_and_joined_by_one_backward_node():
    """Bands of SEGMENT_SPREAD from the block's first row cut wherever any (batch, head)
    crossed a band's edge: sequences climbing out of step gave about twice the segments
    needed, a number growing with B·H; and each segment was a slice, whose backward fills a
    zero tensor of the whole block (S segments: O(S·N) backward, 70% of it at N = 8192)."""
    from kernelstudy.core.recurrent import SEGMENT_SPREAD

    b, h, n, f, m = 1, 4, 240, 3, 2
    climb = torch.arange(n, dtype=torch.float32)  # one e-fold a token, above the safe range
    offsets = torch.tensor([0.0, 7.0, 15.0, 22.0])  # the heads climb out of step
    log_scale = (100.0 + climb + offsets[:, None])[None]
    empty = ks.RecurrentState.zeros(b, h, f, m, scaled=True)
    bounds = empty.segment_bounds(log_scale)
    assert bounds[0] == 0 and bounds[-1] == n
    shift = log_scale[0] - log_scale[0, :, :1]  # each head's shift climbs as its log scale
    for start, stop in zip(bounds, bounds[1:], strict=False):
        assert (shift[:, stop - 1] - shift[:, start]).max() <= SEGMENT_SPREAD  # within
        if stop < n:
            assert (shift[:, stop] - shift[:, start]).max() > SEGMENT_SPREAD  # no fewer
    assert len(bounds) - 1 == 8  # 240 tokens, 31 a segment; the bands cut 31 times
    torch.manual_seed(0)
    q, k = torch.rand(b, h, n, f) + 0.1, torch.rand(b, h, n, f) + 0.1
    v = torch.randn(b, h, n, m).requires_grad_()
    out, _ = empty.steps(q, k, v, log_scale)
    seen, todo, readers = set(), [out.grad_fn], []  # the nodes that take v's gradient
    while todo:
        node = todo.pop()
        if node is not None and node not in seen:
            seen.add(node)
            nexts = [next_fn for next_fn, _ in node.next_functions]
            if any(getattr(x, "variable", None) is v for x in nexts):
                readers.append(type(node).__name__)
            todo.extend(nexts)
    assert readers == ["SplitWithSizesBackward0"]
    want, _ = stepped(empty, q, k, v.detach(), log_scale)
    assert rel_err(out, want) <= 1e-5


def test_a_block_after_padding_with_keys_far_below_the_range_is_split():
    """A padded first token (no key yet: shift 0) before keys e^200 below the range (their
    shift −180): the rows' shifts fell, then climbed back to 0, and the check saw no climb
    from the first row to the last. The block ran at one shift, where those keys underflow:
    rows 1-2 read 0 (stepping: −0.34, −1.15)."""
    torch.manual_seed(0)
    q, k, v = torch.rand(1, 1, 4, 3) + 0.1, torch.rand(1, 1, 4, 3) + 0.1, torch.randn(1, 1, 4, 2)
    log_scale = torch.tensor([[[0.0, -200.0, -200.0, 0.0]]])
    mask = torch.tensor([[False, True, True, True]])
    empty = ks.RecurrentState.zeros(1, 1, 3, 2, scaled=True)
    assert empty.segment_bounds(log_scale, mask) == [0, 3, 4]
    got, _ = empty.steps(q, k, v, log_scale, key_padding_mask=mask)
    padded = log_scale.masked_fill(~mask[:, None, :], -torch.inf)
    want, _ = stepped(empty, q, k.masked_fill(~mask[:, None, :, None], 0), v, padded)
    assert rel_err(got, want) <= 1e-6


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_infinite_log_scale_reaches_no_earlier_row_of_a_block(bad):
    """A key whose log scale is NaN or +inf (an exponent that overflowed) set the block's
    shift to 0 (exp_shift of a non-finite maximum): earlier keys above the range overflowed
    and every row of the block turned NaN, where stepping keeps the rows before it."""
    torch.manual_seed(0)
    q, k, v = torch.rand(1, 1, 4, 3) + 0.1, torch.rand(1, 1, 4, 3) + 0.1, torch.randn(1, 1, 4, 2)
    log_scale = torch.tensor([[[0.0, 150.0, 0.0, bad]]])
    empty = ks.RecurrentState.zeros(1, 1, 3, 2, scaled=True)
    got, _ = empty.steps(q, k, v, log_scale)
    want, _ = stepped(empty, q, k, v, log_scale)
    assert torch.isfinite(got[:, :, :3]).all() and rel_err(got[:, :, :3], want[:, :, :3]) <= 1e-6
    assert not torch.isfinite(got[:, :, 3]).all()  # the key's own row, as stepping's
