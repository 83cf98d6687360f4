"""Exact polynomial-kernel features: (x·y)^p, or its Taylor sum Σ_k (x·y)^k / k!."""

from __future__ import annotations

import functools
import itertools
import math
from typing import Any, ClassVar

import numpy as np
import torch

from ..core.exp_range import exp_shift
from ..core.transforms import checked_in_graph
from .base import FeatureMap, Hyperparameter
from .registry import register_feature_map


def _monomials(dim: int, degree: int, symmetric: bool) -> tuple[np.ndarray, np.ndarray]:
    """Index tuples ``(F_k, degree)`` of the degree-``degree`` monomials and their weights.

    Full: every ordered tuple (the tensor power x^{⊗p}, F = D^p), weight 1.
    Symmetric: sorted tuples only (F = C(D+p−1, p)), weighted by √(number of
    orderings), so that the dot products are unchanged.
    """
    if not symmetric:
        tuples = list(itertools.product(range(dim), repeat=degree))
        weights = [1.0] * len(tuples)
    else:
        tuples = list(itertools.combinations_with_replacement(range(dim), degree))
        weights = []
        for t in tuples:
            counts = [t.count(i) for i in set(t)]
            weights.append(math.factorial(degree) / math.prod(map(math.factorial, counts)))
        weights = [math.sqrt(w) for w in weights]
    index = np.array(tuples, dtype=np.int64).reshape(len(tuples), degree)
    return index, np.array(weights, dtype=np.float64)


@functools.lru_cache(maxsize=32)
def _tables(dim: int, degree: int, symmetric: bool, taylor: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`_monomials`, weights divided by √(degree!) for the Taylor map: NumPy arrays, so
    that no tensor mode (meta, fake, inference) of a first caller is cached (read only)."""
    index, weight = _monomials(dim, degree, symmetric)
    return index, weight / math.sqrt(math.factorial(degree) if taylor else 1)


def _num_monomials(dim: int, degree: int, symmetric: bool) -> int:
    return math.comb(dim + degree - 1, degree) if symmetric else dim**degree


def _times_exp2(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """``x · 2^e`` for integer-valued ``e`` (broadcast), exact where the result is a normal
    float: two factors, each a normal float even where 2^e alone is not (|e| up to ~250)."""
    half = torch.floor(e / 2)
    return x * torch.exp2(half) * torch.exp2(e - half)


def _check_no_overflow(phi: torch.Tensor, x: torch.Tensor, is_query: bool) -> None:
    """ValueError where a row of finite inputs ``x: (..., N, D)`` gave an infinite feature
    in ``phi: (..., N, F)`` (with ``stabilize=False``: the products overflowed; non-finite
    inputs keep their inf and NaN, as with ``stabilize``). Syncs, but while compiling."""
    phi, x = phi.detach(), x.detach()
    what = "query" if is_query else "key"
    help_ = (
        "pass stabilize=True (query rows are rescaled: attention is unchanged), smaller inputs"
        if is_query
        else "keys are not rescaled: pass smaller inputs (scale_inputs=True divides x by D^(1/4))"
    )
    if checked_in_graph(  # compile: in the graph, without a sync on the GPU; vmap: a warning
        lambda: ~(torch.isinf(phi).any(-1) & torch.isfinite(x).all(-1)).any(),
        f"polynomial {what} features overflow {phi.dtype}: {help_} or float64",
        f"the polynomial map's overflow check of {what} features (stabilize=False)",
        phi,
    ):
        return
    if not phi.numel() or bool(torch.isfinite(torch.stack([phi.amax(), phi.amin()])).all()):
        return  # the common case: two reductions, no copy of φ
    overflow = torch.isinf(phi).any(-1) & torch.isfinite(x).all(-1)
    if bool(overflow.any()):
        largest = float(x.abs().masked_fill(~overflow[..., None], 0.0).amax())
        raise ValueError(
            f"polynomial {what} features of inputs up to |x| = {largest:.3g} overflow "
            f"{phi.dtype} (stabilize=False): {help_} or float64 inputs"
        )


def _rescale_rows(phi: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``phi: (..., N, F)`` with each row whose largest |φ| lies above ``dtype``'s safe
    range divided by the smallest power of two that brings it inside (exact; detached, a
    constant): only the excess, so the factor grows with the row from 1 at the range's top
    (no jump in how much ``eps`` weighs). Small rows are left alone: lifting them would
    change the output where the normalizer is near ``eps``."""
    top = phi.detach().abs().amax(-1, keepdim=True)
    shift = exp_shift(torch.log(top).clamp_min(0.0), dtype)  # 0 inside, and for zero rows
    return _times_exp2(phi, -torch.ceil(shift / math.log(2)))


#: Query rows whose largest |x̂| passes 2^(PRESCALE_BITS/p) are divided by a power of two
#: before their degree-p products are taken, so that those stay below 2^PRESCALE_BITS
#: (float32's largest value is 2^128; weights add at most √4! ≈ 2^2.3).
PRESCALE_BITS = 96


def _prescale_exponents(x: torch.Tensor, degree: int) -> torch.Tensor:
    """``a: (..., N, 1)`` ≥ 0 with the degree-``degree`` products of ``x · 2^-a`` below
    2^PRESCALE_BITS; 0 for rows that need nothing (and for non-finite ones)."""
    top = x.detach().abs().amax(-1, keepdim=True)
    a = (torch.ceil(torch.log2(top)) - PRESCALE_BITS // degree).clamp_min(0.0)
    return a.nan_to_num(0.0, 0.0, 0.0)


#: The most features F a polynomial map builds (F = D^p grows fast: D = 64, p = 3 is 262144).
MAX_FEATURES = 2**16


@register_feature_map("polynomial")
class PolynomialFeatureMap(FeatureMap):
    """Exact features of the polynomial kernel (x̂·ŷ)^p, or of its Taylor sum.

    ``degree = p``: φ(x) = x̂^{⊗p} (for p = 2, all products x̂_i x̂_j, F = D²).
    ``symmetric=True`` keeps each unordered product once, weighted by √(its count),
    which gives the same kernel with F = C(D+p−1, p) (≈ D²/2 for p = 2).
    ``taylor=True`` concatenates the orders 0..p scaled by 1/√k!, so that
    φ(x)·φ(y) = Σ_k (x̂·ŷ)^k / k! (p = 2: 1 + x̂·ŷ + (x̂·ŷ)²/2), the Taylor
    approximation of exp(x̂·ŷ). ``scale_inputs`` uses x̂ = x/D^{1/4} (so the kernel is in
    x·y/√D, as softmax attention); otherwise x̂ = x. Features can be negative; the
    kernel is ≥ 0 for even p and, with ``taylor`` and p = 2, always > 0.
    ``stabilize`` divides a query row whose largest |φ| lies above the dtype's safe range
    (:data:`kernelstudy.core.SAFE_EXPONENTS`, e^20 in float32) by the smallest power of two
    (exact) that brings it inside, the products of very large rows taken on x̂ divided by a
    power of two first (no overflow on the way, up to float32's largest inputs): large
    queries then give no inf/NaN normalizer, and normalized attention is unchanged but for
    ``eps``, which weighs as much more in such a row as the row is divided by (1 at the
    range's top: no jump); φ(q)·φ(k) is the kernel only up to that per-row factor (turn
    it off for kernel-level analysis).
    Keys are never rescaled: where the sums of their features leave float32's range
    (p = 2, D = 4, 2000 keys: |k| ≈ 1e18) attention is NaN, as it is for elu, relu and
    softplus_ffn at such inputs. ``(..., N, D) → (..., N, F)``.
    """

    paper = "polynomial kernel; 2nd-order Taylor map as in Zhang et al. 2024 / Arora et al. 2024"
    positive = False
    feature_dim_formula = "D^p (C(D+p-1,p) if symmetric; summed over orders 0..p if taylor)"
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "degree": Hyperparameter(int, 2, low=1, high=4, doc="p, the polynomial degree"),
        "taylor": Hyperparameter(
            bool, False, search=False, doc="add orders 0..p−1 with 1/k! weights (Taylor of exp)"
        ),
        "symmetric": Hyperparameter(
            bool, False, search=False, doc="keep each unordered product once (same kernel)"
        ),
        "scale_inputs": Hyperparameter(
            bool, False, search=False, doc="x̂ = x/D^{1/4}, so the kernel is in x·y/√D"
        ),
        "stabilize": Hyperparameter(
            bool, True, search=False, doc="rescale extreme query rows (cancels in attention)"
        ),
    }

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        p, symmetric = self.hparams["degree"], self.hparams["symmetric"]
        orders = range(p + 1) if self.hparams["taylor"] else [p]
        f = sum(_num_monomials(head_dim, k, symmetric) for k in orders)
        if f > MAX_FEATURES:  # D = 64, p = 4 would be 16.7M index tuples
            raise ValueError(
                f"degree={p} at head_dim={head_dim} gives {f} features, more than "
                f"{MAX_FEATURES}: lower degree, or use symmetric=True"
            )
        self.orders = list(orders)
        self._set_tables(torch.get_default_device())  # as a parameter would be made

    def _set_tables(self, device: torch.device) -> None:
        """The monomials' index and weight tables (``index_k``, ``weight_k`` float64) as
        buffers on ``device``: not saved in the state dict, made afresh rather than taken
        from whatever a module method did to them (``to_empty`` after a build on the meta
        device left them uninitialized, ``half()`` rounded the weights; and tables made
        under ``inference_mode`` took no part in a backward)."""
        taylor, symmetric = self.hparams["taylor"], self.hparams["symmetric"]
        self._unit_weights: set[int] = set()  # the orders whose weights are all 1
        with torch.inference_mode(False):
            for k in self.orders:
                index, weight = _tables(self.head_dim, k, symmetric, taylor)
                if (weight == 1).all():
                    self._unit_weights.add(k)
                index = torch.from_numpy(index).to(device, copy=True)
                weight = torch.from_numpy(weight).to(device, copy=True)
                self.register_buffer(f"index_{k}", index, persistent=False)
                self.register_buffer(f"weight_{k}", weight, persistent=False)

    def _apply(self, fn: Any, recurse: bool = True) -> PolynomialFeatureMap:
        # the tables out of the way (a meta one cannot be copied to a device), then made
        # afresh where ``fn`` puts a tensor of theirs
        tables = [n for n in self._buffers if n.startswith(("index_", "weight_"))]
        was = self._buffers[tables[0]].device
        for name in tables:
            del self._buffers[name]
        super()._apply(fn, recurse)
        try:
            device = fn(torch.empty(0, device=was)).device
        except (RuntimeError, NotImplementedError):  # out of meta: where a CPU one goes
            device = fn(torch.empty(0, device="cpu")).device
        self._set_tables(device)
        return self

    @property
    def feature_dim(self) -> int:
        d, symmetric = self.head_dim, self.hparams["symmetric"]
        return sum(_num_monomials(d, k, symmetric) for k in self.orders)

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.head_dim**-0.25 if self.hparams["scale_inputs"] else x

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """Products computed in float32 at least. float16 features that do not fit float16
        (|φ| > 65504, e.g. p = 2 at |x| ≳ 256: keys, or queries without ``stabilize``)
        raise ValueError rather than becoming inf and NaN attention (the check syncs,
        for float16 only); so do features of finite inputs that overflow float32 with
        ``stabilize=False`` (p = 2 from |x| ≈ 1.8e19; the check syncs there)."""
        dtype, inputs = x.dtype, x
        x = self._scale(x.to(torch.promote_types(dtype, torch.float32)))
        stabilize = is_query and self.hparams["stabilize"] and x.numel() > 0
        p = self.hparams["degree"]
        if stabilize:  # rows whose products would overflow: x·2^-a, order k times 2^(-a(p-k))
            prescale = _prescale_exponents(x, p)
            x = _times_exp2(x, -prescale)
        if getattr(self, f"index_{p}").is_meta and not x.is_meta:  # built on meta, then
            self._set_tables(x.device)  # loaded with assign=True: the tables stayed there
        parts = []
        for k in self.orders:
            index, weight = getattr(self, f"index_{k}"), getattr(self, f"weight_{k}")
            # from the first factor, not from ones, and no product with weights all 1: the
            # same values, a third less time (each (..., N, F) product and its gradient cost)
            if k == 0:
                product = torch.ones(*x.shape[:-1], index.shape[0], dtype=x.dtype, device=x.device)
            else:
                product = x[..., index[:, 0]]
            for j in range(1, k):
                product = product * x[..., index[:, j]]
            part = product if k in self._unit_weights else product * weight.to(x.dtype)
            parts.append(_times_exp2(part, -prescale * (p - k)) if stabilize and k < p else part)
        phi = torch.cat(parts, dim=-1)
        if stabilize:  # every row times 2^(-a·p) so far: the rescale takes that into account
            phi = _rescale_rows(phi, dtype)
        if not self.hparams["stabilize"]:
            _check_no_overflow(phi, inputs, is_query)
        if dtype == torch.float16 and torch.compiler.is_compiling():  # no sync on the GPU
            message = "polynomial features of these float16 inputs pass float16's 65504"
            torch._assert_async(~(phi.abs() > torch.finfo(dtype).max).any(), message)
        elif dtype == torch.float16:
            largest = float(phi.abs().amax()) if phi.numel() else 0.0
            if largest > torch.finfo(dtype).max:
                raise ValueError(
                    f"polynomial features of these float16 inputs reach |φ| = {largest:.3g}, "
                    f"beyond float16's {torch.finfo(dtype).max:.0f}: use bfloat16 or float32 "
                    "inputs, or smaller ones (scale_inputs=True divides x by D^(1/4))"
                )
        return phi.to(dtype)

    def kernel(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The exact kernel: (x̂·ŷ)^p or Σ_k (x̂·ŷ)^k/k!, ``(..., N, S)``."""
        dots = self._scale(x) @ self._scale(y).transpose(-1, -2)
        if not self.hparams["taylor"]:
            return dots ** self.hparams["degree"]
        return sum(dots**k / math.factorial(k) for k in self.orders)
