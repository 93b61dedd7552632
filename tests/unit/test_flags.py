"""tandem.services.common.runtime.flags over nested config dataclasses: one flag, env var and Helm
key per
leaf field, defaults from nested default instances, fixed fields, duplicate leaf names."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from tandem.config import EngineRole
from tandem.services.common.runtime.flags import leaves, parse_config
from tandem.services.common.worker.config import WorkerConfig
from tandem.services.router.config import RouterConfig


@dataclass(frozen=True, slots=True)
class Inner:
    size: int = 1
    name: str = "x"


@dataclass(frozen=True, slots=True)
class Outer:
    path: str
    inner: Inner = field(default_factory=lambda: Inner(size=5))
    ratio: float = 0.5


@dataclass(frozen=True, slots=True)
class Clash:
    size: int = 2
    inner: Inner = field(default_factory=Inner)


def test_leaves_flatten_by_name_with_paths_and_nested_defaults() -> None:
    got = [(leaf.path, leaf.default, leaf.flag, leaf.env) for leaf in leaves(Outer)][1:]
    assert got == [
        (("inner", "size"), 5, "--size", "TANDEM_SIZE"),
        (("inner", "name"), "x", "--name", "TANDEM_NAME"),
        (("ratio",), 0.5, "--ratio", "TANDEM_RATIO"),
    ]


def test_a_leaf_name_declared_twice_is_refused() -> None:
    with pytest.raises(TypeError, match=r"'size' is declared twice \(size and inner.size\)"):
        leaves(Clash)


def test_flag_beats_env_beats_default_for_nested_fields() -> None:
    env = {"TANDEM_SIZE": "7", "TANDEM_NAME": "from-env"}
    cfg = parse_config(Outer, ["--path", "/m", "--name", "flag"], environ=env)
    assert cfg == Outer("/m", Inner(size=7, name="flag"), 0.5)
    assert parse_config(Outer, ["--path", "/m"], environ={}).inner == Inner(size=5)


def test_fixed_fields_have_no_flag() -> None:
    cfg = parse_config(Outer, ["--path", "/m"], fixed={"name": "set"}, environ={})
    assert cfg.inner.name == "set"
    with pytest.raises(SystemExit):
        parse_config(Outer, ["--path", "/m", "--name", "y"], fixed={"name": "set"}, environ={})


def test_every_engine_setting_reaches_a_worker_config() -> None:
    cfg = parse_config(
        WorkerConfig,
        [
            "--model-dir", "/m", "--dtype", "bfloat16", "--device", "cpu",
            "--enable-prefix-caching", "false", "--long-prefill-token-threshold", "64",
            "--kv-cache-bytes", "1048576", "--max-num-seqs", "3", "--transport", "local",
        ],
        fixed={"role": "decode"},
        environ={"TANDEM_MAX_MODEL_LEN": "512"},
    )  # fmt: skip
    engine = cfg.engine
    assert (engine.model_dir, engine.role, engine.dtype, engine.device) == (
        "/m",
        EngineRole.DECODE,
        "bfloat16",
        "cpu",
    )
    assert engine.cache.enable_prefix_caching is False
    assert engine.cache.kv_cache_bytes == 1 << 20
    assert engine.scheduler.long_prefill_token_threshold == 64
    assert engine.scheduler.max_num_seqs == 3
    assert engine.scheduler.max_model_len == 512
    assert cfg.transport == "local"


def test_kv_tier_settings_reach_a_worker_config_by_flag_and_env() -> None:
    """The KV tiers' CacheConfig fields (issue 44) are flags and TANDEM_* variables of every
    worker main, like any other leaf; the disk tier's two halves come from either source."""
    cfg = parse_config(
        WorkerConfig,
        ["--model-dir", "/m", "--kv-host-bytes", "4096", "--kv-disk-dir", "/cache/w0"],
        fixed={"role": "prefill"},
        environ={"TANDEM_KV_DISK_BYTES": "8192", "TANDEM_KV_HOST_BYTES": "1"},
    )  # fmt: skip
    cache = cfg.engine.cache
    assert (cache.kv_host_bytes, cache.kv_disk_dir, cache.kv_disk_bytes) == (
        4096,
        "/cache/w0",
        8192,
    )
    env = {"TANDEM_KV_HOST_BYTES": "2048"}
    cache = parse_config(WorkerConfig, ["--model-dir", "/m"], environ=env).engine.cache
    assert (cache.kv_host_bytes, cache.kv_disk_dir, cache.kv_disk_bytes) == (2048, "", 0)


def test_speculative_settings_reach_a_worker_config_by_flag_and_env() -> None:
    """SpeculativeConfig's fields (issue 45) are flags and TANDEM_* variables of every worker
    main under the names `tandem up` and `tandem generate` give them (PUBLIC_NAMES:
    --speculative, not --method), with their docstring's help."""
    from tandem.config import SpeculativeConfig

    names = {leaf.path: (leaf.name, leaf.flag, leaf.env) for leaf in leaves(WorkerConfig)}
    spec = {
        path[-1]: named for path, named in names.items() if path[:2] == ("engine", "speculative")
    }
    assert spec == {
        "method": ("speculative", "--speculative", "TANDEM_SPECULATIVE"),
        "num_speculative_tokens": (
            "num_speculative_tokens", "--num-speculative-tokens", "TANDEM_NUM_SPECULATIVE_TOKENS",
        ),
        "ngram_max": (
            "speculative_ngram_max", "--speculative-ngram-max", "TANDEM_SPECULATIVE_NGRAM_MAX",
        ),
        "ngram_min": (
            "speculative_ngram_min", "--speculative-ngram-min", "TANDEM_SPECULATIVE_NGRAM_MIN",
        ),
        "max_batch": (
            "speculative_max_batch", "--speculative-max-batch", "TANDEM_SPECULATIVE_MAX_BATCH",
        ),
        "suffix_share": (
            "speculative_suffix_share", "--speculative-suffix-share",
            "TANDEM_SPECULATIVE_SUFFIX_SHARE",
        ),
        "adaptive": (
            "speculative_adaptive", "--speculative-adaptive", "TANDEM_SPECULATIVE_ADAPTIVE",
        ),
        "draft_model": ("draft_model", "--draft-model", "TANDEM_DRAFT_MODEL"),
    }  # fmt: skip
    cfg = parse_config(
        WorkerConfig,
        ["--model-dir", "/m", "--speculative", "suffix", "--speculative-max-batch", "4",
         "--speculative-suffix-share", "--num-speculative-tokens", "7"],
        fixed={"role": "decode"},
        environ={"TANDEM_SPECULATIVE_NGRAM_MAX": "8", "TANDEM_SPECULATIVE_NGRAM_MIN": "3",
                 "TANDEM_SPECULATIVE": "ngram", "TANDEM_NUM_SPECULATIVE_TOKENS": "2"},
    )  # fmt: skip
    assert cfg.engine.speculative == SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=7,
        ngram_max=8,
        ngram_min=3,
        max_batch=4,
        suffix_share=True,
    )
    env = {"TANDEM_SPECULATIVE": "ngram", "TANDEM_SPECULATIVE_SUFFIX_SHARE": "false"}
    spec_cfg = parse_config(WorkerConfig, ["--model-dir", "/m"], environ=env).engine.speculative
    assert spec_cfg == SpeculativeConfig(method="ngram")
    assert parse_config(WorkerConfig, ["--model-dir", "/m"], environ={}).engine.speculative == (
        SpeculativeConfig()
    )
    env = {"TANDEM_SPECULATIVE": "draft", "TANDEM_DRAFT_MODEL": "/models/env-draft"}
    argv = ["--model-dir", "/m", "--draft-model", "/models/draft"]
    spec_cfg = parse_config(WorkerConfig, argv, environ=env).engine.speculative
    assert spec_cfg == SpeculativeConfig(method="draft", draft_model="/models/draft")


def test_speculative_help_and_errors_name_the_public_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--help"], prog="decode", environ={})
    out = " ".join(capsys.readouterr().out.split())
    assert '--speculative SPECULATIVE "none", "ngram" (prompt lookup' in out
    assert "(env TANDEM_SPECULATIVE_MAX_BATCH; default 2)" in out
    assert "--method" not in out and "--max-batch" not in out
    with pytest.raises(SystemExit):
        argv = ["--model-dir", "/m", "--speculative-ngram-min", "9"]
        parse_config(WorkerConfig, argv, prog="decode", environ={})
    assert capsys.readouterr().err.splitlines()[-1] == (
        "decode: error: arguments --speculative-ngram-min, --speculative-ngram-max: need 1 <= "
        "ngram_min <= ngram_max <= 16, got ngram_min=9, ngram_max=4"
    )
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--model-dir", "/m", "--speculative", "eagle"], environ={})
    assert (
        "argument --speculative: speculative must be one of none, ngram, suffix, draft, got "
        "'eagle'" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--model-dir", "/m", "--speculative", "draft"], environ={})
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .endswith(
            "error: arguments --speculative, --draft-model: speculative draft needs a draft model "
            "(--draft-model DIR), and a draft model needs --speculative draft; got "
            "speculative='draft', draft_model=''"
        )
    )


def test_a_disk_tier_without_its_budget_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--model-dir", "/m", "--kv-disk-dir", "/d"], environ={})
    assert "a disk tier needs both kv_disk_dir and kv_disk_bytes" in capsys.readouterr().err


def test_routing_settings_reach_a_router_config() -> None:
    cfg = parse_config(
        RouterConfig,
        ["--model-dir", "/m", "--decode-addresses", "a:1", "--min-free-block-fraction", "0.25",
         "--cache-weight", "3", "--affinity-blocks", "4"],
        environ={},
    )  # fmt: skip
    assert cfg.routing.min_free_block_fraction == 0.25
    assert (cfg.routing.cache_weight, cfg.routing.affinity_blocks) == (3.0, 4)


def test_a_nested_validation_error_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--model-dir", "/m", "--dtype", "int3"], environ={})
    assert "dtype must be auto, float32, bfloat16 or float16, got 'int3'" in capsys.readouterr().err


def test_no_config_field_is_declared_twice() -> None:
    """Service configs hold the core configs instead of copying their fields: every leaf
    name is unique in each tree (leaves() raises otherwise), and no service config field
    shares a name with a field of a core config it could have copied."""
    from tandem.services.controller.config import ControllerConfig

    for cls in (WorkerConfig, RouterConfig, ControllerConfig):
        names = [leaf.name for leaf in leaves(cls)]
        assert len(names) == len(set(names)), cls.__name__
        nested = {leaf.name for leaf in leaves(cls) if len(leaf.path) > 1}
        own = {leaf.name for leaf in leaves(cls) if len(leaf.path) == 1}
        assert not nested & own, cls.__name__


@dataclass(frozen=True, slots=True)
class Documented:
    """A config whose docstring documents its fields.

    Attributes:
        path: where it is; 50% of the
            time, elsewhere.
        low, high: the bounds.
        on: switch it on.
        inner: not a leaf: its own docstring documents its fields.

    Raises:
        nothing: this section is no field's.
    """

    path: str
    low: int = 0
    high: int = 9
    on: bool = False
    inner: DocumentedInner = field(default_factory=lambda: DocumentedInner())


@dataclass(frozen=True, slots=True)
class DocumentedInner:
    """Attributes:
    size: how big (an outer entry would lose to this one).
    """

    size: int = 1


def test_attribute_docs_read_every_entry_of_the_attributes_sections() -> None:
    from tandem.services.common.runtime.flags import attribute_docs

    assert attribute_docs(Documented) == {
        "path": "where it is; 50% of the time, elsewhere.",
        "low": "the bounds.",
        "high": "the bounds.",
        "on": "switch it on.",
        "inner": "not a leaf: its own docstring documents its fields.",
        "size": "how big (an outer entry would lose to this one).",
    }
    assert attribute_docs(Inner) == {}  # no docstring of its own: the dataclass signature


def test_every_service_flag_has_help_from_its_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_config(Documented, ["--help"], prog="documented", environ={"TANDEM_HIGH": "5"})
    out = " ".join(capsys.readouterr().out.split())
    path = "--path PATH where it is; 50% of the time, elsewhere. (env TANDEM_PATH; required)"
    assert path in out
    assert "--high HIGH the bounds. (env TANDEM_HIGH; set from the environment)" in out
    assert "--on [BOOL] switch it on. (env TANDEM_ON; default False)" in out


def test_a_bool_flag_alone_means_true() -> None:
    def on(*argv: str, env: dict[str, str] | None = None) -> bool:
        return parse_config(Documented, ["--path", "p", *argv], environ=env or {}).on

    assert (on(), on("--on"), on("--on", "false"), on("--on", "yes")) == (False, True, False, True)
    assert (on(env={"TANDEM_ON": "1"}), on("--on", "off", env={"TANDEM_ON": "1"})) == (True, False)


def test_a_bad_environment_value_is_a_usage_error_naming_it_when_parsed(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from tandem.services.common.runtime.flags import add_flags

    parser = argparse.ArgumentParser(prog="p")
    add_flags(parser, Documented, environ={"TANDEM_LOW": "two"})  # nothing converted yet
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--path", "p"])
    assert exc.value.code == 2
    assert "p: error: argument --low: TANDEM_LOW='two': invalid literal for int()" in (
        capsys.readouterr().err
    )
    assert parser.parse_args(["--path", "p", "--low", "2"]).low == 2  # the flag wins
    with pytest.raises(SystemExit):
        parser.parse_args(["--path", "p", "--high", "x"])
    assert "argument --high: invalid int value: 'x'" in capsys.readouterr().err  # argparse's own


def test_a_validation_error_names_the_flags_of_the_fields_it_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import argparse

    from tandem.services.common.runtime.flags import usage_error

    parser = argparse.ArgumentParser(prog="p")
    flags = {"low": "--low", "high": "--high", "on": "--on"}
    for message in ("need high > low, got 1, 2", "low_water is not low", "bad"):
        with pytest.raises(SystemExit) as exc:
            usage_error(parser, ValueError(message), flags)
        assert exc.value.code == 2
        assert (
            capsys.readouterr().err.splitlines()[-1]
            == {
                "need high > low, got 1, 2": "p: error: arguments --high, --low: " + message,
                "low_water is not low": "p: error: argument --low: " + message,
                "bad": "p: error: bad",
            }[message]
        )
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--model-dir", "/m", "--max-num-seqs", "0"], environ={})
    assert (
        "argument --max-num-seqs: max_num_seqs must be positive, got 0" in capsys.readouterr().err
    )


def test_add_flags_takes_some_leaves_with_the_program_s_defaults_and_converters() -> None:
    import argparse

    from tandem.services.common.runtime.flags import add_flags, build_config

    parser = argparse.ArgumentParser()
    added = add_flags(
        parser,
        Documented,
        skip=("path",),
        only=("path", "low", "size"),
        defaults={"low": 3},
        converters={"size": lambda raw: len(raw)},
        environ={"TANDEM_SIZE": "abcd", "TANDEM_HIGH": "1"},
    )
    assert [leaf.name for leaf in added] == ["low", "size"]
    assert vars(parser.parse_args([])) == {"low": 3, "size": 4}
    assert vars(parser.parse_args(["--size", "ab", "--low", "0"])) == {"low": 0, "size": 2}
    with pytest.raises(SystemExit):
        parser.parse_args(["--high", "2"])  # not among `only`
    cfg = build_config(Documented, parser, {"path": "p", **vars(parser.parse_args([]))})
    assert cfg == Documented("p", low=3, inner=DocumentedInner(size=4))
    with pytest.raises(TypeError, match=r"Documented has no fields \['nope'\]"):
        add_flags(argparse.ArgumentParser(), Documented, defaults={"nope": 1})
