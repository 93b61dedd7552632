"""The chart's speculative decoding (issue 45): `<role>.config.speculative` and its companions
as the workers' TANDEM_* env (the flags' names: tandem.services.common.runtime.flags
PUBLIC_NAMES), read back by the worker's flag parser, and the schema's refusals, rendered by
the real helm 3."""

from __future__ import annotations

import dataclasses
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
    "TANDEM_SPECULATIVE_ADAPTIVE",
    "TANDEM_DRAFT_MODEL",
}
# The model on a volume mounted at /models (model.volume), where a draft model lies too.
MODEL_VOLUME = {
    "dir": "/models/llama-3-8b",
    "mountPath": "/models",
    "volume": {"persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
}
DRAFT = {"speculative": "draft", "draft_model": "/models/llama-3.2-1b"}


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
                    "speculative_adaptive": False,
                }
            },
            "prefill": {"config": {"speculative": "ngram"}},
        })
    )  # fmt: skip
    objects = helm.render("-f", str(values))
    env = _env(objects, "decode")
    assert {name: env[name] for name in SPEC_ENV if name in env} == {  # no draft model
        "TANDEM_SPECULATIVE": "suffix",
        "TANDEM_NUM_SPECULATIVE_TOKENS": "6",
        "TANDEM_SPECULATIVE_MAX_BATCH": "32",
        "TANDEM_SPECULATIVE_NGRAM_MAX": "5",
        "TANDEM_SPECULATIVE_NGRAM_MIN": "1",
        "TANDEM_SPECULATIVE_SUFFIX_SHARE": "true",
        "TANDEM_SPECULATIVE_ADAPTIVE": "false",
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
        adaptive=False,
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
        (["prefill.config.draft_model=1"],
         "prefill.config.draft_model: Invalid type. Expected: string"),
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


def _draft_values(
    tmp_path: Path,
    prefill: dict[str, Any],
    decode: dict[str, Any],
    model: dict[str, Any] | None = None,
) -> list[str]:
    values = tmp_path / "draft.yaml"
    values.write_text(yaml.safe_dump({
        "model": MODEL_VOLUME if model is None else model,
        "prefill": {"config": prefill},
        "decode": {"config": decode},
    }))  # fmt: skip
    return ["-f", str(values)]


def test_draft_model_as_both_workers_env(helm: Helm, tmp_path: Path) -> None:
    """speculative draft: both roles get TANDEM_SPECULATIVE=draft and the same
    TANDEM_DRAFT_MODEL (the prefill worker prefills the draft and hands its KV over), which
    the worker's flag parser reads into SpeculativeConfig.draft_model."""
    objects = helm.render(*_draft_values(tmp_path, DRAFT, {**DRAFT, "speculative_max_batch": 8}))
    want = SpeculativeConfig(method="draft", draft_model="/models/llama-3.2-1b")
    for role, spec in (("prefill", want), ("decode", dataclasses.replace(want, max_batch=8))):
        env = _env(objects, role)
        assert env["TANDEM_SPECULATIVE"] == "draft"
        assert env["TANDEM_DRAFT_MODEL"] == "/models/llama-3.2-1b"
        assert env["TANDEM_MODEL_DIR"] == "/models/llama-3-8b"
        tandem_env = {k: v for k, v in env.items() if k in SPEC_ENV}
        worker = parse_config(WorkerConfig, ["--model-dir", "/m"], environ=tandem_env)
        assert worker.engine.speculative == spec
    # The model image holds the draft model too (model.baked): any path.
    baked = {"baked": True, "dir": "/opt/model", "volume": None}
    draft = {"speculative": "draft", "draft_model": "/opt/draft"}
    objects = helm.render(*_draft_values(tmp_path, draft, draft, baked))
    assert _env(objects, "decode")["TANDEM_DRAFT_MODEL"] == "/opt/draft"


@pytest.mark.parametrize(
    ("prefill", "decode", "model", "message"),
    [
        ({}, DRAFT, None,
         'prefill.config.draft_model ("") and decode.config.draft_model '
         '("/models/llama-3.2-1b") must be the same'),
        (DRAFT, {"speculative": "ngram"}, None,
         'prefill.config.draft_model ("/models/llama-3.2-1b") and decode.config.draft_model '
         '("") must be the same'),
        ({**DRAFT, "draft_model": "/models/other"}, DRAFT, None, "must be the same"),
        ({**DRAFT, "draft_model": "/drafts/small"}, {**DRAFT, "draft_model": "/drafts/small"},
         None,
         "draft_model (/drafts/small) must lie under model.mountPath (/models): the draft "
         "model is read from the model's volume"),
        # The generated demo model's emptyDir holds no draft model.
        (DRAFT, DRAFT, {"dir": "/models/tandem-tiny-small"},
         "draft_model needs the model on a volume (model.volume) or in the image "
         "(model.baked)"),
    ],
)  # fmt: skip
def test_chart_refuses_a_draft_model_the_workers_cannot_share(
    helm: Helm,
    tmp_path: Path,
    prefill: dict[str, Any],
    decode: dict[str, Any],
    model: dict[str, Any] | None,
    message: str,
) -> None:
    with pytest.raises(HelmError) as exc:
        helm.template(*_draft_values(tmp_path, prefill, decode, model))
    assert message in str(exc.value)
