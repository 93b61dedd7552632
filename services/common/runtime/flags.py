"""Flags and environment variables for a config dataclass, one-to-one with its fields.

A config may compose others (`WorkerConfig.engine: EngineConfig`, which holds a
`CacheConfig`); their fields are flattened by leaf name, which must be unique in the tree:

    WorkerConfig.engine.cache.kv_cache_bytes  <->  --kv-cache-bytes  <->  TANDEM_KV_CACHE_BYTES

A few fields would say too little on their own and go by a longer name (`PUBLIC_NAMES`):

    WorkerConfig.engine.speculative.max_batch  <->  --speculative-max-batch
                                               <->  TANDEM_SPECULATIVE_MAX_BATCH

A flag beats the environment, which beats the field's default (a nested config's default
instance supplies its fields' defaults); a flag's help is its field's entry in the
`Attributes:` section of its config's docstring. Only services' main.py call `parse_config`;
the `tandem` command adds `tandem up`'s flags (UpConfig's) to its own parser with `add_flags`
and builds the config with `build_config`.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import os
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, NamedTuple, NoReturn, TypeVar

T = TypeVar("T")
ENV_PREFIX = "TANDEM_"
# Short spellings a leaf's flag also answers to (the long one is the field's name).
ALIASES = {"tensor_parallel_size": ("--tp",)}
# A leaf's name (flag, TANDEM_* variable, Helm key) where its field's own name would say too
# little once flattened, keyed by (the field holding its config, the field): SpeculativeConfig's
# as `tandem up` and `tandem generate` spell them (UpConfig's speculative_* fields), and the
# router's RecoveryConfig.hold_s.
PUBLIC_NAMES: dict[tuple[str, ...], str] = {
    ("speculative", "method"): "speculative",
    ("speculative", "ngram_max"): "speculative_ngram_max",
    ("speculative", "ngram_min"): "speculative_ngram_min",
    ("speculative", "max_batch"): "speculative_max_batch",
    ("speculative", "suffix_share"): "speculative_suffix_share",
    ("speculative", "adaptive"): "speculative_adaptive",
    ("speculative", "draft_model"): "draft_model",
    ("recovery", "hold_s"): "stream_hold_s",
}


class Leaf(NamedTuple):
    """One settable field of a (possibly nested) config dataclass."""

    path: tuple[str, ...]  # attribute path from the root, e.g. ("engine", "cache", "block_size")
    type: Any  # the field's resolved type hint
    default: Any  # dataclasses.MISSING when the field is required

    @property
    def field(self) -> str:
        """The dataclass field's own name (its config's messages say this one)."""
        return self.path[-1]

    @property
    def name(self) -> str:
        """Its flag's, variable's and Helm key's name: the field's, or its `PUBLIC_NAMES` entry."""
        return PUBLIC_NAMES.get(self.path[-2:], self.path[-1])

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


_ENTRY = re.compile(r"([a-z_][a-z0-9_]*(?:, [a-z_][a-z0-9_]*)*): (.+)")


def _own_attribute_docs(doc: str) -> dict[str, str]:
    lines = inspect.cleandoc(doc).splitlines()
    starts = [i for i, line in enumerate(lines) if line.strip() == "Attributes:"]
    out: dict[str, str] = {}
    if not starts:
        return out
    indent: int | None = None
    names: list[str] = []
    text: list[str] = []
    for line in [*lines[starts[0] + 1 :], "END"]:  # a line at no indent ends the section
        if not line.strip():
            continue
        depth = len(line) - len(line.lstrip())
        indent = depth if indent is None else indent
        entry = _ENTRY.fullmatch(line.strip()) if depth == indent else None
        if names and (entry or depth <= indent):
            out.update(dict.fromkeys(names, " ".join(text)))
            names = []
        if entry:
            names, text = entry[1].split(", "), [entry[2]]
        elif depth > indent and names:
            text.append(line.strip())
        else:
            break
    return out


def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> its entry in the `Attributes:` section of the docstring of `cls` or of a
    config nested in it (continuation lines joined): the flags' help. An entry may name several
    fields ("host, port: where it listens"); a nested config's entry beats the outer one's."""
    out = _own_attribute_docs(cls.__doc__ or "")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(attribute_docs(hints[f.name]))
    return out


class _EnvText(str):
    """An environment variable's text as a flag's default: argparse converts a str default as
    it converts the flag's argument, when (and only when) that parser parses."""

    env: str


def _typed(conv: Callable[[str], Any]) -> Callable[[str], Any]:
    """`conv`, saying which environment variable a bad default came from."""

    def convert(raw: str) -> Any:
        if not isinstance(raw, _EnvText):
            return conv(raw)
        try:
            return conv(raw)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(f"{raw.env}={str(raw)!r}: {exc}") from None

    convert.__name__ = getattr(conv, "__name__", "value")  # argparse: "invalid int value: 'x'"
    return convert


def add_flags(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: Collection[str] = (),
    only: Collection[str] | None = None,
    defaults: Mapping[str, Any] | None = None,
    converters: Mapping[str, Callable[[str], Any]] | None = None,
    environ: Mapping[str, str] | None = None,
) -> list[Leaf]:
    """Add a flag per leaf of `cls` to `parser` (its dest: the leaf name); return those leaves.

    A flag's default is its environment variable's value (TANDEM_<NAME>), else `defaults`'s,
    else the field's; its help is the field's `Attributes:` entry (`attribute_docs`). A bool
    flag alone means true (`--autoscale`; `--autoscale false` too).

    Args:
        skip: leaf names that get no flag (the program sets them).
        only: just these leaves.
        defaults: leaf name -> the flag's default instead of the field's.
        converters: leaf name -> the str -> value function instead of the type's.
        environ: the environment to read (default: os.environ).
    """
    env_vars = os.environ if environ is None else environ
    defaults = dict(defaults or {})
    converters = dict(converters or {})
    all_leaves = leaves(cls)
    unknown = {*skip, *(only or ()), *defaults, *converters} - {leaf.name for leaf in all_leaves}
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    docs = attribute_docs(cls)
    added = []
    for leaf in all_leaves:
        if leaf.name in skip or (only is not None and leaf.name not in only):
            continue
        conv = converters.get(leaf.name) or _converter(leaf.type)
        default = defaults.get(leaf.name, leaf.default)
        required = default is dataclasses.MISSING
        raw = env_vars.get(leaf.env)
        shown = "required" if required else f"default {default!r}"
        if raw is not None:
            default = _EnvText(raw)
            default.env = leaf.env
            # An environment value may be a secret (a Redis URL's password): not in --help.
            shown = "set from the environment"
        help_text = " ".join([docs.get(leaf.field, ""), f"(env {leaf.env}; {shown})"]).strip()
        bare: dict[str, Any] = {"nargs": "?", "const": True, "metavar": "BOOL"}
        parser.add_argument(
            leaf.flag,
            *ALIASES.get(leaf.name, ()),
            dest=leaf.name,
            type=_typed(conv),
            default=None if required and raw is None else default,
            required=required and raw is None,
            help=help_text.replace("%", "%%"),
            **(bare if leaf.type is bool and leaf.name not in converters else {}),
        )
        added.append(leaf)
    return added


def usage_error(
    parser: argparse.ArgumentParser, exc: Exception, flags: Mapping[str, str]
) -> NoReturn:
    """Exit 2 with `exc` as a usage error of `parser`, naming the flags (`flags`: field name ->
    flag) of the fields its message names: "argument --num-decode: need num_decode >= 1 ..."."""
    message = str(exc)
    named = sorted(
        (found.start(), flag)
        for name, flag in flags.items()
        if (found := re.search(rf"\b{re.escape(name)}\b", message)) is not None
    )
    which = list(dict.fromkeys(flag for _, flag in named))
    plural = "s" if len(which) > 1 else ""
    parser.error(f"argument{plural} {', '.join(which)}: {message}" if which else message)


def leaf_flags(added: Sequence[Leaf]) -> dict[str, str]:
    """Name -> flag of each leaf of `added`, for `usage_error`: by its name, and by its
    field's own where that differs (a config's message says `max_batch`, the flag is
    --speculative-max-batch)."""
    return {leaf.field: leaf.flag for leaf in added} | {leaf.name: leaf.flag for leaf in added}


def build_config(
    cls: type[T],
    parser: argparse.ArgumentParser,
    values: Mapping[str, Any],
    flags: Mapping[str, str] | None = None,
) -> T:
    """`cls` from leaf name -> value (a leaf left out takes its default). A validation error of
    any of its dataclasses is a usage error of `parser` (exit 2) naming the flags of the fields
    it names (`flags`: field name -> flag; default: every leaf's own, `leaf_flags`)."""
    all_leaves = leaves(cls)
    by_name = {leaf.name: leaf for leaf in all_leaves}
    unknown = set(values) - set(by_name)
    if unknown:
        raise TypeError(f"{cls.__name__} has no fields {sorted(unknown)}")
    try:
        return build(cls, {by_name[name].path: value for name, value in values.items()})
    except (ValueError, TypeError) as exc:
        usage_error(parser, exc, leaf_flags(all_leaves) if flags is None else flags)


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

    Validation errors of the dataclasses surface as argparse errors naming the flag.
    """
    fixed = dict(fixed or {})
    parser = argparse.ArgumentParser(prog=prog or cls.__name__)
    added = add_flags(parser, cls, skip=fixed, environ=environ)
    ns = vars(parser.parse_args(argv))
    return build_config(cls, parser, {**ns, **fixed}, leaf_flags(added))
