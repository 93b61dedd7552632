"""services.common.runtime.flags over nested config dataclasses: one flag, env var and Helm key per
leaf field, defaults from nested default instances, fixed fields, duplicate leaf names."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from services.common.runtime.flags import leaves, parse_config
from services.common.worker.config import WorkerConfig
from services.router.config import RouterConfig
from tandem.config import EngineRole


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
    from services.controller.config import ControllerConfig

    for cls in (WorkerConfig, RouterConfig, ControllerConfig):
        names = [leaf.name for leaf in leaves(cls)]
        assert len(names) == len(set(names)), cls.__name__
        nested = {leaf.name for leaf in leaves(cls) if len(leaf.path) > 1}
        own = {leaf.name for leaf in leaves(cls) if len(leaf.path) == 1}
        assert not nested & own, cls.__name__
