"""The marks the router's prefix-index lookups carry (services/router/placer.py
`ResumeMarks`): none for full attention, state marks for linear-attention layers, and for a
sliding-window model its first sliding table's keys of the blocks the next token's window
reads, so a worker that freed those pages is not credited with the prefix."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import pytest

from tandem.engine.prefix_hash import hash_blocks, hash_keys, state_mark, table_key
from tandem.engine.request import RequestSpec
from tandem.index import MemoryPrefixIndex
from tandem.model.config import ModelConfig
from tandem.services.router.config import RouterConfig
from tandem.services.router.placer import Placer, ResumeMarks


def _config(arch: str, **extra: Any) -> ModelConfig:
    return ModelConfig.from_hf({
        "architectures": [arch], "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, **extra,
    })  # fmt: skip


def test_each_model_gets_the_marks_that_say_where_it_resumes() -> None:
    assert ResumeMarks.of(_config("LlamaForCausalLM")) == ResumeMarks()
    # gpt-oss: sliding and full alternating -> tables [full 3][sliding 3]
    gpt_oss = _config("GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                      sliding_window=128)  # fmt: skip
    assert ResumeMarks.of(gpt_oss) == ResumeMarks("sliding", 1, 128)
    # Gemma 3: five local layers per global one -> tables [full 1][sliding 1] x 5
    gemma = _config("Gemma3ForCausalLM", sliding_window=512, sliding_window_pattern=6)
    assert ResumeMarks.of(gemma) == ResumeMarks("sliding", 1, 512)
    # linear-attention layers: their state checkpoints decide, sliding layers or not
    linear = dataclasses.replace(gemma.features, linear_layers=(1, 2))
    assert ResumeMarks.of(dataclasses.replace(gemma, features=linear)) == ResumeMarks("state")
    with pytest.raises(ValueError, match="window of 2 tokens or more, got 1"):
        ResumeMarks("sliding", 1, 1)


def test_lookup_args_per_kind() -> None:
    hashes = [7, 8, 9]
    assert ResumeMarks().lookup_args(hashes, 4) == (None, None)
    assert ResumeMarks("state").lookup_args(hashes, 4) == ([state_mark(h) for h in hashes], None)
    marks, marks_from = ResumeMarks("sliding", 2, 8).lookup_args(hashes, 4)
    assert marks == [table_key(h, 2) for h in hashes]
    assert len(set(marks) | set(hashes)) == 6  # a table's keys are not the chain's
    assert marks_from == (0, 0, 1)  # window 8 in blocks of 4: the last two blocks


def test_the_router_counts_a_sliding_prefix_only_where_the_window_is_held() -> None:
    """Six blocks of 4, window 8 (the last two blocks). Every worker holds the prompt's
    blocks (table 0); what differs is table 1's keys, which the lookup must send."""
    tokens = tuple(range(5, 29))
    hashes = hash_blocks(list(tokens), 4, hash_keys("m"))
    keys = [table_key(h, 1) for h in hashes]

    async def overlap() -> dict[str, int] | None:
        index = MemoryPrefixIndex()
        holds = {
            "window": hashes + keys[4:],  # freed what fell out of the window: a full hit
            "stale": hashes + keys[:4],  # lost the window's keys: resumes at 4 blocks
            # the last block's key but not block 4's (mark n - 1 alone would say 6 blocks)
            "gap": hashes + [keys[1], keys[2], keys[5]],
            "none": hashes,  # no sliding pages at all
        }
        for worker, held in holds.items():
            await index.snapshot(worker, "m", 1, 0, held)
        config = RouterConfig(model_dir="m", block_size=4, decode_addresses=("d:1",))
        placer = Placer(config, "m", marks=ResumeMarks("sliding", 1, 8))
        placer._index = index  # type: ignore[assignment]
        _, found = await placer._prefix_overlap(RequestSpec("r", tokens), [])
        return found

    assert asyncio.run(overlap()) == {"window": 6, "stale": 4, "gap": 3}
