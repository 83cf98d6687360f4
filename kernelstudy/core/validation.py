"""Input checks shared by every entry point of the core.

Every public function of the core validates its arguments here, so that bad
input fails with a ``ValueError``/``TypeError`` naming the argument instead of
deep inside a kernel.
"""

from __future__ import annotations

import contextlib

import torch

from ..arguments import check_flag, is_real
from .transforms import constant_when_traced

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: the axes a tensor of each rank holds, for error messages
AXES = {2: "(batch, heads)", 3: "(batch, heads, dim)", 4: "(batch, heads, seq, dim)"}


def check_dense(x: torch.Tensor, name: str) -> None:
    """TypeError naming ``name`` unless the tensor ``x`` is dense (strided): sparse layouts
    failed deep inside the products, the maps and the projections."""
    if x.layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got layout {x.layout}")


def check_device(name: str, device: object) -> torch.device:
    """``device`` as a torch.device, else TypeError/ValueError naming ``name`` (torch's own
    RuntimeError names neither the argument nor the function), also for a device this machine
    lacks (torch raised AssertionError for CUDA)."""
    if not isinstance(device, torch.device | str | int) or isinstance(device, bool):
        raise TypeError(
            f"{name} must be a torch.device or a string such as 'cuda:0', got {device!r}"
        )
    try:
        dev = torch.device(device)
    except RuntimeError as err:
        raise ValueError(
            f"{name} must name a device such as 'cpu' or 'cuda:0', got {device!r}"
        ) from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        # torch raised AssertionError("Torch not compiled with CUDA enabled") at first use
        raise ValueError(f"{name}={str(dev)!r} is not usable here: torch finds no CUDA device")
    if dev.type not in ("cpu", "meta", "cuda"):
        try:
            torch.empty(0, device=dev)
        except (RuntimeError, AssertionError) as err:
            first = (str(err).strip() or type(err).__name__).splitlines()[0]
            raise ValueError(f"{name}={str(dev)!r} is not usable here: {first}") from None
    return dev


def check_tensor(x: object, name: str, ndim: int) -> torch.Tensor:
    """Check that ``x`` is a floating-point tensor of rank ``ndim``."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{name} must be a floating-point tensor (float16, bfloat16, float32 or "
            f"float64), got dtype {x.dtype}"
        )
    check_dense(x, name)
    if x.dim() != ndim:
        raise ValueError(
            f"{name} must have {ndim} dimensions {AXES.get(ndim, '')}, got shape {tuple(x.shape)}"
        )
    return x


def check_eps(eps: float, dtype: torch.dtype | None = None) -> float:
    """``eps`` as a float > 0, else TypeError/ValueError naming it. With the inputs' ``dtype``,
    also at least the smallest normal number of their accumulation dtype: a smaller eps is 0
    in (or flushed from) the sums, and a normalizer with nothing summed gives 0/0 = NaN."""
    if not is_real(eps):
        raise TypeError(f"eps must be a positive float, got {type(eps).__name__}")
    if not 0 < eps < float("inf"):
        raise ValueError(f"eps must be a finite float > 0, got {eps}")
    if dtype is not None:
        acc = accumulation_dtype(dtype)
        tiny = torch.finfo(acc).tiny
        if eps < tiny:
            raise ValueError(
                f"eps must be >= {tiny:.3g} ({acc}'s smallest normal: the sums are {acc}), "
                f"got {eps}"
            )
    return float(eps)


def check_same_dtype_and_device(tensors: dict[str, torch.Tensor]) -> None:
    """TypeError unless the named tensors share one dtype, ValueError unless one device."""
    names = ", ".join(list(tensors)[:-1]) + " and " + list(tensors)[-1]
    for attr, error in (("dtype", TypeError), ("device", ValueError)):
        values = [getattr(t, attr) for t in tensors.values()]
        if any(x != values[0] for x in values):
            got = ", ".join(str(x) for x in values)
            raise error(f"{names} must share one {attr}, got {got}")


def check_qkv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    names: tuple[str, str, str] = ("phi_q", "phi_k", "v"),
    causal: bool = False,
) -> bool:
    """Check ``q: (B,H,N,F)``, ``k: (B,H,S,F)``, ``v: (B,H,S,M)`` (``S == N`` if causal);
    returns ``causal`` as a bool (:func:`check_flag`)."""
    nq, nk, nv = names
    causal = check_flag("causal", causal)
    check_tensor(q, nq, 4)
    check_tensor(k, nk, 4)
    check_tensor(v, nv, 4)
    check_same_dtype_and_device({nq: q, nk: k, nv: v})
    for axis, label in ((0, "batch"), (1, "heads")):
        if not (q.shape[axis] == k.shape[axis] == v.shape[axis]):
            raise ValueError(
                f"{nq}, {nk} and {nv} must agree in {label} size (dim {axis}), got shapes "
                f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} and {nk} must have the same last dimension, got {q.shape[-1]} and {k.shape[-1]}"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{nk} and {nv} must have the same sequence length, got {k.shape[2]} and {v.shape[2]}"
        )
    if causal and q.shape[2] != k.shape[2]:
        raise ValueError(
            f"causal attention needs {nq} and {nk} of the same sequence length, "
            f"got {q.shape[2]} and {k.shape[2]}"
        )
    return causal


def check_key_padding_mask(
    mask: object, batch: int, seq: int, device: torch.device, name: str = "key_padding_mask"
) -> torch.Tensor:
    """Check a ``(B, S)`` bool mask, True for real tokens (``name`` says which mask, as the
    analyses also check a ``query_padding_mask``)."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a bool torch.Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool, got {mask.dtype}")
    if tuple(mask.shape) != (batch, seq):
        raise ValueError(
            f"{name} must have shape (batch, seq) = ({batch}, {seq}), got {tuple(mask.shape)}"
        )
    if mask.device.type == "meta" and torch.device(device).type != "meta":  # no data to move
        raise ValueError(f"{name} is a meta tensor (no values) for inputs on {device}")
    return mask.to(device)


def zero_padded_keys(
    k: torch.Tensor, v: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``k: (B,H,S,·)`` and ``v: (B,H,S,M)`` with padded positions zeroed, whatever they
    held (inf and NaN included), so they contribute nothing; the mask is checked."""
    if key_padding_mask is None:
        return k, v
    mask = check_key_padding_mask(key_padding_mask, k.shape[0], k.shape[2], k.device)
    keep = mask[:, None, :, None]
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    return torch.where(keep, k, zero), torch.where(keep, v, zero)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other float type accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def autocast_off(example: torch.Tensor) -> contextlib.AbstractContextManager:
    """A context with autocast off on ``example``'s device (nothing where autocast does
    not exist). The core runs its sums in it: autocast would round each product of
    the float32 accumulation back to float16 or bfloat16 (a float16 normalizer
    overflows at a few thousand keys)."""
    device = example.device.type
    # where autocast is not on there is nothing to turn off: a disabled region would cost a
    # few µs on every call of the core (twice a training step of a product)
    if _autocast_available(device) and torch.is_autocast_enabled(device):
        return torch.autocast(device, enabled=False)
    return contextlib.nullcontext()


@constant_when_traced  # torch.compile asks once, outside the graph
def _autocast_available(device_type: str) -> bool:
    """``torch.amp.is_autocast_available``: dynamo in torch 2.11 cannot trace it (a graph
    break, an error under ``fullgraph=True``; the H200, 2026-11-30)."""
    return torch.amp.is_autocast_available(device_type)
