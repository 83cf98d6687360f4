"""The RNN form of causal linear attention: constant memory per step.

State per head: ``S = Σ_j φk_j v_jᵀ`` of shape ``(F, M)`` and ``Z = Σ_j φk_j`` of
shape ``(F,)``, kept in float32 (float64 for float64 inputs). Stepping through a
sequence reproduces ``linear_attention(..., causal=True)``.

A *scaled* state (``zeros(..., scaled=True)``) also keeps ``log_scale``, the
running maximum of the keys' log scales ``m``, and holds ``S·exp(−c)`` and
``Z·exp(−c)`` with ``c = exp_shift(m)``: 0 while ``m`` lies in the safe range of the
sums' dtype (:mod:`kernelstudy.core.exp_range`; float32's for half inputs, which are
summed in float32, as ``kernel_attention`` maps them), as the batch key stabilizer of
FAVOR+ and Hedgehog, so stepping gives the batch output; beyond it, keys whose features
are exp of large exponents do not overflow. The factor cancels in the normalized output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..arguments import check_count, check_flag
from .autocast import without_autocast
from .exp_range import exp_shift
from .validation import (
    accumulation_dtype,
    check_device,
    check_eps,
    check_same_dtype_and_device,
    check_tensor,
)


@dataclass(frozen=True, eq=False)  # no field-wise ==: tensors have no single truth value
class RecurrentState:
    """Running sums ``S: (B,H,F,M)`` and ``Z: (B,H,F)``; immutable, ``step`` returns a new one.

    ``log_scale: (B,H)`` is None for a plain state; for a scaled one it is the
    largest key log scale so far (−inf before the first key); the sums are divided
    by ``exp(exp_shift(log_scale))``.
    """

    S: torch.Tensor
    Z: torch.Tensor
    eps: float = 1e-6
    log_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        """Checks a state built directly (``zeros`` and ``step`` build valid ones)."""
        for name, t in (("S", self.S), ("Z", self.Z), ("log_scale", self.log_scale)):
            if not (isinstance(t, torch.Tensor) or (name == "log_scale" and t is None)):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        s, z = self.S, self.Z
        if s.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"S must be float32 or float64 (the sums' dtype), got {s.dtype}")
        if s.dim() != 4:
            raise ValueError(f"S must have shape (B,H,F,M), got {tuple(s.shape)}")
        expected = {"Z": s.shape[:3], "log_scale": s.shape[:2]}
        for name, t in (("Z", z), ("log_scale", self.log_scale)):
            if t is None:
                continue
            if t.shape != expected[name]:
                raise ValueError(
                    f"{name} must have shape {tuple(expected[name])} (from S), got {tuple(t.shape)}"
                )
            if t.dtype != s.dtype or t.device != s.device:
                raise ValueError(
                    f"{name} must be {s.dtype} on {s.device} as S, got {t.dtype} on {t.device}"
                )
        object.__setattr__(self, "eps", check_eps(self.eps, s.dtype))

    @classmethod
    def zeros(
        cls,
        batch: int,
        heads: int,
        feature_dim: int,
        value_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        eps: float = 1e-6,
        scaled: bool = False,
    ) -> RecurrentState:
        """An empty state; ``dtype`` is the accumulation dtype (float32 or float64).

        ``scaled=True``: ``step`` takes each key's log scale (see
        :meth:`kernelstudy.feature_maps.FeatureMap.key_features`).
        """
        batch, heads, feature_dim, value_dim = (
            check_count(name, n, 1)  # numpy ints too, as elsewhere in the core
            for name, n in (
                ("batch", batch),
                ("heads", heads),
                ("feature_dim", feature_dim),
                ("value_dim", value_dim),
            )
        )
        if dtype not in (torch.float32, torch.float64):
            raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
        scaled = check_flag("scaled", scaled)
        if device is not None:
            device = check_device("device", device)
        s = torch.zeros(batch, heads, feature_dim, value_dim, dtype=dtype, device=device)
        z = torch.zeros(batch, heads, feature_dim, dtype=dtype, device=device)
        log_scale = None
        if scaled:
            log_scale = torch.full((batch, heads), -torch.inf, dtype=dtype, device=device)
        return cls(s, z, check_eps(eps, dtype), log_scale)

    def step(
        self,
        phi_q_t: torch.Tensor,
        phi_k_t: torch.Tensor,
        v_t: torch.Tensor,
        k_log_scale: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """Add key/value at time t, then read with the query at t.

        ``phi_q_t, phi_k_t: (B,H,F)``, ``v_t: (B,H,M)`` → output ``(B,H,M)`` in the
        input dtype, and the new state. A scaled state needs ``k_log_scale: (B,H)``
        (the key's feature is ``phi_k_t·exp(k_log_scale)``); a plain one refuses it.
        """
        check_tensor(phi_q_t, "phi_q_t", 3)
        check_tensor(phi_k_t, "phi_k_t", 3)
        check_tensor(v_t, "v_t", 3)
        b, h, f, m = self.S.shape
        for name, t, want in (
            ("phi_q_t", phi_q_t, (b, h, f)),
            ("phi_k_t", phi_k_t, (b, h, f)),
            ("v_t", v_t, (b, h, m)),
        ):
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        check_same_dtype_and_device({"phi_q_t": phi_q_t, "phi_k_t": phi_k_t, "v_t": v_t})
        if phi_q_t.device != self.S.device:
            raise ValueError(
                f"the step's inputs are on {phi_q_t.device} but the state is on {self.S.device}"
            )
        acc = self.S.dtype
        if accumulation_dtype(phi_q_t.dtype) == torch.float64 and acc != torch.float64:
            acc = torch.float64
        q, k, v = phi_q_t.to(acc), phi_k_t.to(acc), v_t.to(acc)
        s, z, log_scale = self.S.to(acc), self.Z.to(acc), None
        if (self.log_scale is None) != (k_log_scale is None):
            raise ValueError(
                "k_log_scale must be given exactly when the state is scaled "
                f"(this state is {'' if self.log_scale is not None else 'not '}scaled)"
            )
        if k_log_scale is not None:
            check_tensor(k_log_scale, "k_log_scale", 2)
            if tuple(k_log_scale.shape) != (b, h):
                raise ValueError(
                    f"k_log_scale must have shape {(b, h)}, got {tuple(k_log_scale.shape)}"
                )
            if k_log_scale.device != self.S.device:
                raise ValueError(
                    f"k_log_scale is on {k_log_scale.device} but the state is on {self.S.device}"
                )
            old, new = self.log_scale.to(acc), k_log_scale.to(acc)
            log_scale = torch.maximum(old, new)
            # the sums' dtype, not the step's: the sums keep one shift whatever each step holds
            shift = exp_shift(log_scale, acc)
            # exp_shift grows with its argument, so decay <= 1 (1 while the state is empty)
            shift_old = torch.where(old == -torch.inf, shift, exp_shift(old, acc))
            decay = torch.exp(shift_old - shift)
            s = s * decay[..., None, None]
            z = z * decay[..., None]
            k = k * torch.exp(new - shift)[..., None]  # new - shift <= the safe maximum
        s = s + k.unsqueeze(-1) * v.unsqueeze(-2)
        z = z + k
        # autocast would read the float32 state in float16 (forward, or a backward in it)
        num = without_autocast(lambda q, s: (q.unsqueeze(-2) @ s).squeeze(-2), q, s)
        den = (q * z).sum(-1, keepdim=True)
        out = num / (den + self.eps)
        return out.to(phi_q_t.dtype), RecurrentState(s, z, self.eps, log_scale)
