"""Flags and environment variables for a config dataclass, one-to-one with its fields.

Field `kv_cache_bytes` <-> flag `--kv-cache-bytes` <-> env `TANDEM_KV_CACHE_BYTES`; a flag
beats the environment, which beats the field's default. Only services' main.py call this.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")
ENV_PREFIX = "TANDEM_"


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
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)) and args:
        inner = _converter(args[0])
        return lambda raw: None if raw.lower() in ("", "none") else inner(raw)
    if origin is tuple:
        inner = _converter(args[0]) if args else str
        return lambda raw: tuple(inner(x) for x in raw.split(",") if x)
    if tp is bool:
        return _parse_bool
    if tp in (int, float, str):
        return tp
    raise TypeError(f"no flag conversion for {tp!r}")


def parse_config(cls: type[T], argv: Sequence[str] | None = None, prog: str = "") -> T:
    """Build `cls` from flags and TANDEM_* environment variables.

    Nested dataclass fields are skipped (they keep their defaults). Validation errors of the
    dataclass surface as argparse errors naming the field.
    """
    hints = typing.get_type_hints(cls)
    parser = argparse.ArgumentParser(prog=prog or cls.__name__)
    converters: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            continue
        conv = converters[f.name] = _converter(tp)
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        env = os.environ.get(ENV_PREFIX + f.name.upper())
        default = conv(env) if env is not None else (None if required else f.default)
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            type=conv,
            default=default,
            required=required and env is None,
            help=f"(env {ENV_PREFIX}{f.name.upper()}; default {default!r})",
        )
    ns = parser.parse_args(argv)
    try:
        return cls(**vars(ns))
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
