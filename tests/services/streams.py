"""Streams a test interrupts: every prompt streamed at once, something done to the cluster once
each stream is past its 20th token (a worker killed or drained), every result collected."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.client import AsyncTandemClient, Result

STARTED_AT = 20  # tokens every stream has before `interrupt` runs
WAIT_S = 120.0


async def stream(
    address: str, prompt: list[int], started: asyncio.Event, max_tokens: int, **kw: object
) -> Result:
    """One stream to the end; `started` set once its STARTED_AT-th token arrived."""
    result = Result()
    async with AsyncTandemClient(address, timeout_s=WAIT_S) as client:
        async for _ in client.stream(
            prompt, result=result, max_tokens=max_tokens, ignore_eos=True, **kw
        ):
            if len(result.token_ids) >= STARTED_AT:
                started.set()
    return result


def run_streams(
    address: str,
    prompts: list[list[int]],
    seeds: list[int | None],
    max_tokens: int,
    interrupt: Callable[[], None] | None = None,
) -> list[Result]:
    """Every prompt streamed (a seed: sampled at 0.8; None: greedy); `interrupt` run once
    every stream is past its STARTED_AT-th token."""

    async def main() -> list[Result]:
        started = [asyncio.Event() for _ in prompts]
        tasks = []
        for p, seed, ev in zip(prompts, seeds, started, strict=True):
            kw = {"temperature": 0.0} if seed is None else {"temperature": 0.8, "seed": seed}
            tasks.append(asyncio.create_task(stream(address, p, ev, max_tokens, **kw)))
        if interrupt is not None:
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
            interrupt()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), WAIT_S))

    return asyncio.run(main())
