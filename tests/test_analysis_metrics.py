"""Analysis metrics on constructed cases: exact maps, known ranks, KL, bad input."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

import kernelstudy as ks
from kernelstudy.feature_maps import FeatureMap
from kernelstudy.tasks import CopyTask

from .conftest import rel_err


class OneHotExactMap(FeatureMap):
    """φ(x) = [1, √γ·x] so φ(q)·φ(k) = 1 + γ q·k. For q = a·e_i, k = b·e_j this equals
    exp(q·k/√D) exactly when γ = (exp(ab/√D) − 1)/(ab): a map that reproduces softmax."""

    def __init__(self, head_dim: int, ab: float) -> None:
        super().__init__(head_dim)
        self.gamma = (math.exp(ab / math.sqrt(head_dim)) - 1.0) / ab

    @property
    def feature_dim(self) -> int:
        return self.head_dim + 1

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        ones = torch.ones(*x.shape[:-1], 1, dtype=x.dtype, device=x.device)
        return torch.cat([ones, math.sqrt(self.gamma) * x], -1)

    def kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.exp(x @ y.transpose(-1, -2) / math.sqrt(self.head_dim))


def one_hot_qk(n: int = 24, d: int = 8, a: float = 2.0, b: float = 1.5, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = a * torch.nn.functional.one_hot(torch.randint(d, (1, 2, n), generator=gen), d).double()
    k = b * torch.nn.functional.one_hot(torch.randint(d, (1, 2, n), generator=gen), d).double()
    return q, k


@pytest.mark.parametrize("causal", [False, True])
def test_exact_map_has_zero_error_and_uniform_does_not(causal):
    q, k = one_hot_qk()
    v = torch.randn(1, 2, 24, 5, dtype=torch.float64)
    fm = OneHotExactMap(8, ab=3.0)
    frame = ks.analysis.approximation_error(fm, q, k, v, causal=causal)
    ours = frame[frame.kind == "map"].set_index("metric")["value"]
    assert set(ours.index) == {"kernel_mse", "attention_mse", "attention_kl", "output_rel_error"}
    assert (ours.abs() < 1e-12).all(), ours
    uniform = frame[frame.method == "uniform"].set_index("metric")["value"]
    assert set(uniform.index) == {"attention_mse", "attention_kl", "output_rel_error"}
    assert (uniform > 1e-4).all()
    assert frame.feature_dim.iloc[0] == 9


def test_no_kernel_mse_while_a_stabilizer_rescales_the_features():
    """FAVOR+ with its stabilizer on reported a kernel MSE of 7852 for a kernel it estimates
    to 1e-1 with the stabilizer off: the rescaled φ is not the kernel's."""
    q, k = ks.analysis.gaussian_qk(16, 8, std=1.0, seed=3)
    metrics = {}
    for stabilize in (False, True):
        fm = ks.create_feature_map("favor", head_dim=8, num_features=32, stabilize=stabilize)
        frame = ks.analysis.approximation_error(fm, q, k)
        metrics[stabilize] = set(frame[frame.kind == "map"].metric)
    assert metrics[False] == {"kernel_mse", "attention_mse", "attention_kl"}
    assert metrics[True] == {"attention_mse", "attention_kl"}
    # the polynomial map's stabilizer rescales only extreme query rows, but it did then:
    # a kernel MSE from scores of 7.6e-8 where its kernel is 41
    q = torch.full((1, 1, 3, 4), 4e4, dtype=torch.float64)
    k = torch.full((1, 1, 3, 4), 1e-4, dtype=torch.float64)
    for stabilize in (False, True):
        fm = ks.create_feature_map("polynomial", head_dim=4, taylor=True, stabilize=stabilize)
        frame = ks.analysis.approximation_error(fm, q, k)
        assert ("kernel_mse" in set(frame.metric)) is not stabilize


def test_attention_metrics_without_kernel_and_with_padding():
    q, k = ks.analysis.gaussian_qk(16, 8, std=1.0, batch=2, seed=3)
    mask = torch.ones(2, 16, dtype=torch.bool)
    mask[1, 10:] = False
    frame = ks.analysis.approximation_error("elu", q, k, key_padding_mask=mask)
    assert set(frame.metric) == {"attention_mse", "attention_kl"}
    assert np.isfinite(frame.value).all() and (frame.value > 0).all()


def test_approximation_error_ignores_padding_and_refuses_what_it_cannot_measure():
    q, k = ks.analysis.gaussian_qk(6, 4, seed=1)
    v = torch.randn(1, 1, 6, 3)
    mask = torch.ones(1, 6, dtype=torch.bool)
    mask[0, 4:] = False
    favor = {"name": "favor", "num_features": 16, "seed": 0}
    clean = ks.analysis.approximation_error(favor, q, k, v, key_padding_mask=mask)
    k2, v2 = k.clone(), v.clone()
    k2[..., 4:, :], v2[..., 4:, :] = math.nan, math.inf  # padding may hold anything
    dirty = ks.analysis.approximation_error(favor, q, k2, v2, key_padding_mask=mask)
    pd.testing.assert_frame_equal(dirty, clean)
    assert np.isfinite(clean.value).all()
    cases = [
        ({"eps": -1.0}, ValueError, "eps must be a finite float >= 0"),
        ({"eps": math.nan}, ValueError, "eps must be a finite float >= 0"),
        ({"eps": "1"}, TypeError, "eps must be a float"),
        ({"q": q * math.nan}, ValueError, "q holds NaN or inf"),
        ({"k": k2}, ValueError, r"k holds NaN or inf \(outside padded keys\)"),
        ({"key_padding_mask": torch.zeros(1, 6, dtype=torch.bool)}, ValueError, "no query a key"),
        ({"v": torch.zeros(1, 1, 6, 3)}, ValueError, "output_rel_error is undefined"),
        ({"v": torch.randn(2, 2)}, ValueError, "v must have 4 dimensions"),
        ({"v": v.numpy()}, TypeError, "v must be a torch.Tensor"),
    ]
    for empty in ("batch", "heads"):  # every metric was the NaN mean of nothing
        size = {"batch": (0, *q.shape[1:]), "heads": (q.shape[0], 0, *q.shape[2:])}[empty]
        cases.append(({"q": q.new_zeros(size), "k": q.new_zeros(size), "v": v.new_zeros(size)},
                      ValueError, "q has no batch elements or heads"))  # fmt: skip
    for change, error, match in cases:
        args = {"q": q, "k": k, "v": v, **change}
        with pytest.raises(error, match=match):
            ks.analysis.approximation_error("elu", **args)


def test_row_kl_of_nearly_equal_rows_is_accurate_and_never_negative():
    """log p − log q cancels to ~1e-16 where p ≈ q, while the KL is O((p − q)²): the uniform
    baseline at query/key std 1e-4 came out −2.9e-16 (a negative KL), at 1e-3 0.08% off."""
    gen = torch.Generator().manual_seed(0)
    q = torch.full((200, 64), 1 / 64, dtype=torch.float64)
    for scale in (1e-3, 1e-5, 1e-7, 1e-9):
        p = torch.softmax(scale * torch.randn(200, 64, generator=gen, dtype=torch.float64), -1)
        got = ks.analysis.row_kl(p, q)
        want = (p * torch.log1p((p - q) / q)).sum(-1)  # each log exact to rounding
        assert (got >= 0).all(), scale
        torch.testing.assert_close(got, want, rtol=1e-6, atol=2e-15)  # the sum's rounding


def test_row_kl_identical_rows_is_zero_and_matches_formula():
    p = torch.softmax(torch.randn(3, 7, 11, dtype=torch.float64), -1)
    assert ks.analysis.row_kl(p, p).abs().max() < 1e-14
    q = torch.softmax(torch.randn(3, 7, 11, dtype=torch.float64), -1)
    expected = (p * (p / q).log()).sum(-1)
    assert torch.allclose(ks.analysis.row_kl(p, q), expected, atol=1e-12)
    neg = q.clone()
    neg[0, 0, 0] = -0.1
    assert math.isnan(ks.analysis.row_kl(p, neg)[0, 0].item())
    # q missing mass p has is +inf (it was ~69 nats, set by the clamp), as scipy's entropy
    kl = ks.analysis.row_kl(
        torch.tensor([[0.5, 0.5], [1.0, 0.0]]), torch.tensor([[1.0, 0], [1, 0]])
    )
    assert kl.tolist() == [math.inf, 0.0]
    # a kernel weight below 1e-30 was logged as 1e-30 (45.36 nats read as 33.85)
    f64 = torch.float64
    kl = ks.analysis.row_kl(
        torch.tensor([[0.5, 0.5]], dtype=f64), torch.tensor([[1.0, 1e-40]], dtype=f64)
    )
    exact = 0.5 * math.log(0.5 / (1 / (1 + 1e-40))) + 0.5 * math.log(0.5 / 1e-40)
    assert kl.item() == pytest.approx(exact, rel=1e-12)


def test_row_kl_and_approximation_error_name_bad_inputs():
    """numpy arrays were an AttributeError, a negative softmax weight was silently
    dropped, and empty q or k blamed a key_padding_mask nobody gave."""
    with pytest.raises(TypeError, match="p must be a floating-point torch.Tensor"):
        ks.analysis.row_kl(np.ones((2, 3)), torch.ones(2, 3))
    with pytest.raises(ValueError, match="p must be non-negative"):
        ks.analysis.row_kl(torch.tensor([[0.9, -0.4, 0.5]]), torch.ones(1, 3))
    # a NaN tiny read a +inf row (q misses p's mass) as 0
    p, q0 = torch.tensor([[0.5, 0.5]]), torch.tensor([[1.0, 0.0]])
    assert ks.analysis.row_kl(p, q0).item() == math.inf
    for tiny in (float("nan"), 0.0, "x"):
        with pytest.raises((TypeError, ValueError), match="tiny must be"):
            ks.analysis.row_kl(p, q0, tiny=tiny)
    # head dimension 0: 1/√D made every entry NaN
    empty = torch.randn(1, 1, 3, 0)
    for call in (ks.analysis.attention_matrix, ks.analysis.softmax_kernel):
        with pytest.raises(ValueError, match="must have head dimension D >= 1, got D = 0"):
            call(empty, empty)
    q, k = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 3, 4)
    for qq, kk, name in ((q[:, :, :0], k, "q"), (q, k[:, :, :0], "k")):
        with pytest.raises(ValueError, match=rf"^{name} has no positions"):
            ks.analysis.approximation_error("elu", qq, kk)
    # numpy's ints, as the rest of the package takes them
    assert ks.analysis.matched_feature_map("favor", 4, np.int64(8)).feature_dim == 8
    spectrum = ks.analysis.normalized_spectrum(np.array([2.0, 1.0]), digits=np.int64(2))
    assert list(spectrum) == [1.0, 0.5]


@pytest.mark.parametrize("name", ["softmax", "elu", "hedgehog"])
def test_half_precision_attention_matrices_sum_in_float32(name):
    """In float16 a row sum over 1024 keys overflowed: every row became 0 (rank 0), and
    softmax scores above 65504 became NaN, hidden as zero rows."""
    for n, std in ((1024, 1.0), (8, 100.0 if name == "softmax" else 1.0)):
        q, k = ks.analysis.gaussian_qk(n, 64, std, seed=0)
        want = ks.analysis.attention_matrix(q, k, name)
        for dtype in (torch.float16, torch.bfloat16):
            got = ks.analysis.attention_matrix(q.to(dtype), k.to(dtype), name)
            assert got.dtype == dtype
            torch.testing.assert_close(got.float().sum(-1), want.sum(-1), rtol=0.02, atol=0.02)
    big_q, big_k = (30 + 10 * torch.rand(1, 1, n, 64) for n in (4, 6))  # φq·φk > 65504
    want = ks.analysis.attention_matrix(big_q, big_k, "elu")
    got = ks.analysis.attention_matrix(big_q.half(), big_k.half(), "elu")
    torch.testing.assert_close(got.float(), want, rtol=0.01, atol=1e-3)
    q, k = ks.analysis.gaussian_qk(1024, 64, 1.0, seed=0, dtype=torch.float16)
    fm = ks.analysis.matched_feature_map("softplus_ffn", 64, 64, seed=0)
    loss = ks.analysis.distillation_loss(fm, q, k)
    torch.testing.assert_close(loss, ks.analysis.distillation_loss(fm, q.float(), k.float()),
                               rtol=0.01, atol=0)  # fmt: skip


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matrix_agrees_with_the_core(causal):
    q, k = ks.analysis.gaussian_qk(13, 8, batch=2, heads=3, seed=1)
    v = torch.randn(2, 3, 13, 4)
    mask = torch.ones(2, 13, dtype=torch.bool)
    mask[0, 9:] = False
    soft = ks.analysis.attention_matrix(q, k, causal=causal, key_padding_mask=mask)
    ref = ks.softmax_attention(q, k, v, causal=causal, key_padding_mask=mask)
    assert rel_err(soft @ v, ref) < 1e-5
    kern = ks.analysis.attention_matrix(q, k, "elu", causal=causal, key_padding_mask=mask)
    ref = ks.kernel_attention(q, k, v, "elu", causal=causal, key_padding_mask=mask)
    assert rel_err(kern @ v, ref) < 1e-5
    uni = ks.analysis.attention_matrix(q, k, "uniform", causal=causal, key_padding_mask=mask)
    assert torch.allclose(uni.sum(-1), torch.ones(()))
    assert (uni[0, :, :, 9:] == 0).all()


def test_rank_of_known_matrices():
    gen = torch.Generator().manual_seed(0)
    low = torch.randn(50, 5, generator=gen, dtype=torch.float64)
    low = low @ torch.randn(5, 50, generator=gen, dtype=torch.float64)
    r = ks.analysis.attention_rank(low)
    assert r["numerical_rank"] == 5 and r["n"] == 50
    assert len(r["singular_values"]) == 50 and r["tol"] > 0
    eye = ks.analysis.attention_rank(torch.eye(20))
    assert eye["numerical_rank"] == 20
    assert eye["effective_rank"] == pytest.approx(20.0)
    assert eye["stable_rank"] == pytest.approx(20.0)
    one = ks.analysis.attention_rank(np.outer(np.arange(1.0, 9.0), np.ones(8)))
    assert one["numerical_rank"] == 1
    assert one["effective_rank"] == pytest.approx(1.0)
    assert one["stable_rank"] == pytest.approx(1.0)
    assert ks.analysis.attention_rank(torch.eye(4), tol=2.0)["numerical_rank"] == 0
    zero = ks.analysis.attention_rank(torch.zeros(3, 5))  # as documented: all three 0
    assert (zero["numerical_rank"], zero["effective_rank"], zero["stable_rank"]) == (0, 0.0, 0.0)


@pytest.mark.parametrize("scale", [1e-305, 1e-200, 1e-160, 1e160, 1e200, 1e308])
def test_effective_and_stable_ranks_do_not_depend_on_the_matrix_scale(scale):
    """Both are scale-free: ‖A‖_F²/‖A‖_2² overflowed past 1e154 and divided by 0 below 1e-162;
    a finite A near float64's top had σ_max = inf (numerical rank 0, stable rank NaN)."""
    a = np.random.default_rng(0).normal(size=(3, 3))
    a /= np.abs(a).max()  # entries up to 1e308 at the largest scale, σ_max past float64's top
    s = np.linalg.svd(a, compute_uv=False)
    p = s / s.sum()
    base = ks.analysis.attention_rank(a)
    assert base["stable_rank"] == pytest.approx(((s / s[0]) ** 2).sum(), rel=1e-12)
    assert base["effective_rank"] == pytest.approx(np.exp(-(p * np.log(p)).sum()), rel=1e-12)
    r = ks.analysis.attention_rank(scale * a)
    assert r["stable_rank"] == pytest.approx(base["stable_rank"], rel=1e-12)
    assert r["effective_rank"] == pytest.approx(base["effective_rank"], rel=1e-12)
    assert r["numerical_rank"] == 3
    assert r["tol"] == pytest.approx(scale * base["tol"], rel=1e-12)
    assert ks.analysis.attention_rank(scale * a, tol=scale * 1e-3)["numerical_rank"] == 3


def test_rank_of_a_cross_attention_matrix():
    """N queries by S keys: min(N, S) singular values, tolerance from max(N, S)."""
    gen = torch.Generator().manual_seed(1)
    A = torch.randn(30, 4, generator=gen, dtype=torch.float64)
    A = torch.softmax(A @ torch.randn(4, 50, generator=gen, dtype=torch.float64), dim=-1)
    r = ks.analysis.attention_rank(A)
    assert (r["n"], r["s"], len(r["singular_values"])) == (30, 50, 30)
    sv = np.linalg.svd(A.numpy(), compute_uv=False)
    assert r["tol"] == pytest.approx(sv[0] * 50 * np.finfo(np.float64).eps)
    assert r["numerical_rank"] == np.linalg.matrix_rank(A.numpy())
    assert ks.analysis.attention_rank(A.T)["numerical_rank"] == r["numerical_rank"]


def test_normalized_spectrum():
    sv = ks.analysis.attention_rank(torch.diag(torch.tensor([4.0, 2.0, 1.0 / 3, 0.0])))
    ratio = ks.analysis.normalized_spectrum(sv["singular_values"])
    assert ratio.tolist() == [1.0, 0.5, 0.0833333, 0.0]  # 6 significant digits
    exact = ks.analysis.normalized_spectrum(torch.tensor([3.0, 1.0]), digits=None)
    assert exact.tolist() == [1.0, 1.0 / 3]
    for bad in ([], [1.0, 2.0], [0.0, 0.0], [1.0, -1.0], [[1.0]]):
        with pytest.raises(ValueError, match="singular_values"):
            ks.analysis.normalized_spectrum(np.array(bad))
    with pytest.raises(ValueError, match="digits"):
        ks.analysis.normalized_spectrum([1.0], digits=0)


@pytest.mark.parametrize("head_dim", [4, 8, 16])
def test_kernel_attention_rank_is_at_most_feature_dim(head_dim):
    q, k = ks.analysis.gaussian_qk(96, head_dim, std=1.0, seed=2)
    fm = ks.create_feature_map("elu", head_dim=head_dim)
    kern = ks.analysis.attention_matrix(q, k, fm)[0, 0]
    assert ks.analysis.attention_rank(kern)["numerical_rank"] <= fm.feature_dim
    soft = ks.analysis.attention_matrix(q, k)[0, 0]
    assert ks.analysis.attention_rank(soft)["numerical_rank"] > fm.feature_dim


@pytest.mark.parametrize("name", ["favor", "trig_rf", "hedgehog", "softplus_ffn"])
def test_registered_maps_attention_rank_is_at_most_feature_dim(name):
    fm = ks.analysis.matched_feature_map(name, 8, 8, seed=0)
    q, k = ks.analysis.gaussian_qk(64, 8, std=1.0, seed=4)
    A = ks.analysis.attention_matrix(q.double(), k.double(), fm)[0, 0]
    assert ks.analysis.attention_rank(A)["numerical_rank"] <= fm.feature_dim < 64


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"2-D \(N, S\) matrix"):
        ks.analysis.attention_rank(torch.ones(2, 3, 3))
    # torch's own errors named no argument: "can't convert np.ndarray of type numpy.object_"
    with pytest.raises(TypeError, match="A must be a numeric array, got dtype object"):
        ks.analysis.attention_rank(np.array([[1.0, None]], dtype=object))
    with pytest.raises(ValueError, match="A must hold values"):
        ks.analysis.attention_rank(torch.ones(3, 3, device="meta"))
    q, k = ks.analysis.gaussian_qk(8, 4)
    with pytest.raises(ValueError, match="unknown feature map 'no_such_map'"):
        ks.analysis.attention_matrix(q, k, "no_such_map")
    with pytest.raises(ValueError, match="unknown feature map"):
        ks.analysis.approximation_error("no_such_map", q, k)
    with pytest.raises(ValueError, match="max_n"):
        ks.analysis.attention_matrix(q, k, max_n=4)
    big_q, big_k = ks.analysis.gaussian_qk(ks.analysis.MAX_N + 1, 2)
    with pytest.raises(ValueError, match="max_n=4096"):
        ks.analysis.attention_matrix(big_q, big_k)
    with pytest.raises(ValueError, match="q"):
        ks.analysis.attention_matrix(q, k[..., :3])
    with pytest.raises(ValueError, match="feature_dim"):
        ks.analysis.matched_feature_map("elu", 8, 0)
    with pytest.raises(ValueError, match="feature_dim must be an int >= 1, got True"):
        ks.analysis.matched_feature_map("elu", 8, True)
    with pytest.raises(ValueError, match="not a random-feature map"):
        ks.analysis.random_feature_map("elu", 8, 16)
    for bad in ("no", "False", 1.0):  # read as True before
        with pytest.raises(TypeError, match="causal must be a bool"):
            ks.analysis.attention_matrix(q, k, "elu", causal=bad)
        with pytest.raises(TypeError, match="causal must be a bool"):
            ks.analysis.approximation_error("elu", q, k, causal=bad)


def test_analysis_in_another_dtype_keeps_a_redrawing_maps_draws():
    """A float32 map that redraws in training, analysed on float64 inputs, runs on cast
    copies: its redraw used to land on the copies, so the seed advanced but the weights did
    not, and config() no longer named the features the map held. Both dtypes now follow
    the same draws."""
    maps = {}
    for dtype in (torch.float32, torch.float64):
        fm = ks.create_feature_map("favor", head_dim=8, num_features=16, seed=0, redraw_every=1)
        q, k = ks.analysis.gaussian_qk(6, 8, dtype=dtype)
        for _ in range(3):
            att = ks.analysis.attention_matrix(q, k, fm)
            twin = ks.create_feature_map(fm.config())
            assert torch.equal(twin.weight, fm.weight) and fm.weight.dtype == torch.float32
            want = ks.analysis.attention_matrix(q, k, twin.to(dtype).eval())
            assert torch.allclose(att, want, rtol=1e-5, atol=1e-7)  # the draw the map holds
        maps[dtype] = fm
    assert torch.equal(maps[torch.float32].weight, maps[torch.float64].weight)
    assert maps[torch.float64].training  # the mode is restored


def test_capture_qk_returns_each_layers_projections():
    enc = ks.nn.TransformerEncoder(2, 16, 4, 32, feature_map="elu", dropout=0.0).eval()
    x = torch.randn(3, 10, 16)
    captured = ks.analysis.capture_qk(enc, x)
    assert list(captured) == ["layers.0.attn", "layers.1.attn"]
    for q, k in captured.values():
        assert q.shape == k.shape == (3, 4, 10, 4)
    layer = enc.layers[0]
    qkv = layer.attn.qkv(layer.norm1(x)).view(3, 10, 3, 4, 4)
    assert torch.allclose(captured["layers.0.attn"][0], qkv[:, :, 0].transpose(1, 2), atol=1e-6)
    assert torch.allclose(captured["layers.0.attn"][1], qkv[:, :, 1].transpose(1, 2), atol=1e-6)
    assert not any(m._forward_pre_hooks for m in enc.modules())
    lm = ks.nn.CausalLM(12, d_model=16, n_heads=2, n_layers=1)
    task = CopyTask("val", seq_len=10, num_samples=3)
    batch = task.collate([task[i] for i in range(3)])  # has targets/loss_mask too
    ((q, k),) = ks.analysis.capture_qk(lm, batch).values()
    assert q.shape == (3, 2, 10, 8)
    with pytest.raises(ValueError, match="no kernelstudy.nn.KernelAttention"):
        ks.analysis.capture_qk(torch.nn.Linear(3, 3), torch.randn(1, 3))
    with pytest.raises(ValueError, match=r"A must be non-empty, got shape \(4, 0\)"):
        ks.analysis.attention_rank(torch.zeros(4, 0))  # said "got dtype torch.float32"


def test_capture_qk_reads_a_compiled_model_through_its_module():
    """Hooks put on the layers of a compiled model that had run in eval mode never ran (the
    graph was reused): capture_qk gave {} without a word, and a dict batch failed on the
    wrapper's (*args, **kwargs) signature. The model inside runs eagerly; a forward that
    runs no layer is an error."""
    lm = ks.nn.CausalLM(12, d_model=16, n_heads=2, n_layers=2).eval()
    compiled = torch.compile(lm, backend="eager")
    task = CopyTask("val", seq_len=10, num_samples=3)
    batch = task.collate([task[i] for i in range(3)])  # targets too
    with torch.no_grad():
        compiled(batch["input_ids"])  # an evaluation: the eval-mode graph exists
    want = ks.analysis.capture_qk(lm, batch)
    got = ks.analysis.capture_qk(compiled, batch)
    assert list(got) == list(want) == ["encoder.layers.0.attn", "encoder.layers.1.attn"]
    assert all(torch.equal(a, b) for n in want for a, b in zip(got[n], want[n], strict=True))

    class Skips(torch.nn.Module):  # holds a layer its forward never calls
        def __init__(self):
            super().__init__()
            self.attn = ks.nn.KernelAttention(8, 2)

        def forward(self, x):
            return x

    with pytest.raises(ValueError, match="no KernelAttention layer of model ran"):
        ks.analysis.capture_qk(Skips(), torch.randn(1, 3, 8))


def test_approximation_error_leaves_a_redrawing_map_as_it_was():
    """A redrawing map in training mode counted each analysis call as a query call: three
    equal calls measured other features at the third, and the map redrew (seed changed)."""
    fm = ks.analysis.random_feature_map("favor", 4, 8, seed=0, redraw_every=2)
    assert fm.training
    q, k = torch.randn(2, 1, 2, 6, 4).unbind(0)
    first = ks.analysis.approximation_error(fm, q, k)
    for _ in range(3):
        pd.testing.assert_frame_equal(ks.analysis.approximation_error(fm, q, k), first)
    assert fm.hparams["seed"] == 0 and fm.calls_since_draw == 0 and fm.training


def test_capture_qk_runs_in_eval_mode_and_changes_nothing():
    """In training mode a redrawing map counted the call and redrew its features, and
    dropout made two captures of one batch differ."""
    favor = {"name": "favor", "num_features": 8, "redraw_every": 1, "seed": 0}
    lm = ks.nn.CausalLM(20, d_model=16, n_heads=2, n_layers=1, dropout=0.1, feature_map=favor)
    lm.train()
    fm = lm.encoder.layers[0].attn.feature_map
    weight = fm.weight.clone()
    ids = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(0))
    first = ks.analysis.capture_qk(lm, ids)
    second = ks.analysis.capture_qk(lm, ids)
    assert lm.training and torch.equal(fm.weight, weight)
    lm.encoder.layers[0].eval()  # a frozen block stays in eval: each module's mode comes back
    ks.analysis.capture_qk(lm, ids)
    assert lm.training and not lm.encoder.layers[0].training and lm.head.training
    for (q1, k1), (q2, k2) in zip(first.values(), second.values(), strict=True):
        assert torch.equal(q1, q2) and torch.equal(k1, k2)


def test_capture_qk_checks_a_layers_input_as_the_layer_does():
    """On a KernelAttention model the hook projected x before the layer checked it: a wrong
    width failed inside nn.Linear ("mat1 and mat2 shapes cannot be multiplied")."""
    layer = ks.nn.KernelAttention(8, 2)
    for bad, error, message in (
        (torch.randn(2, 5, 7), ValueError, r"x must have shape \(batch, seq, 8\)"),
        (torch.randn(2, 5, 8, dtype=torch.float64), TypeError, "x has dtype torch.float64"),
        (torch.randn(5, 8), ValueError, r"x must have shape \(batch, seq, 8\)"),
    ):
        with pytest.raises(error, match=message):
            ks.analysis.capture_qk(layer, bad)
    q, k = ks.analysis.capture_qk(layer, torch.randn(2, 5, 8))[""]
    assert q.shape == k.shape == (2, 2, 5, 4)


def test_rank_of_half_precision_matrices_and_numpy_views():
    """The default tolerance σ_max·max(N,S)·eps is >= σ_max for bfloat16 at N >= 128 (and
    float16 at N >= 1024): every such matrix had numerical rank 0."""
    import numpy as np

    for dtype, n in ((torch.bfloat16, 256), (torch.float16, 1024)):
        assert ks.analysis.attention_rank(torch.eye(n, dtype=dtype))["numerical_rank"] == n
    low = torch.randn(256, 8, dtype=torch.float64) @ torch.randn(8, 256, dtype=torch.float64)
    assert ks.analysis.attention_rank(low.to(torch.bfloat16))["numerical_rank"] < 64
    # entries ~1/S are rounded relative to their size, not to σ_max: an exact rank-16
    # kernel attention matrix keeps rank 16, and a long softmax row block is not rank 0
    gen = torch.Generator().manual_seed(0)
    q, k = torch.rand(512, 16, generator=gen), torch.rand(512, 16, generator=gen)
    kernel = q @ k.T
    kernel = kernel / kernel.sum(-1, keepdim=True)
    assert ks.analysis.attention_rank(kernel.to(torch.bfloat16))["numerical_rank"] == 16
    wide = torch.softmax(torch.randn(16, 16384, generator=gen), -1).to(torch.bfloat16)
    assert ks.analysis.attention_rank(wide)["numerical_rank"] == 16
    reversed_view = np.eye(4)[::-1]  # negative strides: torch.from_numpy refused it
    assert ks.analysis.attention_rank(reversed_view)["numerical_rank"] == 4


def test_matched_map_comes_closest_where_blocks_do_not_divide_f():
    """F = 7 for a map with two blocks per feature gave F = 14."""
    for name, kwargs in (("favor", {"hyperbolic": True}), ("trig_rf", {})):
        fm = ks.analysis.matched_feature_map(name, 16, 7, **kwargs)
        assert abs(fm.feature_dim - 7) <= 1, (name, fm.feature_dim)


def test_matched_map_beyond_its_largest_size_takes_the_largest():
    """FAVOR+ allows R <= 8192: F = 8193 gave R = 4097 (F/2, the first size it took) and
    F = 20000 gave 6667, not the closest F the map allows."""
    for name, f, want in (("favor", 8193, 8192), ("favor", 20000, 8192), ("trig_rf", 20000, 16384)):
        assert ks.analysis.matched_feature_map(name, 4, f).feature_dim == want, (name, f)


@pytest.mark.parametrize("name", ["favor", "trig_rf"])
def test_a_random_feature_map_has_its_stabilizer_off(name):
    """random_feature_map switches a map's stabilizer off (stabilize defaults to True), so
    that φ(q)·φ(k) is the plain kernel estimate; one asked for explicitly stays on."""
    fm = ks.analysis.random_feature_map(name, 8, 16)
    assert fm.config()["stabilize"] is False
    assert ks.analysis.random_feature_map(name, 8, 16, stabilize=True).config()["stabilize"]


def test_causal_approximation_error_scores_rows_as_kernel_attention_does():
    """approximation_error normalized causal rows at the whole sequence's key shift, not at
    each row's prefix as kernel_attention does: its output error (1.0438) was not the
    layer's (1.0375) for FAVOR+ at 8·randn."""
    torch.manual_seed(0)
    fm = ks.create_feature_map("favor", head_dim=8, num_features=16, seed=0).double()
    q, k = (8 * torch.randn(1, 2, 24, 8, dtype=torch.float64) for _ in "qk")
    v = torch.randn(1, 2, 24, 4, dtype=torch.float64)
    table = ks.analysis.approximation_error(fm, q, k, v, causal=True, eps=1e-6, baseline=False)
    got = table.set_index("metric")["value"]["output_rel_error"]
    ours = ks.kernel_attention(q, k, v, fm, causal=True)
    exact = ks.softmax_attention(q, k, v, causal=True)
    want = float((ours - exact).norm() / exact.norm())
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("causal", [False, True])
def test_a_float16_attention_matrix_maps_as_the_core_does(causal):
    """float16 queries and keys were mapped in float16 here and in float32 by
    kernel_attention: Hedgehog at 8·randn differed by up to 0.48."""
    torch.manual_seed(0)
    fm = ks.create_feature_map("hedgehog", head_dim=8, num_heads=2)
    q, k = (8 * torch.randn(1, 2, 16, 8) for _ in "qk")
    v = torch.randn(1, 2, 16, 4)
    half = [t.half() for t in (q, k, v)]
    core = ks.kernel_attention(*half, fm, causal=causal).float()
    matrix = ks.analysis.attention_matrix(half[0], half[1], fm, causal=causal).float()
    assert (matrix @ half[2].float() - core).abs().max() <= 1e-2


@pytest.mark.parametrize("name", ["favor", "trig_rf"])
def test_a_bfloat16_kernel_matrix_keeps_the_maps_float32_weights(name):
    """bfloat16 queries and keys ran a float32 map on copies of its weights cast to
    bfloat16, which kernel_attention never does: FAVOR+'s kernel came out 2.7e-2 from
    float64's where the core's features are 9.6e-3 away. Now the scores are the core's
    φ(q)·φ(k) (summed in float32)."""
    from kernelstudy.analysis.matrices import kernel_scores
    from kernelstudy.nn.functional import query_and_key_features

    fm = ks.create_feature_map(name, head_dim=16, num_features=64, seed=0)
    q, k = ks.analysis.gaussian_qk(64, 16, std=1.5, heads=2, seed=1, dtype=torch.bfloat16)
    phi_q, phi_k = query_and_key_features(fm, q, k)
    core = phi_q.float() @ phi_k.float().transpose(-1, -2)
    got = kernel_scores(q, k, fm)
    assert got.dtype == torch.float32 and fm.weight.dtype == torch.float32
    assert rel_err(got, core) <= 1e-5
    exact = kernel_scores(q.double(), k.double(), fm)
    assert rel_err(got, exact) <= 2 * rel_err(core, exact) + 1e-3


def _sliced_metrics(fm, q, k, v, q_lens, k_lens, causal):
    """approximation_error recomputed in float64 on each batch element's unpadded slice
    (queries ``:q_lens[b]``, keys and values ``:k_lens[b]``), pooled with each metric's own
    weights: entries for the MSEs, rows for the KL, squared norms for the output error."""
    sums: dict[tuple[str, str], list[float]] = {}

    def add(key, num, den):
        acc = sums.setdefault(key, [0.0, 0.0])
        acc[0] += float(num)
        acc[1] += float(den)

    heads, d = q.shape[1], q.shape[-1]
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True)):
        qb, kb, vb = q[b : b + 1, :, :nq], k[b : b + 1, :, :nk], v[b : b + 1, :, :nk]
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            seen = seen.tril()
        logits = qb @ kb.transpose(-1, -2) / math.sqrt(d)
        p = torch.softmax(logits.masked_fill(~seen, -math.inf), -1)
        with torch.no_grad():
            scores = fm(qb, is_query=True) @ fm(kb, is_query=False).transpose(-1, -2)
        scores = scores.masked_fill(~seen, 0.0)
        entries = int(seen.sum()) * heads
        add(("map", "kernel_mse"), ((scores - logits.exp()) ** 2)[seen.expand_as(p)].sum(), entries)
        a_map = scores / scores.sum(-1, keepdim=True)
        a_uni = seen.double() / seen.sum(-1, keepdim=True)
        for method, a in (("map", a_map), ("baseline", a_uni)):
            add((method, "attention_mse"), ((a - p) ** 2).sum(), entries)
            kl = torch.where(seen, p * (p / a).log(), 0.0).sum(-1)
            add((method, "attention_kl"), kl.sum(), kl.numel())
            out = p @ vb
            add((method, "output_rel_error"), ((a @ vb - out) ** 2).sum(), (out**2).sum())
    got = {key: num / den for key, (num, den) in sums.items()}
    for method in ("map", "baseline"):
        got[method, "output_rel_error"] **= 0.5
    return got


def _padded_case(case):
    """(q, k, v, query lengths, key lengths, causal) for a batch of 2 of different lengths."""
    gen = torch.Generator().manual_seed(7)
    n, s, q_lens, k_lens, causal = {
        "self": (10, 10, [7, 4], [7, 4], False),
        "self_causal": (10, 10, [7, 4], [7, 4], True),
        "cross": (9, 12, [9, 5], [8, 12], False),
    }[case]
    q = torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 3, s, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 3, s, 5, generator=gen, dtype=torch.float64)
    return q, k, v, q_lens, k_lens, causal


def _lengths_mask(lengths, size):
    return torch.arange(size)[None, :] < torch.tensor(lengths)[:, None]


def _by_key(frame):
    return {(row.kind, row.metric): row.value for row in frame.itertuples()}


@pytest.mark.parametrize("case", ["self", "self_causal", "cross"])
@pytest.mark.parametrize("name", ["favor", "elu"])
def test_query_padding_mask_averages_over_real_queries_only(name, case):
    """Every metric averaged over the rows of padded queries too: with query_padding_mask
    each is the float64 metric of the unpadded slices, pooled with the metric's weights
    (entries, rows, squared norms), and padded positions may hold anything."""
    q, k, v, q_lens, k_lens, causal = _padded_case(case)
    config = {"name": name, "head_dim": 8}
    if name == "favor":
        config.update(num_features=16, stabilize=False, seed=0)
    fm = ks.create_feature_map(config).double()
    qmask, kmask = _lengths_mask(q_lens, q.shape[2]), _lengths_mask(k_lens, k.shape[2])

    def measure(q, k, v, **kw):
        return ks.analysis.approximation_error(
            fm, q, k, v, causal=causal, key_padding_mask=kmask, **kw
        )

    frame = measure(q, k, v, query_padding_mask=qmask)
    got, want = _by_key(frame), _sliced_metrics(fm, q, k, v, q_lens, k_lens, causal)
    if name == "elu":
        del want["map", "kernel_mse"]  # elu estimates no kernel
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-10, abs=0), key
    # garbage (huge, NaN, inf) in padded queries, keys and values changes nothing
    dirty = [t.clone() for t in (q, k, v)]
    for t, mask in zip(dirty, (qmask, kmask, kmask), strict=True):
        t.masked_fill_(~mask[:, None, :, None], 1e30)
    dirty[0][1, 0, -1, 0], dirty[1][0, 2, -1, 3], dirty[2][0, 1, -1, 1] = (
        math.nan,
        -math.inf,
        math.nan,
    )
    pd.testing.assert_frame_equal(measure(*dirty, query_padding_mask=qmask), frame)
    # without a query mask every row counts, padded queries included (the default, unchanged)
    everyone = _by_key(measure(q, k, v))
    all_rows = _sliced_metrics(fm, q, k, v, [q.shape[2]] * 2, k_lens, causal)
    for key, value in everyone.items():
        assert value == pytest.approx(all_rows[key], rel=1e-10, abs=0), key
        assert value != pytest.approx(got[key], rel=1e-6), key  # the mask matters


def test_query_padding_mask_a_batch_element_without_real_queries_counts_for_nothing():
    q, k = ks.analysis.gaussian_qk(6, 4, batch=2, seed=2, dtype=torch.float64)
    v = torch.randn(2, 1, 6, 3, dtype=torch.float64)
    qmask = torch.tensor([[True] * 6, [False] * 6])
    both = ks.analysis.approximation_error("elu", q, k, v, query_padding_mask=qmask)
    first = ks.analysis.approximation_error("elu", q[:1], k[:1], v[:1])
    assert np.isfinite(both.value).all()
    np.testing.assert_allclose(both.value, first.value, rtol=1e-12, atol=0)


def test_query_padding_mask_bad_input_and_nothing_to_measure():
    q, k = ks.analysis.gaussian_qk(6, 4, batch=2, seed=1)
    v = torch.randn(2, 1, 6, 3)
    ok = torch.ones(2, 6, dtype=torch.bool)
    first3 = _lengths_mask([3, 3], 6)
    nan_q = q.clone()
    nan_q[0, 0, 1, 2] = math.nan  # a real query
    v_late = torch.zeros_like(v)
    v_late[:, :, 4:] = 1.0  # only queries 4 and 5 (padded) see these values causally
    cases = [
        ({"query_padding_mask": ok.tolist()}, TypeError,
         "query_padding_mask must be a bool torch.Tensor, got list"),
        ({"query_padding_mask": ok.float()}, TypeError,
         "query_padding_mask must have dtype torch.bool, got torch.float32"),
        ({"query_padding_mask": ok[:1]}, ValueError,
         r"query_padding_mask must have shape \(batch, seq\) = \(2, 6\), got \(1, 6\)"),
        ({"q": q[:, :, :4], "query_padding_mask": ok}, ValueError,
         r"query_padding_mask must have shape \(batch, seq\) = \(2, 4\), got \(2, 6\)"),
        ({"query_padding_mask": ~ok}, ValueError,
         "query_padding_mask marks no query as real: nothing to measure"),
        ({"query_padding_mask": torch.tensor([[False] * 6, [True] * 6]),
          "key_padding_mask": torch.tensor([[True] * 6, [False] * 6])}, ValueError,
         "no real query .query_padding_mask. has a key to attend to"),
        ({"q": nan_q, "query_padding_mask": first3}, ValueError,
         r"q holds NaN or inf \(outside padded queries\)"),
        ({"v": v_late, "causal": True, "query_padding_mask": first3}, ValueError,
         "softmax attention of v is all zero on the real queries: output_rel_error is undefined"),
    ]  # fmt: skip
    for change, error, match in cases:
        args = {"q": q, "k": k, "v": v, **change}
        with pytest.raises(error, match=match):
            ks.analysis.approximation_error("elu", **args)
    # the last two measure without the mask (padded queries do count there)
    ks.analysis.approximation_error("elu", q, k, v_late, causal=True)
    nan_q[0, 0, 1, 2] = 0.0
    nan_q[1, 0, 4, 0] = math.nan  # a padded query: ignored
    ks.analysis.approximation_error("elu", nan_q, k, v, query_padding_mask=first3)


# --- attention_matrix with a query_padding_mask ---


def _matrix_case(case):
    """(q, k, query lengths, key lengths, causal), float64, right-padded."""
    if case == "one":  # a batch of 1, N != S
        gen = torch.Generator().manual_seed(9)
        q = torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(1, 2, 7, 8, generator=gen, dtype=torch.float64)
        return q, k, [3], [6], False
    q, k, _, q_lens, k_lens, causal = _padded_case(case)
    return q, k, q_lens, k_lens, causal


def _matrix_map(name):
    if name in ("softmax", "uniform"):
        return name
    if name == "favor":  # a per-sequence key stabilizer
        return ks.create_feature_map("favor", head_dim=8, num_features=16, seed=0).double()
    return ks.create_feature_map(name, head_dim=8, **({"seed": 0} if name != "elu" else {}))


def _garbage_in(t, real):
    """``t: (B,H,L,D)`` with 1e30 at padded positions (``real: (B,L)`` False), and a NaN,
    a -inf and an inf among them."""
    out = t.masked_fill(~real[:, None, :, None], 1e30)
    for i, (b, pos) in enumerate((~real).nonzero().tolist()[:3]):
        out[b, i % t.shape[1], pos, i] = (math.nan, -math.inf, math.inf)[i]
    return out


@pytest.mark.parametrize("case", ["self", "self_causal", "cross", "one"])
@pytest.mark.parametrize("name", ["softmax", "uniform", "elu", "favor", "softplus_ffn"])
def test_attention_matrix_query_padding_mask_zeroes_padded_rows(name, case):
    """Real rows and keys are each sequence's unpadded matrix (float64, to 1e-12), the
    rows of padded queries and the columns of padded keys are exactly 0, and garbage
    (1e30, NaN, ±inf) there changes nothing, bit for bit."""
    q, k, q_lens, k_lens, causal = _matrix_case(case)
    qmask, kmask = _lengths_mask(q_lens, q.shape[2]), _lengths_mask(k_lens, k.shape[2])
    fm = _matrix_map(name)
    a = ks.analysis.attention_matrix(q, k, fm, causal, kmask, query_padding_mask=qmask)
    assert a.shape == (*q.shape[:3], k.shape[2]) and a.dtype == torch.float64
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True)):
        qb, kb = q[b : b + 1, :, :nq], k[b : b + 1, :, :nk]
        want = ks.analysis.attention_matrix(qb, kb, fm, causal)
        if name == "softmax":  # written out
            logits = qb @ kb.transpose(-1, -2) / math.sqrt(8)
            if causal:
                logits = logits.masked_fill(~torch.ones(nq, nk, dtype=torch.bool).tril(), -math.inf)
            assert (torch.softmax(logits, -1) - want).abs().max() < 1e-15
        assert (a[b : b + 1, :, :nq, :nk] - want).abs().max() < 1e-12
        assert not a[b, :, nq:].any() and not a[b, :, :, nk:].any()
    dirty = ks.analysis.attention_matrix(
        _garbage_in(q, qmask), _garbage_in(k, kmask), fm, causal, kmask, query_padding_mask=qmask
    )
    assert torch.equal(dirty, a)
    # without the query mask the padded queries' rows are kept (the default, unchanged)
    kept = ks.analysis.attention_matrix(q, k, fm, causal, kmask)
    real_rows = qmask[:, None, :, None].expand_as(a)
    assert torch.equal(kept[real_rows], a[real_rows])
    assert kept[~real_rows].abs().sum() > 0
    ones = torch.ones_like(qmask)
    assert torch.equal(
        ks.analysis.attention_matrix(q, k, fm, causal, kmask, query_padding_mask=ones), kept
    )


@pytest.mark.parametrize("name", ["softmax", "softplus_ffn"])
def test_attention_matrix_padding_reaches_no_gradient(name):
    """Gradients in q and k through the masked matrix are those of the slices, 0 at padded
    positions, and finite whatever those hold (the softmax multiplied NaN keys by 0)."""
    q, k, q_lens, k_lens, _ = _matrix_case("cross")
    qmask, kmask = _lengths_mask(q_lens, q.shape[2]), _lengths_mask(k_lens, k.shape[2])
    fm = _matrix_map(name)
    weights = torch.randn(*q.shape[:3], k.shape[2], dtype=torch.float64)
    q_in, k_in = _garbage_in(q, qmask).requires_grad_(), _garbage_in(k, kmask).requires_grad_()
    a = ks.analysis.attention_matrix(q_in, k_in, fm, False, kmask, query_padding_mask=qmask)
    gq, gk = torch.autograd.grad((a * weights).sum(), (q_in, k_in))
    assert torch.isfinite(gq).all() and torch.isfinite(gk).all()
    assert not gq[~qmask[:, None, :, None].expand_as(gq)].any()
    assert not gk[~kmask[:, None, :, None].expand_as(gk)].any()
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True)):
        qb = q[b : b + 1, :, :nq].clone().requires_grad_()
        kb = k[b : b + 1, :, :nk].clone().requires_grad_()
        ab = ks.analysis.attention_matrix(qb, kb, fm)
        wq, wk = torch.autograd.grad((ab * weights[b : b + 1, :, :nq, :nk]).sum(), (qb, kb))
        assert rel_err(gq[b : b + 1, :, :nq], wq) < 1e-12
        assert rel_err(gk[b : b + 1, :, :nk], wk) < 1e-12


def test_attention_matrix_query_padding_mask_bad_input():
    q, k = ks.analysis.gaussian_qk(6, 4, batch=2, seed=1)
    ok = torch.ones(2, 6, dtype=torch.bool)
    cases = [
        (ok.tolist(), TypeError, "query_padding_mask must be a bool torch.Tensor, got list"),
        (ok.float(), TypeError,
         "query_padding_mask must have dtype torch.bool, got torch.float32"),
        (ok[:1], ValueError,
         r"query_padding_mask must have shape \(batch, seq\) = \(2, 6\), got \(1, 6\)"),
        (ok[:, :5], ValueError,
         r"query_padding_mask must have shape \(batch, seq\) = \(2, 6\), got \(2, 5\)"),
    ]  # fmt: skip
    for mask, error, match in cases:
        for fm in ("softmax", "uniform", "elu"):
            with pytest.raises(error, match=match):
                ks.analysis.attention_matrix(q, k, fm, query_padding_mask=mask)
    # all padded: every row zero
    zero = ks.analysis.attention_matrix(q, k, "elu", query_padding_mask=~ok)
    assert zero.shape == (2, 1, 6, 6) and not zero.any()


@pytest.mark.parametrize("std", [0.5, 3.0])
def test_gaussian_qk_entries_have_the_given_std(std):
    q, k = ks.analysis.gaussian_qk(256, 16, std=std, batch=2, heads=2, seed=0)
    both = torch.cat([q, k]).double()
    assert both.std().item() == pytest.approx(std, rel=0.03)
    assert both.mean().abs().item() < 0.03 * std


def test_default_rank_tolerance_uses_the_larger_side_of_a_rectangular_matrix():
    """tol = σ_max · max(N, S) · eps, as numpy.linalg.matrix_rank (the docstring's)."""
    torch.manual_seed(0)
    a = torch.rand(5, 40)
    r = ks.analysis.attention_rank(a)
    smax = float(r["singular_values"][0])
    assert r["tol"] == pytest.approx(smax * 40 * torch.finfo(torch.float32).eps, rel=1e-12)
    assert ks.analysis.attention_rank(a.T)["tol"] == pytest.approx(r["tol"], rel=1e-12)
    # a singular value between the min- and the max-based tolerance is not counted
    u, _ = torch.linalg.qr(torch.randn(5, 5, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(40, 5, dtype=torch.float64))
    sv = torch.tensor([1.0, 1.0, 1.0, 1.0, 20 * np.finfo(np.float64).eps], dtype=torch.float64)
    m = (u * sv) @ v.T
    assert ks.analysis.attention_rank(m)["numerical_rank"] == 4


def test_calls_too_large_for_their_matrices_fail_before_making_masks(monkeypatch):
    """approximation_error, distillation_loss and fit_to_softmax built N×S masks (and float64
    copies) before attention_matrix refused N > max_n: 767 MiB at N = 20000, and under a
    memory limit the allocator's error in place of the message. kernel_attention ran the map
    before the core checked backend and eps."""
    from kernelstudy.analysis import approximation, fitting

    def no_masks(*args, **kwargs):
        raise AssertionError("an N×S mask was made before the size check")

    monkeypatch.setattr(approximation, "allowed_keys", no_masks)
    monkeypatch.setattr(fitting, "allowed_keys", no_masks)
    q, k = ks.analysis.gaussian_qk(64, 4)
    mask = torch.ones(1, 64, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"approximation_error materializes .*max_n=32 \(pass"):
        ks.analysis.approximation_error("elu", q, k, causal=True, max_n=32)
    monkeypatch.setattr(ks.analysis.matrices, "MAX_N", 32)
    monkeypatch.setattr(fitting, "MAX_N", 32)
    fm = ks.create_feature_map("elu", head_dim=4)
    with pytest.raises(ValueError, match=r"distillation_loss .*max_n=32 \(it caps them at 32"):
        ks.analysis.distillation_loss(fm, q, k, key_padding_mask=mask)
    with pytest.raises(ValueError, match=r"fit_to_softmax materializes N×S .*N=64"):
        trainable = ks.create_feature_map("softplus_ffn", head_dim=4)
        ks.analysis.fit_to_softmax(trainable, q, k, steps=1, key_padding_mask=mask)

    class Refuses(type(fm)):
        def forward(self, x):
            raise AssertionError("the map ran before the core's checks")

    v = torch.randn(1, 1, 64, 3)
    for kwargs, match in (
        ({"backend": "tourch"}, "backend must be one of"),
        ({"eps": -1.0}, "eps"),
    ):
        with pytest.raises(ValueError, match=match):
            ks.nn.kernel_attention(q, k, v, Refuses(head_dim=4), **kwargs)
    monkeypatch.setenv("KERNELSTUDY_BACKEND", "tourch")
    with pytest.raises(ValueError, match="KERNELSTUDY_BACKEND must be one of"):
        ks.nn.kernel_attention(q, k, v, Refuses(head_dim=4))
