"""Flags and environment variables for a config dataclass, one-to-one with its fields.

A config may compose others (`WorkerConfig.engine: EngineConfig`, which holds a
`CacheConfig`); their fields are flattened by leaf name, which must be unique in the tree:

    WorkerConfig.engine.cache.kv_cache_bytes  <->  --kv-cache-bytes  <->  TANDEM_KV_CACHE_BYTES

A flag beats the environment, which beats the field's default (a nested config's default
instance supplies its fields' defaults). Only services' main.py call `parse_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

T = TypeVar("T")
ENV_PREFIX = "TANDEM_"


class Leaf(NamedTuple):
    """One settable field of a (possibly nested) config dataclass."""

    path: tuple[str, ...]  # attribute path from the root, e.g. ("engine", "cache", "block_size")
    type: Any  # the field's resolved type hint
    default: Any  # dataclasses.MISSING when the field is required

    @property
    def name(self) -> str:
        return self.path[-1]

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()


def _field_default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def leaves(cls: type, _prefix: tuple[str, ...] = (), _defaults: Any = None) -> list[Leaf]:
    """Every non-dataclass field of `cls`, nested configs flattened, in declaration order.

    Raises:
        TypeError: two fields of the tree share a leaf name (flags would be ambiguous).
    """
    hints = typing.get_type_hints(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        default = _field_default(f) if _defaults is None else getattr(_defaults, f.name)
        if dataclasses.is_dataclass(tp):
            nested = None if default is dataclasses.MISSING else default
            out.extend(leaves(tp, (*_prefix, f.name), nested))  # type: ignore[arg-type]
        else:
            out.append(Leaf((*_prefix, f.name), tp, default))
    if not _prefix:
        seen: dict[str, tuple[str, ...]] = {}
        for leaf in out:
            if leaf.name in seen:
                raise TypeError(
                    f"{cls.__name__}: field name {leaf.name!r} is declared twice "
                    f"({'.'.join(seen[leaf.name])} and {'.'.join(leaf.path)})"
                )
            seen[leaf.name] = leaf.path
    return out


def build(cls: type[T], values: Mapping[tuple[str, ...], Any], _prefix: tuple[str, ...] = ()) -> T:
    """Construct `cls` and its nested configs from leaf values keyed by path (a leaf left out
    takes its field's default). Validation errors of any dataclass propagate."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        path = (*_prefix, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, path)
        elif path in values:
            kwargs[f.name] = values[path]
    return cls(**kwargs)


def _parse_bool(raw: str) -> bool:
    if raw.lower() in ("1", "true", "yes", "on"):
        return True
    if raw.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {raw!r}")


def _converter(tp: Any) -> Any:
    """A str -> value function for a (simple) field type."""
    origin = typing.get_origin(tp)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if origin in (typing.Union, types.UnionType) and args:
        inner = _converter(args[0])
        return lambda raw: None if raw.lower() in ("", "none") else inner(raw)
    if origin is tuple:
        inner = _converter(args[0]) if args else str
        return lambda raw: tuple(inner(x) for x in raw.split(",") if x)
    if tp is bool:
        return _parse_bool
    if isinstance(tp, type) and issubclass(tp, (int, float, str)):
        return tp  # StrEnum fields convert through their class
    raise TypeError(f"no flag conversion for {tp!r}")


def parse_config(
    cls: type[T],
    argv: Sequence[str] | None = None,
    prog: str = "",
    fixed: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Build `cls` from flags and TANDEM_* environment variables.

    Args:
        fixed: leaf name -> value the program sets itself (e.g. a worker's engine role);
            these get no flag and no environment variable.
        environ: the environment to read (default: os.environ).

    Validation errors of the dataclasses surface as argparse errors naming the field.
    """
    env_vars = os.environ if environ is None else environ
    fixed = dict(fixed or {})
    parser = argparse.ArgumentParser(prog=prog or cls.__name__)
    by_name = {leaf.name: leaf for leaf in leaves(cls)}
    unknown = set(fixed) - set(by_name)
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    for leaf in by_name.values():
        if leaf.name in fixed:
            continue
        conv = _converter(leaf.type)
        required = leaf.default is dataclasses.MISSING
        raw = env_vars.get(leaf.env)
        default = conv(raw) if raw is not None else (None if required else leaf.default)
        parser.add_argument(
            leaf.flag,
            dest=leaf.name,
            type=conv,
            default=default,
            required=required and raw is None,
            # An environment value may be a secret (a Redis URL's password): not in --help.
            help=f"(env {leaf.env}; "
            + ("set from the environment)" if raw is not None else f"default {default!r})"),
        )
    ns = vars(parser.parse_args(argv))
    values = {by_name[name].path: value for name, value in {**ns, **fixed}.items()}
    try:
        return build(cls, values)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
