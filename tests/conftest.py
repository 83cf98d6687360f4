"""Shared fixtures: deterministic seeds and helpers to compare tensors."""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
import torch.autograd.forward_ad as fwAD


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (``-n``), the workers share the cores: each runs torch, and the
    processes it starts, on its share of them (every worker on all of them oversubscribes
    the cores, and torch's threads then spin waiting for each other)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        threads = max(1, (cores or os.cpu_count() or 1) // int(workers))
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)
    # A shell without job control starts a background command (`pytest ... &` in a script)
    # with Ctrl-C ignored, and the processes it starts inherit that: the tests of Ctrl-C
    # then never see their SIGINT and hang. They test what a terminal's Ctrl-C does, so
    # SIGINT gets Python's default handler back (children then start with the default).
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    # The user's settings of the library would change what the tests check (a default
    # backend, where results are read and written, which plugin maps load, the storage):
    # the tests set them where they test them. The build folder and CUDA flags stay.
    for name in USER_SETTINGS:
        os.environ.pop(name, None)


#: Environment variables of the library that the test run clears (see pytest_configure).
USER_SETTINGS = (
    "KERNELSTUDY_BACKEND",
    "KERNELSTUDY_RESULTS",
    "KERNELSTUDY_STUDIES_DIR",
    "KERNELSTUDY_FEATURE_MAPS",
    "KERNELSTUDY_STORAGE",
)


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as module ``bench_<name>`` (registered in
    ``sys.modules``, where dataclasses look their module up)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _close_figures():
    """The figures a test's plots returned (the library gives them to the caller, who owns
    them) are closed after it: a worker of the suite that ran the plot tests went past
    matplotlib's 20 open figures and warned in a later test."""
    yield
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.close("all")


@pytest.fixture
def one_thread():
    """Torch on one thread for the test (tiny tensors: threads only contend on a shared CPU).

    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A zombie does not (dead, not yet reaped: where its reaper
    never waits, as a container whose PID 1 is no init, ``os.kill(pid, 0)`` still finds it);
    read from /proc where there is one."""
    if not Path("/proc/self/status").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


def rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a-b| / max(max |b|, floor).

    ``floor`` is the natural scale of the quantity where the exact value may
    vanish (e.g. the φq-gradient of normalized attention over one key is 0).
    """
    a, b = a.double(), b.double()
    scale = max(b.abs().max().item(), floor)
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def rel_rms(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """RMS(a-b) / max(RMS(b), floor); RMS(a-b) where that scale is 0."""
    a, b = a.double(), b.double()
    scale = max(b.pow(2).mean().sqrt().item(), floor)
    diff = (a - b).pow(2).mean().sqrt().item()
    return diff / scale if scale > 0 else diff


def stepped(state, q, k, v, log_scale=None):
    """``state`` (a ``ks.RecurrentState``) stepped token by token through ``(B,H,N,·)``
    inputs (``log_scale: (B,H,N)`` for a scaled state): (outputs (B,H,N,M), the last state)."""
    outs = []
    for t in range(q.shape[2]):
        scale = None if log_scale is None else log_scale[:, :, t]
        out, state = state.step(q[:, :, t], k[:, :, t], v[:, :, t], scale)
        outs.append(out)
    return torch.stack(outs, 2), state


def compiled_whole(fn, nodes: list | None = None):
    """``torch.compile(fn, fullgraph=True)`` (dynamo's cache reset first) on AOTAutograd without
    inductor: the traced forward and backward graphs run as traced, so outputs can be compared
    bit for bit with eager mode. Every call of a ``kernelstudy::`` custom op in either graph is
    appended to ``nodes`` (torch.fx nodes: ``.target``, ``.args``)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(graph_module, _inputs):
        if nodes is not None:
            nodes.extend(
                n
                for n in graph_module.graph.nodes
                if n.op == "call_function" and str(n.target).startswith("kernelstudy.")
            )
        return make_boxed_func(graph_module.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    return torch.compile(fn, fullgraph=True, backend=backend)


def ramp_sum(out: torch.Tensor) -> torch.Tensor:
    """``Σ w·out`` with weights ``w`` from -1 to 1 over ``out``'s elements: its gradient into
    ``out`` is ``w``, which tells the elements apart (a plain sum would not)."""
    return (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)).sum()


def outputs_and_grads(module, runs, call, scalar=ramp_sum) -> list[list[torch.Tensor]]:
    """For each of ``runs`` (callables standing for ``module``: compiled, eager), with the
    module's gradients zeroed first: ``[out, *every parameter's gradient]`` where ``out =
    call(run)`` and the gradients are those of ``scalar(out)``."""
    results = []
    for run in runs:
        module.zero_grad()
        out = call(run)
        scalar(out).backward()
        results.append([out, *(p.grad.clone() for p in module.parameters())])
    return results


def autocast_bf16(device_type: str, *inputs: torch.Tensor):
    """A ``call`` for :func:`outputs_and_grads`: ``run(*inputs)`` under bfloat16 autocast on
    ``device_type``."""

    def call(run):
        with torch.autocast(device_type, torch.bfloat16):
            return run(*inputs)

    return call


def compiled_matches_eager(fn, inputs, upstream) -> set[str]:
    """``fn`` compiled whole (:func:`compiled_whole`) and in eager mode on copies of ``inputs``
    that require grad: asserts that outputs and the gradients against ``upstream`` are equal bit
    for bit, and returns the names of the ``kernelstudy::`` custom ops in the traced graphs."""
    nodes = []
    compiled = compiled_whole(fn, nodes)
    results = []
    for run in (compiled, fn):
        xs = [t.detach().clone().requires_grad_() for t in inputs]
        out = run(*xs)
        results.append([out, *torch.autograd.grad(out, xs, upstream.to(out.dtype))])
    for got, want in zip(*results, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    return {str(n.target).removeprefix("kernelstudy.").removesuffix(".default") for n in nodes}


# The CUDA extension's custom ops in the compiled graphs (forward and backward) of the product
# and of causal and non-causal attention (F, M <= 64: the fused backward)
CUDA_COMPILED_OPS = {
    "product": {"cuda_causal_product", "cuda_causal_backward"},
    "causal": {
        "cuda_causal_product",
        "cuda_causal_backward",
        "cuda_normalized_grad",
        "cuda_scaled_cumsum",
    },
    "full": {"cuda_full_state", "cuda_full_apply", "cuda_normalized_grad"},
}


def cuda_custom_op_cases(q, k, v, g, mask) -> list[tuple]:
    """``(custom op, args)`` over the options of the CUDA extension's functions as custom ops
    (``kernelstudy.core.traced_kernels``), for ``torch.library.opcheck``: ``q, k: (B,H,N,F)``,
    ``v, g: (B,H,N,M)`` in one dtype, ``mask: (B,N)`` bool."""
    ops = torch.ops.kernelstudy
    b, h, n, _ = q.shape
    m = v.shape[-1]
    state = ops.cuda_full_state(k, v, mask)
    out, den = ops.cuda_causal_product(q, k, v, False, False, True, True, 1e-6, 0, False)
    rows = torch.rand(b, h, n, device=q.device)
    bias = torch.randn(b, h, m, device=q.device)
    base = torch.randn(q.shape, device=q.device)
    return [
        (ops.cuda_causal_product, (q, k, v, False, True, False, False, 1e-6, 0, False)),
        (ops.cuda_causal_product, (q, k, v, True, False, True, True, 1e-3, 2, False)),
        (ops.cuda_causal_backward, (q, k, v, g, False, None, 0, False, True)),
        (ops.cuda_causal_backward, (q, k, v, g, True, False, 2, False, True)),
        (ops.cuda_full_state, (k, v, mask)),
        (ops.cuda_full_state, (k, v, None)),
        (ops.cuda_full_apply, (q, state, m, False, True, True, 1e-6, None, None, None)),
        (ops.cuda_full_apply, (q, state, m, True, False, False, 1e-6, bias, mask, None)),
        (
            ops.cuda_full_apply,
            (q.float(), state, m, False, False, False, 1e-6, None, None, torch.bfloat16),
        ),
        (ops.cuda_normalized_grad, (g, out, den, 1e-6, False, False)),
        (ops.cuda_normalized_grad, (g, out, den, 1e-6, True, True)),
        (ops.cuda_scaled_cumsum, (q, rows, None, False, base, False)),
        (ops.cuda_scaled_cumsum, (q, None, rows, True, None, True)),
    ]


def close_in_dtype(
    got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, half_floor: float = 1e-12
) -> bool:
    """The core's tolerances against a float64 reference: for float32 inputs, max relative
    error ≤ 1e-4 (scale at least 1); for float16/bfloat16, relative RMS error ≤ 1e-2 (scale at
    least ``half_floor``: an all-zero reference must be met to 1e-14 by default; pass the
    quantity's natural scale where its exact value vanishes up to eps, as the φq-gradient of
    normalized attention over one key). Non-finite values never pass."""
    if not torch.isfinite(got).all():
        return False
    if dtype == torch.float32:
        return rel_err(got, want, floor=1.0) <= 1e-4
    return rel_rms(got, want, floor=half_floor) <= 1e-2


def shifted(t: torch.Tensor, elements: int) -> torch.Tensor:
    """A contiguous copy of t (same device and dtype) whose data starts `elements` past an
    allocation: torch aligns allocations, so 1 element misaligns 16-byte vectors."""
    if elements == 0:
        return t
    flat = torch.empty(t.numel() + elements, dtype=t.dtype, device=t.device)[elements:]
    return flat.view(t.shape).copy_(t)


def torch_func_results(fn, xs, small_fn, small_xs, w, u, tangents) -> list[torch.Tensor]:
    """Derivatives of ``fn(q, k, v)`` by every route, for comparing a backend with the
    reference: the jvp along ``tangents``, by ``torch.func`` and by dual tensors of inputs that
    require grad; vmap over two copies of q (k and v unmapped); vmap of grad of ``L = Σ fn·w``;
    on the small inputs ``small_xs`` (``small_fn`` takes them, e.g. with a mask cut to their
    length) jacrev, jacrev under ``no_grad`` (its vjp runs with grad mode off on wrapped
    gradients), the jacobian by batched gradients (torch's older vmap) and the Hessian of L
    (jacfwd of jacrev); the gradient of ``dL/dq · u`` by autograd with ``create_graph=True``.
    Inputs are cast to ``xs``' dtype and device."""
    dtype, device = xs[0].dtype, xs[0].device

    def cast(t):
        return t.to(device, dtype)

    def loss_of(fn):
        return lambda *x: (fn(*x) * cast(w)[:, :, : x[0].shape[2]]).sum()

    inputs = [t.detach().clone().requires_grad_() for t in xs]
    (dq,) = torch.autograd.grad(loss_of(fn)(*inputs), inputs[0], create_graph=True)
    per_copy_grads = torch.func.vmap(torch.func.grad(loss_of(fn), argnums=(0, 1, 2)))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, cast(d)) for x, d in zip(inputs, tangents, strict=True)]
        dual_tangent = fwAD.unpack_dual(fn(*duals)).tangent
    with torch.no_grad():
        jacobian_without_grad = torch.func.jacrev(small_fn)(*small_xs)
    return [
        torch.func.jvp(fn, tuple(xs), tuple(map(cast, tangents)))[1],
        dual_tangent,
        torch.func.vmap(fn, in_dims=(0, None, None))(torch.stack([xs[0], 2 * xs[0]]), *xs[1:]),
        *per_copy_grads(*(t[None] for t in xs)),
        torch.func.jacrev(small_fn)(*small_xs),
        jacobian_without_grad,
        torch.autograd.functional.jacobian(small_fn, tuple(small_xs), vectorize=True)[0],
        torch.func.jacfwd(torch.func.jacrev(loss_of(small_fn)))(*small_xs),
        *torch.autograd.grad((dq * cast(u)).sum(), inputs, materialize_grads=True),
    ]


def write_text_data(root: Path, layout: str) -> Path:
    """Four movie reviews per split for the text task, in ``root``: a directory of split
    tables (``layout`` "val.tsv", or "no val" without it) or ``aclImdb/`` ("aclImdb", whose
    val is its test split). Returns the path to give the task."""
    rows = ["a fine film", "dull, skip it", "loved it", "no"]
    if layout == "aclImdb":
        for split in ("train", "test"):
            for label, polarity in enumerate(("neg", "pos")):
                folder = root / "aclImdb" / split / polarity
                folder.mkdir(parents=True)
                for i, row in enumerate(rows):
                    (folder / f"{i}_{label}.txt").write_text(f"{split} {row}")
        return root / "aclImdb"
    root.mkdir(parents=True)
    splits = ("train", "val", "test") if layout == "val.tsv" else ("train", "test")
    for split in splits:
        body = "".join(f"{split} {row}\t{i % 2}\n" for i, row in enumerate(rows))
        (root / f"{split}.tsv").write_text("text\tlabel\n" + body)
    return root
