"""The `tandem` command line, run as a user would: a separate process."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tandem.config import SpeculativeConfig
from tandem.services.up import UpConfig
from tandem.tokenizer.tokenizer import Tokenizer


def tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.services.cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    res = tandem("make-tiny-model", str(out), "--preset", "tiny")
    assert res.returncode == 0, res.stderr
    assert "wrote tiny model (0.1M params)" in res.stdout
    return out


def test_make_tiny_model_writes_a_loadable_directory(model_dir) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()


def test_generate_prints_text_and_stats(model_dir) -> None:
    res = tandem("generate", "--model", str(model_dir), "--max-tokens", "6", "--ignore-eos", "hi")
    assert res.returncode == 0, res.stderr
    assert "loading weights" in res.stderr  # the progress bar
    assert "[6 tokens in" in res.stderr
    ids = tandem(
        "generate",
        "--model",
        str(model_dir),
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--token-ids",
        "hi",
    )
    token_ids = [int(t) for t in ids.stdout.split()]
    assert len(token_ids) == 6
    assert res.stdout.rstrip("\n") == Tokenizer.from_dir(model_dir).decode(token_ids)


def test_generate_rejects_bad_parameters_with_the_field_name(model_dir) -> None:
    res = tandem("generate", "--model", str(model_dir), "--top-p", "1.5", "hi")
    assert res.returncode == 2
    assert "top_p" in res.stderr


def test_generate_reports_a_missing_model(tmp_path) -> None:
    res = tandem("generate", "--model", str(tmp_path / "missing"), "hi")
    assert res.returncode == 2
    assert "does not exist" in res.stderr


def test_up_sizes_the_kv_cache_for_the_full_context(tiny_model_dir: Path) -> None:
    from tandem.config import CacheConfig
    from tandem.services.cli.model import up_kv_cache

    # The tiny model: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token,
    # context 2048: 1 MiB holds it all, so the engine's default (256 MiB) stands.
    size, line = up_kv_cache(tiny_model_dir, None, "cpu", "float32")
    assert size == CacheConfig().kv_cache_bytes
    assert line == (
        "KV cache: 256 MiB per worker (float32) = 524288 tokens: the model's full context of 2048"
    )
    # Asked for less than a context: the cap is stated, with what would hold it all.
    size, line = up_kv_cache(tiny_model_dir, 512 * 1024, "cpu", "bfloat16")
    assert size == 512 * 1024
    assert line == (
        "KV cache: 512 KiB per worker (bfloat16) = 2048 tokens: the model's full context of 2048"
    )
    size, line = up_kv_cache(tiny_model_dir, 256 * 1024, "cpu", "float32")
    assert line.endswith(
        "= 512 tokens: contexts capped at 512 of the model's 2048 (--kv-cache-bytes 1048576 "
        "holds it all)"
    )
    assert up_kv_cache(tiny_model_dir, None, "cuda", "auto")[1] == (
        "KV cache: sized from the GPU's memory"
    )


def test_up_sizes_a_large_context_above_the_default(tmp_path: Path) -> None:
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64, context 8192) in fp32: 360 MiB."""
    import json

    from tandem.services.cli.model import up_kv_cache

    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    size, line = up_kv_cache(tmp_path, None, "cpu", "float32")
    assert size == 8192 * 30 * 2 * 3 * 64 * 4
    assert line.startswith("KV cache: 360 MiB per worker (float32) = 8192 tokens")


# -- `tandem up`'s flags: UpConfig's fields, through tandem.services.common.runtime.flags ----------

# A non-default value for every UpConfig field with a flag: the flag's text, and the field.
UP_VALUES: dict[str, tuple[str, Any]] = {
    "host": ("127.0.0.2", "127.0.0.2"),
    "port": ("7", 7),
    "http_port": ("-1", -1),
    "num_prefill": ("0", 0),
    "num_decode": ("3", 3),
    "transport": ("local", "local"),
    "kv_cache_bytes": ("1048576", 1 << 20),
    "kv_host_bytes": ("4096", 4096),
    "kv_disk_dir": ("/cache/kv", "/cache/kv"),
    "kv_disk_bytes": ("8192", 8192),
    "device": ("cuda:1", "cuda:1"),
    "gpu_memory_utilization": ("0.5", 0.5),
    "dtype": ("bfloat16", "bfloat16"),
    "kv_cache_dtype": ("fp8", "fp8"),
    "tensor_parallel_size": ("2", 2),
    "expert_parallel": ("true", True),
    "replicate_attention": ("true", True),
    "tp_exact_sums": ("false", False),
    "cpu_matmul": ("onednn", "onednn"),
    "speculative": ("suffix", "suffix"),
    "num_speculative_tokens": ("6", 6),
    "speculative_max_batch": ("32", 32),
    "speculative_ngram_max": ("3", 3),
    "speculative_ngram_min": ("1", 1),
    "speculative_suffix_share": ("true", True),
    "speculative_adaptive": ("false", False),
    "draft_model": ("drafts/small", "drafts/small"),
    "quantization": ("int4", "int4"),
    "quantization_group_size": ("32", 32),
    "disagg_min_uncached_tokens": ("0", 0),
    "max_queue_delay_s": ("0", 0.0),
    "tool_call_parser": ("mistral", "mistral"),
    "redis_port": ("6390", 6390),
    "api_keys": ("true", True),
    "run_dir": ("/tmp/up", "/tmp/up"),
    "ready_timeout_s": ("5", 5.0),
    "autoscale": ("1", True),
    "admin_port": ("0", 0),
    "controller_args": ("--max-prefill 4", ("--max-prefill", "4")),
    "host_cores": ("2", 2),
    "num_threads": ("3", 3),
    "restart_backoff_s": ("0.25", 0.25),
    "restart_max_backoff_s": ("2", 2.0),
    "max_restarts": ("0", 0),
    "restart_window_s": ("5", 5.0),
}
# Fields valid only with another: the disk tier's directory and its budget; a draft model
# and speculative draft.
UP_COMPANIONS: dict[str, dict[str, tuple[str, Any]]] = {
    "kv_disk_dir": {"kv_disk_bytes": ("1", 1)},
    "kv_disk_bytes": {"kv_disk_dir": ("/d", "/d")},
    "draft_model": {"speculative": ("draft", "draft")},
}


@pytest.fixture
def up_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No TANDEM_* variable of an UpConfig field from the environment the tests run in."""
    from tandem.services.common.runtime.flags import leaves

    for leaf in leaves(UpConfig):
        monkeypatch.delenv(leaf.env, raising=False)
    return monkeypatch


def up_args(*argv: str) -> argparse.Namespace:
    from tandem.services.cli.main import build_parser

    return build_parser().parse_args(["up", *argv])  # reads the environment as it is now


def up(*argv: str) -> UpConfig:
    from tandem.services.cli.up import up_config

    return up_config(up_args(*argv))


def test_every_up_config_field_is_a_flag_with_help(up_env: pytest.MonkeyPatch) -> None:
    import re

    from tandem.services.cli.up import SET_BY_CLI
    from tandem.services.common.runtime.flags import attribute_docs, leaves

    names = [leaf.name for leaf in leaves(UpConfig)]
    parser = up_args().parser
    flags = re.findall(r"\[(--[a-z0-9-]+)", parser.format_usage())
    generated = ["--" + n.replace("_", "-") for n in names if n not in SET_BY_CLI]
    assert flags == ["--model", *generated, "--kv-cache-mb"]  # hand-written: --model, --kv-cache-mb
    assert SET_BY_CLI == {"model_dir": "--model"}
    assert sorted(UP_VALUES) == sorted(n for n in names if n not in SET_BY_CLI)
    docs = attribute_docs(UpConfig)
    assert [n for n in names if not docs.get(n)] == []  # every field's help, from its docstring
    help_text = " ".join(parser.format_help().split())
    assert "--max-restarts MAX_RESTARTS restarts of one process within restart_window_s" in (
        help_text
    )
    assert "(env TANDEM_MAX_RESTARTS; default 5)" in help_text


@pytest.mark.parametrize("name", sorted(UP_VALUES))
def test_a_flag_or_its_variable_sets_the_field(up_env: pytest.MonkeyPatch, name: str) -> None:
    raw, value = UP_VALUES[name]
    flag, env = "--" + name.replace("_", "-"), "TANDEM_" + name.upper()
    companions = UP_COMPANIONS.get(name, {})
    for other, (other_raw, _) in companions.items():
        up_env.setenv("TANDEM_" + other.upper(), other_raw)
    assert getattr(UpConfig(model_dir=""), name) != value
    want = UpConfig(model_dir="", **{n: v for n, (_, v) in companions.items()}, **{name: value})
    assert up(flag, raw) == want
    up_env.setenv(env, raw)
    assert up() == want


def test_a_flag_beats_its_variable(up_env: pytest.MonkeyPatch) -> None:
    for name, raw in (
        ("NUM_DECODE", "2"), ("AUTOSCALE", "true"), ("KV_CACHE_BYTES", "4096"), ("DTYPE", "int3"),
    ):  # fmt: skip
        up_env.setenv(f"TANDEM_{name}", raw)
    # int3 would be refused (an environment value is checked only if its flag is not given).
    config = up(
        "--num-decode", "3", "--autoscale", "false", "--kv-cache-mb", "2", "--dtype", "auto"
    )
    assert (config.num_decode, config.autoscale, config.kv_cache_bytes, config.dtype) == (
        3, False, 2 << 20, "auto",
    )  # fmt: skip
    config = up("--kv-cache-bytes", "8192", "--dtype", "float16")
    assert (config.num_decode, config.autoscale, config.kv_cache_bytes) == (2, True, 8192)


# Every way the tests, scripts, image and docs call `tandem up`, and the UpConfig the command
# built before its flags were generated (with the tiny model: its full context fits in the
# default 256 MiB).
OLD_SPELLINGS = [
    (["--port", "0", "--kv-cache-mb", "64"], {"port": 0, "kv_cache_bytes": 64 << 20}),
    (
        ["--port", "0", "--admin-port", "0", "--autoscale", "--kv-cache-bytes", "1048576"],
        {"port": 0, "admin_port": 0, "autoscale": True, "kv_cache_bytes": 1 << 20},
    ),
    (
        ["--port", "0", "--num-prefill", "0", "--kv-cache-bytes", "1048576",
         "--restart-backoff-s", "0.1", "--max-restarts", "0"],
        {"port": 0, "num_prefill": 0, "kv_cache_bytes": 1 << 20, "restart_backoff_s": 0.1,
         "max_restarts": 0},
    ),
    (["--port", "5", "--admin-port", "6", "--http-port", "7"], {"port": 5, "admin_port": 6,
                                                                 "http_port": 7}),
    ([], {}),
    (["--device", "cuda"], {"device": "cuda"}),
    (
        ["--http-port", "-1", "--num-decode", "2", "--transport", "local", "--dtype", "bfloat16",
         "--gpu-memory-utilization", "0.5", "--api-keys", "--host-cores", "2",
         "--max-queue-delay-s", "0", "--controller-args", "--max-prefill 4 --min-decode 1",
         "--restart-window-s", "5", "--restart-max-backoff-s", "1"],
        {"http_port": -1, "num_decode": 2, "transport": "local", "dtype": "bfloat16",
         "gpu_memory_utilization": 0.5, "api_keys": True, "host_cores": 2,
         "max_queue_delay_s": 0.0, "controller_args": ("--max-prefill", "4", "--min-decode", "1"),
         "restart_window_s": 5.0, "restart_max_backoff_s": 1.0},
    ),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "fields"), OLD_SPELLINGS)
def test_the_old_spellings_give_the_same_config(
    up_env: pytest.MonkeyPatch, tiny_model_dir: Path, argv: list[str], fields: dict[str, Any]
) -> None:
    from tandem.services.cli.up import resolve, up_config

    args = up_args("--model", str(tiny_model_dir), *argv)
    config, _ = resolve(up_config(args), args)
    assert config == UpConfig(model_dir=str(tiny_model_dir), **fields)


BAD_UP_VALUES = [
    (["--num-decode", "0"],
     "arguments --num-decode, --num-prefill: need num_decode >= 1 and num_prefill >= 0, got 0, 1"),
    (["--restart-window-s", "0"],
     "argument --restart-window-s: restart_window_s must be > 0, got 0.0"),
    (["--restart-backoff-s", "9"],
     "arguments --restart-backoff-s, --restart-max-backoff-s: need 0 < restart_backoff_s <= "
     "restart_max_backoff_s, got 9.0, 8.0"),
    (["--transport", "pigeon"],
     "argument --transport: transport must be one of ('nixl', 'local'), got 'pigeon'"),
    (["--dtype", "int3"],
     "argument --dtype: dtype must be auto, float32, bfloat16 or float16, got 'int3'"),
    (["--quantization", "int3"],
     "argument --quantization: quantization must be one of none, int8, int4, fp8, got 'int3'"),
    (["--quantization-group-size", "48"],
     "argument --quantization-group-size: quantization_group_size must be 32, 64 or 128, "
     "got 48"),
    (["--gpu-memory-utilization", "1.5"],
     "argument --gpu-memory-utilization: gpu_memory_utilization must be in (0, 1], got 1.5"),
    (["--kv-cache-mb", "0"], "argument --kv-cache-mb: kv_cache_bytes must be positive, got 0"),
    (["--host-cores", "-1"],
     "argument --host-cores: host_cores must be >= 0 (0: measured), got -1"),
    (["--num-threads", "-1"],
     "argument --num-threads: num_threads must be >= 0 (0: auto), got -1"),
    (["--port", "x"], "argument --port: invalid int value: 'x'"),
    (["--autoscale", "maybe"], "argument --autoscale: expected a boolean, got 'maybe'"),
    (["--speculative", "eagle"],
     "argument --speculative: speculative must be one of none, ngram, suffix, draft, got "
     "'eagle'"),
    (["--speculative", "draft"],
     "arguments --speculative, --draft-model: speculative draft needs a draft model "
     "(--draft-model DIR), and a draft model needs --speculative draft; got "
     "speculative='draft', draft_model=''"),
    (["--draft-model", "/d", "--speculative", "suffix"],
     "arguments --speculative, --draft-model: speculative draft needs a draft model "
     "(--draft-model DIR), and a draft model needs --speculative draft; got "
     "speculative='suffix', draft_model='/d'"),
    (["--num-speculative-tokens", "17"],
     "argument --num-speculative-tokens: num_speculative_tokens must be in [1, 16], got 17"),
    (["--speculative-ngram-min", "5"],
     "arguments --speculative-ngram-min, --speculative-ngram-max: need 1 <= ngram_min <= "
     "ngram_max <= 16, got ngram_min=5, ngram_max=4"),
    (["--speculative-max-batch", "0"],
     "arguments --speculative, --speculative-max-batch: speculative max_batch must be >= 1, "
     "got 0"),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "message"), BAD_UP_VALUES)
def test_a_bad_value_is_a_usage_error_naming_its_flag(
    up_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        up(*argv)
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"tandem up: error: {message}"


def test_a_bad_variable_is_a_usage_error_naming_it(
    up_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    up_env.setenv("TANDEM_NUM_DECODE", "many")
    with pytest.raises(SystemExit) as exc:
        up()
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tandem up: error: argument --num-decode: TANDEM_NUM_DECODE='many': invalid literal for "
        "int() with base 10: 'many'"
    )
    assert up("--num-decode", "2").num_decode == 2  # the flag given, the variable is not read


def test_tandem_up_refuses_a_bad_value_before_fetching_a_model() -> None:
    res = tandem("up", "--num-decode", "0")  # no --model: the default one would be fetched
    assert res.returncode == 2
    assert res.stderr.splitlines()[-1].startswith("tandem up: error: arguments --num-decode")
    assert "Traceback" not in res.stderr and "fetch" not in res.stderr


def test_tandem_up_leaves_its_variables_out_of_its_children_s_environment() -> None:
    from tandem.services.cli.up import drop_up_variables

    environ = {"TANDEM_PORT": "9", "TANDEM_NUM_DECODE": "2", "TANDEM_MAX_NUM_SEQS": "4",
               "TANDEM_MODEL_DIR": "/m", "PATH": "/bin"}  # fmt: skip
    drop_up_variables(environ)
    assert environ == {"TANDEM_MAX_NUM_SEQS": "4", "TANDEM_MODEL_DIR": "/m", "PATH": "/bin"}


def test_tp_is_the_tensor_parallel_size_everywhere(up_env: pytest.MonkeyPatch) -> None:
    """`--tp N` and `--tensor-parallel-size N` on tandem up, tandem generate and a worker,
    and TANDEM_TENSOR_PARALLEL_SIZE; tandem up refuses it on CUDA (one GPU per worker)."""
    from tandem.services.cli.main import _engine_config, build_parser
    from tandem.services.common.runtime.flags import parse_config
    from tandem.services.common.worker.config import WorkerConfig

    assert up("--tp", "2") == up("--tensor-parallel-size", "2")
    assert up("--tp", "2").engine_config().tensor_parallel_size == 2
    generate = build_parser().parse_args(["generate", "--tp", "3", "hi"])
    assert _engine_config(generate).tensor_parallel_size == 3
    worker = parse_config(WorkerConfig, argv=["--model-dir", "m", "--tp", "2"])
    assert worker.engine.tensor_parallel_size == 2
    up_env.setenv("TANDEM_TENSOR_PARALLEL_SIZE", "4")
    assert parse_config(WorkerConfig, argv=["--model-dir", "m"]).engine.tensor_parallel_size == 4
    with pytest.raises(ValueError, match="tandem up places one GPU per worker"):
        UpConfig(model_dir="m", device="cuda", tensor_parallel_size=2)


def test_generate_shares_the_engine_flags_of_up(
    up_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.services.cli.main import ENGINE_FLAGS, _engine_config, build_parser
    from tandem.services.cli.up import up_config

    def option_help(command: str) -> dict[str, str]:
        parser = build_parser().parse_args([command, *(["hi"] if command == "generate" else [])])
        return {
            a.option_strings[0]: a.help or ""
            for a in parser.parser._actions
            if a.dest in (*ENGINE_FLAGS, "kv_cache_mb")
        }

    shared = option_help("generate")
    assert sorted(shared) == [
        "--cpu-matmul", "--device", "--draft-model", "--dtype", "--expert-parallel",
        "--gpu-memory-utilization",
        "--kv-cache-bytes", "--kv-cache-dtype", "--kv-cache-mb", "--kv-disk-bytes",
        "--kv-disk-dir", "--kv-host-bytes", "--num-speculative-tokens", "--quantization",
        "--quantization-group-size", "--replicate-attention", "--speculative",
        "--speculative-adaptive", "--speculative-max-batch", "--speculative-ngram-max",
        "--speculative-ngram-min", "--speculative-suffix-share", "--tensor-parallel-size",
        "--tp-exact-sums",
    ]  # fmt: skip
    assert shared == {flag: h for flag, h in option_help("up").items() if flag in shared}
    argv = ["--device", "cuda:1", "--dtype", "float16", "--kv-cache-mb", "3",
            "--gpu-memory-utilization", "0.5", "--kv-cache-dtype", "fp8",
            "--expert-parallel", "true", "--tp-exact-sums", "false",
            "--cpu-matmul", "plain", "--kv-host-bytes", "4096", "--kv-disk-dir", "/kv",
            "--kv-disk-bytes", "8192", "--speculative", "ngram", "--num-speculative-tokens",
            "5", "--speculative-max-batch", "2", "--speculative-ngram-max", "6",
            "--speculative-suffix-share"]  # fmt: skip
    up_env.setenv("TANDEM_DTYPE", "bfloat16")  # both read the variables
    up_env.setenv("TANDEM_SPECULATIVE_NGRAM_MIN", "3")
    engine = _engine_config(build_parser().parse_args(["generate", *argv, "--model", "m", "hi"]))
    assert engine == up_config(up_args(*argv, "--model", "m")).engine_config()
    assert (engine.device, engine.dtype, engine.cache.kv_cache_bytes) == (
        "cuda:1",
        "float16",
        3 << 20,
    )
    assert (engine.kv_cache_dtype, engine.expert_parallel, engine.tp_exact_sums) == (
        "fp8",
        True,
        False,
    )
    assert engine.cpu_matmul == "plain"
    # `tandem generate`'s one engine takes the disk tier's directory as given.
    tiers = (engine.cache.kv_host_bytes, engine.cache.kv_disk_dir, engine.cache.kv_disk_bytes)
    assert tiers == (4096, "/kv", 8192)
    assert engine.speculative == SpeculativeConfig(
        method="ngram",
        num_speculative_tokens=5,
        ngram_max=6,
        ngram_min=3,
        max_batch=2,
        suffix_share=True,
    )
    assert _engine_config(build_parser().parse_args(["generate", "hi"])).dtype == "bfloat16"
    with pytest.raises(SystemExit) as exc:
        _engine_config(build_parser().parse_args(["generate", "--gpu-memory-utilization", "2"]))
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tandem generate: error: argument --gpu-memory-utilization: gpu_memory_utilization must "
        "be in (0, 1], got 2.0"
    )


def test_generate_refuses_half_a_disk_tier_naming_its_flags(
    up_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.services.cli.main import _engine_config, build_parser

    with pytest.raises(SystemExit):
        _engine_config(build_parser().parse_args(["generate", "--kv-disk-dir", "/kv", "hi"]))
    assert "a disk tier needs both kv_disk_dir and kv_disk_bytes" in capsys.readouterr().err


def test_generate_refuses_a_bad_speculative_setting_naming_its_flag(
    up_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from tandem.services.cli.main import _engine_config, build_parser

    argv = ["generate", "--speculative", "suffix", "--speculative-ngram-max", "17", "hi"]
    with pytest.raises(SystemExit) as exc:
        _engine_config(build_parser().parse_args(argv))
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "tandem generate: error: arguments --speculative-ngram-min, --speculative-ngram-max: "
        "need 1 <= ngram_min <= ngram_max <= 16, got ngram_min=2, ngram_max=17"
    )
    off = _engine_config(build_parser().parse_args(["generate", "hi"])).speculative
    assert off == SpeculativeConfig() and not off.enabled


def test_up_passes_the_speculative_settings_to_every_worker(up_env: pytest.MonkeyPatch) -> None:
    """The workers' command lines (UpConfig.worker_args) carry the speculative flags as given
    (issue 45: speculation runs where a worker decodes; a prefill worker's engine has them
    too, unused), and a worker main parses them into the config's SpeculativeConfig."""
    from tandem.services.common.runtime.flags import parse_config
    from tandem.services.common.worker.config import WorkerConfig

    up_env.setenv("TANDEM_SPECULATIVE_SUFFIX_SHARE", "true")
    config = up("--model", "/m", "--speculative", "suffix", "--num-speculative-tokens", "8",
                "--speculative-max-batch", "16", "--speculative-ngram-max", "5",
                "--speculative-ngram-min", "3")  # fmt: skip
    want = SpeculativeConfig("suffix", 8, ngram_max=5, ngram_min=3, max_batch=16,
                             suffix_share=True)  # fmt: skip
    assert config.engine_config().speculative == want

    def flags(args: list[str]) -> dict[str, str]:
        return dict(zip(args[::2], args[1::2], strict=True))

    for name, role in (("prefill-0", "prefill"), ("decode-1", "decode")):
        args = config.worker_args(name)
        assert {k: v for k, v in flags(args).items() if "speculative" in k} == {
            "--speculative": "suffix",
            "--num-speculative-tokens": "8",
            "--speculative-max-batch": "16",
            "--speculative-ngram-max": "5",
            "--speculative-ngram-min": "3",
            "--speculative-suffix-share": "true",
            "--speculative-adaptive": "true",
        }
        worker = parse_config(WorkerConfig, args, fixed={"role": role}, environ={})
        assert worker.engine.speculative == want
    # Off by default, and the workers are told so.
    up_env.delenv("TANDEM_SPECULATIVE_SUFFIX_SHARE")
    plain = flags(up("--model", "/m").worker_args("decode-0"))
    assert (plain["--speculative"], plain["--speculative-suffix-share"]) == ("none", "false")
    assert plain["--draft-model"] == ""


def test_up_passes_the_draft_model_to_every_worker(up_env: pytest.MonkeyPatch) -> None:
    """speculative draft: every worker, prefill too (it prefills the draft and hands its KV
    over), gets --speculative draft and the same --draft-model, from the flag or
    TANDEM_DRAFT_MODEL."""
    from tandem.services.common.runtime.flags import parse_config
    from tandem.services.common.worker.config import WorkerConfig

    config = up("--model", "/m", "--speculative", "draft", "--draft-model", "/models/draft")
    up_env.setenv("TANDEM_DRAFT_MODEL", "/models/draft")
    assert up("--model", "/m", "--speculative", "draft") == config
    want = SpeculativeConfig("draft", draft_model="/models/draft")
    assert config.engine_config().speculative == want
    for name, role in (("prefill-0", "prefill"), ("decode-1", "decode")):
        args = config.worker_args(name)
        assert args[args.index("--draft-model") + 1] == "/models/draft"
        assert args[args.index("--speculative") + 1] == "draft"
        worker = parse_config(WorkerConfig, args, fixed={"role": role}, environ={})
        assert worker.engine.speculative == want


def _fake_gguf_conversion(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """tandem.weights.fetch.convert_gguf_file replaced: it records the files it is given and
    names cache_dir/<stem> (the real one converts, out of scope here)."""
    import tandem.weights.fetch as fetch

    converted: list[Path] = []

    def convert(path: Path, cache_dir: Path) -> Path:
        converted.append(path)
        return cache_dir / path.stem

    monkeypatch.setattr(fetch, "convert_gguf_file", convert)
    return converted


def test_up_resolves_the_draft_model_as_the_model(
    up_env: pytest.MonkeyPatch, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """--draft-model is resolved as --model is (tandem.services.cli.model.resolve_model): a
    directory as given (a relative one relative to where `tandem up` runs, whose workers
    inherit its working directory), a .gguf file converted once; none stays none (not the
    default model)."""
    from tandem.services.cli.model import MODEL_CACHE_DIR
    from tandem.services.cli.up import resolve, up_config

    converted = _fake_gguf_conversion(up_env)
    gguf = tmp_path / "draft-q8.gguf"
    gguf.write_bytes(b"GGUF")
    for draft, want in (
        ("drafts/small", "drafts/small"),
        (str(gguf), str(MODEL_CACHE_DIR / gguf.stem)),
    ):
        args = up_args(
            "--model", str(tiny_model_dir), "--speculative", "draft", "--draft-model", draft
        )
        config, _ = resolve(up_config(args), args)
        assert config.draft_model == want
        assert config.worker_args("prefill-0")[-2:] == ["--draft-model", want]
        assert config.model_dir == str(tiny_model_dir)
    assert converted == [gguf]
    args = up_args("--model", str(tiny_model_dir))
    config, _ = resolve(up_config(args), args)
    assert config.draft_model == "" and converted == [gguf]


def test_generate_resolves_the_draft_model_as_the_model(
    up_env: pytest.MonkeyPatch,
    tiny_model_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`tandem generate --speculative draft --draft-model X.gguf`: the engine it builds is
    given the converted draft model's directory (the engine itself is replaced: this checks
    the config it gets)."""
    import tandem.engine.engine as engine_module
    from tandem.services.cli.main import build_parser, cmd_generate
    from tandem.services.cli.model import MODEL_CACHE_DIR

    converted = _fake_gguf_conversion(up_env)
    built: list[Any] = []

    class NoEngine:
        def __init__(self, config: Any, progress: Any = None) -> None:
            built.append(config)
            raise ValueError("not loaded in this test")

    up_env.setattr(engine_module, "LLMEngine", NoEngine)
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["generate", "--model", str(tiny_model_dir), "--speculative", "draft",
            "--draft-model", str(gguf), "hi"]  # fmt: skip
    assert cmd_generate(build_parser().parse_args(argv)) == 2
    assert "not loaded in this test" in capsys.readouterr().err
    (config,) = built
    assert config.model_dir == str(tiny_model_dir) and converted == [gguf]
    assert config.speculative == SpeculativeConfig(
        "draft", draft_model=str(MODEL_CACHE_DIR / "draft")
    )


def test_up_gives_each_worker_its_own_disk_tier_directory(up_env: pytest.MonkeyPatch) -> None:
    """The workers' command lines (UpConfig.worker_args): the tiers' flags as given, but the
    disk tier's directory one per worker under --kv-disk-dir."""
    config = up("--model", "/m", "--kv-host-bytes", "4096", "--kv-disk-dir", "/kv",
                "--kv-disk-bytes", "8192")  # fmt: skip

    def flags(args: list[str]) -> dict[str, str]:
        return dict(zip(args[::2], args[1::2], strict=True))

    prefill, decode = flags(config.worker_args("prefill-0")), flags(config.worker_args("decode-1"))
    assert {k: v for k, v in prefill.items() if k.startswith("--kv-")} == {
        "--kv-cache-bytes": str(config.kv_cache_bytes),
        "--kv-host-bytes": "4096",
        "--kv-disk-dir": "/kv/prefill-0",
        "--kv-disk-bytes": "8192",
        "--kv-cache-dtype": "auto",
    }
    assert decode["--kv-disk-dir"] == "/kv/decode-1"
    assert {k: v for k, v in prefill.items() if k != "--kv-disk-dir"} == {
        k: v for k, v in decode.items() if k != "--kv-disk-dir"
    }
    # What a worker main makes of them: the config's engine, but its own directory.
    from tandem.services.common.runtime.flags import parse_config
    from tandem.services.common.worker.config import WorkerConfig

    argv = [*config.worker_args("prefill-0"), "--worker-id", "prefill-0"]
    worker = parse_config(WorkerConfig, argv, fixed={"role": "prefill"}, environ={})
    want = config.engine_config()
    want = dataclasses.replace(
        want, cache=dataclasses.replace(want.cache, kv_disk_dir="/kv/prefill-0")
    )
    assert dataclasses.replace(worker.engine, role=want.role) == want
    # Without tiers: no directory, and 0 for both budgets (the workers' "no such tier").
    plain = flags(up("--model", "/m").worker_args("decode-0"))
    assert "--kv-disk-dir" not in plain
    assert (plain["--kv-host-bytes"], plain["--kv-disk-bytes"]) == ("0", "0")
    assert (plain["--model-dir"], plain["--tp-exact-sums"]) == ("/m", "none")
