"""fit_to_softmax, benchmark_attention, generation and plots."""

from __future__ import annotations

import gc
import math
import os
import subprocess
import sys
import warnings

import matplotlib
import numpy as np
import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

import kernelstudy as ks
from kernelstudy.feature_maps import FeatureMap

matplotlib.use("Agg")


class ExpLinearMap(FeatureMap):
    """A tiny learnable positive map φ(x) = exp(xW − ‖x‖²/2 scale) with W trainable."""

    trainable = True

    def __init__(self, head_dim: int, num_features: int = 16) -> None:
        super().__init__(head_dim)
        gen = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter(torch.randn(head_dim, num_features, generator=gen))
        self.num_features = num_features

    @property
    def feature_dim(self) -> int:
        return self.num_features

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        x = x / self.head_dim**0.25
        w = self.weight.to(x.dtype)
        return torch.exp(x @ w - (x * x).sum(-1, keepdim=True) / 2) / math.sqrt(self.num_features)

    def regularization(self) -> torch.Tensor:
        return 1e-4 * self.weight.square().mean()


def _learned_maps(head_dim: int) -> list[FeatureMap]:
    maps: list[FeatureMap] = [ExpLinearMap(head_dim)]
    for name in ("softplus_ffn", "hedgehog"):
        maps.append(ks.analysis.matched_feature_map(name, head_dim, 16, seed=0))
    return maps


@pytest.mark.parametrize("index", [0, 1, 2])
def test_fit_to_softmax_lowers_held_out_loss(index):
    fm = _learned_maps(8)[index]
    q, k = ks.analysis.gaussian_qk(48, 8, std=1.0, batch=2, seed=11)
    q_val, k_val = ks.analysis.gaussian_qk(48, 8, std=1.0, batch=2, seed=12)
    before = ks.analysis.distillation_loss(fm, q_val, k_val).item()
    history = ks.analysis.fit_to_softmax(fm, q, k, steps=60, lr=3e-2, q_val=q_val, k_val=k_val)
    after = ks.analysis.distillation_loss(fm, q_val, k_val).item()
    assert after < before - 1e-3
    assert set(history.metric) == {"train_loss", "regularization", "val_loss"}
    val = history[history.metric == "val_loss"].sort_values("step")
    assert val.value.iloc[0] == pytest.approx(before, rel=1e-5)
    assert val.value.iloc[-1] == pytest.approx(after, rel=1e-5)


def test_fit_to_softmax_keeps_out_of_the_callers_graph():
    """q and k made by the caller's projection were not detached: every step's backward ran
    into the caller's graph (the second step failed, 'backward through the graph a second
    time') and wrote the caller's .grad. A causal validation pair of two lengths is named."""
    proj = torch.nn.Linear(4, 4)
    x = torch.randn(1, 1, 6, 4)
    q, k = proj(x), proj(x.flip(2))
    fm = ks.create_feature_map("softplus_ffn", head_dim=4, seed=0)
    history = ks.analysis.fit_to_softmax(fm, q, k, steps=3, q_val=q, k_val=k)
    assert len(history[history.metric == "train_loss"]) == 3
    assert proj.weight.grad is None and q.requires_grad
    with pytest.raises(ValueError, match="causal attention needs q_val and k_val of one length"):
        ks.analysis.fit_to_softmax(fm, q, k, steps=1, causal=True, q_val=q, k_val=k[:, :, :5])


def test_fit_history_steps_name_one_map_each():
    """train_loss at step s was the loss of the map before update s, val_loss at step s
    that of the map after it: with the training data as validation data the two columns
    disagreed by one step. Step s is now the map after s updates, in both."""
    q, k = ks.analysis.gaussian_qk(16, 4, seed=0)
    fm = ks.create_feature_map("softplus_ffn", head_dim=4, seed=0)
    history = ks.analysis.fit_to_softmax(
        fm, q, k, steps=4, lr=0.1, reg_weight=0.0, q_val=q, k_val=k, eval_every=1
    )
    values = history.pivot(index="step", columns="metric", values="value")
    assert list(values.index) == [0, 1, 2, 3, 4] and np.isnan(values.loc[4, "train_loss"])
    pd.testing.assert_series_equal(
        values.loc[:3, "train_loss"], values.loc[:3, "val_loss"], rtol=1e-6, check_names=False
    )
    assert values.loc[4, "val_loss"] == pytest.approx(
        ks.analysis.distillation_loss(fm, q, k).item(), rel=1e-6
    )


def test_fit_records_the_val_loss_of_the_last_step_off_the_eval_grid():
    """val_loss is recorded every eval_every steps and at the end: steps=5 with eval_every=2
    gives steps 0, 2, 4 and 5 (the last: the map that is returned)."""
    q, k = ks.analysis.gaussian_qk(16, 4, seed=0)
    fm = ks.create_feature_map("softplus_ffn", head_dim=4, seed=0)
    history = ks.analysis.fit_to_softmax(fm, q, k, steps=5, lr=0.1, q_val=q, k_val=k, eval_every=2)
    val = history[history.metric == "val_loss"]
    assert val.step.tolist() == [0, 2, 4, 5]
    assert val.value.iloc[-1] == pytest.approx(
        ks.analysis.distillation_loss(fm, q, k).item(), rel=1e-6
    )


def test_fit_to_softmax_rejects_fixed_maps_and_bad_args():
    q, k = ks.analysis.gaussian_qk(8, 4)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ks.analysis.fit_to_softmax(ks.create_feature_map("elu", head_dim=4), q, k)
    with pytest.raises(ValueError, match="steps"):
        ks.analysis.fit_to_softmax(ExpLinearMap(4), q, k, steps=-1)
    with pytest.raises(ValueError, match="q_val and k_val"):
        ks.analysis.fit_to_softmax(ExpLinearMap(4), q, k, q_val=q)
    fm = ExpLinearMap(4)
    before = fm.weight.detach().clone()
    for kwargs, error, match in (
        ({"lr": math.inf}, ValueError, "lr must be a finite float > 0"),
        ({"reg_weight": math.nan}, ValueError, "reg_weight must be a finite float >= 0"),
        ({"reg_weight": "a"}, TypeError, "reg_weight must be a float"),
        ({"q": q * math.nan}, ValueError, "q holds NaN or inf"),
    ):
        with pytest.raises(error, match=match):
            ks.analysis.fit_to_softmax(fm, **{"q": q, "k": k, "steps": 2, **kwargs})
    assert torch.equal(fm.weight, before)  # the caller's map untouched
    with pytest.raises(ValueError, match=r"target must be softmax attention of shape"):
        ks.analysis.distillation_loss(fm, q, k, target=torch.ones(3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fit_to_softmax_trains_a_float32_map_on_inputs_of_either_dtype(dtype):
    """float64 inputs used to evaluate a cast copy of the map: the loss never moved."""
    q, k = ks.analysis.gaussian_qk(16, 4, seed=0, dtype=dtype)
    fm = ks.create_feature_map("softplus_ffn", head_dim=4, seed=0)
    before = [p.detach().clone() for p in fm.parameters()]
    history = ks.analysis.fit_to_softmax(fm, q, k, steps=20, lr=0.1, reg_weight=0.0)
    loss = history[history.metric == "train_loss"].value
    assert loss.iloc[-1] < loss.iloc[0] - 0.05
    assert all(not torch.equal(a, b) for a, b in zip(before, fm.parameters(), strict=True))
    assert all(p.dtype == torch.float32 for p in fm.parameters())


def test_quadratic_skip_sizes_the_reference_matrix_in_float32():
    """The reference's N×N kernel matrix is float32 for bfloat16 inputs, the explicit
    softmax's stays bfloat16: at N=64 (fwd, B=H=1) they take 32.8 and 16.4 kB, so a
    limit of 25 kB skips the reference only (it was sized at 16.4 kB, about 2x low)."""
    frame = ks.analysis.benchmark_attention(
        [64],
        head_dim=8,
        repeats=1,
        dtype=torch.bfloat16,
        methods=["softmax_explicit", "linear"],
        causal=[False],
        passes=["fwd"],
        backends=["reference", "torch"],
        max_quadratic_gb=25e-6,
        matmul=False,
    )
    times = frame[frame.metric == "time_ms"].set_index(["method", "backend"])
    assert times.loc[("linear", "reference"), "note"].startswith("skipped: N×N buffers")
    assert times.loc[("softmax_explicit", ""), "value"] > 0
    assert times.loc[("linear", "torch"), "value"] > 0


def test_benchmark_attention_rows_and_skips():
    frame = ks.analysis.benchmark_attention(
        [16, 64], head_dim=8, repeats=2, max_quadratic_gb=1e-6, memory=True
    )
    assert {"matmul", "softmax_sdpa", "softmax_explicit", "linear"} <= set(frame.method)
    assert frame[frame.metric == "gflops"].value.iloc[0] > 0
    explicit = frame[(frame.method == "softmax_explicit")]
    assert explicit.value.isna().all() and explicit.note.str.startswith("skipped").all()
    sdpa = frame[(frame.method == "softmax_sdpa") & (frame.metric == "time_ms")]
    assert len(sdpa) == 2 * 2 * 2 and (sdpa.value > 0).all()  # causal × pass × N
    causal_backends = set(frame[(frame.method == "linear") & frame.causal].backend)
    assert causal_backends == set(ks.backends())
    mem = frame[frame.metric == "peak_memory_mb"]
    assert (mem.value >= 0).all() and len(mem) > 0
    with pytest.raises(ValueError, match="methods"):
        ks.analysis.benchmark_attention([16], methods=["flash"])
    with pytest.raises(ValueError, match="backends"):
        ks.analysis.benchmark_attention([16], backends=["nope"])
    bad = [
        ({"seq_lens": 16}, TypeError, "seq_lens must be a non-empty list of int"),
        ({"seq_lens": [True]}, ValueError, "seq_lens entries must be an int >= 1"),
        ({"causal": True}, TypeError, "causal must be a non-empty list of bool"),
        ({"causal": [1]}, TypeError, "causal must be a list of bools"),
        ({"batch": 0}, ValueError, "batch must be an int >= 1"),
        ({"value_dim": 0}, ValueError, "value_dim must be an int >= 1"),
        ({"dtype": torch.int32}, TypeError, "dtype must be a floating-point torch.dtype"),
        ({"repeats": 0}, ValueError, "repeats must be an int >= 1"),
        ({"time_limit_s": "a"}, TypeError, "time_limit_s must be a float"),
        ({"time_limit_s": 0.0}, ValueError, "time_limit_s must be a finite float > 0"),
    ]
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            ks.analysis.benchmark_attention(**{"seq_lens": [16], **change})
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        ks.analysis.matmul_rate(size=0)
    with pytest.raises(ValueError, match="size must be an int >= 1, got 0"):
        ks.analysis.matmul_rate("cuda", size=0)  # was replaced by 4096 on CUDA
    with pytest.raises(ValueError, match="repeats must be an int >= 1, got 0"):
        ks.analysis.matmul_rate(repeats=0)


def test_default_backends_are_those_that_take_the_device():
    """On a GPU machine ``cuda`` is available but takes no CPU tensors (and ``cpu`` no CUDA
    ones): the default list used to include it and the benchmark died on it."""
    from kernelstudy.core.backends import Backend, register_backend, unregister_backend

    register_backend(Backend("gpu_only", lambda q, k, v: q, supports=lambda x: x.is_cuda))
    try:
        frame = ks.analysis.benchmark_attention(
            [8], head_dim=4, methods=["linear"], causal=[True], passes=["fwd"],
            repeats=1, memory=False, matmul=False,
        )  # fmt: skip
        assert "gpu_only" in ks.backends() and "gpu_only" not in set(frame.backend)
        with pytest.raises(ValueError, match=r"backends \['gpu_only'\] do not take"):
            ks.analysis.benchmark_attention([8], head_dim=4, backends=["torch", "gpu_only"])
    finally:
        unregister_backend("gpu_only")


def test_non_causal_runs_backends_with_their_own_attention():
    """Non-causal attention ran only torch and reference: a backend's fused attention (the
    cuda backend's non-causal kernels) was never timed. A backend without one is still not
    timed there (it would time the torch path again)."""
    from kernelstudy.core.backends import Backend, register_backend, unregister_backend

    calls = []

    def fused(q, k, v, causal, mask, eps):
        calls.append(causal)
        return ks.linear_attention(q, k, v, causal=causal, key_padding_mask=mask, eps=eps)

    product = ks.core.registered_backends()["torch"].product
    register_backend(Backend("fused_test", product, attention=fused))
    register_backend(Backend("plain_test", product))
    try:
        frame = ks.analysis.benchmark_attention(
            [8], head_dim=4, methods=["linear"], causal=[False], passes=["fwd"], repeats=1,
            memory=False, matmul=False, backends=["torch", "fused_test", "plain_test"],
        )  # fmt: skip
    finally:
        unregister_backend("fused_test")
        unregister_backend("plain_test")
    assert set(frame.backend) == {"torch", "fused_test"} and False in calls


def test_profiler_lines_are_silenced_where_sys_stderr_is_not_fd_2():
    """Under ipykernel ``sys.stderr.fileno()`` is a copy of the terminal's descriptor while
    fd 2 feeds the notebook: the profiler's USDT lines reached the notebook's output."""
    script = """if True:
        import io, os, sys
        copy = os.dup(2)
        class Kernel(io.TextIOBase):  # ipykernel's OutStream: another descriptor
            def fileno(self): return copy
            def write(self, s): return len(s)
        sys.stderr = Kernel()
        import torch
        from kernelstudy.analysis.speed import peak_memory_bytes
        print(peak_memory_bytes(lambda: torch.ones(1000)))
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0 and int(run.stdout) == 4000, run.stderr
    assert "profiler_start" not in run.stderr


def test_peak_memory_ignores_frees_of_blocks_from_before_the_call():
    """Frees of blocks allocated before the call (in an earlier measured call) counted as
    negative: a fwd+bwd that drops the last call's gradients measured their size too low
    (168.75 MiB came out as 120.75), and a collected cycle made a peak negative."""

    class Node:
        pass

    def cycle() -> None:  # garbage that only the cyclic collector frees
        a, b = Node(), Node()
        a.other, b.other, a.t = b, a, torch.zeros(4 * 2**20)  # 16 MiB

    def work() -> None:
        gc.collect()  # as an automatic pass early in the call
        torch.ones(2**20).sum()  # 4 MiB

    leaf = torch.randn(2**20, requires_grad=True)

    def backward() -> None:
        leaf.grad = None  # frees the last call's 4 MiB gradient
        (leaf * 2).sum().backward()

    peak = ks.analysis.peak_memory_bytes
    first = peak(work)
    peak(cycle)
    assert peak(work) == first >= 4 * 2**20
    grads = [peak(backward) for _ in range(3)]
    assert grads[0] == grads[1] == grads[2] >= 4 * 2**20  # the new gradient, every time


def test_peak_memory_counts_temporaries():
    def work() -> None:
        a = torch.ones(1024, 1024)  # 4 MiB
        (a * 2).sum()

    assert ks.analysis.peak_memory_bytes(work) >= 8 * 2**20 - 1024


def tiny_lm(attention: str, feature_map: str = "elu") -> torch.nn.Module:
    return ks.nn.CausalLM(
        11,
        d_model=16,
        n_heads=2,
        n_layers=2,
        dropout=0.0,
        attention=attention,
        feature_map=feature_map if attention == "kernel" else None,
    )


@pytest.mark.parametrize(
    ("attention", "feature_map"),
    [("kernel", "elu"), ("kernel", "favor"), ("kernel", "hedgehog"), ("softmax", None)],
)
def test_recurrent_generation_matches_batch_greedy_decoding(attention, feature_map):
    """FAVOR+ and Hedgehog keep their key stabilizer (a running maximum in RNN mode)."""
    torch.manual_seed(0)
    model = tiny_lm(attention, feature_map).eval()
    prompt = torch.randint(11, (3, 4))
    stepped, state = ks.analysis.generate(model, prompt, 20, mode="step")
    full, none = ks.analysis.generate(model, prompt, 20, mode="full")
    assert none is None and stepped.shape == (3, 24)
    assert torch.equal(stepped, full)
    assert torch.equal(stepped, model.generate(prompt, 20))
    assert ks.analysis.state_bytes(state) > 0


@pytest.mark.parametrize("attention", ["kernel", "softmax"])
@pytest.mark.parametrize("steps", [0, 1, 5])
def test_generation_runs_no_step_past_the_last_token(attention, steps):
    """Both modes run the model P + steps - 1 positions deep, and the returned state,
    fed the last token, continues exactly as a batch forward over all tokens."""
    torch.manual_seed(0)
    model = tiny_lm(attention).eval()
    prompt = torch.randint(11, (2, 3))
    calls = {"step": 0, "steps": 0, "full": 0}
    step, block, forward = model.step, model.steps, model.forward

    def counted(name, fn):
        def call(*args):
            calls[name] += 1
            return fn(*args)

        return call

    model.step, model.steps = counted("step", step), counted("steps", block)
    model.forward = counted("full", forward)
    tokens, state = ks.analysis.generate(model, prompt, steps, mode="step")
    full, _ = ks.analysis.generate(model, prompt, steps, mode="full")
    assert torch.equal(tokens, full)
    # the prompt in one block, a step a new token but the last
    assert calls == {"step": max(steps - 1, 0), "steps": 1, "full": steps}
    model.steps = None  # a model without blocks steps through its prompt
    stepped, _ = ks.analysis.generate(model, prompt, steps, mode="step")
    assert torch.equal(stepped, tokens) and calls["step"] == 3 + 2 * max(steps - 1, 0)
    if steps:  # (with no new token, the state is after the whole prompt)
        with torch.no_grad():
            logits, _ = step(tokens[:, -1], state)
            torch.testing.assert_close(logits, forward(tokens)[:, -1], rtol=1e-5, atol=1e-5)


def test_benchmark_generation_and_speedups():
    torch.manual_seed(0)
    lin, soft = tiny_lm("kernel").eval(), tiny_lm("softmax").eval()
    runs = {"rnn": (lin, "step"), "no_cache": (soft, "full"), "kv_cache": (soft, "step")}
    frame = ks.analysis.benchmark_generation(runs, [8, 16], batch=2, warmup=0)
    tps = frame[frame.metric == "tokens_per_s"]
    assert len(tps) == 6 and (tps.value > 0).all()
    state = frame[frame.metric == "state_mb"].set_index(["label", "length"]).value
    assert state["rnn", 8] == state["rnn", 16] > 0  # constant-size RNN state
    assert state["kv_cache", 16] > state["kv_cache", 8]  # the KV cache grows
    ratio = ks.analysis.speedups(frame, "rnn", "kv_cache")
    assert list(ratio.length) == [8, 16] and (ratio.speedup > 0).all()
    with pytest.raises(ValueError, match="mode"):
        ks.analysis.generate(lin, torch.zeros(1, 1, dtype=torch.long), 2, mode="cached")
    lin.train()
    ks.analysis.benchmark_generation({"rnn": (lin, "step")}, [2], warmup=0)
    assert lin.training  # the caller's mode is restored
    bad = [
        ({"runs": {"rnn": lin}}, TypeError, r"runs\['rnn'\] must be a \(model, mode\) pair"),
        ({"runs": {"rnn": ("lin", "step")}}, TypeError, "model must be a torch.nn.Module"),
        ({"lengths": [True]}, ValueError, "lengths entries must be an int >= 1"),
        ({"lengths": 8}, TypeError, "lengths must be a non-empty list"),
        ({"batch": 0}, ValueError, "batch must be an int >= 1"),
        (
            {"vocab_size": 10**6},
            ValueError,
            r"vocab_size must be <= the vocabulary of runs\['rnn'\]",
        ),
    ]
    for change, error, match in bad:
        with pytest.raises(error, match=match):
            ks.analysis.benchmark_generation(**{"runs": runs, "lengths": [2], **change})
    with pytest.raises(ValueError, match="steps must be an int >= 0"):
        ks.analysis.generate(lin, torch.zeros(1, 1, dtype=torch.long), True)
    with pytest.raises(ValueError, match=r"prompt must lie in \[0, "):  # it named "token"
        ks.analysis.generate(lin, torch.full((1, 2), lin.vocab_size), 2)


def test_analysis_inputs_are_named():
    q, k = ks.analysis.gaussian_qk(4, 2)
    bad = [
        (lambda: ks.analysis.gaussian_qk(4, 2, std=math.inf), ValueError, "std must be a finite"),
        (lambda: ks.analysis.gaussian_qk(4, 2, seed=1.5), ValueError, "seed must be an int"),
        (lambda: ks.analysis.gaussian_qk(4, 2, dtype=torch.int64), TypeError, "dtype must be"),
        (lambda: ks.analysis.attention_rank(torch.eye(3), tol="1e-3"), TypeError, "tol must be"),
        (lambda: ks.analysis.attention_matrix(q, k, max_n="x"), ValueError, "max_n must be"),
        (lambda: ks.analysis.normalized_spectrum([1.0], digits=True), ValueError, "digits"),
        (lambda: ks.analysis.approximation_error("elu", q, k, baseline="no"), TypeError,
         "baseline"),
        (lambda: ks.analysis.matched_feature_map("favor", 8, 16, stabilise=False), ValueError,
         r"via num_features\): unknown hyperparameter\(s\) \['stabilise'\]"),
        (lambda: ks.analysis.matched_feature_map("favor", 8, 16, orthogonal="no"), ValueError,
         "orthogonal must be bool"),
    ]  # fmt: skip
    speed = ks.analysis.benchmark_attention
    for kwargs, error, match in [
        ({"max_quadratic_gb": "4"}, TypeError, "max_quadratic_gb must be a float"),
        ({"max_quadratic_gb": -1.0}, ValueError, "max_quadratic_gb must be a finite float > 0"),
        ({"max_quadratic_gb": math.nan}, ValueError, "max_quadratic_gb"),
        ({"seed": 1.5}, ValueError, "seed must be an int"),
    ]:
        bad.append(
            (lambda kw=kwargs: speed([16], methods=["softmax_explicit"], **kw), error, match)
        )
    run = {"rnn": (tiny_lm("kernel"), "step")}
    for kwargs, error, match in [
        ({"vocab_size": 0}, ValueError, "vocab_size must be an int >= 1"),
        ({"time_limit_s": "1"}, TypeError, "time_limit_s must be a float"),
    ]:
        bad.append(
            (lambda kw=kwargs: ks.analysis.benchmark_generation(run, [2], **kw), error, match)
        )
    assert ks.analysis.gaussian_qk(np.int64(3), np.int64(2))[0].shape == (1, 1, 3, 2)
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()
    fm = ks.create_feature_map("hedgehog", head_dim=2)
    with pytest.raises(ValueError, match="q_val .* and k_val .* must agree"):
        ks.analysis.fit_to_softmax(fm, q, k, steps=1, q_val=q, k_val=k[..., :1])


def test_plots_return_figures():
    q, k = ks.analysis.gaussian_qk(16, 4, seed=0)
    frames = []
    for seed in range(2):
        for f in (4, 8):
            fm = ExpLinearMap(4, f)
            fm.weight.data.normal_(generator=torch.Generator().manual_seed(seed))
            frames.append(ks.analysis.approximation_error(fm, q, k).assign(seed=seed, F=f))
    frame = pd.concat(frames)
    fig = ks.analysis.plots.plot_approximation(frame, metric="attention_mse", x="F")
    assert isinstance(fig, Figure)
    bars = ks.analysis.plots.plot_map_comparison(frame.assign(stage="x"), metric="attention_kl")
    assert isinstance(bars, Figure)
    speed = ks.analysis.benchmark_attention([16, 32], head_dim=4, repeats=1, memory=False)
    fig = ks.analysis.plots.plot_speed(speed)
    assert isinstance(fig, Figure) and fig.axes[0].get_ylabel() == "time (ms)"  # with its unit
    read_back = speed.assign(backend=speed.backend.replace("", np.nan))  # as from a CSV
    relabelled = ks.analysis.plots.plot_speed(read_back)
    labels = [t.get_text() for legend in relabelled.legends for t in legend.get_texts()]
    assert "softmax_sdpa" in labels and not any("nan" in x for x in labels)
    with pytest.raises(ValueError, match="plot_speed: metric 'peak_memory_mb' has no finite"):
        ks.analysis.plots.plot_speed(speed, metric="peak_memory_mb")
    with pytest.raises(ValueError, match="lacks columns"):
        ks.analysis.plots.plot_approximation(frame, x="nope")
    # pd.concat repeats index labels; with the identity map's NaN KL seaborn used to fail
    mixed = pd.concat(
        [ks.analysis.approximation_error(m, q, k).assign(seed=s) for m in ("elu", "identity")
         for s in (1, 2)]
    )  # fmt: skip
    assert isinstance(
        ks.analysis.plots.plot_approximation(mixed, metric="attention_kl", x="seed"), Figure
    )
    spectra = pd.DataFrame(
        [
            {"method": m, "F": f, "seed": s, "i": i + 1, "sigma_ratio": r}
            for m, f in (("favor", 4), ("favor", 8), ("elu", 4))
            for s in range(2)
            for i, r in enumerate(ks.analysis.normalized_spectrum([2.0, 1.0, 1e-20, 0.0]))
        ]
    )
    curves = ks.analysis.plots.plot_spectra(spectra, hue="F", col="method")
    assert isinstance(curves, Figure) and len(curves.axes) == 2
    with pytest.raises(ValueError, match="lacks columns"):
        ks.analysis.plots.plot_spectra(spectra.drop(columns="sigma_ratio"))
    for f in (fig, bars, curves, relabelled):
        ks.analysis.plots.close(f)


def test_plot_history_takes_the_history_of_fit_to_softmax():
    """Its default hue="method" refused fit_to_softmax's history (columns step, metric,
    value), which the analysis package says every plot takes."""
    q, k = ks.analysis.gaussian_qk(16, 8, std=0.5, seed=1)
    fm = ks.create_feature_map("glu", head_dim=8, seed=0)
    history = ks.analysis.fit_to_softmax(fm, q, k, steps=2)
    fig = ks.analysis.plots.plot_history(history)
    assert isinstance(fig, Figure) and len(fig.axes) == history["metric"].nunique()
    with pytest.raises(ValueError, match="lacks columns"):  # one asked for by name
        ks.analysis.plots.plot_history(history, hue="seed")
    ks.analysis.plots.close(fig)


def test_generation_repeats_do_not_hold_the_last_state(monkeypatch):
    """The previous repeat's state (a whole KV cache) stayed alive through the next repeat,
    so the CUDA peak counted two of them."""
    import weakref

    from kernelstudy.analysis import generation

    real, previous, alive = generation.generate, [], []

    def watched(*args, **kwargs):
        alive.append(any(ref() is not None for ref in previous))
        tokens, state = real(*args, **kwargs)
        previous.append(weakref.ref(state))
        return tokens, state

    monkeypatch.setattr(generation, "generate", watched)
    lm = tiny_lm("softmax").eval()
    generation.benchmark_generation({"kv": (lm, "step")}, [4], batch=1, repeats=3, warmup=0)
    assert alive == [False, False, False]


def test_a_bad_generation_run_fails_before_any_model_is_touched():
    """A mistyped mode was found after the model was moved and put in eval mode, which it
    kept; fit_to_softmax likewise left its map in train mode after an error."""
    lm = ks.nn.CausalLM(vocab_size=8, d_model=8, n_heads=2, n_layers=1, attention="elu")
    lm.train()
    with pytest.raises(ValueError, match=r"runs\['a'\]: mode must be one of"):
        ks.analysis.benchmark_generation({"a": (lm, "stepp")}, [2], warmup=0)
    assert lm.training
    fm = ks.create_feature_map("hedgehog", head_dim=4).eval()
    q = torch.randn(1, 1, 5, 4)

    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    import kernelstudy.analysis.fitting as fitting

    real, fitting._distillation_loss = fitting._distillation_loss, broken
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            ks.analysis.fit_to_softmax(fm, q, q, steps=2)
    finally:
        fitting._distillation_loss = real
    assert not fm.training


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_time_call_times_on_the_devices_stream():
    """Events were recorded on the current device's stream, not ``device``'s."""
    device = torch.device("cuda", torch.cuda.device_count() - 1)
    a = torch.randn(512, 512, device=device)
    times = ks.analysis.time_call(lambda: a @ a, device, repeats=3)
    assert len(times) == 3 and all(t > 0 for t in times)


def test_benchmark_and_timing_arguments_are_named():
    """A string list read as its letters ('methods must be among ... got ['l', 'i', ...]'),
    memory="no" and matmul="no" taken as True, torch's own errors for a device name, an
    integer dtype, a string of singular values or a non-callable ('normal_kernel_cpu not
    implemented for Int', "'int' object is not callable"): now each names its argument."""
    speed = ks.analysis.benchmark_attention
    bad = [
        (lambda: speed([8], methods="linear"), TypeError, "methods must be a non-empty list"),
        (lambda: speed([8], passes="fwd"), TypeError, "passes must be a non-empty list"),
        (lambda: speed([8], backends="torch"), TypeError, "backends must be a non-empty list"),
        (lambda: speed([8], methods=["linear"], memory="no"), TypeError, "memory must be"),
        (lambda: speed([8], methods=["linear"], matmul="no"), TypeError, "matmul must be"),
        (lambda: speed([8], device="gpu0"), ValueError, "device must name a device"),
        (lambda: ks.analysis.matmul_rate(dtype=torch.int32), TypeError, "dtype must be"),
        (lambda: ks.analysis.matmul_rate(size=8, repeats=0), ValueError, "repeats must be"),
        (lambda: ks.analysis.time_call(3), TypeError, "fn must be a callable"),
        (lambda: ks.analysis.peak_memory_bytes(None), TypeError, "fn must be a callable"),
        (lambda: ks.analysis.time_call(lambda: None, "bogus"), ValueError, "device must"),
        (lambda: ks.analysis.gaussian_qk(4, 2, device="bogus"), ValueError, "device must"),
        (lambda: ks.analysis.normalized_spectrum("abc"), TypeError, "singular_values must"),
        (lambda: ks.analysis.normalized_spectrum([1.0, None]), TypeError, "singular_values"),
        (lambda: ks.analysis.benchmark_generation({"a": (tiny_lm("kernel"), "step")}, [2],
                                                  device=["cpu"]), TypeError, "device must"),
    ]  # fmt: skip
    for call, error, match in bad:
        with pytest.raises(error, match=match):
            call()


def test_matmul_rate_leaves_the_global_rng_alone():
    """The yardstick drew its matrices from the global RNG: a benchmark run moved every
    later unseeded draw (a model's init after it came out different)."""
    torch.manual_seed(123)
    want = torch.rand(4)
    torch.manual_seed(123)
    assert ks.analysis.matmul_rate(size=16, repeats=1) > 0
    assert torch.equal(torch.rand(4), want)


def test_matmul_rate_counts_two_flops_per_multiply_add(monkeypatch):
    """A size×size matmul is 2·size³ flops (a multiply and an add each): pinned to 1 ms a
    call, size 100 is 2 GFLOP/s (it counted size³: half the rate)."""
    from kernelstudy.analysis import speed

    monkeypatch.setattr(speed, "time_call", lambda fn, device, repeats, warmup=1: [1e-3] * repeats)
    assert ks.analysis.matmul_rate(size=100, repeats=3) == pytest.approx(2.0, rel=1e-12)


def test_benchmark_time_ms_is_the_median_and_time_ms_min_the_minimum(monkeypatch):
    """Timed calls of 3, 1 and 2 ms: time_ms is their median, 2, and time_ms_min their
    minimum, 1 (not the maximum, 3)."""
    from kernelstudy.analysis import speed

    monkeypatch.setattr(
        speed, "time_call", lambda fn, device, repeats, warmup=1: [3e-3, 1e-3, 2e-3]
    )
    frame = ks.analysis.benchmark_attention(
        [16], head_dim=4, methods=["softmax_sdpa"], causal=[False], passes=["fwd"],
        memory=False, matmul=False, repeats=3,
    )  # fmt: skip
    values = frame.set_index("metric").value
    assert values["time_ms"] == pytest.approx(2.0) and values["time_ms_min"] == pytest.approx(1.0)


def test_distillation_loss_takes_a_map_not_a_name():
    """A name built a new, randomly initialized map on every call: the same inputs gave
    2.04 and then 2.11 nats, and no gradient reached anything the caller holds."""
    q, k = ks.analysis.gaussian_qk(8, 4)
    with pytest.raises(TypeError, match="feature_map must be a FeatureMap, got str"):
        ks.analysis.distillation_loss("glu", q, k)
    fm = ks.create_feature_map("glu", head_dim=4, seed=0)
    a, b = (ks.analysis.distillation_loss(fm, q, k) for _ in range(2))
    assert torch.equal(a, b)


def test_speedups_keep_batch_sizes_and_devices_apart():
    """A frame of two batch sizes gave one speed-up per length, of tokens/s averaged over
    both batches (here 2.5 instead of 2 and 3)."""
    rows = [
        {"label": label, "length": 8, "batch": batch, "device": "cpu"}
        | {"metric": "tokens_per_s", "value": float(batch * (2 + batch) if label == "a" else batch)}
        for label in ("a", "b")
        for batch in (1, 2)
    ]
    ratio = ks.analysis.speedups(pd.DataFrame(rows), "a", "b")
    assert list(ratio.columns) == ["length", "batch", "speedup"]
    assert ratio.set_index("batch")["speedup"].to_dict() == {1: 3.0, 2: 4.0}
    one = ks.analysis.speedups(pd.DataFrame(rows[::2]), "a", "b")  # batch 1 only
    assert list(one.columns) == ["length", "speedup"] and one["speedup"].tolist() == [3.0]


def test_benchmark_attention_leaves_the_callers_map_alone():
    """The caller's FeatureMap was timed itself, moved to the device in place, and a map that
    redraws (redraw_every=1) came back with a new projection and seed."""
    fm = ks.create_feature_map("favor", head_dim=8, redraw_every=1)
    before = {k: v.clone() if torch.is_tensor(v) else dict(v) for k, v in fm.state_dict().items()}
    frame = ks.analysis.benchmark_attention(
        [16], head_dim=8, feature_map=fm, methods=["linear"], causal=[False], passes=["fwd"],
        repeats=2, memory=False, matmul=False,
    )  # fmt: skip
    assert (frame["metric"] == "time_ms").any()
    after = fm.state_dict()
    assert torch.equal(after["weight"], before["weight"])
    assert after["_extra_state"] == before["_extra_state"]


# --- padded batches: distillation_loss and fit_to_softmax with key/query padding masks ---


def _padded_learned_map(name: str, dtype: torch.dtype = torch.float64) -> FeatureMap:
    """A learned map of 3 heads (one W per head), its weights moved off their init by a
    seeded perturbation: the same call builds the same map."""
    if name == "softplus_ffn":
        fm = ks.create_feature_map(name, head_dim=8, num_heads=3, shared=False, seed=0)
    else:  # hedgehog: a per-sequence key stabilizer (keys_need_sequence)
        fm = ks.create_feature_map(name, head_dim=8, num_heads=3)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in fm.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return fm.to(dtype)


def _distillation_case(case: str, dtype: torch.dtype = torch.float64):
    """(q, k, query lengths, key lengths, causal): right-padded, different real lengths."""
    n, s, q_lens, k_lens, causal, batch = {
        "self": (10, 10, [7, 4], [7, 4], False, 2),
        "self_causal": (10, 10, [7, 4], [7, 4], True, 2),
        "causal_uneven": (10, 10, [7, 10], [5, 10], True, 2),  # real queries past the keys
        "cross": (9, 12, [9, 5], [8, 12], False, 2),
        "one": (5, 7, [3], [6], False, 1),
    }[case]
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(batch, 3, n, 8, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(batch, 3, s, 8, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, q_lens, k_lens, causal


def _mask_of(lengths, size):
    return torch.arange(size)[None, :] < torch.tensor(lengths)[:, None]


def _sliced_distillation(fm, q, k, q_lens, k_lens, causal, eps=1e-6):
    """The float64 loss of each sequence's unpadded slice (queries ``:q_lens[b]``, keys
    ``:k_lens[b]``), written out from the map's features, pooled: the sum of the row
    cross-entropies of every sequence and head over their number (rows without a key
    left out)."""
    total = torch.zeros((), dtype=torch.float64)
    rows = 0
    for b, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True)):
        qb, kb = q[b : b + 1, :, :nq].double(), k[b : b + 1, :, :nk].double()
        seen = torch.ones(nq, nk, dtype=torch.bool)
        if causal:
            seen = seen.tril()
        logits = qb @ kb.transpose(-1, -2) / math.sqrt(q.shape[-1])
        has_key = seen.any(-1)
        p = torch.softmax(logits.masked_fill(~seen, -math.inf), -1)
        p = torch.where(has_key[:, None], p, 0.0)  # rows without keys: NaN → 0
        scores = fm(qb, is_query=True) @ fm(kb, is_query=False).transpose(-1, -2)
        scores = scores.masked_fill(~seen, 0.0)
        a = scores / (scores.sum(-1, keepdim=True) + eps)
        ce = -torch.where(seen, p * a.clamp_min(1e-30).log(), 0.0).sum(-1)
        total = total + ce.sum()
        rows += int(has_key.sum()) * q.shape[1]
    return total / rows


def _garbage(t: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """``t: (B,H,L,D)`` with its padded positions (``real: (B,L)`` False) set to 1e30, and a
    NaN, a -inf and an inf among them."""
    out = t.masked_fill(~real[:, None, :, None], 1e30)
    where = (~real).nonzero()
    for i, value in zip(range(len(where)), (math.nan, -math.inf, math.inf), strict=False):
        b, pos = where[i].tolist()
        out[b, i % t.shape[1], pos, i % t.shape[-1]] = value
    return out


@pytest.mark.parametrize("case", ["self", "self_causal", "causal_uneven", "cross", "one"])
@pytest.mark.parametrize("name", ["softplus_ffn", "hedgehog"])
def test_masked_distillation_loss_is_the_pooled_loss_of_the_unpadded_slices(name, case):
    """With both masks the loss is the float64 loss of the real rows and keys of each
    sequence pooled over rows (not a mean of per-sequence means), its gradients in the
    map's parameters those of the sliced computation, and garbage (1e30, NaN, ±inf) in
    padded positions changes neither, bit for bit."""
    q, k, q_lens, k_lens, causal = _distillation_case(case)
    qmask, kmask = _mask_of(q_lens, q.shape[2]), _mask_of(k_lens, k.shape[2])
    fm = _padded_learned_map(name)
    params = list(fm.parameters())

    def masked(q, k, **kw):
        loss = ks.analysis.distillation_loss(
            fm, q, k, causal, key_padding_mask=kmask, query_padding_mask=qmask, **kw
        )
        return loss, torch.autograd.grad(loss, params)

    loss, grads = masked(q, k)
    want = _sliced_distillation(fm, q, k, q_lens, k_lens, causal)
    want_grads = torch.autograd.grad(want, params)
    assert loss.dtype == torch.float64
    assert loss.item() == pytest.approx(want.item(), rel=1e-12, abs=0)
    for got, exp in zip(grads, want_grads, strict=True):
        assert _rel(got, exp) < 1e-10
    # a mean of per-sequence means would differ (the lengths differ)
    if len(q_lens) > 1:
        per_seq = torch.stack(
            [_sliced_distillation(fm, q[b : b + 1], k[b : b + 1], [nq], [nk], causal)
             for b, (nq, nk) in enumerate(zip(q_lens, k_lens, strict=True))]
        ).mean()  # fmt: skip
        assert per_seq.item() != pytest.approx(loss.item(), rel=1e-6)
    # garbage in the padded queries and keys
    dirty_loss, dirty_grads = masked(_garbage(q, qmask), _garbage(k, kmask))
    assert torch.equal(dirty_loss, loss)
    for got, exp in zip(dirty_grads, grads, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, exp)
    # the precomputed masked softmax target gives the same loss; its padded rows may hold
    # anything
    target = ks.analysis.attention_matrix(q, k, "softmax", causal, kmask, query_padding_mask=qmask)
    target[~qmask[:, None, :, None].expand_as(target)] = math.nan
    assert torch.equal(masked(q, k, target=target)[0], loss)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


@pytest.mark.parametrize("case", ["self_causal", "cross"])
def test_masked_distillation_loss_in_float32_against_float64_slices(case):
    q, k, q_lens, k_lens, causal = _distillation_case(case, torch.float32)
    qmask, kmask = _mask_of(q_lens, q.shape[2]), _mask_of(k_lens, k.shape[2])
    fm32, fm64 = (
        _padded_learned_map("softplus_ffn", torch.float32),
        _padded_learned_map("softplus_ffn"),
    )
    loss = ks.analysis.distillation_loss(
        fm32, _garbage(q, qmask), _garbage(k, kmask), causal,
        key_padding_mask=kmask, query_padding_mask=qmask,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, [fm32.weight])
    want = _sliced_distillation(fm64, q, k, q_lens, k_lens, causal)
    (want_grad,) = torch.autograd.grad(want, [fm64.weight])
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert torch.isfinite(grad).all() and _rel(grad, want_grad) < 1e-4


def test_distillation_loss_without_masks_is_unchanged():
    """No mask: every B·H·N row counts, computed exactly as before the masks (bit for bit),
    and all-True masks agree up to rounding."""
    for dtype, causal in ((torch.float32, False), (torch.float64, True)):
        q, k, _, _, _ = _distillation_case("self", dtype)
        fm = _padded_learned_map("softplus_ffn", dtype)
        loss = ks.analysis.distillation_loss(fm, q, k, causal)
        p = ks.analysis.attention_matrix(q, k, "softmax", causal)
        a = ks.analysis.attention_matrix(q, k, fm, causal)
        assert torch.equal(loss, -(p * a.clamp_min(1e-30).log()).sum(-1).mean())
        ones = torch.ones(q.shape[0], q.shape[2], dtype=torch.bool)
        full = ks.analysis.distillation_loss(
            fm, q, k, causal, key_padding_mask=ones, query_padding_mask=ones
        )
        assert full.item() == pytest.approx(
            loss.item(), rel=1e-6 if dtype == torch.float32 else 1e-13
        )


def test_masked_distillation_loss_leaves_out_rows_without_keys():
    """A sequence whose keys are all padded has rows with nothing to match: they are left
    out (the loss is the other sequence's); with no such row anywhere it is a ValueError."""
    q, k, _, _, _ = _distillation_case("cross")
    fm = _padded_learned_map("softplus_ffn")
    qmask, kmask = _mask_of([6, 3], q.shape[2]), _mask_of([9, 0], k.shape[2])
    loss = ks.analysis.distillation_loss(
        fm, q, _garbage(k, kmask), key_padding_mask=kmask, query_padding_mask=qmask
    )
    want = _sliced_distillation(fm, q[:1], k[:1], [6], [9], False)
    assert loss.item() == pytest.approx(want.item(), rel=1e-12)
    # a key mask alone keeps every query's row (padded queries attend to the real keys)
    alone = ks.analysis.distillation_loss(fm, q, k, key_padding_mask=_mask_of([9, 12], 12))
    assert alone.item() == pytest.approx(
        _sliced_distillation(fm, q, k, [9, 9], [9, 12], False).item(), rel=1e-12
    )
    for kw in (
        {"key_padding_mask": torch.zeros(2, 12, dtype=torch.bool)},
        {"query_padding_mask": torch.zeros(2, 9, dtype=torch.bool)},
        {"key_padding_mask": kmask, "query_padding_mask": _mask_of([0, 3], 9)},
    ):
        with pytest.raises(ValueError, match=r"no real query \(query_padding_mask\) has a key"):
            ks.analysis.distillation_loss(fm, q, k, **kw)
    # without masks, an empty batch, no heads, queries or keys: NaN (no keys: 0.0) before
    for qq, kk in ((q[:0], k[:0]), (q[:, :0], k[:, :0]), (q[:, :, :0], k), (q, k[:, :, :0])):
        with pytest.raises(ValueError, match="leave no row to average the loss over"):
            ks.analysis.distillation_loss(fm, qq, kk)
        with pytest.raises(ValueError, match="leave no row to average the loss over"):
            ks.analysis.fit_to_softmax(fm, qq, kk, steps=1)


def test_masked_distillation_loss_checks_its_masks_and_target():
    q, k, _, _, _ = _distillation_case("cross")  # N=9, S=12, B=2
    fm = _padded_learned_map("softplus_ffn")
    kmask, qmask = _mask_of([8, 12], 12), _mask_of([9, 5], 9)
    cases = [
        ({"key_padding_mask": kmask.float()}, TypeError,
         "key_padding_mask must have dtype torch.bool, got torch.float32"),
        ({"key_padding_mask": kmask.tolist()}, TypeError,
         "key_padding_mask must be a bool torch.Tensor, got list"),
        ({"key_padding_mask": qmask}, ValueError,
         r"key_padding_mask must have shape \(batch, seq\) = \(2, 12\), got \(2, 9\)"),
        ({"query_padding_mask": kmask}, ValueError,
         r"query_padding_mask must have shape \(batch, seq\) = \(2, 9\), got \(2, 12\)"),
        ({"query_padding_mask": qmask.int()}, TypeError,
         "query_padding_mask must have dtype torch.bool, got torch.int32"),
        # a target computed without the key mask weighs padded keys
        ({"key_padding_mask": kmask, "target": ks.analysis.attention_matrix(q, k)}, ValueError,
         "target weighs keys its queries may not see"),
    ]  # fmt: skip
    for kw, error, match in cases:
        with pytest.raises(error, match=match):
            ks.analysis.distillation_loss(fm, q, k, **kw)
    # causal: a non-causal target is refused too (it weighs later keys)
    qs, ks_ = q[:, :, :9], k[:, :, :9]
    with pytest.raises(ValueError, match=r"target weighs keys .*later keys \(causal\)"):
        ks.analysis.distillation_loss(
            fm, qs, ks_, True, target=ks.analysis.attention_matrix(qs, ks_)
        )
    causal_target = ks.analysis.attention_matrix(qs, ks_, causal=True)
    assert torch.equal(
        ks.analysis.distillation_loss(fm, qs, ks_, True, target=causal_target),
        ks.analysis.distillation_loss(fm, qs, ks_, True),
    )
    # values were checked only where a mask or causal was given: a negative, NaN or scaled
    # target gave a negative, NaN or scaled loss
    target = ks.analysis.attention_matrix(q, k)
    for bad, match in (
        (-target, "finite and non-negative"),
        (target.masked_fill(target > 0.2, float("nan")), "finite and non-negative"),
        (5 * target, r"rows must sum to 1 \(to 0.001\), got 54 row\(s\) .* sum of 5"),
    ):
        with pytest.raises(ValueError, match=match):
            ks.analysis.distillation_loss(fm, q, k, target=bad)
    # rows of padded queries may hold anything
    masked = ks.analysis.attention_matrix(q, k, key_padding_mask=kmask, query_padding_mask=qmask)
    rows = {"key_padding_mask": kmask, "query_padding_mask": qmask}
    want = ks.analysis.distillation_loss(fm, q, k, **rows)
    garbage = masked.masked_fill(~qmask[:, None, :, None], float("nan"))
    assert torch.equal(ks.analysis.distillation_loss(fm, q, k, target=garbage, **rows), want)


def test_fit_to_softmax_with_masks_fits_the_real_rows_only():
    """Training and validation data padded: the history starts at the sliced losses
    (step 0's val_loss and train_loss), garbage in padded positions changes nothing,
    and a batch padded to one real length trains as its unpadded slice."""
    start = _padded_learned_map("softplus_ffn")
    for train, val in (("self_causal", "causal_uneven"), ("cross", "one")):
        q, k, q_lens, k_lens, causal = _distillation_case(train, torch.float32)
        qv, kv, qv_lens, kv_lens, _ = _distillation_case(val, torch.float32)
        qv, kv = qv * 1.5, kv.flip(2)  # not the training data
        masks = {
            "key_padding_mask": _mask_of(k_lens, k.shape[2]),
            "query_padding_mask": _mask_of(q_lens, q.shape[2]),
            "key_padding_mask_val": _mask_of(kv_lens, kv.shape[2]),
            "query_padding_mask_val": _mask_of(qv_lens, qv.shape[2]),
        }

        def fit(q, k, qv, kv, causal=causal, masks=masks):
            fm = _padded_learned_map("softplus_ffn", torch.float32)
            history = ks.analysis.fit_to_softmax(
                fm, q, k, steps=6, lr=3e-2, causal=causal, q_val=qv, k_val=kv, eval_every=2,
                reg_weight=0.0, **masks,
            )  # fmt: skip
            return fm, history

        fm, history = fit(q, k, qv, kv)
        assert np.isfinite(history.value).all()
        values = history.set_index(["step", "metric"])["value"]
        want_train = _sliced_distillation(start, q, k, q_lens, k_lens, causal).item()
        want_val = _sliced_distillation(start, qv, kv, qv_lens, kv_lens, causal).item()
        assert values[0, "train_loss"] == pytest.approx(want_train, rel=1e-5)
        assert values[0, "val_loss"] == pytest.approx(want_val, rel=1e-5)
        assert values[5, "train_loss"] < values[0, "train_loss"]
        # garbage in every padded position: the same history and weights, bit for bit
        dirty = [
            _garbage(t, masks[name])
            for t, name in (
                (q, "query_padding_mask"), (k, "key_padding_mask"),
                (qv, "query_padding_mask_val"), (kv, "key_padding_mask_val"),
            )
        ]  # fmt: skip
        fm_dirty, history_dirty = fit(*dirty)
        pd.testing.assert_frame_equal(history_dirty, history, check_exact=True)
        assert torch.equal(fm_dirty.weight, fm.weight)
    # every sequence 6 real of 10: the masked fit is the fit of the [:6] slice
    q, k, _, _, _ = _distillation_case("self", torch.float32)
    six = _mask_of([6, 6], 10)
    pad = {"key_padding_mask": six, "query_padding_mask": six}
    fm_pad, h_pad = fit(_garbage(q, six), _garbage(k, six), None, None, True, pad)
    fm_cut, h_cut = fit(q[:, :, :6], k[:, :, :6], None, None, True, {})
    np.testing.assert_allclose(h_pad.value, h_cut.value, rtol=1e-5, atol=1e-7)
    assert _rel(fm_pad.weight, fm_cut.weight) < 1e-5


def test_fit_to_softmax_checks_its_masks_before_training():
    q, k = ks.analysis.gaussian_qk(6, 8, batch=2, heads=3, seed=1)
    qv, kv = ks.analysis.gaussian_qk(5, 8, batch=1, heads=3, seed=2)
    fm = _padded_learned_map("softplus_ffn", torch.float32)
    before = fm.weight.detach().clone()
    ok, ok_val = torch.ones(2, 6, dtype=torch.bool), torch.ones(1, 5, dtype=torch.bool)
    nan_q = q.clone()
    nan_q[1, 0, 2, 0] = math.nan  # a real query: refused; padded, it is not
    cases = [
        ({"key_padding_mask_val": ok_val}, ValueError,
         "key_padding_mask_val needs q_val and k_val"),
        ({"q_val": qv, "k_val": kv, "query_padding_mask_val": ok}, ValueError,
         r"query_padding_mask_val must have shape \(batch, seq\) = \(1, 5\), got \(2, 6\)"),
        ({"q_val": qv, "k_val": kv, "key_padding_mask_val": ok_val.float()}, TypeError,
         "key_padding_mask_val must have dtype torch.bool"),
        ({"key_padding_mask": ok[:, :5]}, ValueError,
         r"key_padding_mask must have shape \(batch, seq\) = \(2, 6\), got \(2, 5\)"),
        ({"query_padding_mask": ok.tolist()}, TypeError,
         "query_padding_mask must be a bool torch.Tensor, got list"),
        ({"q": nan_q, "query_padding_mask": _mask_of([6, 3], 6)}, ValueError,
         r"q holds NaN or inf \(outside padded queries\)"),
        ({"q_val": qv, "k_val": kv, "query_padding_mask_val": ~ok_val}, ValueError,
         r"no real query \(query_padding_mask_val\) has a key to attend to"),
        ({"key_padding_mask": ~ok, "query_padding_mask": ok}, ValueError,
         r"no real query \(query_padding_mask\) has a key to attend to \(key_padding_mask\)"),
    ]  # fmt: skip
    for change, error, match in cases:
        args = {"q": q, "k": k, "steps": 2, **change}
        with pytest.raises(error, match=match):
            ks.analysis.fit_to_softmax(fm, **args)
    assert torch.equal(fm.weight, before)  # the caller's map untouched
    history = ks.analysis.fit_to_softmax(
        fm, nan_q, k, steps=2, query_padding_mask=_mask_of([6, 2], 6)
    )
    assert np.isfinite(history.value).all()


def test_wrap_title_puts_facet_parts_on_lines_and_keeps_labels_whole():
    wrap = ks.analysis.plots.wrap_title
    title = "setting = favor(row_norms='sqrt_d') D=8 | std = 0.5"
    assert wrap(title, 60) == "setting = favor(row_norms='sqrt_d') D=8\nstd = 0.5"
    assert wrap(title, 20) == "setting =\nfavor(row_norms='sqrt_d')\nD=8\nstd = 0.5"  # label whole
    assert wrap("no parts", 3) == "no\nparts"
    with pytest.raises(ValueError, match="width must be at least 1"):
        wrap(title, 0)


def test_a_baseline_that_changes_with_x_is_drawn_over_x():
    """``plot_approximation(x="n")`` drew uniform attention's KL as one horizontal line at its
    mean over N (35% above it at N = 8); a baseline that differs by the hue column is refused
    (one dashed line cannot say whose it is); one constant in x stays horizontal."""
    rows = [
        {"method": m, "metric": "attention_kl", "n": n, "std": std, "seed": seed, "value": v}
        for n, uniform in ((8, 0.3), (64, 0.5), (512, 0.6))
        for std in (1.0,)
        for seed in (0, 1)
        for m, v in (("uniform", uniform), ("elu", uniform / 2))
    ]
    frame = pd.DataFrame(rows)
    fig = ks.analysis.plots.plot_approximation(frame, "attention_kl", x="n")
    (dashed,) = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"]
    assert list(dashed.get_xdata()) == [8, 64, 512]
    assert list(dashed.get_ydata()) == pytest.approx([0.3, 0.5, 0.6])
    ks.analysis.plots.close(fig)
    flat = frame.assign(value=frame["value"].where(frame["method"] != "uniform", 0.4))
    fig = ks.analysis.plots.plot_approximation(flat, "attention_kl", x="n")
    (dashed,) = [line for line in fig.axes[0].get_lines() if line.get_linestyle() == "--"]
    assert list(dashed.get_ydata()) == pytest.approx([0.4, 0.4])  # axhline: across the axes
    ks.analysis.plots.close(fig)
    two = pd.concat([flat, flat.assign(std=0.5, value=flat["value"] * 2)], ignore_index=True)
    with pytest.raises(ValueError, match="differs by 'std'.*facet by 'std'"):
        ks.analysis.plots.plot_approximation(two, "attention_kl", x="n", hue="std")
    fig = ks.analysis.plots.plot_approximation(two, "attention_kl", x="n", col="std")
    ks.analysis.plots.close(fig)
    # baselines a last bit apart (as the same values summed in another order give): not refused
    rows = [
        {"method": "uniform", "metric": "attention_kl", "n": 8, "kind": kind, "value": v}
        for kind, values in (("iid", [1.0] * 3), ("orthogonal", [math.nextafter(1.0, 2)] * 3))
        for v in values
    ] + [
        {"method": "favor", "metric": "attention_kl", "n": n, "kind": kind, "value": 0.01 * n}
        for kind in ("iid", "orthogonal")
        for n in (8, 16)
    ]
    same = pd.DataFrame(rows)
    means = same[same["method"] == "uniform"].groupby("kind")["value"].mean()
    assert means.nunique() == 2  # 1 and 1 + 2^-52, in any summation order
    fig = ks.analysis.plots.plot_approximation(same, "attention_kl", x="n", hue="kind")
    ks.analysis.plots.close(fig)


def test_facet_titles_and_reference_lines_stay_clear_of_the_legend():
    """A long facet title of the right column ran into the legend beside the grid (the
    approximation study's performer figures), and the baseline's label, written on the axes,
    lay over the data: titles are wrapped to their axes, the legend is outside the axes and
    names the baseline, and no text is left on the axes."""
    rows = [
        {"setting": s, "std": std, "features": f, "R": r, "seed": seed, "value": v}
        for s in ("favor D=8", "favor(row_norms='sqrt_d', orthogonal=False) D=8")
        for std in (0.5, 1.0)
        for f in ("iid", "orthogonal")
        for r in (8, 16, 32)
        for seed, v in enumerate((1.0 / r, 2.0 / r))
    ]
    frame = pd.DataFrame(rows)
    base = frame[["setting", "std"]].drop_duplicates().assign(value=0.01)
    fig = ks.analysis.plots.line_plot(
        frame, "R", hue="features", col="std", row="setting", hlines=base, hline_label="uniform"
    )
    fig.draw_without_rendering()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["iid", "orthogonal", "uniform"]
    box = legend.get_window_extent(renderer)
    for ax in fig.axes:
        title = ax.title.get_window_extent(renderer)
        assert title.width <= ax.get_window_extent(renderer).width, ax.title.get_text()
        assert not title.overlaps(box), ax.title.get_text()
        assert not ax.get_window_extent(renderer).overlaps(box)
        assert not ax.texts  # no label written over the data
    title = " ".join(fig.axes[-1].get_title().split())  # wrapped at spaces, so whole again
    assert title == "setting = favor(row_norms='sqrt_d', orthogonal=False) D=8 std = 1.0"
    assert fig.axes[-1].get_xlabel() == "R" and fig.axes[0].get_ylabel() == "value"
    ranks = pd.DataFrame(
        [{"method": m, "n": n, "metric": "numerical_rank", "value": min(n, 8)}
         for m in ("elu", "favor") for n in (4, 8, 16)]
    )  # fmt: skip
    rank = ks.analysis.plots.plot_rank(ranks)
    labels = [t.get_text() for t in rank.legends[0].get_texts()]
    assert labels == ["elu", "favor", "rank = N (full rank)"] and len(rank.legends) == 1
    assert rank.axes[0].get_xlabel() == "sequence length N"
    for f in (fig, rank):
        ks.analysis.plots.close(f)


def test_plot_rank_by_f_draws_the_bound_min_f_n():
    """Rank vs F at one N: the bound is min(F, N), not F (an N×N matrix has rank ≤ N; the
    line ran on to (F, F) past F = N, so a map meeting its bound looked below it)."""
    ranks = pd.DataFrame(
        [{"method": "poly", "n": 16, "feature_dim": f, "metric": "numerical_rank",
          "value": min(f, 16)} for f in (4, 8, 64)]
    )  # fmt: skip
    fig = ks.analysis.plots.plot_rank(ranks, x="feature_dim")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == ["poly", "rank = min(F, N) (kernel bound)"]
    (line,) = [ln for ln in fig.axes[0].lines if ln.get_linestyle() == ":"]
    assert list(line.get_xdata()) == [4.0, 16.0, 64.0]
    assert list(line.get_ydata()) == [4.0, 16.0, 16.0]
    several = pd.concat([ranks, ranks.assign(n=32)])  # several N: no single cap, rank = F
    fig2 = ks.analysis.plots.plot_rank(several, x="feature_dim", col="n")
    assert fig2.legends[0].get_texts()[-1].get_text() == "rank = F (kernel bound)"
    for f in (fig, fig2):
        ks.analysis.plots.close(f)


def test_figure_title_widens_a_figure_narrower_than_it_and_keeps_its_text():
    """A figure title wider than its figure ran past both edges (saved with a tight bbox, the
    layout was redone for the wider canvas, leaving a gap before the legend)."""
    frame = pd.DataFrame({"n": [4, 8, 4, 8], "value": [1.0, 2.0, 1.5, 2.5], "m": list("aabb")})
    fig = ks.analysis.plots.line_plot(frame, "n", hue="m")
    width = fig.get_figwidth()
    title = "a title much wider than a single small panel with its legend, " * 2
    text = ks.analysis.plots.figure_title(fig, title)
    assert text.get_text() == title and fig.get_figwidth() > width
    assert text.get_window_extent(fig.canvas.get_renderer()).width <= fig.bbox.width
    width = fig.get_figwidth()
    ks.analysis.plots.figure_title(fig, "short")  # a narrower one leaves the width alone
    assert fig.get_figwidth() == width
    ks.analysis.plots.close(fig)


def test_analysis_helpers_name_bad_arguments():
    """speedups of a non-frame raised AttributeError, of a frame without the metric column
    KeyError; map_label and map_kind of a name AttributeError; a distillation target of a
    complex dtype lost its imaginary part silently; a seed beyond 2**64 failed in torch
    ("Overflow when unpacking long long")."""
    A = ks.analysis
    with pytest.raises(TypeError, match="frame must be a pandas DataFrame"):
        A.speedups("results.csv", "a", "b")
    with pytest.raises(ValueError, match=r"frame has no column\(s\) \['metric', 'value'"):
        A.speedups(pd.DataFrame({"label": ["a"], "length": [1]}), "a", "b")
    with pytest.raises(TypeError, match="feature_map must be a FeatureMap, got str"):
        A.map_label("elu")
    with pytest.raises(TypeError, match="feature_map must be a FeatureMap or a FeatureMap class"):
        A.map_kind("elu")
    assert A.map_kind(ks.create_feature_map("favor", head_dim=4)) == "random"
    with pytest.raises(ValueError, match="seed must be an int <= "):
        A.gaussian_qk(4, 4, seed=2**70)
    # the benchmarks' seeds too (they failed inside torch, naming no argument)
    with pytest.raises(ValueError, match="seed must be an int <= "):
        A.benchmark_attention([8], seed=2**64, methods=["softmax_sdpa"], matmul=False)
    lm = ks.nn.CausalLM(10, d_model=8, n_heads=1, n_layers=1)
    with pytest.raises(ValueError, match="seed must be an int <= "):
        A.benchmark_generation({"a": (lm, "full")}, [2], seed=2**64)
    q, k = A.gaussian_qk(4, 4)
    fm = ks.create_feature_map("glu", head_dim=4, seed=0)
    target = A.attention_matrix(q, k)
    for dtype in (torch.complex64, torch.int64, torch.bool):
        with pytest.raises(TypeError, match="target must be a floating-point tensor"):
            A.distillation_loss(fm, q, k, target=target.to(dtype))


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_this_machine_lacks_is_named():
    """check_device parsed the name only: gaussian_qk, time_call, peak_memory_bytes,
    matmul_rate and benchmark_generation then failed in torch with AssertionError ("Torch
    not compiled with CUDA enabled")."""
    A = ks.analysis
    lm = ks.nn.CausalLM(10, d_model=8, n_heads=2, n_layers=1)
    for call in (
        lambda: A.gaussian_qk(4, 4, device="cuda"),
        lambda: A.time_call(lambda: None, device="cuda:1"),
        lambda: A.peak_memory_bytes(lambda: None, device=torch.device("cuda")),
        lambda: A.matmul_rate(device="cuda"),
        lambda: A.benchmark_generation({"a": (lm, "step")}, [2], device="cuda", repeats=1),
    ):
        with pytest.raises(ValueError, match="device='cuda(:1)?' is not usable here"):
            call()


def test_speed_rows_are_labelled_as_the_speed_study_labels_them():
    """plot_speed labelled rows "linear[torch]" (the study: "linear [torch]") and raised a
    bare KeyError 'backend' for a frame without that column."""
    frame = pd.DataFrame(
        {
            "method": ["linear", "softmax_sdpa"],
            "backend": ["torch", np.nan],  # as read back from CSV
            "metric": "time_ms",
            "value": [1.0, 2.0],
            "n": 64,
            "pass": "fwd",
            "causal": False,
        }
    )
    assert ks.analysis.speed_labels(frame).tolist() == ["linear [torch]", "softmax_sdpa"]
    no_backend = frame.drop(columns="backend")
    assert ks.analysis.speed_labels(no_backend).tolist() == ["linear", "softmax_sdpa"]
    for rows, want in ((frame, "linear [torch]"), (no_backend, "linear")):
        fig = ks.analysis.plots.plot_speed(rows)
        assert want in [t.get_text() for t in fig.legends[0].get_texts()]
        matplotlib.pyplot.close(fig)


def test_fit_to_softmax_trains_under_no_grad():
    """It failed at its first step under torch.no_grad (a notebook cell)."""
    q, k = ks.analysis.gaussian_qk(16, 4, seed=0)
    fm = ks.create_feature_map("softplus_ffn", head_dim=4, seed=0)
    before = fm.weight.detach().clone()
    with torch.no_grad():
        ks.analysis.fit_to_softmax(fm, q, k, steps=2)
    assert not torch.equal(fm.weight, before)
    with torch.inference_mode():  # q, k made there too (inference tensors)
        q, k = ks.analysis.gaussian_qk(16, 4, seed=1)
        ks.analysis.fit_to_softmax(fm, q, k, steps=2)


def _legend_colours(fig) -> dict[str, str]:
    (legend,) = fig.legends  # drawn outside the axes
    return {
        t.get_text(): h.get_color()
        for t, h in zip(legend.texts, legend.legend_handles, strict=True)
    }


def test_plots_name_what_they_cannot_draw_and_keep_colours_across_figures():
    """An infinite value (a run that diverged) was dropped with the NaN ones: the point drew
    the mean of the finite seeds, below the uniform baseline where the study's table said
    inf. Rows at 0 or below vanished from log axes. The generation study's two figures gave
    one run two colours (the state figure has no row of the no-cache run)."""
    plots = ks.analysis.plots
    rows = [
        {"method": m, "metric": "attention_kl", "n": 8, "std": 1.0, "seed": s, "value": v}
        for m, values in (("relu", [0.03, 0.04, math.inf]), ("uniform", [0.045] * 3))
        for s, v in enumerate(values)
    ]
    with pytest.warns(RuntimeWarning, match=r"1 infinite value\(s\) of 'attention_kl' not drawn"
                      r".*'method': 'relu'"):  # fmt: skip
        plots.close(plots.plot_approximation(pd.DataFrame(rows), "attention_kl", x="n"))
    frame = pd.DataFrame({"f": [0, 8, 16], "value": [1.0, 2.0, 0.0], "run": ["a", "b", "c"]})
    with pytest.warns(RuntimeWarning) as caught:
        plots.close(plots.line_plot(frame, "f", hue="run"))
    assert [str(w.message).split(" (e.g.")[0] for w in caught] == [
        "line_plot: 1 row(s) with f <= 0 are not shown on the log x axis",
        "line_plot: 1 row(s) with value <= 0 are not shown on the log y axis",
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fig = plots.line_plot(frame, "f", hue="run", logx=False, logy=False, hue_order="cba")
    colours = _legend_colours(fig)
    plots.close(fig)
    fig = plots.line_plot(frame[frame.run != "c"], "f", hue="run", logx=False, logy=False,
                          hue_order="cba")  # fmt: skip
    again = _legend_colours(fig)
    plots.close(fig)
    assert again == {k: colours[k] for k in ("b", "a")} and len(set(colours.values())) == 3
    with pytest.raises(ValueError, match=r"hue_order lacks run values \['c'\]"):
        plots.line_plot(frame, "f", hue="run", logx=False, logy=False, hue_order="ab")


def test_a_geometric_estimator_draws_spread_across_decades_on_a_log_axis():
    """The approximation study drew FAVOR+'s kernel MSE as mean ± sd on a log axis: one
    seed's tail set a mean 1000x the median, and in a quarter of the points the lower bar
    fell below 0, off the axis. estimator="geometric" draws the geometric mean ×/÷ the
    geometric sd; a value <= 0 (no geometric mean) is refused."""
    plots = ks.analysis.plots
    values = [1e-3, 1e-2, 1e-1, 1e3]
    rows = [
        {"method": "favor", "metric": "kernel_mse", "num_features": r, "seed": s, "value": v}
        for r in (16, 32)
        for s, v in enumerate(values)
    ]
    frame = pd.DataFrame(rows)
    fig = plots.plot_approximation(frame, "kernel_mse", x="num_features", estimator="geometric")
    line = next(ln for ln in fig.axes[0].get_lines() if len(ln.get_xdata()) == 2)
    logs = np.log(values)
    assert list(line.get_ydata()) == pytest.approx([math.exp(logs.mean())] * 2)
    bars = fig.axes[0].collections[0].get_segments()[0][:, 1]  # the first x's error bar
    spread = math.exp(logs.std(ddof=1))
    assert sorted(bars) == pytest.approx(
        [math.exp(logs.mean()) / spread, math.exp(logs.mean()) * spread]
    )
    plots.close(fig)
    with pytest.raises(ValueError, match="a geometric mean needs value > 0"):
        plots.line_plot(frame.assign(value=0.0), "num_features", estimator="geometric")
    with pytest.raises(ValueError, match="estimator must be 'mean' or 'geometric'"):
        plots.line_plot(frame, "num_features", estimator="median")


def test_map_comparison_bars_follow_the_maps_not_the_rows():
    """A map recomputed with ``--force`` is appended at the results' end: its bars moved to
    the end of the committed figure (and a stage's colour could change with the first row)."""
    q, k = ks.analysis.gaussian_qk(16, 4, seed=0)
    frame = pd.concat(
        [
            ks.analysis.approximation_error(m, q, k).assign(seed=0, stage=stage)
            for m, stage in (("elu", "fixed"), ("softplus_ffn", "init"), ("favor", "random"))
        ]
    )
    figures = []
    for rows in (frame, frame.iloc[::-1]):
        fig = ks.analysis.plots.plot_map_comparison(rows, metric="attention_kl")
        ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
        legend = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
        figures.append((ticks, legend))
    assert figures[0] == figures[1] and figures[0][0] == ["elu", "favor", "softplus_ffn"]
