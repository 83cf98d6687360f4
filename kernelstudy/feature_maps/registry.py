"""The feature-map registry: register, list and create maps by name or config."""

from __future__ import annotations

import contextlib
import contextvars
import difflib
import fnmatch
import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from .base import FeatureMap, Hyperparameter

_REGISTRY: dict[str, type[FeatureMap]] = {}

#: Modules of feature maps defined outside kernelstudy, comma-separated, imported before the
#: registry is first read (so the CLI, studies and saved configs know their maps).
ENV_FEATURE_MAPS = "KERNELSTUDY_FEATURE_MAPS"
#: Entry-point group: an installed package lists ``name = "its.module"`` under it.
ENTRY_POINT_GROUP = "kernelstudy.feature_maps"
#: Names the models read as other attentions (``attention="softmax"``, ``"kernel"``): a map
#: registered under one would never be built by them.
RESERVED_NAMES = ("softmax", "kernel")
#: Keys of a map's config besides its hyperparameters.
CONFIG_KEYS = ("name", "head_dim", "num_heads")
#: Set (to the file's description) while a saved file's names are resolved: see
#: :func:`names_from_saved_file`.
_SAVED_FILE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "kernelstudy_saved_file", default=None
)


@contextlib.contextmanager
def names_from_saved_file(what: str) -> Iterator[None]:
    """Within: a ``"module:Class"`` name is resolved only from a module already imported
    (or listed in ``$KERNELSTUDY_FEATURE_MAPS``); importing one a saved file names would
    run that module's code, as unpickling would. ``what`` names the file in the error."""
    token = _SAVED_FILE.set(what)
    try:
        yield
    finally:
        _SAVED_FILE.reset(token)


def register_feature_map(name: str) -> Callable[[type[FeatureMap]], type[FeatureMap]]:
    """Class decorator: ``@register_feature_map("mymap")`` adds a FeatureMap subclass."""
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"name must be a non-empty str without ':', got {name!r}")
    if name in RESERVED_NAMES:
        raise ValueError(f"{name!r} names another attention in the models; choose another name")

    def decorate(cls: type[FeatureMap]) -> type[FeatureMap]:
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise TypeError(f"@register_feature_map({name!r}) needs a FeatureMap subclass")
        check_feature_map_class(cls)
        old = _REGISTRY.get(name)
        redefined = old is not None and _qualified(old) == _qualified(cls)
        if old is not None and old is not cls and not redefined:
            raise ValueError(
                f"a feature map named {name!r} is already registered: {_clash(old, cls)}"
            )
        # a class of the same qualified name (a notebook cell run again, a module reloaded)
        # takes its name over
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return decorate


@functools.cache
def load_plugins() -> tuple[str, ...]:
    """Import the modules of feature maps defined outside kernelstudy, once per process:
    those listed in ``$KERNELSTUDY_FEATURE_MAPS`` (comma-separated) and the entry points of
    group ``kernelstudy.feature_maps``. Their ``@register_feature_map`` classes then join the
    registry. Returns the modules imported; ValueError naming one that fails to import."""
    names = [m.strip() for m in os.environ.get(ENV_FEATURE_MAPS, "").split(",") if m.strip()]
    points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
    loaded = []
    for module in names:
        try:
            importlib.import_module(module)
        except Exception as err:  # a map's own error (a clash of names) too, not only imports
            raise ValueError(
                f"{ENV_FEATURE_MAPS} lists {module!r}, which cannot be imported: {err}"
            ) from err
        loaded.append(module)
    for point in points:
        try:
            point.load()
        except ImportError as err:
            raise ValueError(
                f"entry point {point.name!r} of group {ENTRY_POINT_GROUP!r} ({point.value}) "
                f"cannot be imported: {err}"
            ) from err
        loaded.append(point.value)
    return tuple(loaded)


def _qualified(cls: type) -> str:
    """``module.QualName`` of a class."""
    return f"{cls.__module__}.{cls.__qualname__}"


def _clash(old: type, new: type) -> str:
    """Why ``new`` cannot take ``old``'s name: another class, or one file imported twice."""
    try:
        files = inspect.getsourcefile(old), inspect.getsourcefile(new)
    except (TypeError, OSError):  # a class without a file (in a notebook, python -c)
        files = None, None
    if files[0] is not None and files[0] == files[1] and old.__qualname__ == new.__qualname__:
        return (
            f"{_qualified(old)} and {_qualified(new)} are the same file, "
            f"{inspect.getsourcefile(new)}, imported twice (run as a script and also listed in "
            f"${ENV_FEATURE_MAPS}, say): import it once, under one module name"
        )
    return f"{_qualified(old)}; {_qualified(new)} needs another name"


def check_feature_map_class(cls: type[FeatureMap]) -> None:
    """TypeError naming ``cls`` and what it lacks, unless it meets the :class:`FeatureMap`
    contract: ``features`` (or ``forward``) implemented, ``feature_dim`` a property (or an
    int), ``hyperparameters`` of :class:`Hyperparameter` whose defaults they accept, none
    named as a config's own keys. Checked at registration, before any study or search would
    build the map and fail late (an empty NotImplementedError, a RecursionError)."""
    what = f"feature map class {_qualified(cls)}"
    if cls.features is FeatureMap.features and cls.forward is FeatureMap.forward:
        raise TypeError(f"{what} must implement features(self, x, is_query) -> (B,H,N,F)")
    dim = inspect.getattr_static(cls, "feature_dim")
    if dim is inspect.getattr_static(FeatureMap, "feature_dim"):
        raise TypeError(f"{what} must define feature_dim, a @property returning F")
    if not isinstance(dim, property | functools.cached_property | int) or isinstance(dim, bool):
        raise TypeError(
            f"{what}: feature_dim must be a @property returning F (an int), got "
            f"{type(dim).__name__}"
        )
    hyperparameters = cls.hyperparameters
    if not isinstance(hyperparameters, Mapping):
        raise TypeError(f"{what}: hyperparameters must be a dict of Hyperparameter")
    for key, spec in hyperparameters.items():
        if key in CONFIG_KEYS:
            raise TypeError(f"{what}: a hyperparameter may not be named {key!r} (a config key)")
        if not isinstance(spec, Hyperparameter):
            raise TypeError(
                f"{what}: hyperparameters[{key!r}] must be a Hyperparameter(type, default, ...), "
                f"got {spec!r}"
            )
        try:
            spec.validate(key, spec.default)
        except (TypeError, ValueError) as err:
            raise TypeError(
                f"{what}: the default of hyperparameter {key!r} is refused: {err}"
            ) from None


def registered_modules() -> tuple[str, ...]:
    """The importable modules outside kernelstudy whose maps are registered in this process
    (sorted): what another process (a spawned search worker) imports to know the same maps.
    A script run as ``__main__`` is left out (a spawned child runs it again as its main), and
    so is a module that cannot be found by its name (loaded from a path: ``runpy``)."""
    own = __name__.split(".")[0]
    names = {cls.__module__ for cls in _REGISTRY.values()}
    return tuple(
        sorted(
            name
            for name in names
            if name.split(".")[0] != own
            and name not in ("__main__", "__mp_main__")
            and _findable(name)
        )
    )


def _findable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package gone, or a name like "<run_path>"
        return False


def list_feature_maps(pattern: str | None = None) -> list[str]:
    """Sorted names of the registered maps (with those of :func:`load_plugins`), optionally
    filtered by a glob ``pattern``."""
    load_plugins()
    names = sorted(_REGISTRY)
    if pattern is not None and not isinstance(pattern, str):
        raise TypeError(f"pattern must be a glob str such as 'favor*', got {pattern!r}")
    if pattern is not None:
        names = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
    return names


def get_feature_map_class(name: str) -> type[FeatureMap]:
    """The class registered as ``name``, or one given as ``"package.module:Class"``."""
    if not isinstance(name, str):
        raise TypeError(f"feature map name must be a str, got {type(name).__name__}")
    if ":" in name:
        module_name, _, attr = name.partition(":")
        saved_file = _SAVED_FILE.get()
        if saved_file is not None and module_name not in sys.modules:
            load_plugins()
            if module_name not in sys.modules:
                raise ValueError(
                    f"{saved_file} names feature map {name!r}, whose module {module_name!r} "
                    f"is not imported: a saved file's names import no module (that would run "
                    f"its code); import the module first, or list it in ${ENV_FEATURE_MAPS}"
                )
        try:
            # a nested class is "module:Outer.Inner" (its __qualname__)
            cls = functools.reduce(getattr, attr.split("."), importlib.import_module(module_name))
        except (ImportError, AttributeError, ValueError) as err:  # ValueError: ":" alone
            raise ValueError(f"cannot import feature map {name!r}: {err}") from err
        if not (isinstance(cls, type) and issubclass(cls, FeatureMap)):
            raise TypeError(f"{name!r} is not a FeatureMap subclass")
        check_feature_map_class(cls)
        return cls
    load_plugins()
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.5)
        hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
        raise ValueError(
            f"unknown feature map {name!r}{hint} (known: {', '.join(sorted(_REGISTRY))}); a "
            f"map defined outside kernelstudy is known once its module is imported: list the "
            f"module in ${ENV_FEATURE_MAPS}, or name the map 'module:Class'"
        )
    return _REGISTRY[name]


def create_feature_map(
    name_or_config: str | Mapping[str, Any], head_dim: int | None = None, **kwargs: Any
) -> FeatureMap:
    """Create a map from a registered name, a dotted ``"module:Class"`` name or a ``config()`` dict.

    Keyword arguments override the config's entries. ``head_dim`` is required
    (in the call or the config).
    """
    if isinstance(name_or_config, FeatureMap):
        raise TypeError("name_or_config is already a FeatureMap; pass it directly")
    if isinstance(name_or_config, Mapping):
        config = dict(name_or_config)
        if "name" not in config:
            raise ValueError("a feature-map config needs a 'name' entry")
        name = config.pop("name")
    elif isinstance(name_or_config, str):
        name, config = name_or_config, {}
    else:
        raise TypeError(
            f"name_or_config must be a str or a config dict, got {type(name_or_config).__name__}"
        )
    config.update(kwargs)
    if head_dim is not None:
        config["head_dim"] = head_dim
    if "head_dim" not in config:
        raise ValueError(f"head_dim is required to create feature map {name!r}")
    cls = get_feature_map_class(name)
    return cls(**config)
