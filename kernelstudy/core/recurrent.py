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

``steps`` reads a block of tokens at once (a prompt, or one segment of a long sequence):
the causal product of the block on the core's backends plus the state's part, the same
outputs and state as stepping token by token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from ..arguments import check_count, check_flag
from .autocast import without_autocast
from .backends import check_backend_name, resolve_backend
from .exp_range import exp_shift, shift_setting
from .transforms import host_reads_allowed
from .validation import (
    accumulation_dtype,
    autocast_off,
    check_device,
    check_eps,
    check_key_padding_mask,
    check_same_dtype_and_device,
    check_tensor,
    zero_padded_keys,
)

#: A scaled block whose rows' shifts climb by more than this many e-folds is summed in
#: segments (:meth:`RecurrentState.segment_bounds`): at one shift, keys ``e^x`` below it
#: lie at ``e^-x`` times their own scale, and from about ``e^-87`` (float32) they round
#: to 0. Within 30, a key down to e^-50 below its row's own shift stays a normal float32.
SEGMENT_SPREAD = 30.0


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
            check_count(name, n, low)  # numpy ints too, as elsewhere in the core
            for name, n, low in (
                ("batch", batch, 0),  # an empty batch, as the layers' forward takes one
                ("heads", heads, 1),
                ("feature_dim", feature_dim, 1),
                ("value_dim", value_dim, 1),
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
        b, h, _, m = self.S.shape
        self._check_inputs({"phi_q_t": phi_q_t, "phi_k_t": phi_k_t, "v_t": v_t}, ())
        self._check_log_scale(k_log_scale, (b, h))
        acc = self._sums_dtype(phi_q_t.dtype)
        q, k, v = phi_q_t.to(acc), phi_k_t.to(acc), v_t.to(acc)
        s, z, log_scale, shift = self._sums_for(
            None if k_log_scale is None else k_log_scale.to(acc), acc
        )
        if shift is not None:
            k = k * torch.exp(k_log_scale.to(acc) - shift)[..., None]  # <= the safe maximum
        s = s + k.unsqueeze(-1) * v.unsqueeze(-2)
        z = z + k
        # autocast would read the float32 state in float16 (forward, or a backward in it)
        num = without_autocast(lambda q, s: (q.unsqueeze(-2) @ s).squeeze(-2), q, s)
        den = (q * z).sum(-1, keepdim=True)
        out = num / (den + self.eps)
        return out.to(phi_q_t.dtype), RecurrentState(s, z, self.eps, log_scale)

    def steps(
        self,
        phi_q: torch.Tensor,
        phi_k: torch.Tensor,
        v: torch.Tensor,
        k_log_scale: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        backend: str | None = None,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """:meth:`step` through ``N`` tokens at once: a prompt read in parallel, or a long
        sequence in segments that carry the state.

        ``phi_q, phi_k: (B,H,N,F)``, ``v: (B,H,N,M)`` → outputs ``(B,H,N,M)`` in the input
        dtype and the state after the block: ``out_i = φq_i·(S + Σ_{j≤i} φk_j v_jᵀ) /
        (φq_i·(Z + Σ_{j≤i} φk_j) + eps)``, what ``N`` steps give. The block's part is the
        core's causal product (``backend`` as in :func:`kernelstudy.causal_dot_product`: the
        compiled kernels where they run), the state's an ``(F, M)`` product, both in the sums'
        dtype where that is wider than the inputs' (a float64 state: then on a backend that
        takes float64, which ``"cuda"`` does not), as :meth:`step` sums. A scaled state
        needs ``k_log_scale: (B,H,N)``: the block's sums share the shift of its largest log
        scale (and the state's), and each row's ``eps`` is scaled to the shift of the row's
        own prefix, as ``kernel_attention`` normalizes causal rows: the outputs equal the
        steps' beyond the safe range too. Where the shift climbs by more than
        ``SEGMENT_SPREAD`` within the block (a later key far above the earlier ones, whose
        features at the later shift would underflow), the block is summed in segments that
        carry the state, each within that spread (:meth:`segment_bounds`; decided on the host,
        one sync; not while ``torch.compile`` traces or inside ``vmap``, where a single block
        reads keys about e^87 below a later key of the block as 0 in float32).
        ``key_padding_mask: (B,N)`` bool, True = real token: padded tokens add nothing to the
        sums (their own outputs read the sums before them). Differentiable in the inputs and
        in the state's tensors (back-propagation through segments).
        """
        b, h, _, m = self.S.shape
        check_tensor(phi_q, "phi_q", 4)  # its length is the block's
        self._check_inputs({"phi_q": phi_q, "phi_k": phi_k, "v": v}, (phi_q.shape[2],))
        check_backend_name(backend)
        n = phi_q.shape[2]
        self._check_log_scale(k_log_scale, (b, h, n))
        mask = None
        if key_padding_mask is not None:
            mask = check_key_padding_mask(key_padding_mask, b, n, phi_q.device)
        if n == 0:
            return v.new_empty(b, h, 0, m), self
        bounds = [0, n] if k_log_scale is None else self.segment_bounds(k_log_scale, mask)
        if len(bounds) == 2:
            return self._block(phi_q, phi_k, v, k_log_scale, mask, backend)
        # split, not sliced: one backward node that joins the segments' gradients (a slice's
        # backward fills a zero tensor of the whole block per segment)
        sizes = [stop - start for start, stop in itertools.pairwise(bounds)]
        pieces = [t.split(sizes, dim=2) for t in (phi_q, phi_k, v, k_log_scale)]
        masks = mask.split(sizes, dim=1) if mask is not None else [None] * len(sizes)
        outs, state = [], self
        for q_i, k_i, v_i, log_i, mask_i in zip(*pieces, masks, strict=True):
            out, state = state._block(q_i, k_i, v_i, log_i, mask_i, backend)
            outs.append(out)
        return torch.cat(outs, dim=2), state

    def segment_bounds(
        self, k_log_scale: torch.Tensor, mask: torch.Tensor | None = None
    ) -> list[int]:
        """``[0, ..., N]``: where a scaled state splits a block of keys with log scales
        ``k_log_scale: (B,H,N)`` (``mask: (B,N)``, True = real key, or None), so that in
        every segment and every (batch, head) the rows' shifts (of the state's and the
        block's keys up to each row) climb by at most ``SEGMENT_SPREAD``, in as few segments
        as that allows. ``[0, N]`` where
        they do in the whole block (one sync to tell), and where the host may not read
        values (:func:`~kernelstudy.core.transforms.host_reads_allowed`)."""
        n = k_log_scale.shape[-1]
        if self.log_scale is None or n < 2 or not host_reads_allowed(k_log_scale):
            return [0, n]
        acc = self.S.dtype
        with torch.no_grad():
            logs = shift_setting(k_log_scale.detach().to(acc))
            if mask is not None:
                logs = logs.masked_fill(~mask[:, None, :], -torch.inf)
            running = torch.maximum(self.log_scale.to(acc)[..., None], logs.cummax(-1).values)
            shift = exp_shift(running, acc)
            # rows before any key (padding first) take the shift of the first row with one:
            # theirs (0) lies above a first key below the range, and the climb from there
            # back to 0 would be missed; so the shift is non-decreasing along the block
            keyed = running > -torch.inf
            first = torch.where(keyed, shift, torch.inf).amin(-1, keepdim=True)
            shift = torch.where(keyed, shift, first.nan_to_num(posinf=0.0))
            if (
                not shift.numel()
                or float((shift[..., -1] - shift[..., 0]).amax()) <= SEGMENT_SPREAD
            ):
                return [0, n]
            # greedy, fewest segments: each ends before the first row, in any (batch, head),
            # whose shift lies more than SEGMENT_SPREAD above that one's at the segment's start
            rows = shift.flatten(0, 1).cpu().contiguous()  # (B·H, N), non-decreasing
            bounds = [0]
            while bounds[-1] < n:
                limit = rows[:, bounds[-1], None] + SEGMENT_SPREAD
                stop = int(torch.searchsorted(rows, limit, right=True).min())
                bounds.append(max(stop, bounds[-1] + 1))  # (stop > start: rows[:, start] fits)
        return bounds

    def _block(
        self,
        phi_q: torch.Tensor,
        phi_k: torch.Tensor,
        v: torch.Tensor,
        k_log_scale: torch.Tensor | None,
        mask: torch.Tensor | None,
        backend: str | None,
    ) -> tuple[torch.Tensor, RecurrentState]:
        """:meth:`steps` through one block of checked inputs, its sums at one shift."""
        m = self.S.shape[-1]
        acc = self._sums_dtype(phi_q.dtype)
        with autocast_off(phi_q):
            q, k, v = phi_q, phi_k, v
            if accumulation_dtype(q.dtype) != acc:  # a float64 state: the block in float64
                q, k, v = q.to(acc), k.to(acc), v.to(acc)  # too, as step() sums it
            new = None
            if k_log_scale is not None:  # padded keys take no part in the maximum
                new = k_log_scale.to(acc)
                if mask is not None:
                    new = new.masked_fill(~mask[:, None, :], -torch.inf)
            top = None if new is None else shift_setting(new).amax(-1)
            s, z, log_scale, shift = self._sums_for(top, acc)
            eps = self.eps
            if shift is not None:  # the block's keys at the state's shift, in the sums' dtype
                q, v = q.to(acc), v.to(acc)
                k = k.to(acc) * torch.exp(new - shift[..., None])[..., None]
                eps = self._prefix_eps(new, shift, acc)
            k, v = zero_padded_keys(k, v, mask)
            both = _block_sums(q, k, v, backend, acc)  # (B,H,N,M+1): [num | den]
            q, k, v = q.to(acc), k.to(acc), v.to(acc)
            # autocast_off covers the forward only: a backward() inside autocast would run
            # these products' backward in half precision (the state's 76% off after 2000 keys)
            sz = torch.cat([s, z[..., None]], dim=-1)
            both = both + without_autocast(lambda q, sz: q @ sz, q, sz)
            out = both[..., :m] / (both[..., m:] + eps)
            s = s + without_autocast(lambda k, v: k.transpose(-1, -2) @ v, k, v)
            z = z + k.sum(-2)
        return out.to(phi_q.dtype), RecurrentState(s, z, self.eps, log_scale)

    def _check_inputs(self, tensors: dict[str, torch.Tensor], seq: tuple[int, ...]) -> None:
        """TypeError/ValueError naming the tensor unless ``tensors`` (φq, φk, v) are float
        tensors of shapes ``(B,H,*seq,F)``, ``(B,H,*seq,F)``, ``(B,H,*seq,M)`` of one dtype on
        the state's device."""
        b, h, f, m = self.S.shape
        for (name, t), last in zip(tensors.items(), (f, f, m), strict=True):
            check_tensor(t, name, 3 + len(seq))
            want = (b, h, *seq, last)
            if tuple(t.shape) != want:
                raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")
        check_same_dtype_and_device(tensors)
        device = next(iter(tensors.values())).device
        if device != self.S.device:
            raise ValueError(f"the inputs are on {device} but the state is on {self.S.device}")

    def _check_log_scale(self, k_log_scale: object, shape: tuple[int, ...]) -> None:
        """ValueError unless ``k_log_scale`` is given exactly for a scaled state, as a float
        tensor of ``shape`` on the state's device."""
        if (self.log_scale is None) != (k_log_scale is None):
            raise ValueError(
                "k_log_scale must be given exactly when the state is scaled "
                f"(this state is {'' if self.log_scale is not None else 'not '}scaled)"
            )
        if k_log_scale is None:
            return
        if not isinstance(k_log_scale, torch.Tensor) or not k_log_scale.is_floating_point():
            got = getattr(k_log_scale, "dtype", type(k_log_scale).__name__)
            raise TypeError(f"k_log_scale must be a float tensor of shape {shape}, got {got}")
        if tuple(k_log_scale.shape) != shape:
            raise ValueError(f"k_log_scale must have shape {shape}, got {tuple(k_log_scale.shape)}")
        if k_log_scale.device != self.S.device:
            raise ValueError(
                f"k_log_scale is on {k_log_scale.device} but the state is on {self.S.device}"
            )

    def _prefix_eps(
        self, logs: torch.Tensor, shift: torch.Tensor, acc: torch.dtype
    ) -> torch.Tensor:
        """``eps`` for each row of a block whose sums are at ``shift: (B,H)``, as if they were
        at the shift of the row's own prefix (what a step there has): ``(B,H,N,1)``.

        The sums at shift c are those at c_t times ``exp(c_t − c)`` (c_t ≤ c, the shift of the
        running maximum of the state's and the block's ``logs: (B,H,N)`` up to the row), so
        the row's ``eps`` is scaled by it; at least the dtype's smallest normal number (a
        row whose keys all underflow reads 0, not 0/0)."""
        running = torch.maximum(self.log_scale.to(acc)[..., None], logs.cummax(-1).values)
        factor = torch.exp(exp_shift(running, acc) - shift[..., None])
        return (self.eps * factor).clamp_min(torch.finfo(acc).tiny)[..., None]

    def _sums_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The sums' dtype for inputs of ``dtype``: the state's, float64 for float64 inputs."""
        return torch.float64 if accumulation_dtype(dtype) == torch.float64 else self.S.dtype

    def _sums_for(
        self, new_max: torch.Tensor | None, acc: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(S, Z, log_scale, shift)`` in ``acc`` for keys whose largest log scale is
        ``new_max: (B,H)`` (None for a plain state: log_scale and shift None). A scaled state's
        sums move to the shift of the new maximum: multiplied by ``exp(old shift − shift)``
        (≤ 1: ``exp_shift`` grows with its argument; 1 while the state is empty)."""
        s, z = self.S.to(acc), self.Z.to(acc)
        if new_max is None:
            return s, z, None, None
        old = self.log_scale.to(acc)
        log_scale = torch.maximum(old, new_max)
        # the sums' dtype, not the inputs': the sums keep one shift whatever each step holds
        shift = exp_shift(log_scale, acc)
        shift_old = torch.where(old == -torch.inf, shift, exp_shift(old, acc))
        decay = torch.exp(shift_old - shift)
        return s * decay[..., None, None], z * decay[..., None], log_scale, shift


def _block_sums(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str | None, acc: torch.dtype
) -> torch.Tensor:
    """``[Σ_{j≤i} (q_i·k_j) v_j | Σ_{j≤i} q_i·k_j]``: ``(B,H,N,M+1)`` in ``acc``, one causal
    product with a column of ones beside ``v`` on ``backend``."""
    chosen = resolve_backend(backend, q)
    if q.dtype == torch.float16 and chosen.attention is not None:
        # a backend with a fused attention may round its product to the inputs' dtype, and a
        # float16 normalizer overflows at 65504: its products run in float32 instead
        q, k, v = q.float(), k.float(), v.float()
    v1 = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], dim=-1)
    return chosen.product(q, k, v1).to(acc)
