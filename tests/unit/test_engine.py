"""Engine behaviour end to end in one process: inputs, stops, sampling, roles, cleanup."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.config import EngineRole
from tandem.engine.request import RequestStatus, Resume
from tandem.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
FOUR = SamplingParams(max_tokens=4)


@pytest.fixture(scope="module")
def engine(tiny_model_dir, engine_factory):
    return engine_factory(tiny_model_dir, block_size=4, num_blocks=128)


def drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    assert engine.num_free_blocks() == engine.num_blocks


# -- bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ([], None, "prompt must not be empty"),
        ("", None, "prompt must not be empty"),
        ([5, 99999], None, "outside"),
        ([5, -1], None, "outside"),
        ([7] * 2048, None, "max_model_len"),
        ([5, 6], SamplingParams(stop_token_ids=(100000,)), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected_and_leave_nothing_behind(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request(engine.spec("bad", prompt, params))
    assert not engine.has_unfinished()
    assert engine.num_free_blocks() == engine.num_blocks


def test_max_tokens_beyond_the_cache_stops_at_the_context(engine):
    """The fixture's cache holds 128 x 4 = 512 tokens, so the tiny model's 2048-token context
    was capped to 512 at startup: a request asking for more ends there, by length."""
    assert engine.max_model_len == 512
    [out] = engine.generate([[5, 6]], SamplingParams(max_tokens=2000, ignore_eos=True))
    assert len(out.token_ids) == 510 and out.finish_reason == "length"
    assert engine.num_free_blocks() == engine.num_blocks


def test_duplicate_request_id_rejected(engine):
    engine.add_request(engine.spec("dup", [5, 6, 7], GREEDY))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(engine.spec("dup", [5, 6, 7], GREEDY))
    drain(engine)


def test_text_prompts_need_a_tokenizer(hf_model, engine_factory):
    model_dir, _ = hf_model("llama")
    e = engine_factory(model_dir)
    with pytest.raises(ValueError, match="no tokenizer"):
        e.add_request(e.spec("x", "hello", GREEDY))
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        e.add_request(e.spec("x", [1, 2], SamplingParams(stop=("a",))))


# -- outputs and stops -------------------------------------------------------------------


def test_text_matches_tokenizer_decode(engine):
    [c] = engine.generate(["The quick brown fox"], GREEDY)
    assert len(c.token_ids) == 12 and c.finish_reason == "length"
    assert c.text == engine.tokenizer.decode(c.token_ids)
    assert c.prompt_token_ids == engine.tokenizer.encode("The quick brown fox")


def test_streamed_deltas_concatenate_to_the_text(engine):
    engine.add_request(engine.spec("s", "hello there", GREEDY))
    text = ""
    while engine.has_unfinished():
        for o in engine.step():
            text += o.new_text
    assert text == engine.tokenizer.decode(engine.generate(["hello there"], GREEDY)[0].token_ids)


def test_stop_string_truncates_and_is_never_streamed(engine):
    [ref] = engine.generate(["Once upon a time"], SamplingParams(max_tokens=24, temperature=0.0))
    assert len(ref.text) > 12
    stop = ref.text[6:9]  # a 3-character substring from the middle
    cut = ref.text.find(stop)
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=(stop, "\u2603never"))
    engine.add_request(engine.spec("stop", "Once upon a time", params))
    request = engine._requests["stop"]
    streamed = ""
    while engine.has_unfinished():
        for o in engine.step():
            streamed += o.new_text
            assert stop not in streamed
    assert streamed == ref.text[:cut]
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert request.stop_reason == stop
    assert engine.num_free_blocks() == engine.num_blocks


def test_stop_token_ids_end_generation(engine):
    [ref] = engine.generate([[5, 6, 7, 8]], GREEDY)
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=(stop_id,))
    [c] = engine.generate([[5, 6, 7, 8]], params)
    assert c.token_ids == ref.token_ids[: first + 1]
    assert c.finish_reason == "stop"


def test_eos_ends_generation_unless_ignored(tiny_model_dir, engine_factory):
    e = engine_factory(tiny_model_dir)
    [ref] = e.generate([[5, 6, 7]], GREEDY)
    # Make the model's 2nd greedy token an eos token for this engine.
    e.eos_token_ids = (ref.token_ids[1],)
    [c] = e.generate([[5, 6, 7]], SamplingParams(max_tokens=12, temperature=0.0))
    assert c.token_ids == ref.token_ids[:2] and c.finish_reason == "stop"
    [c] = e.generate([[5, 6, 7]], GREEDY)
    assert c.token_ids == ref.token_ids


def test_logprobs_reported_per_token(engine):
    [c] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))
    assert len(c.logprobs) == 4
    for token, (lp, top) in zip(c.token_ids, c.logprobs, strict=True):
        assert top is not None and len(top) == 3
        assert top[0][0] == token  # greedy picks the most likely token
        assert lp == pytest.approx(top[0][1])


# -- sampling through the engine ----------------------------------------------------------


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_model_dir, engine_factory):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    e1 = engine_factory(tiny_model_dir)
    [alone] = e1.generate([[5, 6, 7]], params)
    e2 = engine_factory(tiny_model_dir, seed=99)
    noise = SamplingParams(max_tokens=16, temperature=1.0)
    results = e2.generate([[9, 9, 9, 9], [5, 6, 7], [11, 12]], noise)  # neighbours differ
    e2.add_request(e2.spec("n0", [20, 21], noise))
    e2.add_request(e2.spec("seeded", [5, 6, 7], params))
    e2.add_request(e2.spec("n1", [30, 31, 32], noise))
    request = e2._requests["seeded"]
    drain(e2)
    assert request.output_token_ids == alone.token_ids
    [other] = e1.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, seed=4321))
    assert other.token_ids != alone.token_ids
    assert len(results) == 3


def test_penalties_change_greedy_output(engine):
    [plain] = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=0.0))
    [pen] = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=5.0)
    )
    assert pen.token_ids != plain.token_ids
    # a strong repetition penalty avoids tokens already seen
    assert len(set(pen.token_ids)) >= len(set(plain.token_ids))


# -- prefix caching and cleanup ----------------------------------------------------------


def test_prefix_cache_hit_gives_same_tokens(tiny_model_dir, engine_factory):
    rng = random.Random(3)
    prefix = rng.choices(range(5, 512), k=40)
    cached = engine_factory(tiny_model_dir, block_size=4)
    uncached = engine_factory(tiny_model_dir, block_size=4, enable_prefix_caching=False)
    cached.generate([prefix + [7]], GREEDY)
    [hit] = cached.generate([prefix + [8, 9]], GREEDY)
    [miss] = uncached.generate([prefix + [8, 9]], GREEDY)
    assert hit.num_cached_tokens == 40 and miss.num_cached_tokens == 0
    assert hit.token_ids == miss.token_ids


def test_abort_frees_blocks_in_every_state(tiny_model_dir, engine_factory):
    e = engine_factory(tiny_model_dir, block_size=4, num_blocks=64, max_num_batched_tokens=8)
    for i in range(4):
        e.add_request(e.spec(f"r{i}", list(range(5, 25)), GREEDY))
    e.step()  # r0 is mid-prefill, the rest wait
    e.step()
    assert e.abort("r0") and e.abort("r3")
    assert not e.abort("nope")
    e.check_integrity()
    e.step()
    assert e.abort("r1")
    drain(e)


# -- roles: prefill hands off, decode continues ------------------------------------------


def copy_blocks(src, src_ids, dst, dst_ids) -> None:
    """In-process stand-in for a KV transfer: whole blocks, all layers."""
    dst.kv_cache[torch.tensor(dst_ids, dtype=torch.long)] = src.kv_cache[
        torch.tensor(src_ids, dtype=torch.long)
    ]


def disaggregated(prefill, decode, rid, prompt, params):
    prefill.add_request(prefill.spec(rid, prompt, params))
    while True:
        outs = [o for o in prefill.step() if o.request_id == rid]
        if outs:
            break
    [o] = outs
    if o.finished:
        return o.new_token_ids
    assert o.handed_off
    src = prefill.block_table(rid)
    reserved = decode.reserve_kv(decode.spec(rid, prompt, params), Resume(o.new_token_ids))
    assert reserved is not None
    dst, num_cached = reserved
    first = num_cached // decode.kv.block_size
    copy_blocks(prefill, src[first : len(dst)], decode, dst[first:])
    decode.commit_kv(rid)
    request = decode._requests[rid]
    assert prefill.release(rid)
    while decode.has_unfinished():
        decode.step()
    return request.output_token_ids


def test_prefill_and_decode_roles_match_the_full_engine(tiny_model_dir, engine_factory):
    full = engine_factory(tiny_model_dir, block_size=4)
    prefill = engine_factory(tiny_model_dir, block_size=4, role=EngineRole.PREFILL)
    decode = engine_factory(tiny_model_dir, block_size=4, role=EngineRole.DECODE)
    rng = random.Random(5)
    shared = rng.choices(range(5, 512), k=12)
    prompts = [rng.choices(range(5, 512), k=rng.randint(1, 30)) for _ in range(5)]
    prompts += [shared + [1], shared + [2, 3]]  # the second reuses decode's local cache
    sampled = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, seed=7)
    for i, prompt in enumerate(prompts):
        for params in (GREEDY, sampled):
            [ref] = full.generate([prompt], params)
            got = disaggregated(prefill, decode, f"p{i}-{params.seed}", prompt, params)
            assert got == ref.token_ids
    for e in (full, prefill, decode):
        e.check_integrity()
        assert e.num_free_blocks() == e.num_blocks


def test_decode_reserve_reuses_local_prefix(tiny_model_dir, engine_factory):
    decode = engine_factory(tiny_model_dir, block_size=4, role=EngineRole.DECODE)
    prompt = list(range(5, 21))
    decode.generate([prompt + [1]], GREEDY)  # caches 4 blocks of the prompt locally
    reserved = decode.reserve_kv(decode.spec("d", prompt + [9], GREEDY), Resume((42,)))
    assert reserved is not None
    table, num_cached = reserved
    assert num_cached == 16 and len(table) == 5
    decode.abort("d")
    assert decode.num_free_blocks() == decode.num_blocks


def test_prefill_role_pins_blocks_until_release(tiny_model_dir, engine_factory):
    prefill = engine_factory(tiny_model_dir, block_size=4, role=EngineRole.PREFILL)
    prefill.add_request(prefill.spec("p", list(range(5, 15)), GREEDY))
    [o] = prefill.step()
    assert o.handed_off and not o.finished and len(o.new_token_ids) == 1
    assert len(prefill.block_table("p")) == 3
    assert prefill.num_free_blocks() == prefill.num_blocks - 3
    assert not prefill.has_unfinished()
    assert prefill.release("p")
    assert prefill.num_free_blocks() == prefill.num_blocks
    assert not prefill.release("p")


def test_decode_reserve_rejects_bad_input(tiny_model_dir, engine_factory):
    decode = engine_factory(tiny_model_dir, block_size=4, num_blocks=8, role=EngineRole.DECODE)
    with pytest.raises(ValueError, match="first token"):
        decode.reserve_kv(decode.spec("d", [5, 6], GREEDY), Resume(()))
    with pytest.raises(ValueError, match="outside"):
        decode.reserve_kv(decode.spec("d", [5, 6], GREEDY), Resume((10**6,)))
    # Fits the cache in principle, but not while another request holds blocks.
    assert decode.reserve_kv(decode.spec("a", range(5, 25), FOUR), Resume((7,))) is not None
    assert decode.reserve_kv(decode.spec("b", range(5, 25), FOUR), Resume((7,))) is None
    decode.abort("a")
    assert decode.num_free_blocks() == 8
