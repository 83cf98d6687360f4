"""Attention modules and the encoder: shapes, masks, recurrent steps, baseline switch."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

import kernelstudy as ks
from kernelstudy.core import linear_attention_reference

from .conftest import close_in_dtype, compiled_whole, outputs_and_grads, rel_err, stepped


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
@pytest.mark.parametrize("causal", [False, True])
def test_kernel_attention_module_shapes_and_grads(attention, causal):
    layer = ks.nn.KernelAttention(32, 4, attention=attention, causal=causal)
    x = torch.randn(3, 11, 32, requires_grad=True)
    y = layer(x)
    assert y.shape == x.shape
    y.square().mean().backward()
    assert x.grad is not None and all(p.grad is not None for p in layer.parameters())


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
def test_padding_does_not_change_real_positions(attention):
    torch.manual_seed(0)
    enc = ks.nn.TransformerEncoder(2, 16, 2, 32, attention=attention).eval()
    x = torch.randn(2, 9, 16)
    mask = torch.ones(2, 9, dtype=torch.bool)
    mask[1, 5:] = False
    y = enc(x, key_padding_mask=mask)
    x2 = x.clone()
    x2[1, 5:] = 1e4 * torch.randn(4, 16)
    y2 = enc(x2, key_padding_mask=mask)
    assert torch.isfinite(y2).all()
    assert rel_err(y2[1, :5], y[1, :5]) <= 1e-5
    alone = enc(x[1:, :5])
    assert rel_err(y[1:, :5], alone) <= 1e-5


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
def test_encoder_steps_and_blocks_equal_causal_forward(attention):
    torch.manual_seed(1)
    enc = ks.nn.TransformerEncoder(2, 24, 3, 48, attention=attention, causal=True).eval()
    x = torch.randn(2, 13, 24)
    full = enc(x)
    states = None
    for t in range(x.shape[1]):
        y_t, states = enc.step(x[:, t], states)
        assert rel_err(y_t, full[:, t]) <= 1e-5
    kind = ks.RecurrentState if attention == "kernel" else ks.nn.KVCache
    assert all(isinstance(s, kind) for s in states)
    # blocks (steps), then a step: the same outputs
    with torch.no_grad():
        first, states = enc.steps(x[:, :8])
        second, states = enc.steps(x[:, 8:12], states)
        last, states = enc.step(x[:, 12], states)
    assert rel_err(torch.cat([first, second, last[:, None]], 1), full) <= 1e-5
    assert len(states) == 2 and all(isinstance(s, kind) for s in states)
    with pytest.raises(ValueError, match="states must have 2 entries"):
        enc.steps(x[:, :2], states[:1])


def test_kernel_state_does_not_grow():
    enc = ks.nn.TransformerEncoder(1, 16, 2, 16, feature_map="elu", causal=True).eval()
    states = None
    for _t in range(5):
        _, states = enc.step(torch.randn(1, 16), states)
        assert states[0].S.shape == (1, 2, 8, 8)


def test_kernel_attention_function_with_map_instance_and_name():
    fm = ks.create_feature_map("elu", head_dim=8)
    q, k, v = torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 4)
    a = ks.kernel_attention(q, k, v, feature_map=fm, causal=True)
    b = ks.kernel_attention(q, k, v, feature_map="elu", causal=True)
    want = ks.linear_attention(fm(q), fm(k, is_query=False), v, causal=True, backend="reference")
    assert rel_err(a, want) <= 1e-5 and torch.equal(a, b)


def test_regularization_is_zero_for_elu_and_softmax():
    for attention in ("kernel", "softmax"):
        enc = ks.nn.TransformerEncoder(2, 16, 2, 16, attention=attention)
        assert float(enc.regularization()) == 0.0


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"d_model": 30, "n_heads": 4}, "divisible"),
        ({"d_model": 32, "n_heads": 0}, "n_heads"),
        ({"d_model": 32, "n_heads": 4, "attention": "flash"}, "attention"),
        ({"d_model": 32, "n_heads": 4, "dropout": 1.5}, "dropout"),
        ({"d_model": 32, "n_heads": 4, "feature_map": "elux"}, "elu"),
        ({"d_model": 32, "n_heads": 4, "dropout": "abc"}, "dropout must be a float"),
        ({"d_model": 32, "n_heads": 4, "eps": 0.0}, "eps must be a finite float > 0"),
        ({"d_model": 32, "n_heads": 4, "eps": "small"}, "eps must be a positive float"),
        ({"d_model": 32, "n_heads": 4, "backend": "cudaa"}, "backend must be one of auto"),
        ({"d_model": 32, "n_heads": 4, "backend": 3}, "backend must be a str or None"),
        ({"d_model": 32, "n_heads": 4, "causal": "no"}, "causal must be a bool"),
    ],
)
def test_module_bad_arguments(kwargs, match):
    """Refused when the layer is built, not at its first forward."""
    with pytest.raises((ValueError, TypeError), match=match):
        ks.nn.KernelAttention(**kwargs)


def test_encoder_refuses_a_string_for_causal():
    with pytest.raises(TypeError, match="causal must be a bool"):
        ks.nn.TransformerEncoder(1, 8, 2, causal="false")


def test_inputs_of_another_dtype_or_type_name_the_argument():
    layer = ks.nn.KernelAttention(16, 2, causal=True)
    with pytest.raises(TypeError, match=r"x has dtype torch.float64 but the layer's weights"):
        layer(torch.randn(2, 5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match=r"x_t has dtype torch.float16"):
        layer.step(torch.randn(2, 16, dtype=torch.float16))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        layer([[0.0] * 16])
    with torch.autocast("cpu", torch.bfloat16):  # autocast casts for the layer: allowed
        assert layer(torch.randn(2, 5, 16)).shape == (2, 5, 16)
    assert layer.double()(torch.randn(2, 5, 16, dtype=torch.float64)).dtype == torch.float64


def test_step_needs_causal_and_right_shape():
    layer = ks.nn.KernelAttention(16, 2)
    with pytest.raises(ValueError, match="causal"):
        layer.step(torch.randn(1, 16))
    layer = ks.nn.KernelAttention(16, 2, causal=True)
    with pytest.raises(ValueError, match="x_t"):
        layer.step(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="x"):
        layer(torch.randn(2, 5, 15))
    x = torch.randn(1, 16)
    softmax = ks.nn.KernelAttention(16, 2, attention="softmax", causal=True)
    _, kv_cache = softmax.step(x)
    _, rnn_state = layer.step(x)
    with pytest.raises(TypeError, match="state must be None or the RecurrentState .* got KVCache"):
        layer.step(x, kv_cache)
    with pytest.raises(TypeError, match="the KVCache of .* softmax .* got RecurrentState"):
        softmax.step(x, rnn_state)


@pytest.mark.parametrize("amp", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["glu", "oglu", "aoglu", "softplus_ffn", "elu", "favor"])
def test_layers_with_learned_maps_run_under_autocast(name, amp):
    """Under autocast the linear layers inside a learned map returned float16 features
    beside float32 values: TypeError "must share one dtype"."""
    torch.manual_seed(0)
    for causal in (False, True):
        layer = ks.nn.KernelAttention(16, 2, feature_map=name, causal=causal)
        x = torch.randn(2, 33, 16, requires_grad=True)
        ref = layer(x)
        with torch.autocast("cpu", dtype=amp):
            out = layer(x)
        (grad,) = torch.autograd.grad(out.float().sum(), x)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


STABILIZED = [
    ("favor", {"num_features": 32, "seed": 0}),
    ("favor", {"num_features": 32, "seed": 0, "hyperbolic": True}),
    ("hedgehog", {}),
    ("trig_rf", {"num_features": 32, "seed": 0}),
]


@pytest.mark.parametrize("stabilize", [True, False])
@pytest.mark.parametrize(("name", "kw"), STABILIZED)
def test_step_equals_forward_with_and_without_key_stabilizer(name, kw, stabilize):
    """RNN mode keeps a running maximum where the batch forward uses the sequence's."""
    layer = ks.nn.KernelAttention(
        16,
        2,
        feature_map=name,
        feature_map_kwargs={**kw, "stabilize": stabilize},
        causal=True,
        eps=1e-12,
    ).double()
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    full, state = layer(x), None
    for t in range(9):
        y_t, state = layer.step(x[:, t], state)
        assert rel_err(y_t, full[:, t]) <= 1e-9
    assert (state.log_scale is not None) == stabilize


@pytest.mark.parametrize(("name", "kw"), STABILIZED)
def test_step_equals_forward_in_float32_at_the_default_eps(name, kw):
    """A later key no longer rescales the earlier ones, so the normalizer guard eps has the
    same weight in both modes (it used to differ by up to 0.6 for Hedgehog)."""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(32, 2, feature_map=name, feature_map_kwargs=kw, causal=True)
    x = torch.randn(2, 24, 32)
    with torch.no_grad():
        full, state = layer(x), None
        for t in range(24):
            y_t, state = layer.step(x[:, t], state)
            assert rel_err(y_t, full[:, t]) <= 1e-4


def test_step_with_large_keys_stays_finite_and_matches_forward_on_the_prefix():
    """Key exponents far beyond float32's range: the running maximum keeps every step finite.

    The reference at step t is the batch forward of x[:t+1], whose key stabilizer is the
    prefix's maximum, i.e. the running maximum (the whole sequence's maximum would let
    later keys underflow earlier ones to 0 in float32).
    """
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(16, 2, feature_map="hedgehog", causal=True)
    x = 60 * torch.randn(1, 12, 16)
    state = None
    with torch.no_grad():
        for t in range(12):
            y_t, state = layer.step(x[:, t], state)
            assert torch.isfinite(y_t).all()
            assert rel_err(y_t, layer(x[:, : t + 1])[:, t]) <= 1e-4
    assert state.log_scale.max() > 100  # exp(100) overflows float32: the scale is needed


def _key_below_the_range() -> tuple:
    """FAVOR+ (D=8, R=16) with q, k, v of 6 steps whose first key has a largest exponent
    near -30, below float32's safe range (-20), while later keys lie inside it."""
    torch.manual_seed(0)
    fm = ks.create_feature_map("favor", head_dim=8, num_features=16, seed=0)
    q, k = (torch.randn(1, 1, 6, 8) for _ in "qk")
    directions = torch.nn.functional.normalize(torch.randn(200, 8), dim=-1)
    k[0, 0, 0] = 12 * directions[(directions @ fm.weight.T).amax(-1).argmin()]
    v = torch.randn(1, 1, 6, 3)
    _, log_scale = fm.key_features(k)
    assert log_scale[0, 0, 0] < -20 < log_scale.max()
    return fm, q, k, v


def test_causal_rows_are_normalized_at_their_own_prefix():
    """A first key below the safe range was lifted by the recurrent state and by a prefix
    forward, but not by the whole sequence's forward, where a later in-range key kept the
    shift at 0: row 0 came out as ~1e-7·v0 (swamped by eps) against v0, so stepping, the
    prefix, float32 and float64 all disagreed. Each causal row now uses its prefix's shift."""
    fm, q, k, v = _key_below_the_range()
    whole = ks.kernel_attention(q, k, v, fm, causal=True)
    prefix = ks.kernel_attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], fm, causal=True)
    assert rel_err(prefix[:, :, 0], whole[:, :, 0]) <= 1e-5  # causal: later keys change nothing
    torch.testing.assert_close(whole[:, :, 0], v[:, :, 0], rtol=1e-4, atol=1e-5)  # one key: v0
    state = ks.RecurrentState.zeros(1, 1, fm.feature_dim, 3, scaled=True)
    phi_q = fm(q, is_query=True)
    phi_hat, log_scale = fm.key_features(k)
    for t in range(6):
        out, state = state.step(phi_q[:, :, t], phi_hat[:, :, t], v[:, :, t], log_scale[:, :, t])
        assert rel_err(out, whole[:, :, t]) <= 1e-4, t
    exact = ks.kernel_attention(q.double(), k.double(), v.double(), fm.double(), causal=True)
    assert rel_err(whole, exact) <= 1e-4  # float64 shifts where float32 does
    # the explicit matrix normalizes as the core does
    matrix = ks.analysis.attention_matrix(q, k, fm, causal=True)
    assert rel_err(matrix @ v, whole) <= 1e-5


def test_a_nan_key_reaches_no_earlier_causal_row():
    """The row factors' cap was taken over every key of the sequence, so one NaN key made
    every row NaN, earlier ones included."""
    fm, q, k, v = _key_below_the_range()
    k[0, 0, 4] = float("nan")
    out = ks.kernel_attention(q, k, v, fm, causal=True)
    clean = ks.kernel_attention(q[:, :, :4], k[:, :, :4], v[:, :, :4], fm, causal=True)
    assert torch.isfinite(out[:, :, :4]).all()
    assert rel_err(out[:, :, :4], clean) <= 1e-5
    matrix = ks.analysis.attention_matrix(q, k, fm, causal=True)
    assert torch.isfinite(matrix[:, :, :4, :4]).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["favor", "hedgehog"])
def test_a_half_precision_layer_steps_as_it_runs(dtype, name):
    """float16 steps mapped q and k in float16 and shifted at float16's range (±9), where
    the forward maps them in float32: steps were 69% off (FAVOR+ at 6·randn). Blocks too."""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(16, 2, feature_map=name, causal=True).eval().to(dtype)
    x = (6 * torch.randn(2, 20, 16)).to(dtype)
    with torch.no_grad():
        full, state, steps = layer(x), None, []
        for t in range(20):
            y_t, state = layer.step(x[:, t], state)
            steps.append(y_t)
        first, state = layer.steps(x[:, :13])  # and blocks of 13 and 7
        second, _ = layer.steps(x[:, 13:], state)
    tol = 5e-3 if dtype == torch.float16 else 5e-2
    for got in (torch.stack(steps, 1), torch.cat([first, second], 1)):
        assert got.dtype == dtype and rel_err(got, full) <= tol


@pytest.mark.parametrize("norm", [20.0, 40.0])
def test_a_row_far_below_a_later_key_stays_finite(norm):
    """The row factor is capped against overflow: a first key whose exponents lie hundreds
    below the later keys' gives finite outputs and gradients (its row keeps eps, or its
    key underflows to nothing in float32), never inf or NaN."""
    fm, q, k, v = _key_below_the_range()
    k[0, 0, 0] *= norm / 12
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = ks.kernel_attention(q, k, v, fm, causal=True)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads)
    exact = ks.kernel_attention(q.double(), k.double(), v.double(), fm.double(), causal=True)
    assert rel_err(out[:, :, 1:], exact[:, :, 1:]) <= 1e-4  # later rows as in float64


def _keys_across_the_range(name: str) -> tuple:
    """A map and q, k, v (B=3, D=8, M=3, N=6) whose causal rows get per-prefix factors:
    FAVOR+ (R=16) with the first key's exponents near -30 (below float32's safe range) and
    later keys inside it; Hedgehog (per head, W and b moved off their init) with the last
    key's exponents near +60 (above it). Sequence 1 is left-padded (2 keys holding 1e4),
    sequence 2 fully padded."""
    if name == "favor":
        fm, q, k, v = _key_below_the_range()
    else:
        torch.manual_seed(0)
        fm = ks.create_feature_map("hedgehog", head_dim=8)
        with torch.no_grad():
            for p in fm.parameters():
                p.add_(0.1 * torch.randn_like(p))
        q, k, v = torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 8), torch.randn(1, 1, 6, 3)
        k[0, 0, -1] *= 60 / fm(k, is_query=False)[0, 0, -1].log().max()
    q, k, v = (t.expand(3, -1, -1, -1).clone() for t in (q, k, v))
    k[1, :, :2] = 1e4
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[1, :2] = False
    mask[2] = False
    _, log_factor = ks.nn.functional.causal_key_features(fm, k, mask)
    assert log_factor[0, 0, 0] > 20  # the per-prefix row scaling is in use
    return fm, q, k, v, mask


def _outputs_and_all_grads(fm, q, k, v, mask, eps, dtype, seed=1):
    """Causal kernel_attention in ``dtype`` and its gradients w.r.t. q, k, v and every
    parameter of a ``dtype`` copy of ``fm``, for an upstream gradient drawn from ``seed``."""
    fm = copy.deepcopy(fm).to(dtype)
    inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
    out = ks.kernel_attention(*inputs, fm, causal=True, key_padding_mask=mask, eps=eps)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (out, *torch.autograd.grad(out, [*inputs, *fm.parameters()], g.to(dtype)))


@pytest.mark.parametrize("name", ["favor", "hedgehog"])
def test_causal_prefix_scaled_rows_match_with_all_gradients(name):
    """Causal kernel_attention of a map with a per-sequence key stabilizer scales each row to
    its prefix's shift (causal_key_features, causal_features); tests checked that path's outputs,
    and of its gradients only that they are finite. Here, with left padding, a fully padded
    sequence, batch 3 and batch 1, outputs and the gradients w.r.t. q, k, v and every map
    parameter: float64 against the unstabilized map (eps=1e-300 in both: nothing leaves
    float64's range, the factors cancel), max rel err <= 1e-10; float32 against float64 at
    the default eps (float64 shifts where float32 does), the core's 1e-4."""
    fm, q, k, v, mask = _keys_across_the_range(name)
    plain = ks.create_feature_map({**fm.config(), "stabilize": False})
    plain.load_state_dict(fm.state_dict())
    f64 = torch.float64
    for b in (3, 1):
        x = (q[:b], k[:b], v[:b], mask[:b])
        exact = _outputs_and_all_grads(plain, *x, eps=1e-300, dtype=f64)
        scaled = _outputs_and_all_grads(fm, *x, eps=1e-300, dtype=f64)
        wide = _outputs_and_all_grads(fm, *x, eps=1e-6, dtype=f64)
        narrow = _outputs_and_all_grads(fm, *x, eps=1e-6, dtype=torch.float32)
        for i, (a, w) in enumerate(zip(scaled, exact, strict=True)):
            assert rel_err(a, w, floor=1.0) <= 1e-10, (b, i)
        for i, (a, w) in enumerate(zip(narrow, wide, strict=True)):
            assert close_in_dtype(a, w, torch.float32), (b, i, rel_err(a, w, floor=1.0))
        if b == 3:  # the fully padded sequence: zero output and input gradients
            assert all(torch.all(t[2] == 0) for t in narrow[:4])


@pytest.mark.parametrize(
    ("name", "kw"),
    [
        ("favor", {}),
        ("favor", {"num_features": 32, "seed": 0, "hyperbolic": True}),
        ("hedgehog", {}),
    ],
)
def test_step_equals_forward_at_large_inputs_in_float32(name, kw):
    """At 8·randn inputs some early rows' keys lie below float32's range: the layer's
    forward and its steps differed by 43% of the output's largest entry for FAVOR+.
    (trig_rf's signed features cancel at this scale: float32 and float64 disagree in
    every mode, so it is no test of the shift.)"""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(16, 2, feature_map=name, feature_map_kwargs=kw, causal=True)
    x = 8 * torch.randn(2, 20, 16)
    with torch.no_grad():
        full, state = layer(x), None
        steps = []
        for t in range(20):
            y_t, state = layer.step(x[:, t], state)
            steps.append(y_t)
        exact = layer.double()(x.double()).float()
    steps = torch.stack(steps, 1)
    assert rel_err(steps, full) <= 1e-4
    assert rel_err(full, exact) <= 1e-3


def test_layer_decides_the_head_count_of_a_config():
    """A config recorded from a 1-head map gets per-head weights for every head of the layer."""
    config = ks.create_feature_map("hedgehog", head_dim=8).config()
    assert config["num_heads"] == 1
    layer = ks.nn.KernelAttention(d_model=32, n_heads=4, feature_map=config)
    assert layer.feature_map.num_heads == 4
    per_head = sum(p.numel() for p in ks.create_feature_map(config).parameters())
    assert sum(p.numel() for p in layer.feature_map.parameters()) == 4 * per_head


def test_feature_map_instance_with_other_head_count_is_rejected():
    fm = ks.create_feature_map("hedgehog", head_dim=8, num_heads=2)
    with pytest.raises(ValueError, match="num_heads=2"):
        ks.nn.KernelAttention(d_model=32, n_heads=4, feature_map=fm)


EVERY_KIND = [
    ("glu", {"depth": 2}),
    ("aoglu", {}),
    ("softplus_ffn", {"shared": False}),
    ("polynomial", {"degree": 2}),
    ("relu", {}),
    ("hedgehog", {"shared": True}),
]


@pytest.mark.parametrize("name, kw", EVERY_KIND, ids=[m for m, _ in EVERY_KIND])
@pytest.mark.parametrize("batch", [1, 3])
def test_step_equals_forward_for_every_kind_of_map(name, kw, batch):
    """Learned and fixed maps, batch 1 and 3, float64: steps equal the forward (1e-10)."""
    layer = (
        ks.nn.KernelAttention(16, 2, feature_map=name, feature_map_kwargs=kw, causal=True)
        .double()
        .eval()
    )
    x = torch.randn(batch, 11, 16, dtype=torch.float64)
    with torch.no_grad():
        full, state = layer(x), None
        for t in range(11):
            y_t, state = layer.step(x[:, t], state)
            assert rel_err(y_t, full[:, t]) <= 1e-10, t


@pytest.mark.parametrize(
    ("name", "kw"),
    [("glu", {"shared": False}), ("hedgehog", {}), ("favor", {"num_features": 12, "seed": 0})],
)
def test_step_gradients_equal_the_forwards_for_every_parameter(name, kw):
    """Steps equal the forward in value (tests above); their gradients were compared only for
    softmax's KV cache. Kernel layers, float64, batch 1 (F≠D for Hedgehog and FAVOR+): the
    gradients of the stepped outputs w.r.t. the input and every parameter (projections and
    map weights, through a plain state for GLU and through key_features and a scaled state
    for Hedgehog and FAVOR+, whose keys at 20·randn cross the safe range mid-sequence, so
    the state's decay acts) equal the forward's (1e-10)."""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(
        12, 2, feature_map=name, feature_map_kwargs=kw, causal=True, eps=1e-12
    ).double()
    with torch.no_grad():
        for p in layer.feature_map.parameters():
            p.add_(0.2 * torch.randn_like(p))
    x = (20 * torch.randn(1, 7, 12, dtype=torch.float64)).requires_grad_()
    params = [x, *layer.parameters()]
    state, steps = None, []
    for t in range(7):
        y_t, state = layer.step(x[:, t], state)
        steps.append(y_t)
    assert state.log_scale is None or (state.log_scale.abs() > 20).any()
    steps, full = torch.stack(steps, 1), layer(x)
    g = torch.randn_like(full)
    got, want = (torch.autograd.grad(y, params, g) for y in (steps, full))
    assert rel_err(steps, full) <= 1e-10
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a, w, floor=1e-6) <= 1e-10, i


def _explicit(layer, x, mask):
    b, n, _ = x.shape
    hd, nh = layer.head_dim, layer.n_heads
    qkv = x @ layer.qkv.weight.T + layer.qkv.bias
    q, k, v = (
        qkv[..., i * 16 : (i + 1) * 16].reshape(b, n, nh, hd).transpose(1, 2) for i in range(3)
    )
    fm = layer.feature_map
    kz = k.masked_fill(~mask[:, None, :, None], 0.0) if mask is not None else k
    y = linear_attention_reference(
        fm(q), fm(kz, is_query=False), v, causal=layer.causal, key_padding_mask=mask, eps=layer.eps
    )
    return y.transpose(1, 2).reshape(b, n, nh * hd) @ layer.out.weight.T + layer.out.bias


@pytest.mark.parametrize("name", ["elu", "glu", "softplus_ffn"])
@pytest.mark.parametrize("causal", [False, True])
def test_module_forward_and_parameter_grads_match_explicit(name, causal):
    """The layer against projections + map + reference core written out, float64, with
    padding and a fully padded sequence: output (1e-12) and the gradients with respect to
    the input and every parameter (1e-10); a test that only checked that gradients exist
    passed with every gradient tripled."""
    layer = ks.nn.KernelAttention(16, 2, feature_map=name, causal=causal).double()
    x = torch.randn(3, 9, 16, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 6:] = False
    mask[2] = False  # fully padded sequence
    params = [x, *layer.parameters()]
    got, want = layer(x, key_padding_mask=mask), _explicit(layer, x, mask)
    assert rel_err(got, want) <= 1e-12
    g = torch.randn_like(want)
    for a, w in zip(
        torch.autograd.grad(got, params, g), torch.autograd.grad(want, params, g), strict=True
    ):
        assert torch.isfinite(a).all()
        assert rel_err(a, w, floor=1e-6) <= 1e-10


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
def test_encoder_names_a_bad_input_instead_of_layer_norm_failing(attention):
    """LayerNorm ran before the attention's checks: a wrong width or dtype raised
    RuntimeError ("Given normalized_shape", "mixed dtype") and a list a TypeError from
    layer_norm(), none naming x."""
    enc = ks.nn.TransformerEncoder(2, 16, 2, attention=attention, causal=True)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, 16\)"):
        enc(torch.randn(2, 5, 15))
    with pytest.raises(TypeError, match="x has dtype torch.float64"):
        enc(torch.randn(2, 5, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        enc([[0.0] * 16])
    with pytest.raises(TypeError, match="x must be a float tensor"):
        enc(torch.ones(2, 5, 16, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"x_t must have shape \(batch, 16\)"):
        enc.step(torch.randn(2, 15))
    with pytest.raises(TypeError, match="x_t has dtype torch.float64"):
        enc.step(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, 16\)"):
        enc.layers[0](torch.randn(2, 5, 15))


@pytest.mark.parametrize("d_model", [-16, "16", 16.0])
def test_a_bad_d_model_is_named_not_d_ff(d_model):
    """The default d_ff = 4·d_model was checked first: d_model=-16 raised "d_ff must be a
    positive int, got -64" ('16' gave '16161616'); EncoderLayer hit LayerNorm's errors."""
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        ks.nn.TransformerEncoder(2, d_model, 2)
    with pytest.raises(ValueError, match="d_model must be a positive int"):
        ks.nn.EncoderLayer(d_model, 2, 32)


def test_numpy_ints_are_taken_as_the_maps_take_them():
    """The feature maps and the core took numpy ints; the layers and models refused them
    ("n_heads must be a positive int, got np.int64(2)"). Now they build the same module as
    Python ints, with a config that is still JSON-serializable."""
    import json

    i = np.int64
    ids = torch.randint(0, 10, (2, 7))
    for make in (
        lambda n: ks.nn.KernelAttention(n(8), n(2)),
        lambda n: ks.nn.EncoderLayer(n(8), n(2), n(16)),
        lambda n: ks.nn.TransformerEncoder(n(2), n(8), n(2)),
    ):
        torch.manual_seed(0)
        want = make(int)
        torch.manual_seed(0)
        got = make(i)
        x = torch.randn(2, 7, 8)
        assert torch.equal(got.eval()(x), want.eval()(x))
    models = {
        "classifier": lambda n: ks.nn.SequenceClassifier(
            n(10), n(3), d_model=n(8), n_heads=n(2), n_layers=n(1), max_len=n(16), head_dim=n(4)
        ),
        "lm": lambda n: ks.nn.CausalLM(n(10), d_model=n(8), n_heads=n(2), n_layers=n(1)),
    }
    for name, make in models.items():
        torch.manual_seed(0)
        want = make(int)
        torch.manual_seed(0)
        got = make(i)
        assert torch.equal(got.eval()(ids), want.eval()(ids)), name
        assert json.dumps(got.config()) == json.dumps(want.config()), name
    lm = models["lm"](i)
    assert lm.generate(ids[:, :2], max_new_tokens=i(3)).shape == (2, 5)
    # numpy 2 shows the value as np.int64(0), numpy 1 as 0
    with pytest.raises(ValueError, match=r"n_heads must be a positive int, got (np.int64\()?0"):
        ks.nn.KernelAttention(8, i(0))


def test_a_numpy_seed_gives_each_layer_its_own_draw():
    """A numpy int seed (which the maps accept) skipped the per-layer offset: every layer
    drew the same FAVOR+ projection."""
    encoders = [
        ks.nn.TransformerEncoder(3, 16, 2, feature_map="favor", feature_map_kwargs={"seed": s})
        for s in (np.int64(5), 5)
    ]
    maps = [[layer.attn.feature_map for layer in enc.layers] for enc in encoders]
    from kernelstudy.nn.encoder import layer_seed

    assert [int(m.hparams["seed"]) for m in maps[0]] == [layer_seed(5, i) for i in range(3)]
    assert not torch.equal(maps[0][0].weight, maps[0][1].weight)
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(*maps, strict=True))


def test_masked_mean_pooling_of_a_float16_model_does_not_overflow():
    """The masked mean summed 4096 float16 vectors in float16: a channel at 20 summed to
    81920 > 65504 = inf, so logits were NaN with a mask of all True and finite without."""
    torch.manual_seed(0)
    model = ks.nn.SequenceClassifier(20, 3, d_model=16, n_heads=2, n_layers=1, dropout=0.0)
    with torch.no_grad():
        model.encoder.norm.bias[0] = 20.0  # one large channel after the final norm
    model = model.half().eval()
    ids = torch.randint(0, 20, (1, 4096))
    with torch.no_grad():
        free = model(ids)
        masked = model(ids, torch.ones_like(ids, dtype=torch.bool))
    assert torch.isfinite(free).all()
    torch.testing.assert_close(masked, free, rtol=1e-2, atol=1e-2)


def test_kv_cache_converts_to_a_new_dtype_with_autograd_too():
    """Where autograd records the step the cache grew by torch.cat, which promotes: a
    float32 cache stepped under bfloat16 autocast stayed float32 beside bfloat16 queries,
    and the attention refused the mix. It converts to the new dtype as without autograd."""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(8, 2, attention="softmax", causal=True)
    x = torch.randn(2, 3, 8)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            _, cache = layer.step(x[:, 0])
            with torch.autocast("cpu", dtype=torch.bfloat16):
                y, cache = layer.step(x[:, 1], cache)
        assert cache.k.dtype == cache.v.dtype == torch.bfloat16 and torch.isfinite(y).all()


def test_kv_cache_grows_in_place_and_branches_safely():
    """The softmax layer's KVCache grew by torch.cat, copying the whole cache every step (at
    4096 tokens that copying set the generation study's KV-cache time). It now writes each
    step into buffers with room (the same storage step after step, no copy); an earlier
    cache stays valid, and a second step from it (a branch) does not overwrite the first."""
    torch.manual_seed(2)
    layer = ks.nn.KernelAttention(16, 2, attention="softmax", causal=True).eval()
    x = torch.randn(3, 150, 16)  # past the first buffer's 64 steps: one regrowth at least
    full = layer(x)
    state, storages = None, set()
    with torch.no_grad():
        for t in range(x.shape[1]):
            y_t, state = layer.step(x[:, t], state)
            assert rel_err(y_t, full[:, t]) <= 1e-5
            storages.add(state.k.untyped_storage().data_ptr())
            if t == 9:
                at_ten = state
    assert len(storages) == 4  # the first step's, then room for 64, 130 and 262: not 150
    assert (
        state.k.shape == (3, 2, 150, 8)
        and ks.analysis.state_bytes(state) == 2 * 3 * 2 * 150 * 8 * 4
    )
    with torch.no_grad():  # two branches from the cache after 10 steps
        a, state_a = layer.step(x[:, 10], at_ten)
        b, state_b = layer.step(torch.zeros(3, 16), at_ten)
        a_again, _ = layer.step(x[:, 11], state_a)
    assert rel_err(a, full[:, 10]) <= 1e-5 and rel_err(a_again, full[:, 11]) <= 1e-5
    assert not torch.equal(state_a.k[:, :, 10], state_b.k[:, :, 10])
    assert state_a.k.shape[2] == state_b.k.shape[2] == 11


def test_kv_cache_steps_stay_differentiable():
    """Under autograd the cache grows by concatenation: in-place writes would invalidate what
    the earlier steps saved for the backward."""
    torch.manual_seed(3)
    layer = ks.nn.KernelAttention(8, 2, attention="softmax", causal=True)
    x = torch.randn(2, 5, 8, requires_grad=True)
    state, outs = None, []
    for t in range(5):
        y_t, state = layer.step(x[:, t], state)
        outs.append(y_t)
    (g,) = torch.autograd.grad(torch.stack(outs, 1).square().sum(), x)
    (want,) = torch.autograd.grad(layer(x).square().sum(), x)
    assert rel_err(g, want) <= 1e-5


def test_a_kv_cache_made_under_inference_mode_goes_on_outside_it():
    """The cache's buffers were written in place whatever mode made them: a prompt read under
    torch.inference_mode and continued under no_grad failed with 'Inplace update to
    inference tensor outside InferenceMode' (a RecurrentState, rebuilt every step, went on)."""
    torch.manual_seed(4)
    layer = ks.nn.KernelAttention(16, 2, attention="softmax", causal=True).eval()
    x = torch.randn(2, 8, 16)
    full = layer(x)
    with torch.inference_mode():
        state = None
        for t in range(4):
            _, state = layer.step(x[:, t], state)
    with torch.no_grad():
        for t in range(4, 8):
            y_t, state = layer.step(x[:, t], state)
            assert rel_err(y_t, full[:, t]) <= 1e-5
    assert not state.k.is_inference()


def test_a_kv_cache_refuses_keys_of_another_shape_or_device_by_name():
    """KVCache.append broadcast a batch-1 step into every sequence of a batch-3 cache, and
    copied keys from another device into the cache's buffers (the error came later, from the
    attention, or as a meta-tensor copy error); a cache built with k and v of different
    lengths was accepted."""
    k, v = torch.randn(3, 2, 5, 8), torch.randn(3, 2, 5, 4)
    cache = ks.nn.KVCache(k, v)
    with torch.no_grad():
        grown = cache.append(k[:, :, :1], v[:, :, :1])  # a buffer with room
        for kk, vv, match in [
            (k[:1, :, :1], v[:1, :, :1], r"k must have shape \(3, 2, S, 8\)"),
            (k[:, :, :1], v[:, :, :1, :3], r"v must have shape \(3, 2, S, 4\)"),
            (k[:, :, :1].to("meta"), v[:, :, :1].to("meta"), "k is on meta but the cache"),
        ]:
            for base in (cache, grown):
                with pytest.raises(ValueError, match=match):
                    base.append(kk, vv)
    with pytest.raises(ValueError, match=r"k and v must agree in \(batch, heads, seq\)"):
        ks.nn.KVCache(k, v[:, :, :4])
    layer = ks.nn.KernelAttention(16, 2, attention="softmax", causal=True).eval()
    with torch.no_grad():
        _, state = layer.step(torch.randn(3, 16))
        moved = ks.nn.KVCache(state.k.to("meta"), state.v.to("meta"))
        with pytest.raises(ValueError, match="state is on meta but the layer is on cpu"):
            layer.step(torch.randn(3, 16), moved)


def test_step_follows_the_feature_maps_own_mode_for_redraws():
    """The redraw check read the layer's mode, not the map's: an eval layer whose map was put
    back in training redrew at every step (two draws mixed in one state), while a training
    layer whose map is in eval mode (no redraw) was refused."""
    favor = {"num_features": 8, "redraw_every": 1, "seed": 0}
    layer = ks.nn.KernelAttention(
        16, 2, feature_map="favor", feature_map_kwargs=favor, causal=True
    ).eval()
    layer.feature_map.train()
    x = torch.randn(2, 3, 16)
    with torch.no_grad(), pytest.raises(ValueError, match="needs eval mode"):
        layer.step(x[:, 0])
    assert layer.feature_map.hparams["seed"] == 0  # not redrawn
    layer.train()
    layer.feature_map.eval()
    full, state = layer(x), None
    with torch.no_grad():
        for t in range(3):
            y_t, state = layer.step(x[:, t], state)
            assert rel_err(y_t, full[:, t]) <= 1e-5
    assert layer.feature_map.hparams["seed"] == 0


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
def test_a_sparse_input_is_refused_by_name(attention):
    """A sparse x failed inside the q/k/v projection (RuntimeError: reshape is not
    implemented for sparse tensors)."""
    layer = ks.nn.KernelAttention(8, 2, attention=attention, causal=True)
    with pytest.raises(TypeError, match=r"x must be a dense \(strided\) tensor"):
        layer(torch.randn(2, 5, 8).to_sparse())
    with pytest.raises(TypeError, match=r"x_t must be a dense \(strided\) tensor"):
        layer.step(torch.randn(2, 8).to_sparse())


def test_stepping_an_unstabilized_map_whose_products_overflow_raises():
    """step() raises as the layer's forward does where φ(q)·Σφ(k) would overflow float32
    (Hedgehog with stabilize=False, exponents ~60: features fit, products do not); the
    stabilized map steps the same inputs to the forward's finite output."""
    torch.manual_seed(0)
    layers = {
        stabilize: ks.nn.KernelAttention(
            8, 2, feature_map="hedgehog", causal=True, feature_map_kwargs={"stabilize": stabilize}
        )
        for stabilize in (True, False)
    }
    layers[False].load_state_dict(layers[True].state_dict())
    x = torch.randn(1, 4, 8)
    x[0, 2] *= 70.0  # exponents of about 60 at step 2
    with pytest.raises(ValueError, match="stabilize=False"):
        layers[False](x)
    states, outs = None, []
    for t in range(2):  # ordinary steps: fine without the shift
        y_t, states = layers[False].step(x[:, t], states)
        assert torch.isfinite(y_t).all()
    with pytest.raises(ValueError, match=r"stabilize=False: φ\(q\)·φ\(k\) reaches"):
        layers[False].step(x[:, 2], states)
    states = None
    for t in range(4):
        y_t, states = layers[True].step(x[:, t], states)
        outs.append(y_t)
    torch.testing.assert_close(torch.stack(outs, 1), layers[True](x), rtol=1e-4, atol=1e-5)


BLOCK_KINDS = [
    ("softmax", None, {}),
    ("kernel", "elu", {}),
    ("kernel", "glu", {"depth": 2}),
    ("kernel", "polynomial", {"degree": 2}),
    ("kernel", "hedgehog", {}),
    ("kernel", "favor", {"num_features": 12, "seed": 0}),
    ("kernel", "trig_rf", {"num_features": 12, "seed": 0}),
]


@pytest.mark.parametrize(
    ("attention", "name", "kw"), BLOCK_KINDS, ids=[k[1] or k[0] for k in BLOCK_KINDS]
)
def test_layer_blocks_equal_the_steps_and_the_forward(attention, name, kw):
    """``steps`` through blocks of 4, 1 and 6 tokens (after 2 single steps), float64, batch 3,
    inputs at 20·randn (FAVOR+'s, Hedgehog's and trig_rf's keys cross the safe range: their
    scaled state shifts mid-block): the outputs equal the forward's (1e-10), and the state
    after them the steps' (the KV cache holds the same keys and values)."""
    torch.manual_seed(0)
    kwargs = {"feature_map": name, "feature_map_kwargs": kw} if name else {}
    layer = ks.nn.KernelAttention(12, 2, attention=attention, causal=True, eps=1e-12, **kwargs)
    layer = layer.double().eval()
    x = 20 * torch.randn(3, 13, 12, dtype=torch.float64)
    with torch.no_grad():
        full, outs, state = layer(x), [], None
        for t in range(2):
            y_t, state = layer.step(x[:, t], state)
            outs.append(y_t[:, None])
        start = 2
        for size in (4, 1, 6):
            y, state = layer.steps(x[:, start : start + size], state)
            outs.append(y)
            start += size
        stepped = None
        for t in range(13):
            _, stepped = layer.step(x[:, t], stepped)
    assert rel_err(torch.cat(outs, 1), full) <= 1e-10
    # (the projections of a block and of one token round differently in the last bits)
    if attention == "softmax":
        assert rel_err(state.k, stepped.k) <= 1e-12 and rel_err(state.v, stepped.v) <= 1e-12
        return
    assert rel_err(state.S, stepped.S) <= 1e-10 and rel_err(state.Z, stepped.Z) <= 1e-10
    assert (state.log_scale is None) == (stepped.log_scale is None)
    if state.log_scale is not None:
        assert rel_err(state.log_scale, stepped.log_scale) <= 1e-12
        assert (state.log_scale.abs() > 20).any()  # the shift acted


@pytest.mark.parametrize(("name", "kw"), [("glu", {"shared": False}), ("hedgehog", {})])
def test_layer_block_gradients_equal_the_forwards(name, kw):
    """Gradients of the outputs of two blocks (3 then 4 tokens, the state carried between
    them) w.r.t. the input and every parameter equal the forward's, float64 (1e-10)."""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(
        12, 2, feature_map=name, feature_map_kwargs=kw, causal=True, eps=1e-12
    ).double()
    x = (20 * torch.randn(1, 7, 12, dtype=torch.float64)).requires_grad_()
    params = [x, *layer.parameters()]
    first, state = layer.steps(x[:, :3])
    second, _ = layer.steps(x[:, 3:], state)
    blocks, full = torch.cat([first, second], 1), layer(x)
    g = torch.randn_like(full)
    got, want = (torch.autograd.grad(y, params, g) for y in (blocks, full))
    assert rel_err(blocks, full) <= 1e-10
    for i, (a, w) in enumerate(zip(got, want, strict=True)):
        assert rel_err(a, w, floor=1e-6) <= 1e-10, i


def test_layer_blocks_refuse_what_steps_refuse():
    with pytest.raises(ValueError, match=r"steps\(\) needs a causal"):
        ks.nn.KernelAttention(16, 2).steps(torch.randn(1, 3, 16))
    layer = ks.nn.KernelAttention(16, 2, causal=True)
    with pytest.raises(ValueError, match=r"x must have shape \(batch, seq, 16\)"):
        layer.steps(torch.randn(1, 16))
    softmax = ks.nn.KernelAttention(16, 2, attention="softmax", causal=True)
    _, kv_cache = softmax.steps(torch.randn(1, 3, 16))
    with pytest.raises(TypeError, match="state must be None or the RecurrentState"):
        layer.steps(torch.randn(1, 3, 16), kv_cache)
    _, state = layer.steps(torch.randn(1, 3, 16))
    with pytest.raises(ValueError, match="state"):
        layer.steps(torch.randn(2, 3, 16), state)  # another batch
    favor = {"num_features": 8, "redraw_every": 2, "seed": 0}
    redrawing = ks.nn.KernelAttention(16, 2, "favor", causal=True, feature_map_kwargs=favor)
    with pytest.raises(ValueError, match=r"steps\(\) of a layer whose feature map redraws"):
        redrawing.steps(torch.randn(1, 3, 16))


# every map at its defaults, the softmax baseline, and the maps' stabilize=False (checked sums)
COMPILED_LAYERS = [
    *((name, {}) for name in ks.list_feature_maps()),
    ("softmax", {}),
    *((name, {"stabilize": False}) for name in ("favor", "hedgehog", "polynomial")),
]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "name, kw",
    COMPILED_LAYERS,
    ids=[n + "".join(f"-{k}={v}" for k, v in kw.items()) for n, kw in COMPILED_LAYERS],
)
def test_a_layer_compiles_whole_for_every_map(name, kw, causal):
    """``torch.compile(layer, fullgraph=True)`` traces every feature map's layer and the softmax
    baseline without a graph break (key padding in the non-causal layer; the overflow checks of
    ``stabilize=False`` as asserts in the graph): outputs and every parameter's gradient equal
    eager mode's bit for bit (float64)."""
    kind = {"feature_map": name, "feature_map_kwargs": kw}
    kind = {"attention": "softmax"} if name == "softmax" else kind
    layer = ks.nn.KernelAttention(16, 2, causal=causal, **kind).double()
    x = torch.randn(2, 13, 16, dtype=torch.float64)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[1, 9:] = False
    kwargs = {} if causal else {"key_padding_mask": mask}
    results = outputs_and_grads(layer, (compiled_whole(layer), layer), lambda f: f(x, **kwargs))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)


def test_compiled_overflow_checks_fail_in_the_graph():
    """Compiled whole, the checks that eager mode raises as ValueErrors (with
    ``stabilize=False``: features beyond float32, products φ(q)·φ(k) beyond its sums' range;
    polynomial features beyond float16) are asserts in the graph, without a host sync: a
    RuntimeError that says what to change, on the CPU. Inputs in range pass."""
    torch.manual_seed(0)
    x = torch.randn(1, 5, 8)
    products, features = x.clone(), x.clone()
    products[0, 2] *= 70.0  # features of about e^60 fit float32; their products do not
    features[0, 2] *= 1000.0
    kw = {"feature_map": "hedgehog", "feature_map_kwargs": {"stabilize": False}}
    layer = ks.nn.KernelAttention(8, 2, **kw)
    polynomial = ks.create_feature_map("polynomial", head_dim=8)
    keys = (300 * x).half().view(1, 1, 5, 8)  # a layer maps float16 in float32: the map alone
    cases = [
        (layer, x, products, "stabilize=False"),
        (layer, x, features, "stabilize=False"),
        (lambda k: polynomial(k, is_query=False), x.half().view(keys.shape), keys, "float16"),
    ]
    for fn, fine, bad, match in cases:
        with pytest.raises(ValueError, match=match):
            fn(bad)
        compiled = compiled_whole(fn)
        compiled(fine)
        with pytest.raises(RuntimeError, match=match):
            compiled(bad)


@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_a_layer_exports(causal, strict):
    """``torch.export.export`` of a layer in eval mode (the compiled backends' kernels as custom
    ops in the program): the exported module gives the layer's output bit for bit, also for
    another batch and length (dynamic dimensions)."""
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(16, 2, causal=causal, feature_map="favor").eval()
    x = torch.randn(2, 13, 16)
    batch, length = torch.export.Dim("batch"), torch.export.Dim("length", max=4096)
    shapes = ({0: batch, 1: length},)
    program = torch.export.export(layer, (x,), dynamic_shapes=shapes, strict=strict)
    for inputs in (x, torch.randn(3, 29, 16)):
        assert torch.equal(program.module()(inputs), layer(inputs))


def test_the_classifiers_export_with_a_dynamic_batch():
    """MatchingClassifier split its encoder's output with chunk(2), whose guard on a symbolic
    batch torch.export could not prove: its batch could not be exported dynamic."""
    torch.manual_seed(0)
    match = ks.nn.MatchingClassifier(50, d_model=16, n_heads=2, n_layers=1, max_len=64).eval()
    batch, n1, n2 = (torch.export.Dim(n, max=63) for n in ("batch", "n1", "n2"))
    a, b = torch.randint(0, 50, (2, 13)), torch.randint(0, 50, (2, 20))
    shapes = ({0: batch, 1: n1}, None, {0: batch, 1: n2}, None)
    program = torch.export.export(match, (a, None, b, None), dynamic_shapes=shapes)
    for ids_1, ids_2 in ((a, b), (torch.randint(0, 50, (5, 7)), torch.randint(0, 50, (5, 31)))):
        assert torch.equal(program.module()(ids_1, None, ids_2, None), match(ids_1, None, ids_2))
    seq = ks.nn.SequenceClassifier(50, 3, d_model=16, n_heads=2, n_layers=1, max_len=64).eval()
    program = torch.export.export(seq, (a,), dynamic_shapes=({0: batch, 1: n1},))
    other = torch.randint(0, 50, (5, 7))
    assert torch.equal(program.module()(other), seq(other))


# a map, and the keys that make one sequence's key log scales spread by more than e^100:
# a later key far above the earlier ones (trig_rf, Hedgehog), or early keys far below the
# later ones (FAVOR+: a long key's largest exponent is very negative)
FAR_KEYS = {
    "trig_rf": (7, 10.0),
    "hedgehog": (7, 50.0),
    "favor": (slice(0, 4), 8.0),
}


def _far_keys(name: str) -> tuple:
    """``(fm, q, k, v, mask)`` in float32, B=2, H=2, N=12, D=16, M=8, the second sequence
    padded at its last 3 tokens, keys as :data:`FAR_KEYS` says."""
    torch.manual_seed(1)
    fm = ks.create_feature_map(name, head_dim=16)
    q, k = torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    where, factor = FAR_KEYS[name]
    k[:, :, where] *= factor
    v = torch.randn(2, 2, 12, 8)
    mask = torch.ones(2, 12, dtype=torch.bool)
    mask[1, -3:] = False
    _, log_scale = fm.key_features(k[:, :, :9])  # the real keys of both sequences
    assert (log_scale.amax(-1) - log_scale.amin(-1)).amin() > 100  # beyond the rows' cap
    return fm, q, k, v, mask


@pytest.mark.parametrize("name", list(FAR_KEYS))
def test_far_keys_with_values_of_width_zero(name):
    """M = 0 worked until a later key lay far above the others: then the segments' state
    was built and refused "value_dim must be an int >= 1, got 0", an argument never given."""
    fm, q, k, v, mask = _far_keys(name)
    out = ks.kernel_attention(q, k, v[..., :0], fm, causal=True, key_padding_mask=mask)
    assert out.shape == (*q.shape[:3], 0)


@pytest.mark.parametrize("name", list(FAR_KEYS))
def test_a_key_far_from_the_others_changes_no_earlier_causal_row(name):
    """Causal attention took every key at the whole sequence's shift and scaled each row
    back to its prefix's, the factor capped against overflow: with keys e^100 apart, the
    earlier rows' keys underflowed and eps swamped them. A later token changed earlier
    outputs by up to 124 (trig_rf), 1.7 (Hedgehog), 2.5 (FAVOR+), and the forward disagreed
    with stepping. Such sequences are read in segments of a scaled recurrent state now."""
    fm, q, k, v, mask = _far_keys(name)
    out = ks.kernel_attention(q, k, v, fm, causal=True, key_padding_mask=mask)
    for t in range(1, 12):  # causal: the first t rows are those of the first t tokens
        part = ks.kernel_attention(
            q[:, :, :t], k[:, :, :t], v[:, :, :t], fm, causal=True, key_padding_mask=mask[:, :t]
        )
        assert rel_err(out[:, :, :t], part) <= 1e-6, t
    exact = ks.kernel_attention(
        q.double(), k.double(), v.double(), fm, causal=True, key_padding_mask=mask
    )
    tol = 1e-3 if name == "trig_rf" else 1e-5  # signed features: sums cancel
    assert rel_err(out, exact) <= tol
    state = ks.RecurrentState.zeros(2, 2, fm.feature_dim, 8, scaled=True)
    phi_hat, log_scale = fm.key_features(k.masked_fill(~mask[:, None, :, None], 0.0))
    log_scale = log_scale.masked_fill(~mask[:, None, :], -torch.inf)
    steps, _ = stepped(state, fm(q, is_query=True), phi_hat, v, log_scale)
    assert rel_err(steps, out) <= tol
    matrix = ks.analysis.attention_matrix(q, k, fm, causal=True, key_padding_mask=mask)
    assert torch.isfinite(matrix).all() and rel_err(matrix @ v, out) <= tol
    # gradients against float64, whose single shift leaves every key a normal float64
    w = torch.randn_like(out, dtype=torch.float64)
    grads = []
    for dtype in (torch.float32, torch.float64):
        x = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        y = ks.kernel_attention(*x, fm, causal=True, key_padding_mask=mask)
        grads.append(torch.autograd.grad((y * w.to(dtype)).sum(), x))
    for got, want in zip(*grads, strict=True):
        assert torch.isfinite(got).all() and rel_err(got, want) <= 10 * tol


@pytest.mark.parametrize("name", list(FAR_KEYS))
def test_a_causal_layer_with_far_keys_steps_as_it_runs(name):
    """The layer's forward, its steps (blocks of 5 and 7) and its step agree where one
    token's keys lie e^100 from the others' (the forward leaked the later token before)."""
    where, factor = FAR_KEYS[name]
    torch.manual_seed(0)
    layer = ks.nn.KernelAttention(32, 2, feature_map=name, causal=True).eval()
    x = torch.randn(1, 12, 32)
    x[:, where] *= 3 * factor
    with torch.no_grad():
        full, state, steps = layer(x), None, []
        for t in range(12):
            y_t, state = layer.step(x[:, t], state)
            steps.append(y_t)
        first, state = layer.steps(x[:, :5])
        second, _ = layer.steps(x[:, 5:], state)
        changed = x.clone()
        changed[:, -1] *= 10
        later = layer(changed)
    tol = 1e-3 if name == "trig_rf" else 1e-5
    assert rel_err(torch.stack(steps, 1), full) <= tol
    assert rel_err(torch.cat([first, second], 1), full) <= tol
    assert rel_err(later[:, :-1], full[:, :-1]) <= 1e-6


def test_far_keys_under_vmap_run_in_one_block():
    """Inside vmap the host cannot read whether to segment: one block, capped rows, finite."""
    fm, q, k, v, _ = _far_keys("hedgehog")
    attend = torch.func.vmap(lambda q, k, v: ks.kernel_attention(q, k, v, fm, causal=True))
    out = attend(q[None], k[None], v[None])[0]  # a vmap over a leading dim of 1
    assert out.shape == v.shape and torch.isfinite(out).all()
    state = ks.RecurrentState.zeros(2, 2, fm.feature_dim, 8, scaled=True)
    phi_hat, log_scale = fm.key_features(k)
    assert len(state.segment_bounds(log_scale)) > 2  # outside vmap: segments


def test_causal_attention_after_left_padding_with_keys_far_below_is_causal():
    """FAVOR+ with a padded first token and long keys (log scales near −300) after it: the
    segmented path did not split (the first row's shift, without keys, is 0), and rows 1-3
    read their keys as 0 against stepping's −0.97, −1.01, −0.64."""
    torch.manual_seed(1)
    fm = ks.create_feature_map("favor", head_dim=16)
    q, k, v = torch.randn(1, 1, 10, 16), torch.randn(1, 1, 10, 16), torch.randn(1, 1, 10, 8)
    k[:, :, 1:4] *= 12
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 0] = False
    out = ks.kernel_attention(q, k, v, fm, causal=True, key_padding_mask=mask)
    part = ks.kernel_attention(
        q[:, :, :4], k[:, :, :4], v[:, :, :4], fm, causal=True, key_padding_mask=mask[:, :4]
    )
    exact = ks.kernel_attention(
        q.double(), k.double(), v.double(), fm, causal=True, key_padding_mask=mask
    )
    assert rel_err(out[:, :, :4], part) <= 1e-6 and rel_err(out, exact) <= 1e-5
    assert out[0, 0, 1:4].abs().amax() > 0.1  # not read as 0


def test_a_later_key_whose_exponent_overflows_reaches_no_earlier_row():
    """trig_rf with a key of e^208 and a later finite key of 1e30, whose log scale |x|²/2 is
    inf: the sequence's shift became 0 (exp_shift of +inf) and the e^208 key overflowed, so
    rows 1-2 turned NaN on every backend. Now the shift leaves the inf out."""
    torch.manual_seed(0)
    fm = ks.create_feature_map("trig_rf", head_dim=8)
    q, k, v = torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 4)
    k[:, :, 1] *= 10
    base = ks.kernel_attention(q, k, v, fm, causal=True)
    k[0, 0, 3, 0] = 1e30
    assert torch.isposinf(fm.key_features(k)[1][0, 0, 3])
    for backend in ("reference", "torch", "cpu"):
        out = ks.kernel_attention(q, k, v, fm, causal=True, backend=backend)
        assert torch.isfinite(out[:, :, :3]).all(), backend
        assert rel_err(out[:, :, :3], base[:, :, :3]) <= 1e-5, backend


def test_products_that_fit_float32_but_whose_sums_overflow_raise():
    """hedgehog, stabilize=False: features e^40 fit float32 and so does their product e^80,
    but the attention sums (times values ~1e4) pass float32's e^88.7. check_products_fit
    keeps e^SPARE (18) of room: products beyond e^70.7 raise, rather than inf attention."""
    off = ks.create_feature_map("hedgehog", head_dim=4, stabilize=False)
    x = torch.zeros(1, 1, 3, 4)
    x[..., 0] = 40.0
    v = torch.full((1, 1, 3, 2), 1e4)
    with pytest.raises(ValueError, match="stabilize=False"):
        ks.nn.kernel_attention(x, x, v, off)
    x[..., 0] = 30.0  # products e^60: within the room, no error
    assert torch.isfinite(ks.nn.kernel_attention(x, x, v, off)).all()


def test_float16_causal_favor_gradients_are_finite_and_match_float64():
    """kernel_attention maps float16 inputs in float32: mapped in float16, causal FAVOR+
    gave NaN gradients of q and k (a feature's gradient ~ 1/normalizer overflows float16)."""
    torch.manual_seed(0)
    fm = ks.create_feature_map("favor", head_dim=8, num_heads=2, num_features=32, seed=0)
    q, k, v = (torch.randn(1, 2, 16, 8) * 3 for _ in range(3))

    def grads(dtype):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = ks.nn.kernel_attention(*leaves, fm, causal=True)
        assert out.dtype == dtype
        out.double().sum().backward()
        return [t.grad.double() for t in leaves]

    for half, wide in zip(grads(torch.float16), grads(torch.float64), strict=True):
        assert torch.isfinite(half).all()
        torch.testing.assert_close(half, wide, rtol=0.05, atol=0.05)


def test_two_threads_continuing_one_kv_cache_each_keep_their_own_step():
    """Sampling continuations of one prompt in a thread pool: both appends saw the buffer's
    room free and wrote into the same slots, so one branch attended to the other's key
    (736 of 1000 trials here). The room is claimed with the check, under a lock."""
    import threading

    from kernelstudy.nn.attention import KVCache

    bad = 0
    for _ in range(200):
        base = KVCache(torch.zeros(1, 2, 0, 64), torch.zeros(1, 2, 0, 64))
        base = base.append(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64))  # has room
        steps = [torch.full((1, 2, 1, 64), float(i + 1)) for i in range(2)]
        out = [None, None]
        barrier = threading.Barrier(2)

        def branch(i, base=base, steps=steps, out=out, barrier=barrier):
            barrier.wait()
            out[i] = base.append(steps[i], steps[i])

        threads = [threading.Thread(target=branch, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        bad += sum(not torch.equal(out[i].k[:, :, -1:], steps[i]) for i in range(2))
    assert bad == 0


def test_largest_finite_abs_without_copies_equals_the_copying_reference():
    """The causal stabilizer's bound reduces φ(q), φ(k) without |x| copies where all is
    finite (those copies cost 9-12% of a FAVOR+ training step), else through the copies;
    both give max |x| with non-finite entries left out."""
    from kernelstudy.nn.functional import _finite_abs, _largest_finite_abs

    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 3, 7, 5, generator=gen), torch.randn(2, 3, 9, 5, generator=gen)
    cases = [(q, k), (q.abs(), k.abs()), (-q.abs(), k)]
    for special in (math.nan, math.inf, -math.inf):
        bad = q.clone()
        bad[1, 2, 3, 4] = special
        cases.append((bad, k))
        cases.append((q, k.index_put((torch.tensor(0),), torch.tensor(special))))
    for phi_q, phi_k in cases:
        pairs = ((phi_q, (-1,)), (phi_k, (-2, -1)))
        got = _largest_finite_abs(pairs)
        want = [_finite_abs(x).amax(dims) for x, dims in pairs]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
