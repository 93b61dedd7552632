"""Tenant isolation of the prefix cache: a request's cache salt joins the model id in its block
hashes, so requests with different salts never share a cached block, and "" is the shared
cache exactly as before salts existed."""

from __future__ import annotations

import pytest

from tandem.config import EngineRole
from tandem.engine.block_pool import KVEventKind
from tandem.engine.prefix_hash import hash_blocks, hash_keys
from tandem.engine.request import Resume
from tandem.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 22))  # 17 tokens: 4 full blocks of 4 and one token over


@pytest.fixture
def engine(tiny_model_dir, engine_factory):
    e = engine_factory(tiny_model_dir, block_size=4, num_blocks=64)
    e.enable_kv_events()
    return e


def run(engine, rid: str, prompt: list[int], salt: str):
    request = engine.add_request(engine.spec(rid, prompt, GREEDY, cache_salt=salt))
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.num_free_blocks() == engine.num_blocks
    return request


def salted(engine, tokens: list[int], salt: str) -> list[int]:
    return hash_blocks(tokens, 4, hash_keys(engine.model_id, salt))


def test_different_salts_share_no_cached_block(engine):
    a = run(engine, "a", PROMPT, "tenant-a")
    b = run(engine, "b", PROMPT, "tenant-b")
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 0
    assert a.output_token_ids == b.output_token_ids  # same tokens, same answer
    # 17 prompt tokens + 2 of 3 outputs have KV: 4 full blocks each, all in the prompt.
    assert a.block_hashes[:4] == salted(engine, PROMPT, "tenant-a")
    assert b.block_hashes[:4] == salted(engine, PROMPT, "tenant-b")
    assert not set(a.block_hashes) & set(b.block_hashes)
    assert set(engine.cached_block_hashes()) == set(a.block_hashes[:4] + b.block_hashes[:4])
    # The index hears of each tenant's blocks under that tenant's hashes only.
    stored = [e.block_hash for e in engine.take_kv_events() if e.kind == KVEventKind.STORED]
    assert stored == a.block_hashes[:4] + b.block_hashes[:4]


def test_same_salt_shares_the_cache(engine):
    run(engine, "a", PROMPT, "tenant-a")
    again = run(engine, "a2", PROMPT, "tenant-a")
    assert again.num_cached_tokens == 16
    # A request without a salt does not see the tenant's blocks either.
    shared = run(engine, "s", PROMPT, "")
    assert shared.num_cached_tokens == 0


def test_empty_salt_hashes_as_before_salts(engine):
    """`hash_keys(model_id, "")` is `(model_id,)`, the engine's keys before salts, so caches
    and indexes built before keep their hashes."""
    request = run(engine, "a", PROMPT, "")
    assert request.block_hashes[:4] == hash_blocks(PROMPT, 4, (engine.model_id,))
    assert run(engine, "b", PROMPT, "").num_cached_tokens == 16


def test_decode_reserve_is_salted_and_caches_under_its_own_hashes(tiny_model_dir, engine_factory):
    decode = engine_factory(tiny_model_dir, block_size=4, num_blocks=64, role=EngineRole.DECODE)
    prompt = PROMPT[:16]
    # Tenant A's prompt, cached locally: tenant B's hand-off reuses none of it.
    run(decode, "a", prompt + [1], "tenant-a")
    reserved = decode.reserve_kv(decode.spec("b", prompt, GREEDY, "tenant-b"), Resume((42,)))
    assert reserved is not None and reserved[1] == 0
    before = set(decode.cached_block_hashes())
    decode.commit_kv("b")
    # The filled blocks join the cache under hashes of the request's own tokens and salt.
    new = set(decode.cached_block_hashes()) - before
    assert new == set(salted(decode, prompt, "tenant-b"))
    decode.abort("b")
    reserved = decode.reserve_kv(decode.spec("a2", prompt, GREEDY, "tenant-a"), Resume((42,)))
    assert reserved is not None and reserved[1] == 16
    decode.abort("a2")
    decode.check_integrity()
    assert decode.num_free_blocks() == decode.num_blocks
