"""The base class of every feature map φ and the declaration of its hyperparameters."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from ..arguments import check_flag
from ..core.validation import FLOAT_DTYPES, check_dense


@dataclass(frozen=True)
class Hyperparameter:
    """One hyperparameter of a feature map: its type, default and allowed range.

    ``low``/``high`` bound numbers (inclusive); ``choices`` lists allowed values;
    ``log`` says a search should sample it on a log scale; ``search`` says
    whether searches tune it (False for seeds and structural switches).
    """

    type: type
    default: Any
    low: float | None = None
    high: float | None = None
    choices: tuple | None = None
    log: bool = False
    search: bool = True
    nullable: bool = False
    doc: str = ""

    def validate(self, name: str, value: Any) -> Any:
        """Return ``value`` (ints accepted for floats) or raise naming ``name``."""
        if value is None and self.nullable:
            return None
        if self.type is bool and isinstance(value, np.bool_):  # numpy's, as check_flag
            value = bool(value)
        if isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_):
            if self.type is float:  # ints and numpy numbers too; the config keeps Python's
                try:
                    value = float(value)
                except OverflowError:  # an int beyond float's range
                    raise ValueError(f"{name} must be finite, got {value!r}") from None
            elif self.type is int and isinstance(value, numbers.Integral):
                value = int(value)
        ok_type = isinstance(value, self.type) and not (
            self.type is not bool and isinstance(value, bool)
        )
        if not ok_type:
            raise TypeError(f"{name} must be {self.type.__name__}, got {value!r}")
        if self.choices is not None and value not in self.choices:
            raise ValueError(f"{name} must be one of {list(self.choices)}, got {value!r}")
        if self.type is float and not math.isfinite(value):
            raise ValueError(f"{name} must be finite, got {value!r}")
        if self.low is not None and value < self.low:
            raise ValueError(f"{name} must be >= {self.low}, got {value!r}")
        if self.high is not None and value > self.high:
            raise ValueError(f"{name} must be <= {self.high}, got {value!r}")
        return value

    def describe(self) -> str:
        """Short text such as ``int in [1, 3] = 1``."""
        if self.choices is not None:
            rng = "{" + ", ".join(map(str, self.choices)) + "}"
        elif self.low is not None or self.high is not None:
            rng = f"[{self.low if self.low is not None else '-inf'}, "
            rng += f"{self.high if self.high is not None else 'inf'}]"
        else:
            rng = ""
        return f"{self.type.__name__}{' in ' + rng if rng else ''} = {self.default!r}"


def resolve_seed(seed: Any) -> Any:
    """An int seed from ``seed``: None draws one from torch's global CPU RNG (so
    ``torch.manual_seed`` makes it reproducible, whatever the default device: a map built
    on the meta device too), a ``torch.Generator`` draws one from that generator; anything
    else is returned for validation."""
    if seed is None:
        return int(torch.randint(0, 2**31 - 1, (), device="cpu"))
    if isinstance(seed, torch.Generator):  # a CUDA generator draws on its own device
        return int(torch.randint(0, 2**31 - 1, (), generator=seed, device=seed.device))
    return seed


def fill_on_cpu_(weight: torch.Tensor, draw: Callable[[torch.Tensor], object]) -> torch.Tensor:
    """``weight`` (on any device, of any dtype) set in place to what ``draw`` writes into a
    float32 CPU tensor of its shape, e.g. ``lambda w: w.uniform_(-b, b, generator=g)`` with a
    CPU generator ``g``: a seed gives the same weights on every device and whatever the
    default dtype (the generator's stream differs by dtype: a float64 default drew other
    weights from the same seed, and half ones had no orthogonal init on the CPU), and a map
    builds under a CUDA default device (``with torch.device("cuda")``), where a CPU generator
    cannot fill a CUDA tensor. Returns ``weight``."""
    with torch.no_grad():
        drawn = torch.empty(weight.shape, dtype=torch.float32, device="cpu")
        draw(drawn)
        weight.copy_(drawn)
    return weight


def compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """At least float32 (half inputs are computed in float32), float64 if either is."""
    return torch.promote_types(torch.promote_types(x.dtype, weight.dtype), torch.float32)


#: The ``seed`` hyperparameter of every map with random draws or a random init.
SEED = Hyperparameter(
    int,
    None,
    low=0,
    high=2**32 - 1,  # torch's CPU generator keeps only a seed's low 32 bits
    nullable=True,
    search=False,
    doc="seed of the random draws (None: draw one; the config records it)",
)


#: The ``shared`` hyperparameter of :class:`HeadwiseFeatureMap`: one weight for all heads.
SHARED = Hyperparameter(bool, True, search=False, doc="one W for all heads (False: one per head)")


def _add_missing_hyperparameters(cls: type, base: dict[str, Hyperparameter]) -> None:
    """Give ``cls`` those of a base class's ``hyperparameters`` that its own left out (the
    base's methods read them)."""
    missing = {k: v for k, v in base.items() if k not in cls.hyperparameters}
    if missing:
        cls.hyperparameters = {**cls.hyperparameters, **missing}


def _registered_name(cls: type) -> str | None:
    """The registered name of ``cls`` or, for a class that is not registered itself, of the
    nearest registered class it derives from; None if there is none."""
    for base in cls.__mro__:
        name = base.__dict__.get("name")
        if isinstance(name, str) and name and ":" not in name:
            return name
    return None


class FeatureMap(nn.Module):
    """A feature map φ: ``(..., N, D) → (..., N, F)``, applied per head.

    Subclasses set the class attributes below, declare ``hyperparameters``,
    and implement ``features`` and ``feature_dim``. Inputs are ``(B,H,N,D)``
    (any leading shape works for maps without per-head parameters) with
    ``D == head_dim``; outputs are ``(B,H,N,F)``.
    """

    name: ClassVar[str] = ""
    paper: ClassVar[str] = ""
    trainable: ClassVar[bool] = False
    random: ClassVar[bool] = False
    positive: ClassVar[bool] = True
    feature_dim_formula: ClassVar[str] = "D"
    #: the hyperparameter that sets F, through which studies match maps at one F (None: the
    #: first of ``kernelstudy.analysis.matching.SIZE_KNOBS`` the map has, if any)
    size_hyperparameter: ClassVar[str | None] = None
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {}
    #: hyperparameters that decide the values of the saved tensors (how they are drawn or
    #: initialized) without showing in their shapes: a state dict loads only into a map that
    #: agrees on them (``seed`` is not one: a load adopts the saved seed)
    state_hyperparameters: ClassVar[tuple[str, ...]] = ()

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__()
        for arg, value in (("head_dim", head_dim), ("num_heads", num_heads)):
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{arg} must be a positive int, got {value!r}")
        head_dim, num_heads = int(head_dim), int(num_heads)  # numpy ints too
        unknown = sorted(set(hparams) - set(self.hyperparameters))
        if unknown:
            known = ", ".join(sorted(self.hyperparameters)) or "none"
            raise ValueError(
                f"unknown hyperparameter(s) {unknown} for feature map {self.name!r}; "
                f"it takes: {known}"
            )
        if "seed" in self.hyperparameters:  # None or a Generator becomes a recorded int
            hparams["seed"] = resolve_seed(hparams.get("seed"))
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.hparams: dict[str, Any] = {}
        for key, spec in self.hyperparameters.items():
            self.hparams[key] = spec.validate(key, hparams.get(key, spec.default))

    @property
    def feature_dim(self) -> int:
        """F, the number of features per head."""
        raise NotImplementedError(f"{type(self).__name__} must define feature_dim (a @property)")

    @property
    def keys_need_sequence(self) -> bool:
        """True when φ(k_j) depends on the other keys of its sequence (a per-sequence
        stabilizer): keys one step at a time then go through :meth:`key_features`."""
        return False

    def features(self, x: torch.Tensor, is_query: bool) -> torch.Tensor:
        """φ(x) for a validated ``x: (B,H,N,D)``."""
        raise NotImplementedError(f"{type(self).__name__} must implement features(x, is_query)")

    def _check_input(self, x: object) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:  # float8 too: no map's operations take it
            raise TypeError(
                f"x must be a float16, bfloat16, float32 or float64 tensor, got dtype {x.dtype}"
            )
        check_dense(x, "x")
        if x.dim() < 1 or x.shape[-1] != self.head_dim:
            raise ValueError(
                f"x must have last dimension head_dim={self.head_dim}, got shape {tuple(x.shape)}"
            )
        weight = None if torch.compiler.is_compiling() else self._first_weight()
        if weight is not None and weight.device != x.device:  # torch's x_cpu @ w_meta gives
            raise ValueError(  # a CPU tensor of uninitialized memory, not an error
                f"x is on {x.device}, but the feature map's weights are on {weight.device} "
                "(move one: fm.to(x.device))"
            )

    def _first_weight(self) -> torch.Tensor | None:
        """The first parameter or persistent buffer (tables a map re-makes on the input's
        device are not persistent), or None for a map without any."""
        for param in self.parameters():
            return param
        for module in self.modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    return buffer
        return None

    def forward(self, x: torch.Tensor, is_query: bool = True) -> torch.Tensor:
        """φ(x): ``(B,H,N,D) → (B,H,N,F)``. ``is_query`` picks query/key behaviour."""
        self._check_input(x)
        out = self.features(x, check_flag("is_query", is_query))
        dim = self.feature_dim
        if out.shape[-1] != dim:  # a map's own bug, named before a state holds it
            shown = dim if isinstance(dim, int) else f"a {type(dim).__name__}, not a @property"
            raise RuntimeError(
                f"feature map {type(self).__name__} returned {out.shape[-1]} features per "
                f"token, but its feature_dim is {shown}"
            )
        return out

    def key_features(self, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys mapped one at a time (RNN mode): ``(φ̂: (B,H,N,F), log_scale: (B,H,N))``.

        φ̂_j·exp(log_scale_j) is the key's feature before any per-sequence
        stabilizer, so a :class:`~kernelstudy.core.RecurrentState` created with
        ``scaled=True`` can keep its sums at a running maximum scale and give the
        batch output. Maps without such a stabilizer return ``(φ(k), 0)``; maps
        with one must override this.
        """
        if self.keys_need_sequence:
            raise NotImplementedError(
                f"feature map {type(self).__name__} stabilizes keys per sequence, so it must "
                "implement key_features() to be stepped one key at a time"
            )
        phi = self(k, is_query=False)
        return phi, torch.zeros(phi.shape[:-1], dtype=torch.float32, device=phi.device)

    def config(self) -> dict[str, Any]:
        """A JSON-serializable dict that ``create_feature_map`` turns back into this map.

        Its ``name`` is the registered name, or ``"module:Class"`` for a class that is
        not registered itself (a user's map, or a subclass of a registered one).
        """
        cls = type(self)
        name = cls.__dict__.get("name") or f"{cls.__module__}:{cls.__qualname__}"
        return {
            "name": name,
            "head_dim": self.head_dim,
            "num_heads": self.num_heads,
            **self.hparams,
        }

    @classmethod
    def state_hparams(cls, hparams: Mapping[str, Any]) -> dict[str, Any]:
        """The entries of ``hparams`` (a map's, or a saved config's) that its tensors' values
        depend on: those of ``state_hyperparameters`` that it has."""
        return {k: hparams[k] for k in cls.state_hyperparameters if k in hparams}

    @property
    def _has_extra_state(self) -> bool:
        """Whether the state dict carries an extra state for this map: its config (maps with a
        seed or ``state_hyperparameters``), or a subclass's own ``get_extra_state``. Others
        keep the keys they always had."""
        own = type(self).get_extra_state is not FeatureMap.get_extra_state
        return own or "seed" in self.hparams or bool(self.state_hyperparameters)

    def get_extra_state(self) -> dict[str, Any]:
        """Saved in the state dict of maps with a seed or ``state_hyperparameters``: the seed
        of the tensors held and the map's ``config()``. A load adopts the seed (so
        ``config()`` names the tensors held) and refuses other ``state_hyperparameters``."""
        state: dict[str, Any] = {"config": self.config()}
        if "seed" in self.hparams:
            state["seed"] = self.hparams["seed"]
        return state

    #: the keys that the saved extra state must have (older state dicts lack ``config``)
    _extra_state_keys: ClassVar[tuple[str, ...]] = ()

    def set_extra_state(self, state: Any) -> None:
        """Adopt the saved seed (the saved config was checked by the load)."""
        keys = self._extra_state_keys
        if (
            not isinstance(state, dict)
            or not set(keys) <= set(state)
            or not isinstance(state.get("config", {}), dict)
        ):
            needs = f" with {', '.join(map(repr, keys))}" if keys else ""
            raise ValueError(
                f"{type(self).__name__}: the state dict's extra state must be a dict{needs} "
                f"(and the saved map's 'config' dict), got {state!r}"
            )
        if "seed" in self.hparams and "seed" in state:
            self.hparams["seed"] = self.hyperparameters["seed"].validate("seed", state["seed"])

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self._has_extra_state:
            del destination[prefix + "_extra_state"]

    def _state_mismatch(self, saved: dict[str, Any]) -> str | None:
        """Why this map cannot hold the tensors of the map whose config is ``saved`` (another
        registered map, or ``state_hyperparameters`` that differ), or None. A saved user's map
        (``"module:Class"``) is not checked by name (a class moved to another module still
        loads its saved states), nor is a user's map that subclasses no registered map; a
        user's subclass of a registered map is checked as that map."""
        name, saved_name = self.config()["name"], saved.get("name")
        kind = _registered_name(type(self))  # a user's subclass of oglu is checked as an oglu
        registered = isinstance(saved_name, str) and ":" not in saved_name
        if registered and kind not in (None, saved_name):  # glu into oglu, favor into trig_rf
            parent = "" if kind == name else f", a subclass of {kind!r}"
            return (
                f"the saved tensors are those of feature map {saved_name!r}, but this is a "
                f"{name!r} map ({type(self).__name__}{parent}): create a {saved_name!r} map"
            )
        ours, theirs = self.state_hparams(self.hparams), self.state_hparams(saved)
        differ = [k for k in ours if k in theirs and ours[k] != theirs[k]]
        if not differ:
            return None
        saved_values = ", ".join(f"{k}={theirs[k]!r}" for k in differ)
        return (
            f"the saved tensors were drawn or initialized by {saved.get('name', 'a map')} "
            f"with {saved_values}, but this {type(self).__name__} was built with "
            + ", ".join(f"{k}={ours[k]!r}" for k in differ)
            + f" (its config() would describe other tensors): create it with {saved_values}"
        )

    def _tensors_fit(self, state_dict: Mapping[str, Any], prefix: str) -> bool:
        """Whether ``state_dict`` holds every saved tensor of this map (its submodules' too)
        at its shape, so that the load replaces them all."""
        return all(
            torch.is_tensor(saved := state_dict.get(prefix + key)) and saved.shape == t.shape
            for key, t in self.state_dict(keep_vars=True).items()
            if torch.is_tensor(t)
        )

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load as ``nn.Module`` does, but: a saved config naming another registered map or
        other ``state_hyperparameters`` adds an error and loads nothing of this map (its
        submodules' tensors neither); the saved seed is adopted only when every tensor loads;
        a missing extra state (state dicts saved before it existed) is allowed, and one given
        to a map without extra state is an unexpected key, as for any module."""
        key = prefix + "_extra_state"
        if not self._has_extra_state:
            if key in state_dict:  # (torch calls set_extra_state of every FeatureMap)
                del state_dict[key]
                if strict:
                    unexpected_keys.append(key)
        else:  # refused before anything loads
            saved = state_dict.get(key)
            config = saved.get("config") if isinstance(saved, dict) else None
            why = self._state_mismatch(config) if isinstance(config, dict) else None
            if why is not None:
                error_msgs.append(f"{prefix.rstrip('.') or 'the feature map'}: {why}")
                # the submodules load next, from state_dict: they get back what they hold
                for k in [k for k in state_dict if k.startswith(prefix)]:
                    del state_dict[k]
                state_dict.update(self.state_dict(prefix=prefix, keep_vars=True))
                return
        before = self.get_extra_state() if "seed" in self.hparams else None
        fits = self._tensors_fit(state_dict, prefix)
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        if key in missing_keys:
            missing_keys.remove(key)
        if not fits and before is not None:
            # the tensors were not all loaded (a size mismatch, or missing with strict=False):
            # keep the seed that names the tensors still held
            self.set_extra_state(before)
        self._state_loaded(fits)

    def _state_loaded(self, loaded: bool) -> None:
        """Called at the end of a load: ``loaded`` says every tensor was replaced."""

    def regularization(self) -> torch.Tensor:
        """A scalar penalty to add to the training loss (0 for maps without one)."""
        ref = next(iter(self.parameters()), None)
        if ref is None:
            ref = next(iter(self.buffers()), None)
        device = ref.device if ref is not None else None
        return torch.zeros((), device=device)

    def extra_repr(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams.items())
        return f"head_dim={self.head_dim}, F={self.feature_dim}" + (f", {args}" if args else "")


class RandomFeatureMap(FeatureMap):
    """Base of random-feature maps: features from random draws fixed by ``seed``.

    Subclasses implement ``draw(generator)`` (set their buffers from the generator),
    call ``self.redraw(self.hparams["seed"])`` at the end of ``__init__`` (once their
    buffers exist: the first draw), and call ``self.maybe_redraw(is_query)`` at the
    start of ``features``, which raises if no draw has happened.
    ``redraw_every = k > 0`` redraws after every k query calls in training mode
    (a call is one query pass, so queries and keys of one attention share a draw);
    in eval mode the features stay fixed. Such a map in training mode holds per-call state:
    do not share it between threads (another thread's query call may redraw between this
    one's queries and keys). A redraw due inside ``torch.func.functional_call`` with the
    map's buffers in the dict lands on the call's tensors, which torch swaps back after it:
    the map keeps its old draw while ``config()`` names the new seed. Leave the buffers out
    of the dict, or count the query call outside it (``maybe_redraw(True)``) and make the
    call with the map in eval mode, as ``analysis.attention_matrix`` does.
    A graph compiled whole (``fullgraph=True``) cannot redraw at all (new generators).

    The seed of the draw held is also the buffer ``drawn_seed`` (not saved: the state dict's
    extra state has it), which a redraw derives the next seed from: torch's
    DistributedDataParallel broadcasts rank 0's buffers, so ranks whose maps were built with
    other seeds (``seed=None`` after a per-rank ``torch.manual_seed``) hold rank 0's draw and
    redraw alike, where the next seeds of their own made each rank's features differ.
    """

    random: ClassVar[bool] = True
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {
        "seed": SEED,
        "redraw_every": Hyperparameter(
            int,
            0,
            low=0,
            search=False,
            doc="in training, redraw after this many query calls (0: never)",
        ),
    }

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """A subclass's ``hyperparameters`` get ``seed`` and ``redraw_every`` when it left
        them out (``redraw`` reads them)."""
        super().__init_subclass__(**kwargs)
        _add_missing_hyperparameters(cls, RandomFeatureMap.hyperparameters)

    def __init__(self, head_dim: int, num_heads: int = 1, **hparams: Any) -> None:
        super().__init__(head_dim, num_heads, **hparams)
        self.calls_since_draw = 0
        self.drawn = False  # set by redraw() and by loading a state dict
        self.register_buffer("drawn_seed", torch.zeros((), dtype=torch.int64), persistent=False)

    def draw(self, generator: torch.Generator) -> None:
        """Set the random buffers from ``generator`` (a CPU generator)."""
        raise NotImplementedError

    def redraw(self, seed: int | torch.Generator | None = None) -> None:
        """New random features from ``seed``; None derives the next seed from the current
        one (deterministic, so two maps with one seed stay equal), or for the first draw takes
        it (a map rebuilt from its config then draws the same). ``config()`` records it."""
        if seed is None and not self.drawn:
            seed = self.hparams["seed"]
        if seed is None:
            seed = resolve_seed(torch.Generator().manual_seed(self._seed_held()))
        seed = self.hyperparameters["seed"].validate("seed", resolve_seed(seed))
        with torch.inference_mode(False):  # an inference tensor could never be saved for
            self.draw(torch.Generator().manual_seed(seed))  # a backward afterwards
        self._hold_seed(seed)  # only once drawn: config() names the features held
        self.calls_since_draw = 0
        self.drawn = True

    def _seed_held(self) -> int:
        """The seed of the draw held: ``drawn_seed`` (rank 0's under DDP), or the config's
        where the buffer holds no value (on the meta device) or is missing (a whole map
        pickled by a version before it)."""
        held = self._buffers.get("drawn_seed")
        if getattr(self, "drawn", False) and held is not None and not held.is_meta:
            self.hparams["seed"] = int(held)
        return self.hparams["seed"]

    def _hold_seed(self, seed: int) -> None:
        """Record ``seed`` as the draw's: in the config and in ``drawn_seed`` (in place, so a
        DDP broadcast keeps reaching it)."""
        self.hparams["seed"] = seed
        held = self._buffers.get("drawn_seed")
        if held is None or held.is_inference():  # pickled before it, or made under
            device = held.device if held is not None else None  # inference_mode: a new one
            fresh = torch.tensor(seed, dtype=torch.int64, device=device)
            self.register_buffer("drawn_seed", fresh, persistent=False)
        elif not held.is_meta:
            with torch.no_grad(), torch.inference_mode(False):
                held.fill_(seed)

    def config(self) -> dict[str, Any]:
        self._seed_held()  # rank 0's seed where DDP broadcast its draw
        return super().config()

    _extra_state_keys: ClassVar[tuple[str, ...]] = ("seed", "calls_since_draw")

    def get_extra_state(self) -> dict[str, Any]:
        """Saved in the state dict: the seed of the current draw, the query calls since
        and the config, so that a loaded map's ``config()`` names the features it holds and
        a resumed training redraws where the original would have."""
        return {**super().get_extra_state(), "calls_since_draw": int(self.calls_since_draw)}

    def set_extra_state(self, state: Any) -> None:
        super().set_extra_state(state)
        self._hold_seed(self.hparams["seed"])
        self.calls_since_draw = int(state["calls_since_draw"])

    def _state_loaded(self, loaded: bool) -> None:
        if loaded:
            self.drawn = True  # the buffers hold a saved draw

    def maybe_redraw(self, is_query: bool) -> None:
        """Count a query call in training mode and redraw when ``redraw_every`` calls are done.

        Raises RuntimeError if the map has never drawn (its buffers would hold whatever
        ``__init__`` put there, whatever the seed)."""
        if not self.drawn:
            raise RuntimeError(
                f"feature map {type(self).__name__} has not drawn its random features: call "
                "self.redraw(self.hparams['seed']) at the end of its __init__"
            )
        every = self.hparams["redraw_every"]
        if not (every and self.training and is_query):
            return
        if self.calls_since_draw >= every:
            self.redraw()
        self.calls_since_draw += 1


class HeadwiseFeatureMap(FeatureMap):
    """Base of trainable maps with weights applied per head: ``(H', n, m)`` tensors where
    H' = 1 when the ``shared`` hyperparameter is True and ``num_heads`` otherwise.

    Per-head weights need inputs ``(B, num_heads, N, D)``; shared ones take any
    leading shape. A subclass's ``hyperparameters`` get ``shared`` (:data:`SHARED`) when it
    left it out.
    """

    trainable: ClassVar[bool] = True
    hyperparameters: ClassVar[dict[str, Hyperparameter]] = {"shared": SHARED}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _add_missing_hyperparameters(cls, HeadwiseFeatureMap.hyperparameters)

    @property
    def weight_heads(self) -> int:
        """H', the number of weight copies: 1 if shared across heads, else ``num_heads``."""
        return 1 if self.hparams["shared"] else self.num_heads

    def headwise(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``x @ weight`` per head: ``(..., N, n) @ (H', n, m) → (..., N, m)``."""
        if weight.shape[0] == 1:
            return x @ weight[0]
        if x.dim() != 4 or x.shape[1] != weight.shape[0]:
            raise ValueError(
                f"x must have shape (B, num_heads={weight.shape[0]}, N, {self.head_dim}) for "
                f"per-head weights (shared=False), got {tuple(x.shape)}"
            )
        return x @ weight.unsqueeze(0)
