"""Each map against its plain formula, re-implemented here in float64 with parameters moved
off their initialization: features and the gradients with respect to the input and every
parameter (1e-12); stabilized and unstabilized maps give the same attention and gradients
(1e-8, the stabilizer is a detached constant that normalization cancels); polynomial
features differentiate as their kernel (1e-10)."""

import math

import pytest
import torch
import torch.nn.functional as F

import kernelstudy as ks

from .conftest import rel_err

D, H = 6, 2


def plain_favor(fm, x, is_query):
    w = fm.weight.double()
    xh = x * fm.head_dim**-0.25
    proj = xh @ w.T
    half = xh.square().sum(-1, keepdim=True) / 2
    if fm.hparams["hyperbolic"]:
        return torch.cat([torch.exp(proj - half), torch.exp(-proj - half)], -1) / math.sqrt(
            2 * w.shape[0]
        )
    return torch.exp(proj - half) / math.sqrt(w.shape[0])


def plain_trig(fm, x, is_query):
    w = fm.weight.double()
    xh = x * fm.head_dim**-0.25
    proj = xh @ w.T
    half = xh.square().sum(-1, keepdim=True) / 2
    return torch.exp(half) * torch.cat([proj.sin(), proj.cos()], -1) / math.sqrt(w.shape[0])


def plain_hedgehog(fm, x, is_query):
    tied = is_query or fm.hparams["tie_qk"]
    w, b = (fm.weight, fm.bias) if tied else (fm.key_weight, fm.key_bias)  # (H',D,D), (H',1,D)
    z = x @ w.unsqueeze(0) + b.unsqueeze(0) if w.shape[0] > 1 else x @ w[0] + b[0, 0]
    return torch.cat([z.exp(), (-z).exp()], -1)


def plain_softplus(fm, x, is_query):
    w = fm.weight
    return F.softplus(x @ w.unsqueeze(0) if w.shape[0] > 1 else x @ w[0])


def per_head(t, w):
    """``t @ w`` with per-head weights ``w: (H', D, D')`` (one shared set when H' = 1)."""
    return t @ w.unsqueeze(0) if w.shape[0] > 1 else t @ w[0]


def plain_glu(fm, x, is_query):
    for i, unit in enumerate(fm.units):
        wg = unit.w_g if hasattr(unit, "w_g") else unit.w_g_down @ unit.w_g_up
        value = per_head(x, unit.w_f)
        if i == len(fm.units) - 1:
            value = F.softplus(value)
        x = value * torch.sigmoid(per_head(x, wg))
    return x


CASES = [
    ("favor", {"num_features": 9, "seed": 0, "stabilize": False}, plain_favor),
    ("favor", {"num_features": 9, "seed": 0, "stabilize": False, "hyperbolic": True}, plain_favor),
    ("favor", {"num_features": 9, "seed": 0, "stabilize": False, "orthogonal": False}, plain_favor),
    ("trig_rf", {"num_features": 5, "seed": 0, "stabilize": False}, plain_trig),
    ("hedgehog", {"stabilize": False, "shared": False}, plain_hedgehog),
    ("hedgehog", {"stabilize": False, "shared": True}, plain_hedgehog),
    ("hedgehog", {"stabilize": False, "tie_qk": False}, plain_hedgehog),
    ("hedgehog", {"stabilize": False, "shared": True, "tie_qk": False}, plain_hedgehog),
    ("softplus_ffn", {"shared": False, "seed": 0}, plain_softplus),
    ("glu", {"depth": 2, "shared": False, "seed": 0}, plain_glu),
    ("oglu", {"depth": 3, "shared": True, "seed": 0}, plain_glu),
    ("aoglu", {"depth": 2, "shared": False, "seed": 0, "rank": 2}, plain_glu),
    ("elu", {}, lambda fm, x, is_query: F.elu(x) + 1),
    ("relu", {}, lambda fm, x, is_query: F.relu(x)),
]


def _perturb(fm):
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(0.3 * torch.randn_like(p))


@pytest.mark.parametrize("name, kw, plain", CASES, ids=lambda c: c if isinstance(c, str) else "")
def test_features_and_all_gradients_match_the_plain_formula(name, kw, plain):
    fm = ks.create_feature_map(name, head_dim=D, num_heads=H, **kw).double()
    _perturb(fm)  # leave the identity/orthogonal init, so bugs in W/b handling show
    x = torch.randn(2, H, 7, D, dtype=torch.float64, requires_grad=True)
    params = list(fm.parameters())
    for is_query in (True, False):
        got = fm(x, is_query=is_query)
        want = plain(fm, x, is_query)
        assert got.shape == want.shape
        assert rel_err(got, want) <= 1e-12
        g = torch.randn_like(want)
        # zeros for parameters the side does not use (hedgehog's key map, for queries)
        ga = torch.autograd.grad(got, [x, *params], g, materialize_grads=True)
        gw = torch.autograd.grad(want, [x, *params], g, materialize_grads=True)
        for a, w in zip(ga, gw, strict=True):
            assert rel_err(a, w) <= 1e-12


STABILIZED = [
    ("favor", {"num_features": 16, "seed": 0}),
    ("trig_rf", {"num_features": 8, "seed": 0}),
    ("hedgehog", {}),
]


@pytest.mark.parametrize("name, kw", STABILIZED, ids=[n for n, _ in STABILIZED])
@pytest.mark.parametrize("causal", [False, True])
def test_stabilized_attention_gradients_equal_the_plain_maps(name, kw, causal):
    """The stabilizer is detached and cancels in normalized attention: outputs AND gradients
    w.r.t. q, k, v and the map's parameters equal those of the unstabilized map (float64,
    padding included, N=1 included)."""
    for n in (1, 13):
        on = ks.create_feature_map(name, head_dim=D, num_heads=H, stabilize=True, **kw).double()
        _perturb(on)
        off = ks.create_feature_map(name, head_dim=D, num_heads=H, stabilize=False, **kw).double()
        off.load_state_dict(on.state_dict())
        q, k = (3 * torch.randn(2, H, n, D, dtype=torch.float64) for _ in "qk")
        v = torch.randn(2, H, n, 4, dtype=torch.float64)
        mask = torch.ones(2, n, dtype=torch.bool)
        mask[1, n // 2 + 1 :] = False
        g = torch.randn(2, H, n, 4, dtype=torch.float64)
        res = []
        for fm in (on, off):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out = ks.kernel_attention(*x, fm, causal=causal, key_padding_mask=mask, eps=1e-300)
            res.append((out, *torch.autograd.grad(out, [*x, *fm.parameters()], g)))
        for a, w in zip(*res, strict=True):
            assert rel_err(a, w, floor=1e-3) <= 1e-8


def test_polynomial_gradients_match_the_kernel():
    """Polynomial features are checked only through their Gram matrix, never differentiated."""
    for kw in (
        {"degree": 2},
        {"degree": 3, "symmetric": True},
        {"degree": 2, "taylor": True, "scale_inputs": True},
    ):
        fm = ks.create_feature_map("polynomial", head_dim=4, **kw)
        x = torch.randn(5, 4, dtype=torch.float64, requires_grad=True)
        y = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
        gram = fm(x) @ fm(y, is_query=False).T
        exact = fm.kernel(x, y)
        g = torch.randn_like(exact)
        got = torch.autograd.grad(gram, (x, y), g)
        for a, w in zip(got, torch.autograd.grad(exact, (x, y), g), strict=True):
            assert rel_err(a, w) <= 1e-10
