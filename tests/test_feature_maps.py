"""Table-driven checks of every registered feature map: shapes, numerics, configs,
seeds and redraws, gradients, regularizers, and use with the linear-attention core."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kernelstudy as ks
from kernelstudy.feature_maps import feature_map_table, get_feature_map_class

NAMES = ks.list_feature_maps()
D, H = 8, 2
#: Smaller sizes where the defaults would only make the tests slower.
SMALL = {"favor": {"num_features": 32}, "trig_rf": {"num_features": 16}}
FAMILIES = {
    "elu", "relu", "identity", "polynomial", "favor", "trig_rf",
    "softplus_ffn", "glu", "oglu", "aoglu", "hedgehog",
}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_thread")


def make(name: str, **kwargs) -> ks.FeatureMap:
    return ks.create_feature_map(name, head_dim=D, num_heads=H, **{**SMALL.get(name, {}), **kwargs})


def randn(*shape: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype) * scale


def large_inputs() -> torch.Tensor:
    """``(2,H,6,D)`` entries up to |x| = 30: mixed signs, all +30, all −30."""
    x = torch.empty(2, H, 6, D).uniform_(-30, 30)
    x[0, :, 0] = 30.0
    x[0, :, 1] = -30.0
    x[1, :, 2, : D // 2] = 30.0
    return x


def test_every_family_is_registered():
    assert FAMILIES <= set(NAMES)
    assert NAMES == sorted(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_and_feature_dim(name):
    fm = make(name)
    for dtype in (torch.float32, torch.float64):
        x = randn(3, H, 5, D, dtype=dtype)
        for is_query in (True, False):
            phi = fm(x, is_query=is_query)
            assert phi.shape == (3, H, 5, fm.feature_dim)
            assert phi.dtype == dtype


@pytest.mark.parametrize("name", NAMES)
def test_any_leading_shape_with_shared_weights(name):
    """(..., D) -> (..., F) down to a single vector; Hedgehog's (1, D) bias made (D,) into
    (1, 2D)."""
    cls = get_feature_map_class(name)
    fm = make(name, **({"shared": True} if "shared" in cls.hyperparameters else {}))
    for shape in ((D,), (5, D)):
        x = randn(*shape)
        assert fm(x).shape == (*shape[:-1], fm.feature_dim)
        phi_k = fm.key_features(x)[0]
        assert phi_k.shape == (*shape[:-1], fm.feature_dim)


@pytest.mark.parametrize("name", NAMES)
def test_finite_and_positive_for_large_inputs(name):
    fm = make(name)
    cls = get_feature_map_class(name)
    for x in (randn(2, H, 6, D), large_inputs()):
        for is_query in (True, False):
            phi = fm(x, is_query=is_query)
            assert torch.isfinite(phi).all(), (name, is_query)
            if cls.positive:
                assert (phi >= 0).all(), (name, is_query)


@pytest.mark.parametrize("name", [n for n in NAMES if not get_feature_map_class(n).positive])
def test_maps_not_promising_positivity_do_go_negative(name):
    assert (make(name)(randn(2, H, 6, D)) < 0).any()


@pytest.mark.parametrize("name", NAMES)
def test_config_round_trip_gives_identical_outputs(name):
    fm = make(name)
    config = json.loads(json.dumps(fm.config()))
    again = ks.create_feature_map(config)
    assert type(again) is type(fm) and again.config() == config
    x = randn(2, H, 5, D)
    for is_query in (True, False):
        torch.testing.assert_close(again(x, is_query=is_query), fm(x, is_query=is_query))


def test_keyword_arguments_override_the_configs_entries():
    """create_feature_map(config, **kwargs): the keyword arguments win, as documented (not the
    config's num_features=16 over num_features=32)."""
    config = {"name": "favor", "head_dim": 8, "num_features": 16}
    fm = ks.create_feature_map(config, num_features=32)
    assert fm.feature_dim == 32 and fm.config()["num_features"] == 32
    assert config["num_features"] == 16  # the caller's dict is left alone
    assert ks.create_feature_map(config, head_dim=4).head_dim == 4


@pytest.mark.parametrize(
    "name", [n for n in NAMES if "seed" in get_feature_map_class(n).hyperparameters]
)
def test_same_seed_same_features(name):
    x = randn(2, H, 5, D)
    a, b, c = make(name, seed=3), make(name, seed=3), make(name, seed=4)
    assert a.config()["seed"] == 3
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    assert not torch.allclose(a(x), c(x))
    gen = torch.Generator().manual_seed(0)
    assert isinstance(make(name, seed=gen).config()["seed"], int)


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).random])
def test_redraw_changes_features_reproducibly(name):
    x = randn(2, H, 5, D)
    fm, twin = make(name, seed=0), make(name, seed=0)
    before = fm(x)
    fm.redraw()
    assert not torch.allclose(fm(x), before)
    twin.redraw()  # the next seed derives from the current one: twins stay equal
    torch.testing.assert_close(twin(x), fm(x), rtol=0, atol=0)
    torch.testing.assert_close(ks.create_feature_map(fm.config())(x), fm(x), rtol=0, atol=0)
    fm.redraw(seed=7)
    torch.testing.assert_close(fm(x), make(name, seed=7)(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).random])
def test_a_loaded_state_dict_carries_its_seed_and_draw_count(name, tmp_path):
    x = randn(2, H, 5, D)
    saved = make(name, seed=3, redraw_every=2).train()
    saved(x), saved(x)  # two query calls: the next one redraws
    torch.save(saved.state_dict(), tmp_path / "map.pt")
    loaded = make(name, seed=9, redraw_every=2).train()
    loaded.load_state_dict(torch.load(tmp_path / "map.pt", weights_only=True))
    assert loaded.config() == saved.config() and loaded.config()["seed"] == 3
    rebuilt = ks.create_feature_map(loaded.config()).eval()  # names the loaded features
    torch.testing.assert_close(rebuilt(x), loaded.eval()(x), rtol=0, atol=0)
    loaded.train()
    torch.testing.assert_close(loaded(x), saved(x), rtol=0, atol=0)  # both redraw at call 3
    assert not torch.equal(loaded(x), rebuilt(x))
    # A state dict saved without the seed (older checkpoints) still loads its buffers.
    legacy = {k: v for k, v in saved.state_dict().items() if k != "_extra_state"}
    fresh = make(name, seed=9, redraw_every=2)
    fresh.load_state_dict(legacy)
    torch.testing.assert_close(fresh.eval()(x), saved.eval()(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="extra state must be a dict"):
        fresh.load_state_dict({**legacy, "_extra_state": 3})


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).random])
def test_redraw_every_k_calls_in_training_only(name):
    x = randn(1, H, 4, D)
    fm = make(name, seed=0, redraw_every=2)
    fm.eval()
    fixed = [fm(x) for _ in range(5)]
    assert all(torch.equal(f, fixed[0]) for f in fixed)
    fm.train()
    first, second = fm(x), fm(x)
    keys = fm(x, is_query=False)  # key calls do not count
    third = fm(x)
    assert torch.equal(first, fixed[0]) and torch.equal(second, first)
    torch.testing.assert_close(keys, make(name, seed=0)(x, is_query=False))
    assert not torch.allclose(third, second)


def _ddp_redraws(rank: int, init: str, out: str) -> None:
    """One rank of test_ddp_ranks_redraw_alike: a favor classifier built after a per-rank
    ``torch.manual_seed`` (so with a seed of its own), trained 3 steps under DDP with a
    redraw every call; rank 0 writes each step's (features differ, seeds differ)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.manual_seed(100 + rank)
    model = ks.nn.SequenceClassifier(
        50, 3, d_model=16, n_heads=2, n_layers=1, max_len=64, attention="favor",
        feature_map_kwargs={"redraw_every": 1},
    )  # fmt: skip
    ddp = DistributedDataParallel(model)
    fm = ks.nn.feature_maps_of(model)[0]
    seen = []
    for _ in range(3):
        ddp(torch.randint(0, 50, (2, 10))).sum().backward()
        held = torch.cat([fm.weight.flatten(), torch.tensor([float(fm.config()["seed"])])])
        both = [torch.zeros_like(held) for _ in range(2)]
        dist.all_gather(both, held)
        seen.append([float((both[0][:-1] - both[1][:-1]).abs().max()), both[0][-1] != both[1][-1]])
    if rank == 0:
        Path(out).write_text(json.dumps([[d, bool(s)] for d, s in seen]))
    dist.barrier()  # neither rank leaves while the other still talks (gloo aborts then)
    dist.destroy_process_group()


def test_ddp_ranks_redraw_alike(tmp_path):
    """Under DistributedDataParallel, rank 0's draw reached every rank (buffers broadcast),
    but each derived its next seed from its own: from the first redraw on, the ranks computed
    with features 5 apart while their weights stayed equal, and no error said so."""
    import torch.multiprocessing as mp

    out = tmp_path / "seen.json"
    init = f"file://{tmp_path / 'rendezvous'}"
    mp.spawn(_ddp_redraws, args=(init, str(out)), nprocs=2, join=True)
    assert json.loads(out.read_text()) == [[0.0, False]] * 3


def test_a_map_pickled_before_drawn_seed_still_redraws_alike():
    """A whole map pickled by a version before the ``drawn_seed`` buffer has none: it names its
    seed, redraws as a new map of that seed does, and holds the buffer from then on."""
    import pickle

    fm = make("favor", seed=3, redraw_every=1)
    del fm._buffers["drawn_seed"]
    old = pickle.loads(pickle.dumps(fm)).train()
    fresh = make("favor", seed=3, redraw_every=1).train()
    assert old.config()["seed"] == 3
    x = randn(1, H, 4, D)
    for _ in range(3):  # the second and third calls redraw
        torch.testing.assert_close(old(x), fresh(x), rtol=0, atol=0)
    assert old.config() == fresh.config() and "drawn_seed" in dict(old.named_buffers())


@pytest.mark.parametrize("name", NAMES)
def test_empty_sequences(name):
    """No queries or no keys: empty or zero outputs, as the core gives (the stabilized
    maps' per-sequence maximum used to raise an IndexError)."""
    fm = make(name)
    assert fm(randn(1, H, 0, D), is_query=False).shape == (1, H, 0, fm.feature_dim)
    v = randn(1, H, 0, 3)
    for causal in (False, True):
        out = ks.kernel_attention(randn(1, H, 0, D), randn(1, H, 0, D), v, fm, causal=causal)
        assert out.shape == (1, H, 0, 3)
    no_keys = torch.zeros(1, 0, dtype=torch.bool)
    for mask in (None, no_keys):
        out = ks.kernel_attention(
            randn(1, H, 2, D), randn(1, H, 0, D), v, fm, key_padding_mask=mask
        )
        assert torch.equal(out, torch.zeros(1, H, 2, 3))


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).random])
def test_a_redraw_between_two_forwards_keeps_the_first_backward(name):
    """The draw used to be copied into the buffer in place, which the first forward had
    saved for its backward: two calls before one backward raised."""
    fm = make(name, seed=0, redraw_every=1).train()
    x1, x2 = randn(1, H, 4, D).requires_grad_(), randn(1, H, 4, D).requires_grad_()
    loss = fm(x1).sum() + fm(x2).sum()  # the second call redraws
    loss.backward()
    expected = torch.func.grad(lambda x: make(name, seed=0)(x).sum())(x1.detach())
    torch.testing.assert_close(x1.grad, expected)


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).random])
def test_a_redraw_under_inference_mode_still_trains(name):
    """A redraw inside torch.inference_mode() stored an inference tensor, so every later
    backward through the map failed."""
    fm = make(name, seed=0)
    with torch.inference_mode():
        fm.redraw(3)
    x = randn(1, H, 4, D).requires_grad_()
    fm(x).sum().backward()
    expected = torch.func.grad(lambda x: make(name, seed=3)(x).sum())(x.detach())
    torch.testing.assert_close(x.grad, expected)


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).random])
def test_a_refused_seed_leaves_the_map_as_it_was(name):
    fm = make(name, seed=0)
    x = randn(1, H, 4, D)
    before = fm(x)
    # torch's CPU generator keeps a seed's low 32 bits: 5 and 5 + 2**32 drew the same
    # features under two names
    with pytest.raises(ValueError, match=r"seed must be <= 4294967295"):
        fm.redraw(seed=2**32)
    assert fm.config()["seed"] == 0
    torch.testing.assert_close(fm(x), before, rtol=0, atol=0)
    torch.testing.assert_close(ks.create_feature_map(fm.config())(x), before, rtol=0, atol=0)
    assert make(name, seed=2**32 - 1).config()["seed"] == 2**32 - 1
    with pytest.raises(ValueError, match=r"seed must be <= 4294967295"):
        make(name, seed=5 + 2**32)


def test_a_failed_load_keeps_the_seed_of_the_features_held():
    """A size mismatch left the old features but took the file's seed, so config() named a
    map other than the one held."""
    a = ks.create_feature_map("favor", head_dim=4, num_features=16, seed=1)
    b = ks.create_feature_map("favor", head_dim=4, num_features=32, seed=7)
    with pytest.raises(RuntimeError, match="size mismatch"):
        a.load_state_dict(b.state_dict())
    state = b.state_dict()
    del state["weight"]
    a.load_state_dict(state, strict=False)  # the draw is missing: nothing was loaded
    x = randn(1, 1, 3, 4)
    assert a.config()["seed"] == 1
    torch.testing.assert_close(ks.create_feature_map(a.config())(x), a(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", NAMES)
def test_gradients_reach_every_trainable_parameter(name):
    cls = get_feature_map_class(name)
    fm = make(name)
    params = dict(fm.named_parameters())
    assert bool(params) == cls.trainable
    q = randn(2, H, 6, D, scale=0.5).requires_grad_()
    k = randn(2, H, 6, D, scale=0.5).requires_grad_()
    v = randn(2, H, 6, 3)
    out = ks.linear_attention(fm(q, is_query=True), fm(k, is_query=False), v, causal=True)
    loss = (out * torch.randn_like(out)).sum() + fm.regularization()
    loss.backward()
    for pname, p in params.items():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
        assert p.grad.abs().sum() > 0, pname
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("name", ["softplus_ffn", "oglu", "aoglu"])
def test_regularization_is_float32_under_autocast(name):
    """The trainer calls regularization() inside its autocast: the Gram matrix was rounded
    to bfloat16 (a floor of 3e-6 at an orthogonal W, the gradient 25% off near one)."""
    fm = ks.create_feature_map(name, head_dim=64, seed=0)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(1e-3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    want = fm.regularization()
    want_grads = torch.autograd.grad(want, list(fm.parameters()), allow_unused=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = fm.regularization()
    # the backward outside autocast, as the trainer runs it
    grads = torch.autograd.grad(got, list(fm.parameters()), allow_unused=True)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    for g, w in zip(grads, want_grads, strict=True):
        assert (g is None) == (w is None) and (g is None or torch.equal(g, w))


@pytest.mark.parametrize("name", NAMES)
def test_regularization(name):
    for shared in (True, False):
        if "shared" not in get_feature_map_class(name).hyperparameters and not shared:
            continue
        kwargs = (
            {"shared": shared} if "shared" in get_feature_map_class(name).hyperparameters else {}
        )
        fm = make(name, **kwargs)
        reg = fm.regularization()
        assert reg.shape == ()
        if "reg_weight" not in fm.hparams:
            assert reg.item() == 0.0
            continue
        assert reg.item() < 1e-8  # orthogonal at init
        with torch.no_grad():
            for p in fm.parameters():
                p.add_(0.1 * torch.randn_like(p))
        assert fm.regularization().item() > 1e-4
        assert make(name, reg_weight=0.0).regularization().item() == 0.0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("name", NAMES)
def test_with_linear_attention_no_nan(name, causal):
    fm = make(name)
    q, k, v = randn(2, H, 7, D, scale=2.0), randn(2, H, 7, D, scale=2.0), randn(2, H, 7, 4)
    out = ks.linear_attention(fm(q, is_query=True), fm(k, is_query=False), v, causal=causal)
    assert out.shape == (2, H, 7, 4) and not torch.isnan(out).any()
    mask = torch.ones(2, 7, dtype=torch.bool)
    mask[1, 5:] = False
    via_map = ks.kernel_attention(q, k, v, fm, causal=causal, key_padding_mask=mask)
    assert not torch.isnan(via_map).any()
    if get_feature_map_class(name).positive:
        assert torch.isfinite(out).all()


def test_a_map_with_a_sequence_stabilizer_must_implement_key_features():
    class SequenceScaled(ks.FeatureMap):
        @property
        def feature_dim(self) -> int:
            return self.head_dim

        @property
        def keys_need_sequence(self) -> bool:
            return True

        def features(self, x, is_query):
            return (x - x.amax((-2, -1), keepdim=True)).exp()

    with pytest.raises(NotImplementedError, match="key_features"):
        SequenceScaled(head_dim=4).key_features(torch.randn(1, 1, 3, 4))


@pytest.mark.parametrize("name", NAMES)
def test_keys_one_step_at_a_time_unless_the_map_says_otherwise(name):
    """Ordinary keys map the same one at a time as in a sequence; keys beyond float32's range
    (exponents up to ~1000) do so only for maps without a per-sequence stabilizer."""
    fm = make(name)
    for k, ordinary in ((randn(2, H, 5, D, scale=2.0), True), (large_inputs()[:, :, :5], False)):
        stepwise = torch.cat([fm(k[:, :, t : t + 1], is_query=False) for t in range(5)], dim=2)
        same = torch.allclose(stepwise, fm(k, is_query=False), rtol=1e-5, atol=1e-6)
        assert same == (ordinary or not fm.keys_need_sequence)
    k = randn(2, H, 5, D, scale=2.0)
    if "stabilize" in fm.hparams:
        off = make(name, stabilize=False)
        assert not off.keys_need_sequence
        stepwise = torch.cat([off(k[:, :, t : t + 1], is_query=False) for t in range(5)], dim=2)
        torch.testing.assert_close(stepwise, off(k, is_query=False))
        # key_features: each key on its own scale; φ̂·exp(log_scale) is the unstabilized φ.
        off.load_state_dict(fm.state_dict())
        phi_hat, log_scale = fm.key_features(k)
        assert log_scale.shape == k.shape[:-1] and torch.isfinite(phi_hat).all()
        torch.testing.assert_close(phi_hat * log_scale.exp()[..., None], off(k, is_query=False))
    else:
        phi, log_scale = fm.key_features(k)
        torch.testing.assert_close(phi, fm(k, is_query=False))
        assert not log_scale.any()


@pytest.mark.parametrize("name", NAMES)
def test_wrong_head_dim_raises(name):
    with pytest.raises(ValueError, match="head_dim"):
        make(name)(randn(1, H, 4, D + 1))


def test_per_head_weights_need_num_heads():
    fm = make("hedgehog", shared=False)
    assert fm.weight.shape == (H, D, D)
    with pytest.raises(ValueError, match="num_heads"):
        fm(randn(1, H + 1, 4, D))
    shared = make("glu", shared=True)
    assert shared(randn(4, D)).shape == (4, D)  # shared weights take any leading shape


def test_half_precision_inputs():
    for name in ("favor", "hedgehog", "softplus_ffn"):
        phi = make(name)(randn(1, H, 5, D).half())
        assert phi.dtype == torch.float16 and torch.isfinite(phi).all()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("scale", [3.0, 50.0])
def test_float16_kernel_attention_gradients_are_finite_and_match_float32(name, scale):
    """The gradient w.r.t. a feature grows as 1/normalizer: FAVOR+ at |x|~3 gave 3e5 in
    float32, inf in float16 and NaN through the map; kernel_attention runs float16 in
    float32. The softmax baseline's float16 gradients are finite on the same inputs."""
    torch.manual_seed(0)
    fm = make(name, seed=0) if "seed" in get_feature_map_class(name).hyperparameters else make(name)
    q, k, v = (randn(1, H, 7, D, scale=s).half().float() for s in (scale, scale, 1.0))
    grads = {}
    for dtype in (torch.float32, torch.float16):
        qkv = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        out = ks.kernel_attention(*qkv, feature_map=fm, causal=True)
        assert out.dtype == dtype
        grads[dtype] = torch.autograd.grad(out.float().sum(), qkv)
    for g32, g16 in zip(grads[torch.float32], grads[torch.float16], strict=True):
        assert torch.isfinite(g16).all()
        err = (g16.float() - g32).abs().max() / g32.abs().max().clamp_min(1e-3)
        assert err < 2e-2  # float16 rounding of the output


def test_elu_features_keep_their_relative_precision_in_low_precision():
    """elu(x)+1 as (exp(x) − 1) + 1 cancelled to exactly 0 in bfloat16 below x ≈ −6.3,
    and a query of such entries then attended to nothing."""
    x = torch.linspace(-9, 4, 160).reshape(-1, D)  # exp(-9) is a normal float16
    for dtype, rtol in ((torch.bfloat16, 2**-8), (torch.float16, 2**-11), (torch.float32, 1e-6)):
        rounded = x.to(dtype).double()
        exact = torch.where(rounded > 0, rounded + 1, rounded.exp())
        phi = make("elu")(x.to(dtype)).double()
        assert ((phi - exact).abs() <= rtol * exact).all(), dtype
    # relu(x) + exp(min(x, 0)) is the formula's two torch.where, bit for bit, with gradients
    special = torch.tensor([0.0, -0.0, 1e30, -1e30, math.inf, -math.inf, 1e-45, -1e-45])
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
        x = torch.cat([torch.randn(4000) * 5, special]).to(dtype).requires_grad_()
        positive = x > 0
        want = torch.where(positive, x + 1.0, torch.exp(torch.where(positive, 0.0, x)))
        got = ks.create_feature_map("elu", head_dim=x.shape[0])(x)
        grad_out = torch.randn_like(got)
        assert torch.equal(got, want), dtype
        got_grad, want_grad = (torch.autograd.grad(y, x, grad_out)[0] for y in (got, want))
        assert torch.equal(got_grad, want_grad), dtype
    x = torch.tensor([-1.0, 0.0, 1.0], requires_grad=True)  # elu's slope is 1 at 0 too
    (grad,) = torch.autograd.grad(ks.create_feature_map("elu", head_dim=3)(x).sum(), x)
    assert grad.tolist() == pytest.approx([math.exp(-1), 1.0, 1.0])
    torch.manual_seed(0)
    q, k, v = torch.full((1, 1, 1, D), -7.0), randn(1, 1, 5, D), randn(1, 1, 5, 2)
    ref = ks.kernel_attention(q, k, v, feature_map="elu")
    low = ks.kernel_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), feature_map="elu")
    torch.testing.assert_close(low.float(), ref, rtol=0.02, atol=0.02)


@pytest.mark.parametrize(
    ("name", "dtype", "scale"),
    [
        ("hedgehog", torch.float32, 100.0),
        ("hedgehog", torch.bfloat16, 100.0),
        ("hedgehog", torch.float16, 15.0),
        ("trig_rf", torch.float32, 30.0),
        ("trig_rf", torch.float16, 8.0),
    ],
)
def test_unstabilized_features_that_overflow_raise(name, dtype, scale):
    """Without ``stabilize``, finite exponents beyond the dtype's range (hedgehog's z, trig's
    ‖x̂‖²/2) raise a ValueError naming the fix, where they gave inf features and NaN
    attention; in range the features are unchanged, and the stabilized map takes the same
    inputs. Non-finite inputs pass through as with ``stabilize``."""
    torch.manual_seed(0)
    seed = {"seed": 0} if name == "trig_rf" else {}
    off, on = make(name, stabilize=False, **seed), make(name, **seed)
    x = torch.randn(1, H, 6, D) * scale
    x[0, 0, 0] = scale * 4  # one row well beyond the dtype's range, whatever the draw
    x = x.to(dtype)
    with pytest.raises(ValueError, match=r"stabilize=False: exponents up to .* overflow"):
        off(x)
    with pytest.raises(ValueError, match="stabilize=True"):
        off(x, is_query=False)
    q, k, v = x, x, torch.randn(1, H, 6, 3).to(dtype)
    with pytest.raises(ValueError, match="stabilize=False"):
        ks.nn.kernel_attention(q, k, v, off)
    assert torch.isfinite(on(x)).all()
    assert torch.isfinite(ks.nn.kernel_attention(q, k, v, on)).all()
    small = (torch.randn(1, H, 6, D) / 4).to(dtype)
    torch.testing.assert_close(off(small), on(small), rtol=0, atol=0)
    bad = small.clone()
    bad[0, 0, 1, 0] = torch.inf
    assert not torch.isfinite(off(bad)).all()  # the input's inf, not an overflow


@pytest.mark.parametrize("name", ["favor", "trig_rf", "hedgehog", "polynomial"])
def test_unstabilized_maps_run_under_vmap_with_a_warning_that_the_check_is_skipped(name):
    """The overflow checks of ``stabilize=False`` read values on the host, which a batched
    tensor has not: under ``torch.func.vmap`` the map and attention raised torch's "data-dependent
    control flow" error, naming neither the map nor ``stabilize``. Now they run, equal a loop
    over the mapped axis, and warn that the check is skipped; outside vmap it runs silently
    (and raises on an overflow: the tests below)."""
    seed = {"seed": 0} if name in ("favor", "trig_rf") else {}
    fm = make(name, stabilize=False, **seed)
    torch.manual_seed(0)
    x, v = randn(3, 2, H, 5, D, scale=0.5), randn(2, H, 5, 3)

    def attend(q):
        return ks.nn.kernel_attention(q, q, v, fm, causal=True)

    for fn in (fm, attend):
        with pytest.warns(RuntimeWarning, match="skipped inside torch.func.vmap"):
            got = torch.func.vmap(fn)(x)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # outside vmap the check runs (the overflow tests)
            want = torch.stack([fn(x[i]) for i in range(3)])
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("causal", [False, True])
def test_unstabilized_attention_whose_products_overflow_raises(causal):
    """Features that fit (e^60 in float32) but whose products φ(q)·φ(k) (e^120) do not:
    attention without ``stabilize`` raises (it returned NaN); float64 and the stabilized map
    give finite attention, with padding too."""
    off, on = make("hedgehog", stabilize=False), make("hedgehog")
    x = torch.randn(2, H, 6, D)
    x[0, 1, 2, 0] = 60.0
    v = torch.randn(2, H, 6, 3)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    assert torch.isfinite(off(x)).all()
    for key_padding_mask in (None, mask):
        kwargs = {"causal": causal, "key_padding_mask": key_padding_mask}
        with pytest.raises(ValueError, match=r"'hedgehog' with stabilize=False: φ\(q\)·φ\(k\)"):
            ks.nn.kernel_attention(x, x, v, off, **kwargs)
        assert torch.isfinite(ks.nn.kernel_attention(x, x, v, on, **kwargs)).all()
        wide = ks.nn.kernel_attention(x.double(), x.double(), v.double(), off, **kwargs)
        assert torch.isfinite(wide).all()
    with pytest.raises(ValueError, match="stabilize=True"):  # the analyses map alike
        ks.analysis.attention_matrix(x, x, off, causal=causal)
    # float16 features are summed in float32: its range is the limit, not float16's
    q, k = (torch.randn(1, H, 6, D) for _ in range(2))
    phi_q, phi_k = ks.nn.functional.query_and_key_features(off, q.half(), k.half(), None, causal)
    assert phi_q.dtype == torch.float16 and torch.isfinite(phi_q).all()
    ks.nn.functional.check_products_fit(off, phi_q * 100, phi_k * 100)  # e^9.2: no error


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_hedgehog_exponents_are_computed_in_float32(dtype):
    """A bfloat16 exponent z ≈ 10 is off by up to 0.03: features 3% off, where the
    output's own rounding is 0.4%."""
    torch.manual_seed(0)
    fm = ks.create_feature_map("hedgehog", head_dim=64, stabilize=False)
    with torch.no_grad():
        fm.weight.copy_(torch.eye(64) + torch.randn(1, 64, 64) / 8)
    x = (torch.randn(1, 1, 64, 64) * 1.5).to(dtype)
    exact = fm(x.double())
    assert fm(x).dtype == dtype
    rel = ((fm(x).double() - exact) / exact).abs().max()
    assert rel <= (2**-8 if dtype == torch.bfloat16 else 2**-11) * 1.01


@pytest.mark.parametrize("name", ["favor", "trig_rf", "hedgehog"])
@pytest.mark.parametrize("amp", [torch.bfloat16, torch.float16])
def test_exponents_ignore_autocast(name, amp):
    """Under autocast the projections ran in bfloat16 (features off by up to 8.5%)."""
    fm = make(name, seed=0) if name != "hedgehog" else make(name)
    x = randn(2, H, 9, D, scale=2.0)
    plain = fm(x), fm(x, is_query=False), fm.key_features(x)
    with torch.autocast("cpu", dtype=amp):
        cast = fm(x), fm(x, is_query=False), fm.key_features(x)
        if name != "hedgehog":
            assert all(t.dtype == torch.float32 for t in fm.project(x))
    for a, b in zip(plain[:2] + plain[2], cast[:2] + cast[2], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_polynomial_attention_of_large_inputs_is_finite_and_exact():
    """Σ(q·k)^4 overflowed float32 at |x| ~ 3e5 and normalized attention was NaN; an
    extreme query row is now divided by a power of two, which cancels."""
    torch.manual_seed(0)
    q, k, v = randn(1, 1, 8, D, scale=3e5), randn(1, 1, 8, D, scale=3e5), randn(1, 1, 8, 2)
    plain = ks.create_feature_map("polynomial", head_dim=D, degree=4, stabilize=False)
    for taylor in (False, True):
        fm = ks.create_feature_map("polynomial", head_dim=D, degree=4, taylor=taylor)
        exact = ks.kernel_attention(q.double(), k.double(), v.double(), feature_map=fm)
        for causal in (False, True):
            out = ks.kernel_attention(q, k, v, feature_map=fm, causal=causal)
            want = ks.kernel_attention(q.double(), k.double(), v.double(), fm, causal=causal)
            torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
        assert torch.isfinite(exact).all()
    with pytest.raises(ValueError, match="stabilize=True"):  # it was NaN without the shift
        ks.kernel_attention(q, k, v, feature_map=plain)
    # ordinary inputs: the same bits as without the rescaling; the kernel holds exactly
    x = randn(2, H, 5, D)
    assert torch.equal(make("polynomial")(x), make("polynomial", stabilize=False)(x))
    phi = make("polynomial")(x * 1e3)  # |φ| ~ 1e6..1e7 < e^20: untouched
    assert torch.equal(phi, make("polynomial", stabilize=False)(x * 1e3))
    # tiny queries are not lifted: with a normalizer near eps that would make attention
    # jump (40x for a 0.2% change of q at the threshold)
    tiny = x * 1e-6
    assert torch.equal(make("polynomial")(tiny), make("polynomial", stabilize=False)(tiny))


def test_polynomial_queries_up_to_float32s_largest_give_finite_attention():
    """Products of float32 query rows overflowed before the row was rescaled (p = 4 at
    |x| ~ 1.4e9, p = 2 at 1.8e19): NaN attention, where stabilize=False's error said to
    pass stabilize=True. Such rows' products are now taken on x divided by a power of two:
    their features are the float64 products times the same power of two as any row's."""
    torch.manual_seed(0)
    k, v = randn(1, 1, 6, 4), randn(1, 1, 6, 2)
    for degree, scale in ((2, 1e30), (3, 1e20), (4, 1e10), (4, 1e30)):
        q = randn(1, 1, 5, 4, scale=scale)
        q[0, 0, 1] /= scale  # an ordinary row beside them
        for taylor in (False, True):
            fm = ks.create_feature_map("polynomial", head_dim=4, degree=degree, taylor=taylor)
            phi = fm(q, is_query=True)
            assert torch.isfinite(phi).all()
            exact = fm(q.double(), is_query=False)  # float64 products, not rescaled
            ratio = exact.abs().amax(-1, keepdim=True) / phi.double().abs().amax(-1, keepdim=True)
            power = torch.exp2(torch.log2(ratio).round())
            assert (power[0, 0, 1] == 1).all()  # the ordinary row: untouched
            # to float32's rounding of each row's largest (Taylor's low orders underflow)
            row_top = exact.abs().amax(-1, keepdim=True)
            assert ((phi.double() * power - exact).abs() <= 1e-6 * row_top).all()
            out = ks.kernel_attention(q, k, v, feature_map=fm)
            want = ks.kernel_attention(q.double(), k.double(), v.double(), feature_map=fm)
            torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)


def test_polynomial_attention_does_not_jump_where_query_rows_start_to_be_rescaled():
    """A row just above the safe range was divided down to |φ| ~ 1, so ``eps`` weighed e^20
    times more in it at once: a 0.2% larger query moved attention by 31% (in float64). Now
    the row is divided by its excess only: across the threshold and far above it, attention
    is that of the unrescaled features (those that still fit float64)."""
    torch.manual_seed(0)
    q0 = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    k = torch.randn(1, 1, 4, 4, dtype=torch.float64) * 1e-3  # a small normalizer
    v = torch.randn(1, 1, 4, 2, dtype=torch.float64)
    fm = ks.create_feature_map("polynomial", head_dim=4, degree=2)
    plain = ks.create_feature_map("polynomial", head_dim=4, degree=2, stabilize=False)
    top = fm(q0).abs().max().item()
    for factor in (0.999, 1.001, 2.0, 100.0):  # the row's largest |φ| over e^20
        q = math.sqrt(factor * math.exp(20) / top) * q0
        out = ks.kernel_attention(q, k, v, feature_map=fm)
        want = ks.kernel_attention(q, k, v, feature_map=plain)
        torch.testing.assert_close(out, want, rtol=1e-3 * factor, atol=0)


def test_polynomial_feature_count_is_capped_before_anything_is_built():
    with pytest.raises(ValueError, match=r"degree=4 at head_dim=64 gives 16777216 features"):
        ks.create_feature_map("polynomial", head_dim=64, degree=4)  # was 16.7M tuples
    fm = ks.create_feature_map("polynomial", head_dim=64, degree=3, symmetric=True)
    assert fm.feature_dim == 45760  # C(66, 3), under the cap


def test_polynomial_features_of_float16_inputs_never_overflow_silently():
    fm = make("polynomial")  # degree 2: |φ| up to |x|²
    x = randn(1, H, 5, D)
    exact = fm(x.double())
    for dtype in (torch.float16, torch.bfloat16):  # products in float32, rounded once
        phi = fm(x.to(dtype))
        assert phi.dtype == dtype
        torch.testing.assert_close(phi.double(), exact, rtol=1e-2, atol=1e-2)
    big = x * 1e3  # |φ| ~ 1e6 > 65504
    with pytest.raises(ValueError, match="beyond float16's 65504"):
        fm(big.half(), is_query=False)
    assert torch.isfinite(fm(big.bfloat16(), is_query=False)).all()  # float32's range
    rows = fm(big.half())  # query rows are rescaled into float16's safe range (e^9)
    exact = fm(big.half().double(), is_query=False)
    ratio = exact.abs().amax(-1, keepdim=True) / rows.double().abs().amax(-1, keepdim=True)
    power = torch.exp2(torch.log2(ratio).round())  # each row scaled by a power of two
    top = math.exp(ks.core.SAFE_EXPONENTS[torch.float16][1])
    assert rows.abs().amax() <= top and (power >= 2**4).all()
    # the smallest power that does it: the row's excess over e^9, no more
    assert (rows.double().abs().amax(-1) > top / 2).all()
    torch.testing.assert_close(rows.double() * power, exact, rtol=1e-3, atol=0)


def test_feature_map_table():
    table = feature_map_table()
    assert list(table.columns) == [
        "name", "trainable", "random", "positive", "feature_dim", "parameters", "paper",
    ]  # fmt: skip
    assert table["name"].tolist() == NAMES
    row = table.set_index("name").loc["favor"]
    assert bool(row["random"]) and not bool(row["trainable"]) and bool(row["positive"])
    spec = get_feature_map_class("favor").hyperparameters["num_features"]
    assert f"num_features: {spec.describe()}" in row["parameters"]
    assert "Choromanski" in row["paper"]
    assert table.set_index("name").loc["trig_rf", "positive"] == False  # noqa: E712
    assert (table["paper"].str.len() > 0).all()


def test_numpy_numbers_are_taken_as_sizes_and_hyperparameters():
    """head_dim=np.int64(8) was refused as "not a positive int", and numpy hyperparameters
    as the wrong type; the core takes numpy ints."""
    import numpy as np

    fm = ks.create_feature_map(
        "favor", head_dim=np.int64(8), num_features=np.int32(16), seed=np.int64(3)
    )
    assert fm.head_dim == 8 and type(fm.head_dim) is int
    config = fm.config()
    assert config["num_features"] == 16 and type(config["num_features"]) is int
    assert type(config["seed"]) is int
    ffn = ks.create_feature_map("softplus_ffn", head_dim=8, reg_weight=np.float32(0.5))
    assert type(ffn.config()["reg_weight"]) is float
    with pytest.raises(TypeError, match="num_features must be int"):
        ks.create_feature_map("favor", head_dim=8, num_features=np.float64(16.0))
    # numpy's bools for bool hyperparameters (as check_flag takes them)
    assert ks.create_feature_map("glu", head_dim=8, shared=np.True_).config()["shared"] is True
    # a numpy rank above head_dim was let through, and config() then could not rebuild it
    with pytest.raises(ValueError, match="rank must be <= head_dim=8"):
        ks.create_feature_map("aoglu", head_dim=8, rank=np.int64(12))
    aoglu = ks.create_feature_map("aoglu", head_dim=np.int64(8), rank=np.int64(4))
    assert ks.create_feature_map(aoglu.config()).rank == 4


def test_bad_inputs_and_hyperparameters_are_named():
    """float8 inputs crashed deep inside the maps (or passed identity through); a float
    hyperparameter given as a huge int raised OverflowError."""
    for name in NAMES:
        with pytest.raises(TypeError, match=r"x must be a float16.*float8_e4m3fn"):
            make(name)(randn(1, H, 3, D).to(torch.float8_e4m3fn))
        with pytest.raises(TypeError, match=r"x must be a float16.*int64"):
            make(name)(torch.ones(1, H, 3, D, dtype=torch.long))
    with pytest.raises(ValueError, match=r"reg_weight must be finite"):
        ks.create_feature_map("oglu", head_dim=8, reg_weight=10**400)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_cuda_generator_seeds_a_map():
    """torch.randint drew from the generator on the CPU: a CUDA generator raised."""
    seeds = [
        make("favor", seed=torch.Generator(device="cuda").manual_seed(5)).config()["seed"]
        for _ in range(2)
    ]
    assert seeds[0] == seeds[1] and isinstance(seeds[0], int)
    cpu = make("favor", seed=torch.Generator().manual_seed(5)).config()["seed"]
    assert cpu == make("favor", seed=torch.Generator().manual_seed(5)).config()["seed"]


PLUGIN = """
import torch
from kernelstudy.feature_maps import FeatureMap, register_feature_map


@register_feature_map("plugin_sq_relu")
class SquaredReLU(FeatureMap):
    @property
    def feature_dim(self):
        return self.head_dim

    def features(self, x, is_query):
        return torch.relu(x) ** 2 + 1e-6
"""


def _run(code: str, tmp_path, **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "user_maps.py").write_text(PLUGIN)
    environ = {**os.environ, "PYTHONPATH": str(tmp_path), **env}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300
    )


def test_maps_of_a_module_listed_in_the_environment_join_the_registry(tmp_path):
    """A map registered in a user's module was unknown to every other process (the CLI,
    studies, search workers, a saved config): KERNELSTUDY_FEATURE_MAPS imports it first."""
    code = (
        "import json, sys, kernelstudy as ks\n"
        "config = json.loads(sys.argv[1] if len(sys.argv) > 1 else "
        '\'{"name": "plugin_sq_relu", "head_dim": 4}\')\n'
        "print(ks.list_feature_maps('plugin*'), ks.create_feature_map(config).feature_dim)\n"
    )
    done = _run(code, tmp_path, KERNELSTUDY_FEATURE_MAPS=" user_maps ,")
    assert done.returncode == 0, done.stderr
    assert "['plugin_sq_relu'] 4" in done.stdout
    unknown = _run(code, tmp_path)  # not listed: the error says how to make it known
    assert "unknown feature map 'plugin_sq_relu'" in unknown.stderr
    assert "KERNELSTUDY_FEATURE_MAPS" in unknown.stderr and "'module:Class'" in unknown.stderr
    bad = _run(code, tmp_path, KERNELSTUDY_FEATURE_MAPS="no_such_module")
    assert "KERNELSTUDY_FEATURE_MAPS lists 'no_such_module', which cannot be imported" in (
        bad.stderr
    )


def test_a_map_whose_features_are_not_feature_dim_wide_is_named():
    """A map returning 2D features while claiming D ran through attention and a first
    step, and failed at the second with a message about the state."""

    class TooWide(ks.feature_maps.FeatureMap):
        @property
        def feature_dim(self):
            return self.head_dim

        def features(self, x, is_query):
            return torch.cat([x, x], -1).exp()

    with pytest.raises(RuntimeError, match="TooWide returned 8 features per token, but its "):
        TooWide(head_dim=4)(torch.randn(1, 1, 3, 4))


def test_a_random_map_gets_seed_and_redraw_every_without_declaring_them():
    """A RandomFeatureMap subclass that declared only its own hyperparameters failed in
    redraw() with a bare KeyError('seed')."""

    class Draws(ks.feature_maps.RandomFeatureMap):
        hyperparameters = {"width": ks.feature_maps.Hyperparameter(int, 3, low=1)}
        size_hyperparameter = "width"

        def __init__(self, head_dim, num_heads=1, **hparams):
            super().__init__(head_dim, num_heads, **hparams)
            self.register_buffer("w", torch.empty(head_dim, self.hparams["width"]))
            self.redraw(self.hparams["seed"])

        @property
        def feature_dim(self):
            return self.hparams["width"]

        def draw(self, generator):
            self.w.copy_(torch.randn(self.w.shape, generator=generator))

        def features(self, x, is_query):
            self.maybe_redraw(is_query)
            return (x @ self.w).exp()

    assert set(Draws.hyperparameters) == {"width", "seed", "redraw_every"}
    a, b = Draws(head_dim=4, seed=5), Draws(head_dim=4, seed=5)
    assert torch.equal(a.w, b.w) and a.config()["seed"] == 5
    # size_hyperparameter: the studies match F through it (the built-in names do not fit)
    from kernelstudy.analysis.matching import size_knob

    assert size_knob(Draws) == "width"
    Draws.size_hyperparameter = "nope"
    with pytest.raises(ValueError, match="size_hyperparameter 'nope' is not one of"):
        size_knob(Draws)


@pytest.mark.parametrize("name", NAMES)
def test_every_map_docstring_states_its_shapes(name):
    """elu, relu, identity, oglu and aoglu said nothing of their input and output shapes."""
    doc = get_feature_map_class(name).__doc__ or ""
    assert re.search(r"``\((B,H|\.\.\.), ?N, ?D\) → \((B,H|\.\.\.), ?N, ?[^)]+\)``", doc), name


#: Maps and the hyperparameters (not visible in tensor shapes) that decide their tensors'
#: values: the saved map's value, and another value that the load must refuse.
DRAW_DEFINING = [
    ("favor", "orthogonal", True, False),
    ("favor", "row_norms", "chi", "sqrt_d"),
    ("trig_rf", "orthogonal", True, False),
    ("trig_rf", "row_norms", "chi", "sqrt_d"),
    ("softplus_ffn", "orthogonal", True, False),
]


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name, hparam, saved_value, other", DRAW_DEFINING)
def test_a_state_dict_refuses_a_map_built_with_other_draw_defining_hyperparameters(
    name, hparam, saved_value, other, strict
):
    """An orthogonal FAVOR+ draw loaded silently into a map built with orthogonal=False (or
    other row norms), whose config() then described a draw it did not hold."""
    x = randn(1, H, 5, D)
    saved = make(name, seed=3, **{hparam: saved_value})
    target = make(name, seed=4, **{hparam: other})
    before, config = target(x), target.config()
    with pytest.raises(RuntimeError, match=rf"{hparam}={saved_value!r}.*{hparam}={other!r}"):
        target.load_state_dict(saved.state_dict(), strict=strict)
    # nothing was loaded: the map still holds what its config names
    assert target.config() == config
    torch.testing.assert_close(target(x), before, rtol=0, atol=0)
    torch.testing.assert_close(ks.create_feature_map(config)(x), before, rtol=0, atol=0)
    # the same hyperparameters (another seed) load, and the config names the saved seed
    same = make(name, seed=4, **{hparam: saved_value})
    same.load_state_dict(saved.state_dict(), strict=strict)
    assert same.config() == saved.config()
    torch.testing.assert_close(same(x), saved(x), rtol=0, atol=0)
    # state dicts saved before the config was recorded cannot be checked: they load as before
    state = saved.state_dict()
    state["_extra_state"] = {k: v for k, v in state["_extra_state"].items() if k != "config"}
    old = make(name, seed=4, **{hparam: other})
    old.load_state_dict(state, strict=strict)
    assert old.config()["seed"] == 3
    torch.testing.assert_close(old(x), saved(x), rtol=0, atol=0)


def test_hyperparameters_that_leave_the_draw_alone_still_load_across():
    """iid rows ignore row_norms, and stabilize, hyperbolic, redraw_every and reg_weight only
    use the tensors: a state dict loads across them."""
    x = randn(1, H, 5, D)
    iid = make("favor", orthogonal=False, row_norms="chi", seed=1)
    other = make("favor", orthogonal=False, row_norms="sqrt_d", seed=2)
    other.load_state_dict(iid.state_dict())
    torch.testing.assert_close(ks.create_feature_map(other.config())(x), iid(x), rtol=0, atol=0)
    pairs = [
        ("favor", {"stabilize": False, "hyperbolic": True, "redraw_every": 3}),
        ("trig_rf", {"stabilize": False}),
        ("softplus_ffn", {"reg_weight": 0.5}),
        ("oglu", {"reg_weight": 0.5}),
        ("hedgehog", {"stabilize": False}),
    ]
    for name, changed in pairs:
        target = make(name, **changed)
        target.load_state_dict(make(name).state_dict())
        assert {k: target.config()[k] for k in changed} == changed


@pytest.mark.parametrize("name", [n for n in NAMES if get_feature_map_class(n).trainable])
def test_trained_weights_load_into_a_map_of_the_same_config(name, tmp_path):
    """Trained weights load into a map rebuilt from the config, and into one built with
    another seed, whose config() then names the saved map's seed (it named its own)."""
    x = randn(2, H, 5, D)
    seeded = "seed" in get_feature_map_class(name).hyperparameters
    trained = make(name, **({"seed": 3} if seeded else {}))
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.1 * torch.randn_like(p))
    torch.save(trained.state_dict(), tmp_path / "map.pt")
    state = torch.load(tmp_path / "map.pt", weights_only=True)
    rebuilt = ks.create_feature_map(trained.config())
    rebuilt.load_state_dict(state)
    torch.testing.assert_close(rebuilt(x), trained(x), rtol=0, atol=0)
    if not seeded:
        assert "_extra_state" not in state  # nothing to carry: the keys are as they were
        return
    other = make(name, seed=9)
    other.load_state_dict(state)
    assert other.config() == trained.config() and other.config()["seed"] == 3
    torch.testing.assert_close(other(x), trained(x), rtol=0, atol=0)
    # a state dict saved before the config was recorded (no extra state) loads strictly
    legacy = {k: v for k, v in state.items() if not k.endswith("_extra_state")}
    again = make(name, seed=9)
    again.load_state_dict(legacy)
    torch.testing.assert_close(again(x), trained(x), rtol=0, atol=0)
    assert again.config()["seed"] == 9  # nothing says otherwise


@pytest.mark.parametrize("name", ["favor", "trig_rf"])
def test_a_redrawn_map_saves_and_loads_its_current_draw(name):
    """After redraw(seed=5) config() names seed 5; its state loads into a map built with the
    first seed (adopting 5), and into the map its config() rebuilds."""
    x = randn(1, H, 5, D)
    fm = make(name, seed=0, orthogonal=True)
    fm.redraw(seed=5)
    assert fm.config()["seed"] == 5
    for target in (make(name, seed=0, orthogonal=True), ks.create_feature_map(fm.config())):
        target.load_state_dict(fm.state_dict())
        assert target.config() == fm.config()
        torch.testing.assert_close(target(x), fm(x), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="orthogonal=True"):
        make(name, seed=5, orthogonal=False).load_state_dict(fm.state_dict())


def test_a_model_state_dict_round_trips_and_names_the_layer_that_does_not_fit():
    """Every layer's map carries its config: a model rebuilt from model.config() loads (each
    map adopting its layer's seed); one built with iid FAVOR+ refuses, naming the layer."""
    small = {"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.0}
    ids = torch.randint(0, 20, (2, 7))
    for fm_name, kwargs in (
        ("favor", {"num_features": 8, "orthogonal": True}),
        ("glu", {"depth": 2}),
        ("softplus_ffn", {}),
    ):
        model = ks.nn.CausalLM(20, feature_map=fm_name, feature_map_kwargs=kwargs, **small)
        model.eval()
        rebuilt = type(model)(**model.config()).eval()  # no seed: other draws per layer
        rebuilt.load_state_dict(model.state_dict())
        maps = [m for m in model.modules() if isinstance(m, ks.FeatureMap)]
        again = [m for m in rebuilt.modules() if isinstance(m, ks.FeatureMap)]
        assert [m.config() for m in again] == [m.config() for m in maps]
        torch.testing.assert_close(rebuilt(ids), model(ids), rtol=0, atol=0)
        legacy = {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}
        type(model)(**model.config()).load_state_dict(legacy)  # older checkpoints, strict
    kwargs = {"num_features": 8, "orthogonal": True}
    model = ks.nn.CausalLM(20, feature_map="favor", feature_map_kwargs=kwargs, **small)
    iid = ks.nn.CausalLM(
        20, feature_map="favor", feature_map_kwargs={**kwargs, "orthogonal": False}, **small
    )
    with pytest.raises(RuntimeError, match=r"layers\.1\.attn\.feature_map.*orthogonal"):
        iid.load_state_dict(model.state_dict())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "name, kw", [("softplus_ffn", {}), ("glu", {"depth": 3}), ("oglu", {"depth": 2}), ("aoglu", {})]
)
def test_learned_features_of_half_inputs_are_computed_in_float32(name, kw, dtype):
    """σ(z) and softplus(z) of a negative z are about e^z, and a half z is off by up to
    |z|/256 (bfloat16): features were up to 4% off at |x| ≈ 3, attention at |x| ≈ 100 (D=64)
    0.04 (one GLU unit) to 0.14 (three) off, also under autocast. Now: the float32 features
    rounded once."""
    fm = make(name, seed=0, **kw)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(0.1 * torch.randn_like(p))
    exact_map = ks.create_feature_map(fm.config()).double()
    exact_map.load_state_dict(fm.state_dict())
    for scale in (3.0, 30.0):
        x = randn(2, H, 64, D, scale=scale).to(dtype)
        got, exact = fm(x), exact_map(x.double())
        assert got.dtype == dtype
        # far from underflow in dtype, and in float32, which shares bfloat16's range
        tiny = max(torch.finfo(dtype).tiny, torch.finfo(torch.float32).tiny * 2**24)
        normal = exact.abs() >= tiny
        rel = ((got.double() - exact).abs() / exact.abs())[normal].max()
        assert rel <= (2**-8 if dtype == torch.bfloat16 else 2**-11) * 1.01, scale
    x = randn(2, H, 9, D, scale=3.0)
    with torch.autocast("cpu", dtype=dtype):  # the float32 features, as without autocast
        cast = fm(x)
    assert cast.dtype == torch.float32 and torch.equal(cast, fm(x))


@pytest.mark.parametrize(
    ("saved", "into"),
    [("glu", "oglu"), ("oglu", "glu"), ("favor", "trig_rf"), ("glu", "softplus_ffn")],
)
def test_a_state_dict_of_another_registered_map_is_refused(saved, into):
    """glu and oglu (and favor and trig_rf) hold tensors of the same shapes: one's state
    loaded into the other, whose config() then named a map those tensors were not of."""
    kwargs = {"num_features": 8} if saved == "favor" else {}
    source = ks.create_feature_map(saved, head_dim=8, seed=0, **kwargs)
    target = ks.create_feature_map(into, head_dim=8, seed=1, **kwargs)
    with pytest.raises(
        RuntimeError, match=f"the saved tensors are those of feature map '{saved}', but this is"
    ):
        target.load_state_dict(source.state_dict(), strict=False)
    assert target.hparams["seed"] == 1
    twin = ks.create_feature_map(saved, head_dim=8, seed=1, **kwargs)
    twin.load_state_dict(source.state_dict())  # the same map loads, adopting the seed
    assert twin.hparams["seed"] == 0


@pytest.mark.parametrize("assign", [False, True])
@pytest.mark.parametrize(("saved", "into"), [("glu", "oglu"), ("oglu", "glu"), ("aoglu", "oglu")])
def test_a_refused_state_dict_loads_none_of_the_maps_submodules(saved, into, assign):
    """The GLU family keeps its weights in submodules (``units.0.w_f``), which torch loads
    after the map itself: glu's state into an oglu map was refused, yet the oglu map then held
    glu's weights under its own config (and aoglu's w_f, with errors about its gate's keys)."""
    x = randn(2, H, 5, D)
    source, target = make(saved, seed=0), make(into, seed=1)
    before, config = target(x), target.config()
    tensors = list(target.parameters())
    with pytest.raises(RuntimeError) as err:
        target.load_state_dict(source.state_dict(), strict=False, assign=assign)
    lines = str(err.value).splitlines()[1:]
    assert len(lines) == 1 and f"are those of feature map '{saved}'" in lines[0], lines
    assert target.config() == config
    torch.testing.assert_close(target(x), before, rtol=0, atol=0)
    assert all(a is b for a, b in zip(tensors, target.parameters(), strict=True))  # optimizers
    # in a model: each layer's map keeps its weights
    small = {"d_model": 16, "n_heads": 2, "n_layers": 2, "d_ff": 32, "dropout": 0.0}
    model = ks.nn.CausalLM(20, feature_map=into, **small)
    maps = [m for m in model.modules() if isinstance(m, ks.FeatureMap)]
    held = [{k: v.clone() for k, v in m.state_dict().items() if torch.is_tensor(v)} for m in maps]
    other = ks.nn.CausalLM(20, feature_map=saved, **small)
    with pytest.raises(RuntimeError, match=r"layers\.1\.attn\.feature_map: the saved tensors"):
        model.load_state_dict(other.state_dict(), assign=assign)
    for fm, kept in zip(maps, held, strict=True):
        now = fm.state_dict()
        assert all(torch.equal(now[k], v) for k, v in kept.items())


class CountingMap(ks.FeatureMap):
    """A user's seeded map with its own extra state: an int (how often it was called)."""

    hyperparameters = {"seed": ks.feature_maps.base.SEED}

    def __init__(self, head_dim, num_heads=1, **hparams):
        super().__init__(head_dim, num_heads, **hparams)
        generator = torch.Generator().manual_seed(self.hparams["seed"])
        self.weight = torch.nn.Parameter(torch.randn(head_dim, head_dim, generator=generator))
        self.calls = 0

    @property
    def feature_dim(self):
        return self.head_dim

    def features(self, x, is_query):
        self.calls += 1
        return torch.nn.functional.softplus(x @ self.weight)

    def get_extra_state(self):
        return self.calls

    def set_extra_state(self, state):
        self.calls = int(state)


def test_a_users_map_with_its_own_extra_state_still_loads():
    """A user's map with a seed and its own get/set_extra_state (an int) was refused with
    'the state dict's extra state must be a dict': the load checked the format of
    FeatureMap's extra state before the map's own set_extra_state could take it."""
    x = randn(1, H, 3, D)
    saved, loaded = CountingMap(D, seed=1), CountingMap(D, seed=2)
    saved(x), saved(x)
    state = saved.state_dict()
    assert state["_extra_state"] == 2
    loaded.load_state_dict(state)
    assert loaded.calls == 2
    torch.testing.assert_close(loaded(x), saved(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["elu", "identity", "hedgehog"])
def test_an_extra_state_given_to_a_map_without_one_is_an_unexpected_key(name):
    """Every FeatureMap defines set_extra_state, so torch gave an ``_extra_state`` to maps
    that save none (elu, hedgehog) and reported nothing: a strict load of another map's
    state dict (a seeded map's, of a model with other maps) passed with that key unused."""
    fm = make(name)
    state = {**fm.state_dict(), "_extra_state": make("favor").state_dict()["_extra_state"]}
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "_extra_state"'):
        fm.load_state_dict(state)
    assert fm.load_state_dict(state, strict=False).unexpected_keys == ["_extra_state"]
    fm.load_state_dict(fm.state_dict())  # its own state dict has no such key
    assert "_extra_state" not in fm.state_dict()


class SubclassedFavor(ks.feature_maps.favor.FavorFeatureMap):
    """A user's subclass of a registered map: its config names it ``module:Class``."""


class SubclassedOGLU(ks.feature_maps.glu.OGLUFeatureMap):
    """A user's subclass of oglu, a registered subclass of glu."""


def test_a_users_subclass_of_a_registered_map_is_checked_as_that_map():
    """A subclass of favor (config name ``module:Class``) was not checked by name, so it
    loaded trig_rf's projection (and a subclass of oglu glu's weights) under its own config.
    It loads its parent's state, and its parent loads its state, as before."""
    x = randn(1, H, 5, D)
    kwargs = {"num_features": 16}
    mine = SubclassedFavor(D, H, seed=1, **kwargs)
    assert mine.config()["name"] == f"{__name__}:SubclassedFavor"
    trig = make("trig_rf", seed=2, **kwargs)
    with pytest.raises(
        RuntimeError,
        match=r"are those of feature map 'trig_rf', but this is a '.*:SubclassedFavor' map "
        r"\(SubclassedFavor, a subclass of 'favor'\)",
    ):
        mine.load_state_dict(trig.state_dict())
    assert mine.config()["seed"] == 1
    torch.testing.assert_close(mine(x), SubclassedFavor(D, H, seed=1, **kwargs)(x))
    favor = make("favor", seed=3, **kwargs)
    mine.load_state_dict(favor.state_dict())  # its parent's state
    assert mine.config()["seed"] == 3
    torch.testing.assert_close(mine(x), favor(x), rtol=0, atol=0)
    mine.redraw(seed=4)
    favor.load_state_dict(mine.state_dict())  # and the reverse
    assert favor.config()["seed"] == 4
    torch.testing.assert_close(favor(x), mine(x), rtol=0, atol=0)
    oglu = SubclassedOGLU(D, H, seed=1)
    with pytest.raises(RuntimeError, match="feature map 'glu', .* a subclass of 'oglu'"):
        oglu.load_state_dict(make("glu", seed=2).state_dict())
    oglu.load_state_dict(make("oglu", seed=2).state_dict())
    assert oglu.config()["seed"] == 2


@pytest.mark.parametrize("name", ["favor", "glu", "softplus_ffn"])
def test_a_map_built_on_the_meta_device_loads_with_assign(name):
    """``with torch.device("meta")`` (build without memory, then load_state_dict(...,
    assign=True)) failed in __init__ for a map without an explicit seed: the seed was drawn
    on the default device, and a meta tensor has no value ('Tensor.item() cannot be called
    on meta tensors')."""
    x = randn(1, H, 5, D)
    saved = make(name, seed=3)
    torch.manual_seed(0)
    on_cpu = make(name).config()["seed"]
    torch.manual_seed(0)
    with torch.device("meta"):
        fm = make(name)
    assert fm.config()["seed"] == on_cpu  # the CPU generator's draw, as without the context
    assert all(t.is_meta for t in fm.state_dict().values() if torch.is_tensor(t))
    fm.load_state_dict(saved.state_dict(), assign=True)
    assert fm.config() == saved.config()
    torch.testing.assert_close(fm(x), saved(x), rtol=0, atol=0)


def test_a_map_and_its_input_on_two_devices_are_refused():
    """torch's ``x_cpu @ w_meta`` returns a CPU tensor of uninitialized memory: a map left on
    the meta device gave features that differed call to call. ``kernel_attention`` builds a
    map given by name on the inputs' device (a CPU-built one failed on meta inputs)."""
    x = randn(1, H, 5, D)
    for name in NAMES:
        with torch.device("meta"):
            fm = make(name)
        if fm._first_weight() is None:  # nothing of its own on a device
            continue
        with pytest.raises(ValueError, match="x is on cpu, but the feature map's weights are on"):
            fm(x)
    q = torch.zeros(1, H, 5, D, device="meta")
    for name in NAMES:
        for causal in (False, True):
            assert ks.kernel_attention(q, q, q, name, causal=causal).is_meta, name


def test_polynomial_tables_survive_meta_builds_inference_mode_and_half():
    """Its monomial tables are buffers kept out of the state dict: built on the meta device,
    then to_empty, they were uninitialized memory (an IndexError, or wrong features), with
    load(assign=True) they stayed on meta; built under inference_mode they took no part in a
    backward; half() rounded their float64 weights."""
    x = randn(1, H, 5, D)
    saved = make("polynomial")
    want = saved(x)
    with torch.device("meta"):
        empty = make("polynomial")
    empty.to_empty(device="cpu")
    torch.testing.assert_close(empty(x), want, rtol=0, atol=0)
    with torch.device("meta"):
        assigned = make("polynomial")
    assigned.load_state_dict(saved.state_dict(), assign=True)
    torch.testing.assert_close(assigned(x), want, rtol=0, atol=0)
    with torch.inference_mode():
        inferred = make("polynomial")
    xq = x.clone().requires_grad_()
    inferred(xq).sum().backward()
    assert torch.isfinite(xq.grad).all()
    halved = make("polynomial", symmetric=True).half()
    assert halved.weight_2.dtype == torch.float64
    with torch.device("meta"):  # loaded with assign=True, then moved: the meta tables failed
        moved = make("polynomial")
    moved.load_state_dict(saved.state_dict(), assign=True)
    torch.testing.assert_close(moved.to("cpu", torch.float64)(x.double()), want.double())
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # a first build under a fake mode: its tables are not cached
        make("polynomial", degree=3)
    assert torch.isfinite(make("polynomial", degree=3)(x)).all()


class _DrawDevices(torch.overrides.TorchFunctionMode):
    """The device of every tensor that a call with an explicit ``generator`` makes or fills."""

    def __init__(self) -> None:
        super().__init__()
        self.devices: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if kwargs.get("generator") is not None and isinstance(out, torch.Tensor):
            self.devices.append(out.device.type)
        return out


RANDOM_MAPS = [
    ("favor", {}), ("favor", {"orthogonal": False, "row_norms": "sqrt_d"}), ("trig_rf", {}),
    ("glu", {}), ("oglu", {}), ("aoglu", {}), ("softplus_ffn", {}),
    ("softplus_ffn", {"orthogonal": False}),
]  # fmt: skip


@pytest.mark.parametrize("name, kwargs", RANDOM_MAPS, ids=[f"{n}-{k}" for n, k in RANDOM_MAPS])
def test_random_weights_are_drawn_on_the_cpu_whatever_the_default_device(name, kwargs):
    """Under ``with torch.device("cuda")`` (or set_default_device) the maps' draws from
    their CPU generator made or filled tensors on the default device: on CUDA that fails
    ("Expected a 'cuda' device type for generator but found 'cpu'"), and a seed would not
    give the same weights there. Shown here on the meta device, which takes such draws
    silently: every draw is now made on the CPU, then the weights go to the default device."""
    with _DrawDevices() as draws, torch.device("meta"):
        fm = make(name, seed=3, **kwargs)
    assert draws.devices and set(draws.devices) == {"cpu"}
    assert all(t.is_meta for t in fm.state_dict().values() if torch.is_tensor(t))


@pytest.mark.parametrize("name", ks.list_feature_maps())
def test_a_sparse_input_is_refused_by_name(name):
    """A sparse x reached the maps' reshapes and elementwise ops: RuntimeError ("reshape
    is not implemented for sparse tensors") or NotImplementedError from deep inside."""
    fm = ks.create_feature_map(name, head_dim=4)
    with pytest.raises(TypeError, match="x must be a dense \\(strided\\) tensor, got layout"):
        fm(torch.randn(2, 1, 3, 4).to_sparse())


@pytest.mark.parametrize("is_query", [True, False])
def test_polynomial_features_overflowing_without_stabilize_raise_naming_the_fix(is_query):
    """Features of finite inputs that overflowed float32 came out inf with stabilize=False,
    and attention NaN, while the README promises a ValueError (check_products_fit bounds the
    finite features only, and none was finite)."""
    plain = ks.create_feature_map("polynomial", head_dim=4, degree=2, stabilize=False)
    torch.manual_seed(0)
    x = torch.randn(1, 1, 6, 4) * 2e20
    fix = "pass stabilize=True" if is_query else "keys are not rescaled"
    with pytest.raises(ValueError, match=rf"polynomial {'query' if is_query else 'key'} .*{fix}"):
        plain(x, is_query=is_query)
    q, k, v = torch.randn(3, 1, 1, 6, 4).unbind(0)
    with pytest.raises(ValueError, match="overflow"):
        ks.kernel_attention(q, k * 2e20, v, feature_map=plain)
    nonfinite = torch.ones(1, 1, 2, 4)  # a non-finite input keeps its inf, as with stabilize
    nonfinite[0, 0, 0, 0] = float("inf")
    assert torch.isinf(plain(nonfinite, is_query=is_query)).any()
    assert torch.isfinite(plain(torch.full((1, 1, 3, 4), 1e18))).all()  # 1e36: still a float32


def test_softplus_ffn_plain_init_is_uniform_in_plus_minus_one_over_sqrt_n():
    """orthogonal=False: W uniform in ±1/√n, as nn.Linear (the class docstring)."""
    n = 32
    w = ks.create_feature_map("softplus_ffn", head_dim=n, orthogonal=False, seed=0).weight
    bound = n**-0.5
    assert w.abs().max() <= bound
    assert w.abs().max() > 0.95 * bound
    assert w.std().item() == pytest.approx(bound / 3**0.5, rel=0.1)


def test_aoglu_low_rank_gate_has_the_full_gates_init_variance():
    """Entries of W_g = A B start with the variance 1/(3n) of GLU's full uniform gate."""
    n = 32
    fm = ks.create_feature_map("aoglu", head_dim=n, rank=8, seed=0, num_heads=4, shared=False)
    gate = torch.cat([unit.gate_weight().detach().flatten() for unit in fm.units])
    full = ks.create_feature_map("glu", head_dim=n, seed=0).units[0].gate_weight().detach()
    assert gate.var().item() == pytest.approx(1 / (3 * n), rel=0.15)
    assert full.var().item() == pytest.approx(1 / (3 * n), rel=0.15)


@pytest.mark.parametrize("name", ["glu", "oglu", "aoglu", "softplus_ffn"])
def test_a_seed_gives_the_same_weights_whatever_the_default_dtype(name):
    """The CPU generator's stream differs by dtype: under a float64 default the same seed and
    config drew other weights (φ up to 1.5 apart), and under a half default the orthogonal
    init failed ("geqrf_cpu" not implemented for 'Half')."""
    base = ks.create_feature_map(name, head_dim=8, seed=0)
    before = torch.get_default_dtype()
    for dtype in (torch.float64, torch.bfloat16, torch.float16):
        try:
            torch.set_default_dtype(dtype)
            other = ks.create_feature_map(base.config())
        finally:
            torch.set_default_dtype(before)
        theirs = dict(other.named_parameters())
        for key, a in base.named_parameters():
            assert theirs[key].dtype == dtype and torch.equal(theirs[key], a.to(dtype)), key
