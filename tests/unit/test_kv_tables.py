"""KV tables (issue 42): sliding-window layers keep their pages in tables of their own, which
free the pages every later window has passed while the request runs, hit the prefix cache
only where the window is held, and hand off only the window.

Exact rules on `KVLayout` and `KVCacheManager` (pure bookkeeping, no model), then the tiny
gpt-oss and Gemma 3 engines: blocks freed while they run, and an in-process hand-off that
reads only each table's live blocks and continues as the single engine does.
"""

from __future__ import annotations

import random

import pytest

from tandem.engine.block_pool import KVEventKind
from tandem.engine.kv_manager import NULL_BLOCK, KVCacheManager
from tandem.engine.memory import blocks_needed, fit_context
from tandem.engine.prefix_hash import hash_blocks, table_key
from tandem.engine.request import Request
from tandem.engine.sampling import SamplingParams
from tandem.model.layer_groups import LayerKind, group_layers, kv_layout
from tandem.transfer.plan import plan_read

F, S = LayerKind.FULL, LayerKind.SLIDING
BS = 4


def gemma_kinds(num_layers: int) -> list[LayerKind]:
    return [F if (i + 1) % 6 == 0 else S for i in range(num_layers)]


def test_layouts_of_the_families() -> None:
    gpt_oss = kv_layout(group_layers([S, F] * 12, 128))
    assert gpt_oss.slots == 12 and [t.kind for t in gpt_oss.tables] == [F, S]
    assert gpt_oss.tables[0].layers == tuple(range(1, 24, 2))
    assert gpt_oss.place(6) == (1, 3) and gpt_oss.place(7) == (0, 3)
    # Gemma 3 1B (4 full, 22 sliding): 2 slots waste none; 4B (5, 29): 5 slots waste one
    # of 35 (under 1/16); 27B (10, 52): 6 slots waste 4 of 66
    for num_layers, slots, tables in ((26, 2, 13), (34, 5, 7), (62, 6, 11)):
        layout = kv_layout(group_layers(gemma_kinds(num_layers), 512))
        assert (layout.slots, layout.num_tables) == (slots, tables), num_layers
        assert layout.tables[0].kind is F and layout.sliding == -(-(num_layers // 6) // slots)
    four_b = kv_layout(group_layers(gemma_kinds(34), 512))
    assert four_b.cache_layers()[25:] == (24, 25, 26, 27, 28, 30, 31, 32, 33, None)
    with pytest.raises(KeyError):
        four_b.place(34)
    dense = kv_layout(group_layers([F] * 4, None))
    assert (dense.slots, dense.num_tables, dense.sliding) == (4, 1, None)
    qwen3_next = kv_layout(group_layers([LayerKind.LINEAR] * 3 + [F], None))
    assert qwen3_next.describe() == "slots1[f:3]"


def test_peak_blocks_and_the_context_they_fit() -> None:
    """Window 6, blocks of 4: a sliding table holds at most cdiv(6 - 1 + chunk, 4) + 1
    blocks; a full one all of them."""
    layout = kv_layout(group_layers([S, F], 6))
    assert layout.peak_blocks(40, BS, 1) == 10 + 3
    assert layout.peak_blocks(40, BS, 8) == 10 + 5
    assert layout.peak_blocks(8, BS, 8) == 2 + 2  # never more than the request's blocks
    assert layout.max_tokens(13, BS, 1) == 40 and layout.max_tokens(12, BS, 1) == 36
    assert fit_context(100, False, 13, BS, 10, layout, 1) == 40
    assert blocks_needed(40, BS, layout, 1) == 13 and blocks_needed(40, BS, None, 1) == 10
    with pytest.raises(ValueError, match="give the cache 130 bytes"):
        fit_context(40, True, 12, BS, 10, layout, 1)


def request(rid: str, tokens: list[int]) -> Request:
    r = Request(rid, tokens, SamplingParams(max_tokens=4))
    r.block_hashes = hash_blocks(tokens, BS)
    return r


def manager(num_blocks: int = 64, kinds: tuple[LayerKind, ...] = (S, F, S)) -> KVCacheManager:
    """Window 6: tables [full][sliding][sliding] of one layer each."""
    layout = kv_layout(group_layers(kinds, 6))
    return KVCacheManager(num_blocks, BS, True, True, group_layers(kinds, 6), None, layout)


def compute(kv: KVCacheManager, r: Request, chunk: int) -> None:
    """Run the request's prompt in chunks as the scheduler would, caching after each."""
    while r.num_computed_tokens < r.num_prompt_tokens:
        n = min(chunk, r.num_prompt_tokens - r.num_computed_tokens)
        assert kv.allocate_slots(r, n) is not None
        r.num_computed_tokens += n
        kv.cache_blocks(r)
        kv.check_integrity()


def test_a_sliding_table_frees_what_every_later_window_passed() -> None:
    kv = manager()
    r = request("a", list(range(30)))
    assert kv.allocate_slots(r, 8) is not None  # tokens [0, 8): 2 blocks in each table
    r.num_computed_tokens = 8
    kv.cache_blocks(r)
    assert len(kv.held_blocks("a")) == 6
    assert kv.allocate_slots(r, 8) is not None  # [8, 16): the next token (8) reads from 3
    table = kv.get_block_ids("a")
    # token 8's window starts at key 3: block 0 still read; after 16, from key 11: block 2
    assert len(kv.held_blocks("a")) == 4 * 3
    r.num_computed_tokens = 16
    kv.cache_blocks(r)
    assert kv.allocate_slots(r, 8) is not None  # [16, 24): blocks 0 and 1 freed
    assert len(kv.held_blocks("a")) == 6 + 2 * 4
    assert kv.get_block_ids("a")[: len(table)] == table  # the rows only grow
    free_before = kv.num_free_blocks
    kv.free("a")
    assert kv.num_free_blocks == free_before + 14 and kv.num_free_blocks == 64
    kv.check_integrity()


def test_a_hit_holds_each_sliding_table_s_window_only() -> None:
    kv = manager()
    prompt = list(range(30))
    compute(kv, request("a", prompt), 8)
    kv.free("a")
    b = request("b", prompt + [99])
    hits, tokens = kv.get_computed_blocks(b)
    assert tokens == 28  # 7 blocks: the freed window blocks stayed cached
    # full table: every block; sliding: blocks 5 and 6 (token 28 reads keys 23..28)
    assert [hits[j * 3] != NULL_BLOCK for j in range(7)] == [True] * 7
    for t in (1, 2):
        assert [hits[j * 3 + t] != NULL_BLOCK for j in range(7)] == [False] * 5 + [True] * 2
    assert kv.allocate_slots(b, 3, hits) is not None
    assert len(kv.held_blocks("b")) == 8 + 2 * 3
    kv.check_integrity()


def test_a_hit_on_the_full_table_without_the_window_is_a_miss_at_that_length() -> None:
    kv = manager()
    prompt = list(range(30))
    compute(kv, request("a", prompt), 32)
    kv.free("a")
    hashes = request("x", prompt).block_hashes
    # Evict sliding table 2's block 6: resuming at 28 tokens needs it, at 24 it does not
    # (token 24 reads keys 19..24: blocks 4 and 5); table 1 holds everything.
    victim = kv.pool.get_cached_block(table_key(hashes[6], 2))
    assert victim is not None
    kv.pool._evict(kv.pool.blocks[victim])
    assert kv.get_computed_blocks(request("b", prompt + [99]))[1] == 24
    # and without table 2's block 4 as well, no prefix of 28 or less has its window
    victim = kv.pool.get_cached_block(table_key(hashes[4], 2))
    assert victim is not None
    kv.pool._evict(kv.pool.blocks[victim])
    assert kv.get_computed_blocks(request("c", prompt + [99]))[1] == 16


def test_only_table_zero_and_the_first_sliding_table_are_published() -> None:
    kv = manager()
    kv.enable_events()
    r = request("a", list(range(9)))
    compute(kv, r, 16)
    stored = [e.block_hash for e in kv.take_events() if e.kind is KVEventKind.STORED]
    h = r.block_hashes
    assert sorted(stored) == sorted([h[0], h[1], table_key(h[0], 1), table_key(h[1], 1)])
    assert sorted(kv.cached_hashes()) == sorted(stored)


def test_hand_off_moves_each_table_s_live_blocks_into_a_reader_s_window() -> None:
    """The owner names each table's live blocks, table by table (the rest freed); a reader
    with a prefix cached reserves only the window of its sliding tables and reads every
    block after its own prefix into the right entry."""
    owner, reader = manager(), manager()
    prompt = list(range(30))
    r = request("a", prompt)
    compute(owner, r, 16)
    sent = owner.handoff_blocks("a", 30)
    live = owner.handoff_live(30)  # 8 full blocks; sliding from key 25: blocks 6, 7
    assert [list(x) for x in live] == [list(range(8)), [6, 7], [6, 7]]
    assert len(sent) == 12 and sorted(sent) == sorted(owner.held_blocks("a"))
    compute(reader, request("warm", prompt[:17]), 16)  # the reader caches 16 tokens
    reader.free("warm")
    d = request("d", prompt + [5])
    hits, cached = reader.get_computed_blocks(d, 30)
    assert cached == 16
    assert reader.allocate_slots(d, 30 - cached, hits, live_only=True) is not None
    table = reader.get_block_ids("d")
    # the sliding tables hold blocks 6 and 7 only: the hit's window (2, 3) was freed
    assert len(reader.held_blocks("d")) == 8 + 2 * 2
    plan = plan_read(sent, BS, table, cached, 30, BS, live)
    assert plan.remote_block_ids == tuple(sent[4:8]) + tuple(sent[8:])
    assert plan.local_block_ids == tuple(table[j * 3] for j in range(4, 8)) + tuple(
        table[j * 3 + t] for t in (1, 2) for j in (6, 7)
    )
    reader.check_integrity()
    owner.free("a")
    reader.free("d")
    assert owner.num_free_blocks == reader.num_free_blocks == 64


def test_the_prefix_index_hears_of_table_zero_and_one_sliding_table() -> None:
    """What a router reads to tell a held window: the marks are the first sliding table's
    keys (`table_key`), kept apart from the chain's hashes."""
    h = hash_blocks(list(range(8)), BS)
    assert table_key(h[0], 0) == h[0]
    assert len({table_key(h[0], t) for t in range(4)} | set(h)) == 5


# -- the tiny engines -----------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma3"])
def test_engines_free_out_of_window_pages_and_hand_off_only_the_window(
    hf_model, engine_factory, arch
) -> None:
    """A 60-token prompt and 20 decoded tokens in windows of 5-6: the request never holds
    more than its full tables' blocks and each sliding table's window (chunks of 16); an
    in-process hand-off (blocks copied as a transport would) reads each table's live blocks
    only, with and without a prefix cached at the reader, and continues exactly as the
    single engine, greedy and seeded."""
    from tandem.config import EngineRole
    from tandem.engine.request import Resume
    from tests.unit.test_engine import copy_blocks

    model_dir, _ = hf_model(arch)
    kw = dict(block_size=BS, max_num_batched_tokens=16)
    full = engine_factory(model_dir, **kw)
    layout = full.model.config.kv_layout
    assert layout.num_tables == 3 and layout.sliding == 1
    rng = random.Random(5)
    prompt = rng.choices(range(256), k=60)
    full.add_request(full.spec("long", prompt, SamplingParams(max_tokens=20, temperature=0.0)))
    peak = 0
    while full.has_unfinished():
        full.step()
        full.check_integrity()
        peak = max(peak, len(full.kv.held_blocks("long")))
    assert peak <= blocks_needed(80, BS, layout, 16) < 3 * 20
    prefill = engine_factory(model_dir, role=EngineRole.PREFILL, **kw)
    decode = engine_factory(model_dir, role=EngineRole.DECODE, **kw)
    cases = [prompt, prompt + rng.choices(range(256), k=9)]
    cached_at_reader: list[int] = []
    for i, p in enumerate(cases):
        for params in (
            SamplingParams(max_tokens=6, temperature=0.0),
            SamplingParams(max_tokens=6, temperature=0.8, seed=3),
        ):
            rid = f"h{i}-{params.seed}"
            [ref] = full.generate([p], params)
            prefill.add_request(prefill.spec(rid, p, params))
            while not (outs := [o for o in prefill.step() if o.request_id == rid]):
                pass
            [out] = outs
            live = prefill.kv.handoff_live(len(p))
            assert out.handed_off and len(out.block_ids) == sum(map(len, live))
            reserved = decode.reserve_kv(
                decode.spec(rid, p, params), Resume(tuple(out.new_token_ids))
            )
            assert reserved is not None
            table, cached = reserved
            cached_at_reader.append(cached)
            plan = plan_read(out.block_ids, BS, table, cached, len(p), BS, live)
            copy_blocks(prefill, list(plan.remote_block_ids), decode, list(plan.local_block_ids))
            decode.commit_kv(rid)
            request = decode._requests[rid]
            assert prefill.release(rid)
            while decode.has_unfinished():
                decode.step()
            assert request.output_token_ids == ref.token_ids, rid
    # nothing cached at first; then the first prompt whole, from the reader's own cache: its
    # full tables' pages and the window at its end, all the reader received of it
    assert cached_at_reader[0] == 0 and cached_at_reader[1] == cached_at_reader[2] == 60
    for e in (full, prefill, decode):
        e.check_integrity()
        assert e.num_free_blocks() == e.num_blocks


def test_fp8_scales_follow_the_tables(hf_model, engine_factory, tmp_path) -> None:
    """An FP8 cache's per-layer scales are indexed by table * slots + slot: each sliding
    and full layer gets its own checkpoint scale, wherever its table puts it."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    from tandem.quant.kv import KVScales

    src, _ = hf_model("gpt-oss")
    model_dir = tmp_path / "gpt-oss-scaled"
    shutil.copytree(src, model_dir)
    scales = {
        f"model.layers.{i}.self_attn.{n}": torch.tensor(0.5 + i / 8 + (n == "v_scale"))
        for i in range(3)
        for n in ("k_scale", "v_scale")
    }
    weights = model_dir / "model.safetensors"
    save_file({**load_file(str(weights)), **scales}, str(weights))
    engine = engine_factory(model_dir, kv_cache_dtype="fp8")
    layout = engine.model.config.kv_layout
    got = engine.kv_scales
    assert got is not None and got.source == "checkpoint"
    for t, table in enumerate(layout.tables):
        for s, layer in enumerate(table.layers):
            assert got.k[t * layout.slots + s] == 0.5 + layer / 8
            assert got.v[t * layout.slots + s] == 1.5 + layer / 8
    order = (2, None, 0)
    assert KVScales((1.0, 2.0, 4.0), (8.0, 16.0, 32.0)).arranged((0, 1, 2), order) == KVScales(
        (4.0, 1.0, 1.0), (32.0, 1.0, 8.0)
    )
    [out] = engine.generate([list(range(20))], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out.token_ids) == 4


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_sliding_model_profiles_and_sizes_its_cache(hf_model, engine_factory, backend) -> None:
    """The GPU sizing path's profile steps run every KV table (over the same scratch
    blocks); a byte budget buys blocks of one table's layers; the engine then serves as
    the reference does."""
    import torch

    from tandem.engine.profile import profile_steps
    from tests.unit.test_model_parity import hf_greedy

    model_dir, hf = hf_model("gpt-oss")
    engine = engine_factory(
        model_dir, num_blocks=None, kv_cache_bytes=1 << 16, attention_backend=backend
    )
    block = engine.kv_cache[0]
    assert block.shape[0] == 1 and engine.num_blocks == (1 << 16) // block.nbytes  # one slot
    sched = engine.config.scheduler
    assert profile_steps(engine.model, sched, 4, torch.float32, 64, torch.device("cpu")) > 0
    prompt = list(range(3, 23))
    [out] = engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))
    assert out.token_ids == hf_greedy(hf, prompt, 5)


def test_decode_graphs_replay_every_kv_table(hf_model, engine_factory, monkeypatch) -> None:
    """The decode graphs' step over several KV tables (gpt-oss: a full and two sliding,
    the Triton kernels under the interpreter): captured over buffers whose rows interleave
    the tables, with a slot block per table, and replayed -- here eagerly, a CPU stand-in
    for CUDA's capture (tests/unit/test_tensor_parallel_graphs.py's `EagerGraphs`) --
    decode past the windows as transformers does."""
    from tandem.engine import runner as runner_module
    from tests.unit.test_model_parity import hf_greedy
    from tests.unit.test_tensor_parallel_graphs import EagerGraphs

    replayed: list[int] = []

    class Counted(EagerGraphs):
        def _launch(self, size: int):  # type: ignore[no-untyped-def]
            replayed.append(size)
            return super()._launch(size)

    monkeypatch.setattr(EagerGraphs, "log_dir", "")
    monkeypatch.setattr(runner_module, "DecodeGraphs", Counted)
    model_dir, hf = hf_model("gpt-oss")
    engine = engine_factory(model_dir, block_size=BS, num_blocks=96, attention_backend="triton")
    # the padding rows' block: the last, which these prompts never reach
    engine.runner.capture_decode_graphs(4, engine.max_model_len, padding_block_id=95)
    assert engine.runner.graphs.buffers.slot_block_ids.shape == (3, 4)
    prompts = [random.Random(i).choices(range(256), k=9 + 4 * i) for i in range(3)]
    done = engine.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert replayed  # the decode steps replayed
    assert [d.token_ids for d in done] == [hf_greedy(hf, p, 8) for p in prompts]
