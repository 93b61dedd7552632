"""logit_bias across a migration: the decode worker streaming a biased request is killed,
another one continues it with the same bias (it travels in the request's sampling), and the
output is the one an uninterrupted run gives (seeded sampling), with no banned token."""

from __future__ import annotations

import asyncio

from tandem.client import AsyncTandemClient, Result
from tests.faults.conftest import WAIT_S, Fleet
from tests.faults.test_fault_matrix import run


def test_a_migrated_biased_stream_keeps_its_bias(fleet: Fleet) -> None:
    prompt = [5 + (i * 41) % 500 for i in range(8)]  # token ids, as the fault matrix's
    sampling: dict[str, object] = {"max_tokens": 300, "temperature": 0.9, "seed": 91,
                                   "ignore_eos": True}  # fmt: skip

    async def sampled(started: asyncio.Event | None, **extra: object) -> Result:
        result = Result()
        async with AsyncTandemClient(fleet.addresses["r0"], timeout_s=WAIT_S) as client:
            async for _ in client.stream(prompt, result=result, **sampling, **extra):
                if started is not None:
                    started.set()
        return result

    free = run(sampled(None))
    assert isinstance(free, Result)
    banned = sorted(set(free.token_ids))[:40]  # tokens this seed's free run uses
    bias = {"logit_bias": {t: -100.0 for t in banned}}
    victims: list[str] = []

    async def scenario() -> Result:
        started = asyncio.Event()
        task = asyncio.create_task(sampled(started, **bias))
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
    clean = run(sampled(None, **bias))
    assert isinstance(interrupted, Result) and isinstance(clean, Result)
    assert interrupted.migrations == 1, interrupted.recoveries
    assert clean.migrations == 0
    assert interrupted.token_ids == clean.token_ids
    assert len(clean.token_ids) == 300 and not set(banned) & set(clean.token_ids)
    fleet.assert_clean()
