"""logit_bias end to end on `tandem up`: obeyed on token 1 (sampled by the prefill worker)
and on the decode worker's tokens after the hand-off, over gRPC and the `openai` client; ids
outside the vocabulary are refused before any work."""

from __future__ import annotations

import uuid

import grpc
import openai
import pytest

from tandem.client import TandemClient, TandemError
from tandem.model.config import ModelConfig
from tandem.services.up import Cluster
from tandem.tokenizer.tokenizer import Tokenizer


def long_prompt() -> str:
    """Over the router's 64 uncached tokens, and new each time (no worker has it cached):
    prefilled on the prefill worker and handed over."""
    tag = uuid.uuid4().hex
    return f"{tag} " + " ".join(f"item {i} of the list {tag}, then" for i in range(30))


@pytest.fixture(scope="module")
def tokenizer(cluster: Cluster) -> Tokenizer:
    return Tokenizer.from_dir(cluster.config.model_dir)


def test_a_forcing_bias_holds_on_token_1_and_after_the_handoff(
    grpc_client: TandemClient, tokenizer: Tokenizer
) -> None:
    forced = tokenizer.encode("fox", add_special_tokens=False)[-1]
    for temperature in (0.0, 1.0):
        out = grpc_client.generate(
            long_prompt(), max_tokens=6, temperature=temperature, seed=3,
            logit_bias={forced: 100.0},
        )  # fmt: skip
        assert out.disaggregated  # token 1 came from the prefill worker
        assert out.token_ids == [forced] * 6


def test_a_ban_holds_on_token_1_and_after_the_handoff(grpc_client: TandemClient) -> None:
    prompt = long_prompt()
    free = grpc_client.generate(prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    banned = set(free.token_ids)
    out = grpc_client.generate(
        long_prompt(), max_tokens=6, temperature=0.0, ignore_eos=True,
        logit_bias={t: -100.0 for t in banned},
    )  # fmt: skip
    assert out.disaggregated
    assert len(out.token_ids) == 6 and not banned & set(out.token_ids), (banned, out.token_ids)
    # The same prompt with the same bias: the first token is no longer the unbiased one.
    again = grpc_client.generate(
        prompt, max_tokens=6, temperature=0.0, ignore_eos=True,
        logit_bias={t: -100.0 for t in banned},
    )  # fmt: skip
    assert again.token_ids[0] != free.token_ids[0] and not banned & set(again.token_ids)


def test_the_openai_client_biases_completions_and_chat(
    cluster: Cluster, tokenizer: Tokenizer
) -> None:
    forced = tokenizer.encode("fox", add_special_tokens=False)[-1]
    base_url = f"http://{cluster.http_address}/v1"
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        text = client.completions.create(
            model="", prompt=long_prompt(), max_tokens=4, temperature=0,
            logit_bias={str(forced): 100},
        ).choices[0].text  # fmt: skip
        assert text == tokenizer.decode([forced] * 4)
        answer = client.chat.completions.create(
            model="", messages=[{"role": "user", "content": long_prompt()}], max_tokens=4,
            temperature=0.7, seed=1, logit_bias={str(forced): 100},
        )  # fmt: skip
        assert answer.choices[0].message.content == tokenizer.decode([forced] * 4)
        vocab = ModelConfig.from_dir(cluster.config.model_dir).vocab_size
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(
                model="", prompt="x", max_tokens=1, logit_bias={str(vocab): 1}
            )
        assert f"logit_bias token ids must be in [0, {vocab}), got {vocab}" in err.value.message


def test_grpc_refuses_a_bias_out_of_range(grpc_client: TandemClient) -> None:
    with pytest.raises(TandemError) as err:
        grpc_client.generate("x", max_tokens=1, logit_bias={3: 250.0})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.message == (
        "sampling.logit_bias[3] must be a finite float in [-100.0, 100.0], got 250.0"
    )
