"""The cuda backend's kernel settings are checked by name before any kernel runs (no GPU needed)."""

from __future__ import annotations

import pytest
import torch

from kernelstudy.core import cuda_backend

# the backend's module-level settings that use_variant sets and settings_kept restores
SETTINGS = ("CAUSAL_KERNEL", "FUSED_BACKWARD", "WALKS_TOGETHER", "WALK_BLOCKS")


def _settings() -> tuple:
    return tuple(getattr(cuda_backend, name) for name in SETTINGS)


def test_defaults_are_valid_settings():
    assert cuda_backend.CAUSAL_KERNEL in cuda_backend.CAUSAL_KERNELS
    walk = cuda_backend.CAUSAL_KERNEL != "chunks"
    assert cuda_backend._kernel_args(torch.float32) == {
        "walk_blocks": cuda_backend.walk_blocks(torch.float32) if walk else 0,
        "mma_walk": cuda_backend.CAUSAL_KERNEL == "walk_mma",
    }


def test_each_kernel_passes_its_arguments(monkeypatch):
    """walk_blocks = 0 selects the chunk kernels; the walks pass their block target, and
    walk_mma asks for kernel 8 (mma_walk)."""
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 96)
    want = {
        "chunks": {"walk_blocks": 0, "mma_walk": False},
        "walk": {"walk_blocks": 96, "mma_walk": False},
        "walk_mma": {"walk_blocks": 96, "mma_walk": True},
    }
    assert set(want) == set(cuda_backend.CAUSAL_KERNELS)
    for kernel, args in want.items():
        monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", kernel)
        assert cuda_backend._kernel_args(torch.float32) == args


def test_fused_backward_passes_the_kernel_choice(monkeypatch):
    """The fused backward is the selected kernel's: the walk's block target reaches it, and
    WALKS_TOGETHER."""
    calls = []

    class Ext:
        def causal_backward(
            self, *tensors, out_fp32, dv_fp32, walk_blocks, mma_walk, walks_together
        ):
            calls.append((len(tensors), out_fp32, dv_fp32, walk_blocks, mma_walk, walks_together))
            return []

    x = torch.zeros(1)

    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 64)
    for together in (True, False):
        monkeypatch.setattr(cuda_backend, "WALKS_TOGETHER", together)
        for kernel, blocks, mma in (
            ("walk", 64, False), ("chunks", 0, False), ("walk_mma", 64, True)
        ):  # fmt: skip
            monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", kernel)
            cuda_backend._fused_backward(Ext(), x, x, x, x, out_fp32=True)
            assert calls[-1] == (4, True, None, blocks, mma, together)
            cuda_backend._fused_backward(Ext(), x, x, x, x, out_fp32=True, dv_fp32=False)
            assert calls[-1] == (4, True, False, blocks, mma, together)


def test_a_kernel_for_each_dtype(monkeypatch):
    """CAUSAL_KERNEL as a dict: each operand dtype its own kernel, to the products, the
    normalized attention and the fused backward alike (by their operands' dtype)."""
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 96)
    by_dtype = {torch.float32: "walk", torch.float16: "chunks", torch.bfloat16: "walk_mma"}
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", by_dtype)
    assert cuda_backend._kernel_args(torch.float32) == {"walk_blocks": 96, "mma_walk": False}
    assert cuda_backend._kernel_args(torch.float16) == {"walk_blocks": 0, "mma_walk": False}
    assert cuda_backend._kernel_args(torch.bfloat16) == {"walk_blocks": 96, "mma_walk": True}
    calls = []

    class Ext:
        def causal_product(self, q, k, v, reverse, out_fp32, walk_blocks, mma_walk):
            calls.append(("product", q.dtype, walk_blocks, mma_walk))
            return [q]

        def causal_backward(
            self, q, k, v, g, out_fp32, dv_fp32, walk_blocks, mma_walk, walks_together
        ):
            calls.append(("backward", q.dtype, walk_blocks, mma_walk))
            return [q, k, v]

    for dtype in cuda_backend.DTYPES:
        x = torch.zeros(1, dtype=dtype)
        cuda_backend._product(Ext(), x, x, x, reverse=False, out_fp32=False)
        cuda_backend._fused_backward(Ext(), x, x, x, x, out_fp32=False)
    assert calls == [
        ("product", torch.float32, 96, False), ("backward", torch.float32, 96, False),
        ("product", torch.float16, 0, False), ("backward", torch.float16, 0, False),
        ("product", torch.bfloat16, 96, True), ("backward", torch.bfloat16, 96, True),
    ]  # fmt: skip


@pytest.mark.parametrize(
    "value",
    [
        {torch.float32: "walk", torch.bfloat16: "walk"},  # float16 missing
        {torch.float32: "walk", torch.float16: "walk", torch.bfloat16: "fast"},
        {"float32": "walk", "float16": "walk", "bfloat16": "walk"},  # names, not dtypes
        ["walk"],
    ],
    ids=["missing", "unknown", "names", "list"],
)
def test_a_bad_kernel_by_dtype_is_refused_by_name(monkeypatch, value):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", value)
    with pytest.raises(ValueError, match="cuda_backend.CAUSAL_KERNEL"):
        cuda_backend._kernel_args(torch.float16)


def test_unknown_kernel_is_refused_by_name(monkeypatch):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "fast")
    with pytest.raises(ValueError, match=r"CAUSAL_KERNEL must be one of .*'fast'"):
        cuda_backend._kernel_args(torch.float32)


@pytest.mark.parametrize("blocks", [0, -3, True, 2.0, "256"])
def test_walk_blocks_must_be_a_positive_int(monkeypatch, blocks):
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk")
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", blocks)
    with pytest.raises(ValueError, match="WALK_BLOCKS must be an int >= 1"):
        cuda_backend._kernel_args(torch.float32)


def test_walk_blocks_for_each_dtype(monkeypatch):
    """WALK_BLOCKS as a dict: each operand dtype walks at its own block target (the chunk
    kernels at none); a missing dtype, a name for a dtype or a bad count is refused by name."""
    by_dtype = {torch.float32: 128, torch.float16: 256, torch.bfloat16: 4096}
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", by_dtype)
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk_mma")
    for dtype, blocks in by_dtype.items():
        assert cuda_backend.walk_blocks(dtype) == blocks
        assert cuda_backend._kernel_args(dtype) == {"walk_blocks": blocks, "mma_walk": True}
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "chunks")
    assert cuda_backend._kernel_args(torch.bfloat16)["walk_blocks"] == 0
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk")
    for bad, message in (
        ({torch.float32: 128, torch.bfloat16: 128}, "or a dict giving one for each of"),
        ({"float32": 1, "float16": 1, "bfloat16": 1}, "or a dict giving one for each of"),
        (
            {torch.float32: 128, torch.float16: 0, torch.bfloat16: 1},
            r"WALK_BLOCKS\[torch.float16\]",
        ),
    ):
        monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", bad)
        with pytest.raises(ValueError, match=message):
            cuda_backend._kernel_args(torch.float16)


def test_use_variant_sets_the_kernel_and_the_backward(monkeypatch):
    for name in SETTINGS:
        monkeypatch.setattr(cuda_backend, name, getattr(cuda_backend, name))
    for name, (kernel, fused, together) in cuda_backend.VARIANTS.items():
        cuda_backend.use_variant(name)
        assert (cuda_backend.CAUSAL_KERNEL, cuda_backend.FUSED_BACKWARD) == (kernel, fused)
        assert cuda_backend.WALKS_TOGETHER is together
        assert kernel in cuda_backend.CAUSAL_KERNELS
    cuda_backend.use_variant("walk", walk_blocks=96)
    assert cuda_backend._kernel_args(torch.float32) == {"walk_blocks": 96, "mma_walk": False}
    cuda_backend.use_variant("chunks_fused")
    assert cuda_backend.WALK_BLOCKS == 96
    assert cuda_backend._kernel_args(torch.float32) == {"walk_blocks": 0, "mma_walk": False}
    cuda_backend.use_variant("walk_mma_fused")
    assert cuda_backend._kernel_args(torch.float32) == {"walk_blocks": 96, "mma_walk": True}
    assert cuda_backend.WALKS_TOGETHER is True
    cuda_backend.use_variant("walk_mma_fused_apart")
    assert cuda_backend._kernel_args(torch.float32) == {"walk_blocks": 96, "mma_walk": True}
    assert cuda_backend.WALKS_TOGETHER is False


@pytest.mark.parametrize("value", ["False", None, 2])
def test_walks_together_must_be_a_bool(monkeypatch, value):
    """The fused backward reads WALKS_TOGETHER as a flag; a string is not taken for True."""
    monkeypatch.setattr(cuda_backend, "WALKS_TOGETHER", value)
    with pytest.raises(TypeError, match="cuda_backend.WALKS_TOGETHER must be a bool"):
        cuda_backend._fused_backward(None, None, None, None, None, out_fp32=False)


@pytest.mark.parametrize(
    ("name", "blocks", "match"),
    [("fast", None, r"variant must be one of .*'fast'"), ("walk", 0, "walk_blocks must be an int")],
)
def test_use_variant_refuses_bad_settings_by_name(monkeypatch, name, blocks, match):
    for setting in SETTINGS:
        monkeypatch.setattr(cuda_backend, setting, getattr(cuda_backend, setting))
    before = _settings()
    with pytest.raises(ValueError, match=match):
        cuda_backend.use_variant(name, walk_blocks=blocks)
    assert _settings() == before


@pytest.mark.parametrize("value", ["False", "no", None, 2, (torch.float64,), ("bfloat16",)])
def test_fused_backward_must_be_a_bool_or_dtypes(monkeypatch, value):
    """A string such as "False" used to select the fused backward (read by truthiness)."""
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", value)
    with pytest.raises(TypeError, match="cuda_backend.FUSED_BACKWARD must be"):
        cuda_backend._fused(torch.float32)
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", True)
    assert cuda_backend._fused(torch.float32) is True


def test_fused_backward_by_operand_dtype(monkeypatch):
    """The default fuses every dtype's backward (measured faster in each with walk_mma); a
    tuple names the dtypes it is on for; a bool applies to every dtype, as use_variant sets it."""
    assert [cuda_backend._fused(d) for d in cuda_backend.DTYPES] == [True, True, True]
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", (torch.float32,))
    assert [cuda_backend._fused(d) for d in cuda_backend.DTYPES] == [True, False, False]
    for flag in (True, False):
        monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", flag)
        assert {cuda_backend._fused(d) for d in cuda_backend.DTYPES} == {flag}


def test_a_missing_csrc_folder_warns_once_and_falls_back(monkeypatch):
    """It raised FileNotFoundError from ks.backends() once, then vanished silently."""
    from kernelstudy.core import extensions

    def missing():
        raise FileNotFoundError("kernelstudy: csrc/ not found")

    monkeypatch.setattr(cuda_backend.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(extensions, "csrc_dir", missing)
    monkeypatch.setattr(cuda_backend, "_tried", False)
    monkeypatch.setattr(cuda_backend, "_module", None)
    with pytest.warns(RuntimeWarning, match="csrc/ not found; falling back to the 'torch'"):
        assert cuda_backend.extension() is None
    assert cuda_backend.extension() is None  # tried once


def test_settings_kept_restores_the_defaults(monkeypatch):
    """cuda_core.py and cuda_profile.py try every variant; the defaults come back after, also
    when the block raises."""
    for name in SETTINGS:
        monkeypatch.setattr(cuda_backend, name, getattr(cuda_backend, name))
    before = _settings()
    with cuda_backend.settings_kept():
        cuda_backend.use_variant("walk_mma_fused_apart", walk_blocks=7)
        assert cuda_backend.WALKS_TOGETHER is False and cuda_backend.WALK_BLOCKS == 7
    assert _settings() == before
    with pytest.raises(RuntimeError), cuda_backend.settings_kept():
        cuda_backend.use_variant("walk_fused", walk_blocks=3)
        raise RuntimeError("a variant failed")
    assert _settings() == before
    wide = dict(cuda_backend.WIDE_BACKWARD)
    monkeypatch.setattr(cuda_backend, "WIDE_BACKWARD", dict(wide))  # the module's own kept
    with cuda_backend.settings_kept():  # an entry changed in place comes back too
        cuda_backend.WIDE_BACKWARD[torch.float16] = "products"
    assert cuda_backend.WIDE_BACKWARD == wide


def test_cuda_flags_from_the_environment(monkeypatch):
    """$KERNELSTUDY_CUDA_FLAGS adds nvcc flags, split as shell words, after the build's own."""
    monkeypatch.delenv(cuda_backend.CUDA_FLAGS_ENV, raising=False)
    assert cuda_backend.extra_cuda_flags() == []
    monkeypatch.setenv(
        cuda_backend.CUDA_FLAGS_ENV, " -lineinfo  -DKS_WMMA_GENERIC_LOADS '-Xptxas=-v' "
    )
    assert cuda_backend.extra_cuda_flags() == ["-lineinfo", "-DKS_WMMA_GENERIC_LOADS", "-Xptxas=-v"]

    from kernelstudy.core import extensions

    seen = {}

    def load_extension(name, sources, cuda, extra_cflags, extra_cuda_cflags):
        seen.update(name=name, cuda=cuda, cuda_flags=extra_cuda_cflags)
        return "module"

    monkeypatch.setattr(extensions, "load_extension", load_extension)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(cuda_backend, "_module", None)
    monkeypatch.setattr(cuda_backend, "_tried", False)
    assert cuda_backend.extension() == "module"
    assert seen == {
        "name": cuda_backend.extension_name(),
        "cuda": True,
        "cuda_flags": ["-O3", "-lineinfo", "-DKS_WMMA_GENERIC_LOADS", "-Xptxas=-v"],
    }


def test_unbalanced_cuda_flags_are_refused_by_name(monkeypatch):
    monkeypatch.setenv(cuda_backend.CUDA_FLAGS_ENV, "-DX='unclosed")
    with pytest.raises(ValueError, match=r"\$KERNELSTUDY_CUDA_FLAGS must be nvcc flags"):
        cuda_backend.extra_cuda_flags()


def test_results_record_the_cuda_flags(monkeypatch):
    """A benchmark's recorded command leads with the flags of the build it ran, where set."""
    monkeypatch.delenv(cuda_backend.CUDA_FLAGS_ENV, raising=False)
    argv = ["benchmarks/cuda_core.py", "--n", "512"]
    assert cuda_backend.command_line(argv) == "python benchmarks/cuda_core.py --n 512"
    monkeypatch.setenv(cuda_backend.CUDA_FLAGS_ENV, "-DKS_WMMA_GENERIC_LOADS -lineinfo")
    assert cuda_backend.command_line(argv) == (
        "KERNELSTUDY_CUDA_FLAGS='-DKS_WMMA_GENERIC_LOADS -lineinfo' "
        "python benchmarks/cuda_core.py --n 512"
    )


def test_last_dimensions_from_2_to_the_24_are_refused_before_the_extension(monkeypatch):
    """The kernels index a 64-row tile in 32 bits; the Python side names the tensor whose last
    dimension is too large before any call into the extension (whose own check is a C++
    throw). Meta tensors: no memory."""
    monkeypatch.setattr(cuda_backend, "supports", lambda t: True)
    big = torch.empty(1, 1, 1, 2**24, device="meta")
    small = torch.empty(1, 1, 1, 2, device="meta")
    cuda_backend._check_inputs(small, small, small)
    with pytest.raises(ValueError, match=r"q's last dimension must be below 2\^24"):
        cuda_backend._check_inputs(big, big, small)
    with pytest.raises(ValueError, match=r"v's last dimension must be below 2\^24 .*got 16777216"):
        cuda_backend._check_inputs(small, small, big)


def test_walk_mma_fuses_the_backward_only_where_its_register_walk_applies(monkeypatch):
    """With walk_mma, the fused backward's register dk, dv walk (kernel 9) takes F, M <= 64;
    above that the fused backward would fall back to the WMMA walk, slower than three products
    on kernel 8 (bf16, F = M = 128, H200): the backward runs the three products there, or the
    chunk kernels' fused backward where WIDE_BACKWARD says so (float16 by default). The other
    kernels fuse at any F, as FUSED_BACKWARD says."""
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", True)
    monkeypatch.setattr(cuda_backend, "WALK_BLOCKS", 96)
    calls = []

    class Ext:
        def causal_product(self, q, k, v, reverse, out_fp32, walk_blocks, mma_walk):
            calls.append(("product", walk_blocks, mma_walk))
            return [torch.zeros(*q.shape[:-1], v.shape[-1], dtype=q.dtype)]

        def causal_backward(
            self, q, k, v, g, out_fp32, dv_fp32, walk_blocks, mma_walk, walks_together
        ):
            calls.append(("fused", walk_blocks, mma_walk))
            return [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]

    monkeypatch.setattr(cuda_backend, "_require", lambda: Ext())
    mma, walk, chunks = (96, True), (96, False), (0, False)
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    cases = [("walk_mma", f32, 64, 64, mma, ("fused", *mma)),
             ("walk_mma", f32, 128, 64, mma, None),
             ("walk_mma", bf16, 64, 96, mma, None),
             ("walk_mma", bf16, 128, 128, mma, None),
             ("walk_mma", f16, 64, 64, mma, ("fused", *mma)),
             ("walk_mma", f16, 128, 128, mma, ("fused", *chunks)),
             ("walk_mma", f16, 64, 96, mma, ("fused", *chunks)),
             ("walk", f16, 128, 128, walk, ("fused", *walk)),
             ("walk", f32, 128, 128, walk, ("fused", *walk)),
             ("chunks", f32, 256, 256, chunks, ("fused", *chunks))]  # fmt: skip
    for kernel, dtype, f, m, forward, backward in cases:
        monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", kernel)
        q, k = (torch.rand(1, 1, 3, f, dtype=dtype, requires_grad=True) for _ in range(2))
        v = torch.rand(1, 1, 3, m, dtype=dtype, requires_grad=True)
        calls.clear()
        cuda_backend._CausalProduct.apply(q, k, v, False).sum().backward()
        want = [("product", *forward), backward or ("product", *forward)]
        if backward is None:  # three products, each on the forward's kernels
            want += [("product", *forward)] * 2
        assert calls == want, (kernel, dtype, f, m)
    monkeypatch.setattr(
        cuda_backend, "WIDE_BACKWARD", {**cuda_backend.WIDE_BACKWARD, f16: "products"}
    )
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk_mma")
    q = torch.rand(1, 1, 3, 128, dtype=f16)
    assert not cuda_backend._use_fused(q, q)
    monkeypatch.setattr(
        cuda_backend, "WIDE_BACKWARD", {**cuda_backend.WIDE_BACKWARD, bf16: "chunks"}
    )
    q = torch.rand(1, 1, 3, 128, dtype=bf16)
    assert cuda_backend._use_fused(q, q)
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", False)  # off is off at any F
    for dtype in (bf16, f16):
        q = torch.rand(1, 1, 3, 64, dtype=dtype)
        assert not cuda_backend._use_fused(q, q)
        assert not cuda_backend._use_fused(q, torch.rand(1, 1, 3, 128, dtype=dtype))


@pytest.mark.parametrize(
    "value",
    [{torch.float32: "products"}, {d: "walk" for d in cuda_backend.DTYPES}, ["chunks"], "chunks"],
    ids=["missing_dtypes", "not_a_backward", "list", "str"],
)
def test_wide_backward_is_checked_by_name(monkeypatch, value):
    """WIDE_BACKWARD gives "products" or "chunks" for every dtype; anything else is refused by
    name where a wide walk_mma backward reads it."""
    monkeypatch.setattr(cuda_backend, "FUSED_BACKWARD", True)
    monkeypatch.setattr(cuda_backend, "CAUSAL_KERNEL", "walk_mma")
    monkeypatch.setattr(cuda_backend, "WIDE_BACKWARD", value)
    q = torch.rand(1, 1, 3, 128)
    with pytest.raises(ValueError, match="cuda_backend.WIDE_BACKWARD must be a dict giving one"):
        cuda_backend._use_fused(q, q)


@pytest.mark.parametrize("capability, scale", [((9, 0), 9), ((8, 0), 9), ((7, 5), 7)])
def test_the_gpus_capability_and_the_build_are_constants_when_traced(
    monkeypatch, capability, scale
):
    """While ``torch.compile`` traces, the backend's checks ask whether the GPU's compute
    capability suffices and whether the extension runs once, outside the graph, and keep the
    answers as constants (``fullgraph=True`` passes through them; on a CPU build of torch, with
    the lookups stood in)."""
    asked = []
    monkeypatch.setattr(
        torch.cuda, "get_device_capability", lambda i=None: asked.append(i) or capability
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cuda_backend._capability_once.cache_clear()
    try:

        def fn(x):
            built = cuda_backend.is_available()
            return x * (9 if cuda_backend._capable(0) else 7) + built

        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True, backend="eager")
        assert compiled(torch.ones(2)).tolist() == [scale] * 2
        assert compiled(torch.ones(3)).tolist() == [scale] * 3
        assert asked == [0]
    finally:
        cuda_backend._capability_once.cache_clear()


def test_inputs_are_checked_by_name_and_the_state_fits_the_kernels_grid(monkeypatch):
    """A state of more than 65535 tiles of 64 x 64 (F x (M+1): gridDim.y) passed the checks and
    failed at launch ("invalid configuration argument"; from M = 2^22 at F = 64, well below
    the 2^24 that was checked); the dtype error did not name the tensor. Meta tensors: no
    memory, and no GPU needed for the Python side's checks."""

    def inputs(f: int, m: int) -> tuple[torch.Tensor, ...]:
        q, k = (torch.empty(1, 1, 4, f, device="meta") for _ in "qk")
        return q, k, torch.empty(1, 1, 4, m, device="meta")

    monkeypatch.setattr(cuda_backend, "supports", lambda t: t.dtype != torch.float64)
    cuda_backend._check_inputs(*inputs(255 * 64, 255 * 64 - 1))  # 255 x 255 tiles
    cuda_backend._check_inputs(*inputs(64, 65535 * 64 - 1))  # 1 x 65535
    for f, m in ((64, 2**22), (256 * 64, 256 * 64 - 1), (64, 65535 * 64)):
        with pytest.raises(ValueError, match=f"F = {f} and M = {m} make a state of .* more than"):
            cuda_backend._check_inputs(*inputs(f, m))
    q, k, v = inputs(8, 8)
    with pytest.raises(ValueError, match="got k of torch.float64 on meta"):
        cuda_backend._check_inputs(q, k.double(), v)
