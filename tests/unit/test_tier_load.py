"""A worker's load carries its KV tiers' use (tandem.load.Load): the blocks each tier holds
and the prompt tokens they served, as the engine's tier figures (tandem.tiers.stats) say."""

from __future__ import annotations

import random

from tandem.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


def test_load_counts_the_tiers_blocks_and_hits(tiny_model_dir, engine_factory) -> None:
    """Two 40-token prompts through a 12-block cache (10 blocks each): the second evicts the
    first into host memory, and the first again is served from there."""
    engine = engine_factory(tiny_model_dir, block_size=4, num_blocks=12, kv_host_bytes=1 << 20)
    rng = random.Random(0)
    first, second = (rng.choices(range(3, 250), k=40) for _ in range(2))
    for prompt in (first, second, first):
        engine.generate([prompt], GREEDY)
        engine.check_integrity()
    assert engine.tiers.tiers.drain()
    load = engine.stats()
    [host] = engine.tier_stats()
    assert load.host_tier_blocks == host.blocks > 0
    assert load.tier_hit_tokens == host.hit_tokens > 0
    assert load.disk_tier_blocks == 0  # no disk tier
    engine.close()


def test_an_engine_without_tiers_counts_none(tiny_model_dir, engine_factory) -> None:
    engine = engine_factory(tiny_model_dir, block_size=4, num_blocks=12)
    engine.generate([list(range(3, 43))], GREEDY)
    load = engine.stats()
    assert engine.tiers is None
    assert (load.host_tier_blocks, load.disk_tier_blocks, load.tier_hit_tokens) == (0, 0, 0)
