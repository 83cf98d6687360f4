"""RNN-mode state equals the causal batch output; softmax equals its explicit form."""

from __future__ import annotations

import math

import pytest
import torch

import kernelstudy as ks

from .conftest import close_in_dtype, rel_err, stepped


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b, h, n, f, m", [(1, 1, 1, 3, 2), (2, 3, 23, 8, 5), (1, 2, 70, 16, 40)])
def test_recurrent_steps_equal_causal_output(dtype, b, h, n, f, m):
    q, k = torch.rand(b, h, n, f, dtype=dtype), torch.rand(b, h, n, f, dtype=dtype)
    v = torch.randn(b, h, n, m, dtype=dtype)
    batch = ks.linear_attention(q, k, v, causal=True)
    state = ks.RecurrentState.zeros(b, h, f, m, dtype=dtype)
    for t in range(n):
        out_t, state = state.step(q[:, :, t], k[:, :, t], v[:, :, t])
        assert out_t.shape == (b, h, m)
        # float64 to 1e-12: a state summing float64 inputs in float32 passed at 1e-5
        assert rel_err(out_t, batch[:, :, t]) <= (1e-12 if dtype == torch.float64 else 1e-5)
    assert state.S.shape == (b, h, f, m) and state.Z.shape == (b, h, f)


def test_scaled_state_equals_plain_state_on_rescaled_keys():
    """Keys φ̂·exp(s) with s up to ±300 (beyond float32): a float32 scaled state given (φ̂, s)
    equals the float64 batch output on the keys themselves."""
    b, h, n, f, m = 2, 3, 17, 8, 5
    q, k_hat = torch.rand(2, b, h, n, f, dtype=torch.float64).unbind(0)
    v = torch.randn(b, h, n, m, dtype=torch.float64)
    shift = 300 * torch.randn(b, h, n, dtype=torch.float64).clamp(-1, 1)
    k = k_hat * shift.exp()[..., None]
    batch = ks.linear_attention(q, k, v, causal=True, eps=1e-300)
    state = ks.RecurrentState.zeros(b, h, f, m, scaled=True, eps=1e-30)
    for t in range(n):
        step = (q[:, :, t].float(), k_hat[:, :, t].float(), v[:, :, t].float(), shift[:, :, t])
        out_t, state = state.step(*step)
        assert torch.isfinite(out_t).all()
        assert rel_err(out_t, batch[:, :, t]) <= 1e-5
    torch.testing.assert_close(state.log_scale, shift.amax(-1).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_recurrent_step_gradients_equal_the_reference(dtype):
    """The steps are differentiable (the read-out runs through an autograd Function), but only
    their outputs were compared: the gradients w.r.t. every step's φq, φk and v against the
    float64 causal reference, batch 1, F≠M, float32 state (max rel err <= 1e-4 / 1e-10);
    and a scaled state (keys φ̂·exp(s), s up to ±40, so its decay and shifts act) against
    the reference on the keys themselves."""
    b, h, n, f, m = 1, 2, 11, 5, 3
    q, k = (torch.rand(b, h, n, f, dtype=dtype).requires_grad_() for _ in "qk")
    v = torch.randn(b, h, n, m, dtype=dtype).requires_grad_()
    got, _ = stepped(ks.RecurrentState.zeros(b, h, f, m), q, k, v)
    want = ks.core.linear_attention_reference(*(t.double() for t in (q, k, v)), causal=True)
    g = torch.randn(want.shape, dtype=torch.float64)
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    pairs = zip(
        (got, *torch.autograd.grad(got, (q, k, v), g.to(dtype))),
        (want, *torch.autograd.grad(want, (q, k, v), g)),
        strict=True,
    )
    for i, (a, w) in enumerate(pairs):
        assert rel_err(a, w, floor=1.0) <= tol, i
    # a scaled state (float64: the exact keys stay in range), batch 2
    q, k_hat = (torch.rand(2, 1, 9, 4, dtype=torch.float64).requires_grad_() for _ in "qk")
    v = torch.randn(2, 1, 9, 3, dtype=torch.float64).requires_grad_()
    shift = 40 * torch.randn(2, 1, 9, dtype=torch.float64).clamp(-1, 1)
    state = ks.RecurrentState.zeros(2, 1, 4, 3, dtype=torch.float64, scaled=True, eps=1e-300)
    got, _ = stepped(state, q, k_hat, v, shift)
    k = k_hat * shift.exp()[..., None]
    want = ks.core.linear_attention_reference(q, k, v, causal=True, eps=1e-300)
    g = torch.randn_like(want)
    pairs = zip(
        (got, *torch.autograd.grad(got, (q, k_hat, v), g)),
        (want, *torch.autograd.grad(want, (q, k_hat, v), g)),
        strict=True,
    )
    for i, (a, w) in enumerate(pairs):
        assert rel_err(a, w, floor=1.0) <= 1e-10, i


def test_scaled_and_plain_states_refuse_the_other_kind_of_step():
    q, v = torch.rand(1, 2, 4), torch.rand(1, 2, 3)
    with pytest.raises(ValueError, match="k_log_scale"):
        ks.RecurrentState.zeros(1, 2, 4, 3).step(q, q, v, torch.zeros(1, 2))
    scaled = ks.RecurrentState.zeros(1, 2, 4, 3, scaled=True)
    with pytest.raises(ValueError, match="k_log_scale"):
        scaled.step(q, q, v)
    with pytest.raises(ValueError, match=r"k_log_scale must have shape \(1, 2\)"):
        scaled.step(q, q, v, torch.zeros(2, 1))
    with pytest.raises(TypeError, match="scaled must be a bool"):  # "no" made a scaled state
        ks.RecurrentState.zeros(1, 2, 4, 3, scaled="no")


def test_softmax_with_no_head_dimension_needs_a_scale():
    q = torch.rand(1, 1, 3, 0)
    v = torch.rand(1, 1, 3, 2)
    for fn in (ks.softmax_attention, ks.core.softmax_attention_reference):
        with pytest.raises(ValueError, match="D = 0: 1/√D is undefined, pass scale"):
            fn(q, q, v)  # was ZeroDivisionError
        assert fn(q, q, v, scale=1.0).shape == (1, 1, 3, 2)


def test_recurrent_state_is_constant_size_and_immutable():
    state = ks.RecurrentState.zeros(1, 1, 4, 3)
    q = torch.rand(1, 1, 4)
    out, new = state.step(q, q, torch.rand(1, 1, 3))
    assert new is not state and torch.all(state.S == 0)
    assert new.S.shape == state.S.shape and new.Z.shape == state.Z.shape


def test_recurrent_half_inputs_keep_float32_state():
    state = ks.RecurrentState.zeros(1, 2, 4, 3)
    q = torch.rand(1, 2, 4).half()
    out, state = state.step(q, q, torch.rand(1, 2, 3).half())
    assert out.dtype == torch.float16 and state.S.dtype == torch.float32


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.step(torch.rand(1, 1, 5), torch.rand(1, 1, 4), torch.rand(1, 1, 3)), "phi_q"),
        (lambda s: s.step(torch.rand(1, 1, 4), torch.rand(2, 1, 4), torch.rand(1, 1, 3)), "phi_k"),
        (lambda s: s.step(torch.rand(1, 1, 4), torch.rand(1, 1, 4), torch.rand(1, 1, 2)), "v"),
    ],
)
def test_recurrent_bad_shapes(call, match):
    with pytest.raises(ValueError, match=match):
        call(ks.RecurrentState.zeros(1, 1, 4, 3))


def test_recurrent_step_refuses_mixed_dtypes_and_devices():
    state = ks.RecurrentState.zeros(1, 1, 4, 3)
    q, v = torch.rand(1, 1, 4), torch.rand(1, 1, 3)
    with pytest.raises(TypeError, match=r"phi_q_t, phi_k_t and v_t must share one dtype"):
        state.step(q, q.double(), v)
    with pytest.raises(ValueError, match=r"must share one device, got cpu, meta, cpu"):
        state.step(q, q.to("meta"), v)
    meta = (q.to("meta"), q.to("meta"), v.to("meta"))
    with pytest.raises(ValueError, match="inputs are on meta but the state is on cpu"):
        state.step(*meta)
    scaled = ks.RecurrentState.zeros(1, 1, 4, 3, scaled=True)
    with pytest.raises(ValueError, match="k_log_scale is on meta but the state is on cpu"):
        scaled.step(q, q, v, torch.zeros(1, 1, device="meta"))


def test_recurrent_state_survives_float16_autocast():
    """2000 steps of φ ≈ 1 make a normalizer of 2000·F; read under float16 autocast,
    the state's product was rounded to float16 and overflowed to inf."""
    f, m = 64, 3
    state = ks.RecurrentState.zeros(1, 1, f, m)
    one = torch.ones(1, 1, f)
    for _ in range(2000):
        _, state = state.step(one, one, torch.ones(1, 1, m))
    with torch.autocast("cpu", dtype=torch.float16):
        out, _ = state.step(one, one, torch.ones(1, 1, m))
    torch.testing.assert_close(out, torch.ones(1, 1, m))
    q4 = torch.ones(1, 1, 1, f)
    with pytest.raises(ValueError, match=r"3 dimensions \(batch, heads, dim\), got shape"):
        state.step(q4, q4, torch.ones(1, 1, 1, m))


def test_recurrent_bad_sizes():
    with pytest.raises(ValueError, match="feature_dim"):
        ks.RecurrentState.zeros(1, 1, 0, 3)
    with pytest.raises(TypeError, match="dtype"):
        ks.RecurrentState.zeros(1, 1, 2, 3, dtype=torch.int64)
    with pytest.raises(ValueError, match="eps"):
        ks.RecurrentState.zeros(1, 1, 2, 3, eps=0.0)
    with pytest.raises(ValueError, match="batch must be an int >= 0, got -1"):
        ks.RecurrentState.zeros(-1, 1, 2, 3)


@pytest.mark.parametrize("feature_map", ["elu", "favor"])
def test_an_empty_batch_steps_as_the_forward_takes_it(feature_map):
    """RecurrentState.zeros refused batch 0, so a kernel layer could not step an empty batch
    (its forward, the softmax layer and generate could)."""
    layer = ks.nn.KernelAttention(8, 2, feature_map=feature_map, causal=True)
    x = torch.randn(0, 3, 8)
    y, state = layer.step(x[:, 0])
    out, state = layer.steps(x, state)
    assert y.shape == (0, 8) and out.shape == (0, 3, 8) == layer(x).shape
    assert state.S.shape[0] == 0
    lm = ks.nn.CausalLM(10, d_model=8, n_heads=2, n_layers=1)
    assert lm.generate(torch.zeros(0, 4, dtype=torch.long), 2).shape == (0, 6)


def _explicit_softmax(q, k, v, causal, mask):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    allowed = torch.ones_like(scores, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    if mask is not None:
        allowed &= mask[:, None, None, :]
    scores = scores.masked_fill(~allowed, float("-inf"))
    weights = torch.softmax(scores, -1).nan_to_num(0.0)
    return weights @ v


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("masked", [False, True])
def test_softmax_equals_explicit(causal, masked):
    b, h, n, d, m = 3, 2, 17, 8, 6
    q, k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d), torch.randn(b, h, n, m)
    mask = None
    if masked:
        mask = torch.arange(n)[None] < torch.tensor([17, 9, 4])[:, None]
    got = ks.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    want = _explicit_softmax(q, k, v, causal, mask)
    assert rel_err(got, want) <= 1e-5
    assert rel_err(ks.core.softmax_attention_reference(q, k, v, causal, mask), want) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_softmax_outputs_and_all_gradients_match_the_reference(causal, dtype):
    """softmax_attention (SDPA, with the empty rows' mask trick) against the float64 explicit
    reference, outputs and the gradients w.r.t. q, k, v: D≠M, N=9, batch 3 with left padding
    (causal rows before the first real key see nothing) and a fully padded sequence, and
    batch 1; the core's tolerances (close_in_dtype). Before, outputs only, right padding."""
    q, k = (torch.randn(3, 2, 9, 5) for _ in "qk")
    v = torch.randn(3, 2, 9, 7)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :3] = False
    mask[2] = False
    for b in (3, 1):
        inputs = [t[:b].to(dtype).requires_grad_() for t in (q, k, v)]
        ref = [t.detach().double().requires_grad_() for t in inputs]
        got = ks.softmax_attention(*inputs, causal=causal, key_padding_mask=mask[:b])
        want = ks.core.softmax_attention_reference(*ref, causal, mask[:b])
        g = torch.randn(want.shape, dtype=torch.float64)
        got = (got, *torch.autograd.grad(got, inputs, g.to(dtype)))
        want = (want, *torch.autograd.grad(want, ref, g))
        for i, (a, w) in enumerate(zip(got, want, strict=True)):
            assert a.dtype == dtype and close_in_dtype(a, w, dtype), (b, i)
        if b == 3:  # the fully padded sequence: zero output and gradients
            assert all(torch.all(t[2] == 0) for t in got)


def test_softmax_fully_masked_rows_are_zero_not_nan():
    q, k, v = torch.randn(2, 1, 4, 3), torch.randn(2, 1, 4, 3), torch.randn(2, 1, 4, 3)
    mask = torch.tensor([[True] * 4, [False] * 4])
    out = ks.softmax_attention(q, k, v, key_padding_mask=mask)
    assert torch.isfinite(out).all() and torch.all(out[1] == 0)


def test_softmax_cross_lengths_and_bad_input():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 7, 4), torch.randn(1, 2, 7, 5)
    assert ks.softmax_attention(q, k, v).shape == (1, 2, 3, 5)
    with pytest.raises(ValueError, match="k"):
        ks.softmax_attention(q, k[..., :3], v)
    with pytest.raises(ValueError, match="key_padding_mask"):
        ks.softmax_attention(q, k, v, key_padding_mask=torch.ones(1, 3, dtype=torch.bool))


def test_softmax_reference_in_float16_stays_finite():
    """q.k in float16 overflowed to inf before scaling, and the reference gave NaN where
    the fast path (SDPA) did not."""
    q = torch.full((1, 1, 6, 16), 70.0, dtype=torch.float16)
    v = torch.randn(1, 1, 6, 16).half()
    for causal in (False, True):
        got = ks.core.softmax_attention_reference(q, q, v, causal)
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        want = ks.core.softmax_attention_reference(q.float(), q.float(), v.float(), causal)
        assert rel_err(got, want) <= 1e-2


def test_softmax_reference_takes_a_mask_on_another_device():
    """softmax_attention moves key_padding_mask to q's device; the reference checked the mask
    but built its allowed matrix from the original one (a CPU mask with meta or CUDA
    tensors: RuntimeError 'Tensor on device cpu is not on the expected device')."""
    q, v = torch.randn(2, 1, 5, 3, device="meta"), torch.randn(2, 1, 5, 4, device="meta")
    mask = torch.tensor([[True, True, False, True, False], [False] * 5])
    for causal in (False, True):
        for fn in (ks.softmax_attention, ks.core.softmax_attention_reference):
            out = fn(q, q, v, causal, mask)
            assert out.device.type == "meta" and out.shape == (2, 1, 5, 4)


def test_scaled_state_keeps_one_shift_across_input_dtypes():
    """The shift was taken in the range of each step's feature dtype (float16: e^±9), but
    the sums are float32 and record no dtype: a key at e^15 stepped in float16 was stored
    at shift 15, read back in a float32 step at shift 0, and that step's key was added
    e^15 too high (relative error 1.48 against the exact output)."""
    f, m = 4, 3
    q, k_hat = torch.rand(2, 1, 1, 2, f, dtype=torch.float64).unbind(0)
    v = torch.randn(1, 1, 2, m, dtype=torch.float64)
    shift = torch.tensor([[[15.0, 0.0]]], dtype=torch.float64)
    exact = ks.linear_attention(q, k_hat * shift.exp()[..., None], v, causal=True)
    state = ks.RecurrentState.zeros(1, 1, f, m, scaled=True)
    for t, dtype in enumerate((torch.float16, torch.float32)):
        step = (x[:, :, t].to(dtype) for x in (q, k_hat, v))
        out, state = state.step(*step, shift[:, :, t])
        assert rel_err(out, exact[:, :, t]) <= 1e-3


def test_softmax_reference_keeps_a_nan_query_nan_with_a_mask():
    """Given any key_padding_mask, the reference zeroed every NaN weight (nan_to_num), so a
    NaN query came out as 0 there, and NaN without a mask and in softmax_attention."""
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 2)
    q[0, 0, 1, 0] = float("nan")
    mask = torch.tensor([[True, True, False]])
    for causal in (False, True):
        for fn in (ks.softmax_attention, ks.core.softmax_attention_reference):
            out = fn(q, k, v, causal, mask)
            assert out[0, 0, 1].isnan().all() and torch.isfinite(out[0, 0, [0, 2]]).all()


def test_a_state_built_directly_is_checked():
    """``ks.RecurrentState(S, Z, ...)`` skipped every check that ``zeros`` makes: eps=0 (a
    NaN at the first empty read-out) or mismatched sums were accepted."""
    s, z = torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4)
    state = ks.RecurrentState(s, z)
    assert state.eps == 1e-6 and state != ks.RecurrentState(s, z)  # identity, not field-wise ==
    bad = [
        ({"S": s.numpy()}, TypeError, "S must be a torch.Tensor"),
        ({"S": s.half()}, TypeError, "S must be float32 or float64"),
        ({"S": s[0]}, ValueError, r"S must have shape \(B,H,F,M\)"),
        ({"Z": z[..., :3]}, ValueError, r"Z must have shape \(2, 3, 4\)"),
        ({"Z": z.double()}, ValueError, "Z must be torch.float32"),
        ({"eps": 0.0}, ValueError, "eps must be a finite float > 0"),
        ({"log_scale": torch.zeros(2)}, ValueError, r"log_scale must have shape \(2, 3\)"),
        ({"log_scale": [0.0]}, TypeError, "log_scale must be a torch.Tensor"),
    ]
    for change, error, match in bad:
        args = {"S": s, "Z": z, "eps": 1e-6, "log_scale": None, **change}
        with pytest.raises(error, match=match):
            ks.RecurrentState(**args)
    with pytest.raises(TypeError, match="log_max must be a torch.Tensor"):
        ks.core.exp_shift(3.0, torch.float32)


def test_zeros_names_a_bad_device():
    """torch's RuntimeError ("Expected one of cpu, cuda, ...") named no argument; on a
    machine without CUDA, "cuda" failed in torch with AssertionError."""
    with pytest.raises(ValueError, match="device must name a device.*got 'gpu0'"):
        ks.RecurrentState.zeros(1, 1, 2, 3, device="gpu0")
    with pytest.raises(TypeError, match="device must be a torch.device or a string.*got 1.5"):
        ks.RecurrentState.zeros(1, 1, 2, 3, device=1.5)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device='cuda' is not usable here"):
            ks.RecurrentState.zeros(1, 1, 2, 3, device="cuda")
    assert ks.RecurrentState.zeros(1, 1, 2, 3, device="cpu").S.device.type == "cpu"
