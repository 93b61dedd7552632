"""Structured output across a migration: the decode worker streaming a constrained request is
killed, another one resumes the grammar from every token streamed so far, and the output is
the one an uninterrupted run gives (seeded sampling) and still matches the constraint."""

from __future__ import annotations

import asyncio
import re

from tandem.client import AsyncTandemClient, Result
from tests.faults.conftest import WAIT_S, Fleet
from tests.faults.test_fault_matrix import run

PATTERN = "([a-z]{3} ){200}"  # longer than 300 tokens: the stream runs to max_tokens


def test_a_migrated_constrained_stream_keeps_its_grammar(fleet: Fleet) -> None:
    prompt = [5 + (i * 37) % 500 for i in range(8)]  # token ids, as the fault matrix's
    sampling = {"max_tokens": 300, "temperature": 0.9, "seed": 77, "regex": PATTERN}

    async def sampled(started: asyncio.Event | None) -> Result:
        result = Result()
        async with AsyncTandemClient(fleet.addresses["r0"], timeout_s=WAIT_S) as client:
            async for _ in client.stream(prompt, result=result, **sampling):
                if started is not None:
                    started.set()
        return result

    victims: list[str] = []

    async def scenario() -> Result:
        started = asyncio.Event()
        task = asyncio.create_task(sampled(started))
        await asyncio.wait_for(started.wait(), WAIT_S)
        victims.extend(n for n in ("d0", "d1") if fleet.stats(n).num_running)  # where it runs
        assert len(victims) == 1, victims
        fleet.kill(victims[0])
        return await task

    try:
        interrupted = run(scenario())
    finally:
        for victim in victims:
            fleet.restart(victim)
    clean = run(sampled(None))
    assert isinstance(interrupted, Result) and isinstance(clean, Result)
    assert interrupted.migrations == 1, interrupted.recoveries
    assert clean.migrations == 0
    assert interrupted.token_ids == clean.token_ids
    # Cut at max_tokens, the text is a prefix of a match: every token followed the grammar.
    assert interrupted.finish_reason == "length"
    assert re.fullmatch("([a-z]{3} )*[a-z]{0,3}", interrupted.text), interrupted.text
    fleet.assert_clean()
