"""The chart's speculative decoding (issue 45): `<role>.config.speculative` and its companions
as the workers' TANDEM_* env (the flags' names: tandem.services.common.runtime.flags
PUBLIC_NAMES), read back by the worker's flag parser, and the schema's refusals, rendered by
the real helm 3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tandem.config import SpeculativeConfig
from tandem.services.common.runtime.flags import parse_config
from tandem.services.common.worker.config import WorkerConfig
from tests.deploy.helm import Helm, HelmError, containers, env_of, one

SPEC_ENV = {
    "TANDEM_SPECULATIVE",
    "TANDEM_NUM_SPECULATIVE_TOKENS",
    "TANDEM_SPECULATIVE_MAX_BATCH",
    "TANDEM_SPECULATIVE_NGRAM_MAX",
    "TANDEM_SPECULATIVE_NGRAM_MIN",
    "TANDEM_SPECULATIVE_SUFFIX_SHARE",
}


def _env(objects: list[dict[str, Any]], role: str) -> dict[str, Any]:
    (container,) = containers(one(objects, "Deployment", f"tandem-{role}"))
    return env_of(container)


def test_no_speculative_env_by_default(helm: Helm) -> None:
    objects = helm.render()
    for role in ("prefill", "decode"):
        assert not SPEC_ENV & set(_env(objects, role))


def test_speculative_config_as_the_workers_env(helm: Helm, tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump({
            "decode": {
                "config": {
                    "speculative": "suffix", "num_speculative_tokens": 6,
                    "speculative_max_batch": 32, "speculative_ngram_max": 5,
                    "speculative_ngram_min": 1, "speculative_suffix_share": True,
                }
            },
            "prefill": {"config": {"speculative": "ngram"}},
        })
    )  # fmt: skip
    objects = helm.render("-f", str(values))
    env = _env(objects, "decode")
    assert {name: env[name] for name in SPEC_ENV} == {
        "TANDEM_SPECULATIVE": "suffix",
        "TANDEM_NUM_SPECULATIVE_TOKENS": "6",
        "TANDEM_SPECULATIVE_MAX_BATCH": "32",
        "TANDEM_SPECULATIVE_NGRAM_MAX": "5",
        "TANDEM_SPECULATIVE_NGRAM_MIN": "1",
        "TANDEM_SPECULATIVE_SUFFIX_SHARE": "true",
    }
    tandem_env = {k: v for k, v in env.items() if k in SPEC_ENV}
    worker = parse_config(WorkerConfig, ["--model-dir", "/m"], environ=tandem_env)
    assert worker.engine.speculative == SpeculativeConfig(
        method="suffix",
        num_speculative_tokens=6,
        ngram_max=5,
        ngram_min=1,
        max_batch=32,
        suffix_share=True,
    )
    prefill = _env(objects, "prefill")  # per role: only what that role's config sets
    assert {k: v for k, v in prefill.items() if k in SPEC_ENV} == {"TANDEM_SPECULATIVE": "ngram"}


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["decode.config.speculative=eagle"], "decode.config.speculative must be one of"),
        (["prefill.config.speculative=true"],
         "prefill.config.speculative: Invalid type. Expected: string"),
        (["decode.config.num_speculative_tokens=0"],
         "decode.config.num_speculative_tokens: Must be greater than or equal to 1"),
        (["decode.config.num_speculative_tokens=17"],
         "decode.config.num_speculative_tokens: Must be less than or equal to 16"),
        (["decode.config.speculative_ngram_max=17"],
         "decode.config.speculative_ngram_max: Must be less than or equal to 16"),
        (["decode.config.speculative_ngram_min=0"],
         "decode.config.speculative_ngram_min: Must be greater than or equal to 1"),
        (["decode.config.speculative_max_batch=0"],
         "decode.config.speculative_max_batch: Must be greater than or equal to 1"),
        (["decode.config.speculative_max_batch=many"],
         "decode.config.speculative_max_batch: Invalid type. Expected: integer"),
        (["decode.config.speculative_suffix_share=yes"],
         "decode.config.speculative_suffix_share: Invalid type. Expected: boolean"),
        # SpeculativeConfig's field names are not the chart's (nor the flags').
        (["decode.config.method=ngram"], "Additional property method is not allowed"),
        (["decode.config.max_batch=4"], "Additional property max_batch is not allowed"),
    ],
)  # fmt: skip
def test_schema_refuses_bad_speculative_values(helm: Helm, flags: list[str], message: str) -> None:
    with pytest.raises(HelmError) as exc:
        helm.template(*(arg for flag in flags for arg in ("--set", flag)))
    assert "don't meet the specifications of the schema" in str(exc.value)
    assert message in str(exc.value)
