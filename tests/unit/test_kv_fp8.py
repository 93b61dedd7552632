"""FP8 KV cache (issue 28): the quantization rules, the hand-off manifest (layout, signature,
convert), prefix hashes and placement by KV format, the CPU attention path and the engine."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig, EngineRole
from tandem.engine.kv_cache import block_bytes
from tandem.engine.prefix_hash import hash_blocks, hash_keys, kv_hash_format
from tandem.engine.sampling import SamplingParams
from tandem.kernels import reference
from tandem.model.attention import TorchAttention
from tandem.model.config import ModelConfig
from tandem.quant.kv import (
    FP8_DTYPE,
    KVScales,
    kv_format,
    layer_index,
    load_kv_scales,
    quantize_kv,
)
from tandem.routing import RouteRequest, RoutingConfig, WorkerLoad, choose
from tandem.routing.policy import RouteKind, can_hand_off
from tandem.services.common.redis.worker_info import WorkerInfo
from tandem.services.common.rpc.convert import kv_layout_from_proto, kv_layout_to_proto
from tandem.transfer import KVHandoff, KVLayout, LayoutMismatch, RemoteKV, check_compatible
from tandem.transfer.signing import prompt_hashes, sign_handoff, verify_handoff
from tests.unit.test_attention import build_case
from tests.unit.test_engine import disaggregated

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
FP8 = "float8_e4m3fn"
SCALES = ((0.5, 2.0), (1.0, 0.25))  # (k per layer, v per layer) of a 2-layer cache
FP8_LAYOUT = KVLayout("DRAM", 0, FP8, 2, 4, 2, 8, k_scales=SCALES[0], v_scales=SCALES[1])
BF16_LAYOUT = KVLayout("DRAM", 0, "bfloat16", 2, 4, 2, 8)


# -- quantization --------------------------------------------------------------------------


def test_quantize_rounds_to_e4m3_and_saturates() -> None:
    x = torch.tensor([0.0, 1.0, -3.0, 0.3, 1000.0, -1e6, 448.0 * 2])
    q = quantize_kv(x, 2.0)
    assert q.dtype == FP8_DTYPE
    # x / 2 rounded to e4m3 (3 mantissa bits: 0.15 -> 0.15625), out of range -> +-448
    assert q.float().tolist() == [0.0, 0.5, -1.5, 0.15625, 448.0, -448.0, 448.0]


def test_scales_are_canonical_float32_and_validated() -> None:
    s = KVScales((0.1,), (3.0,))
    assert s.k == (float(torch.tensor(0.1, dtype=torch.float32)),)
    for bad in ((0.0,), (-1.0,), (float("inf"),), (float("nan"),)):
        with pytest.raises(ValueError, match="positive and finite"):
            KVScales(bad, (1.0,))
    with pytest.raises(ValueError, match="one K and one V scale per layer"):
        KVScales((1.0, 1.0), (1.0,))
    assert KVScales.default(3) == KVScales((1.0,) * 3, (1.0,) * 3, "default")


def test_layer_index_of_a_cache_view() -> None:
    cache = torch.zeros(5, 3, 2, 4, 2, 8, dtype=FP8_DTYPE)
    assert [layer_index(cache[:, i]) for i in range(3)] == [0, 1, 2]


def test_kv_format_names_the_dtype_and_digests_the_scales() -> None:
    assert kv_format("bfloat16", None) == "bfloat16"
    one = kv_format(FP8, KVScales((1.0, 1.0), (1.0, 1.0)))
    assert one.startswith(FP8 + "/") and len(one) == len(FP8) + 17
    assert one == kv_format(FP8, KVScales.default(2))
    assert one != kv_format(FP8, KVScales((1.0, 1.0), (1.0, 0.5)))
    assert one != kv_format(FP8, KVScales((1.0, 1.0, 1.0), (1.0, 1.0, 1.0)))


def write_checkpoint(model_dir: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    model_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(model_dir / "model.safetensors"))


def test_scales_load_from_the_checkpoint(tmp_path: Path) -> None:
    w = {"model.layers.0.mlp.up_proj.weight": torch.zeros(2, 2)}
    write_checkpoint(tmp_path / "none", w)
    assert load_kv_scales(tmp_path / "none", 2) == KVScales.default(2)
    scales = {
        f"model.layers.{i}.self_attn.{n}": torch.tensor(s, dtype=torch.float32)
        for i, (k, v) in enumerate([(0.5, 2.0), (0.25, 1.5)])
        for n, s in (("k_scale", k), ("v_scale", v))
    }
    write_checkpoint(tmp_path / "scaled", {**w, **scales})
    got = load_kv_scales(tmp_path / "scaled", 2)
    assert got == KVScales((0.5, 0.25), (2.0, 1.5), "checkpoint")
    del scales["model.layers.1.self_attn.v_scale"]
    write_checkpoint(tmp_path / "partial", scales)
    with pytest.raises(ValueError, match="some layers only"):
        load_kv_scales(tmp_path / "partial", 2)
    per_head = {n: torch.ones(3) for n in scales} | {
        "model.layers.1.self_attn.v_scale": torch.ones(3)
    }
    write_checkpoint(tmp_path / "per-head", per_head)
    with pytest.raises(ValueError, match="only per-tensor scales"):
        load_kv_scales(tmp_path / "per-head", 2)


def test_config_takes_fp8_and_refuses_other_kv_dtypes() -> None:
    assert EngineConfig(model_dir="m", kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    assert EngineConfig(model_dir="m").kv_cache_dtype == "auto"
    with pytest.raises(ValueError, match="auto .* or fp8"):
        EngineConfig(model_dir="m", kv_cache_dtype="int8")


def test_fp8_blocks_are_half_the_bytes_of_bf16() -> None:
    model = ModelConfig.from_hf(
        {
            "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100,
        }
    )  # fmt: skip
    bf16 = block_bytes(model, 16, torch.bfloat16)
    assert block_bytes(model, 16, FP8_DTYPE) * 2 == bf16 == 16 * 3 * 2 * 2 * 16 * 2


# -- the hand-off manifest -------------------------------------------------------------------


def test_layout_of_a_scaled_cache_carries_its_scales() -> None:
    cache = torch.zeros(3, 2, 2, 4, 2, 8, dtype=FP8_DTYPE)
    assert KVLayout.of_cache(cache, SCALES) == FP8_LAYOUT
    assert FP8_LAYOUT.block_bytes * 2 == BF16_LAYOUT.block_bytes
    with pytest.raises(ValueError, match="k_scales must have 0 or num_layers=2"):
        KVLayout("DRAM", 0, FP8, 2, 4, 2, 8, k_scales=(1.0,))


@pytest.mark.parametrize(
    ("remote", "fields"),
    [
        (BF16_LAYOUT, ("dtype", "k_scales", "v_scales")),
        (dataclasses.replace(FP8_LAYOUT, k_scales=(0.5, 1.0)), ("k_scales",)),
        (dataclasses.replace(FP8_LAYOUT, v_scales=(1.0, 0.5)), ("v_scales",)),
        (dataclasses.replace(FP8_LAYOUT, k_scales=(), v_scales=()), ("k_scales", "v_scales")),
    ],
)
def test_a_reader_refuses_another_dtype_or_other_scales(remote, fields) -> None:
    check_compatible(FP8_LAYOUT, dataclasses.replace(FP8_LAYOUT, memory_type="VRAM"))
    with pytest.raises(LayoutMismatch) as info:
        check_compatible(remote, FP8_LAYOUT)
    assert info.value.fields == fields
    assert f"{fields[0]}: handle has" in str(info.value)


def test_the_manifest_round_trips_the_wire() -> None:
    assert kv_layout_from_proto(kv_layout_to_proto(FP8_LAYOUT)) == FP8_LAYOUT
    assert kv_layout_from_proto(kv_layout_to_proto(BF16_LAYOUT)) == BF16_LAYOUT


KEY = b"k" * 32
PROMPT = list(range(5, 15))
KEYS = hash_keys("tiny", "", kv_format(FP8, KVScales(*SCALES)))
HASHES = prompt_hashes(PROMPT, 4, KEYS)
HANDOFF = KVHandoff(
    RemoteKV("nixl", "prefill-0", b"md", 4096, FP8_LAYOUT.block_bytes, (3, 4, 9), FP8_LAYOUT),
    4, 10, "127.0.0.1:5000", "lease-1", 7, 1.7e9,
)  # fmt: skip
SIGNED = dataclasses.replace(HANDOFF, signature=sign_handoff(KEY, "r1", HASHES, HANDOFF))


def forged_layout(**changes: object) -> KVHandoff:
    layout = copy.copy(FP8_LAYOUT)  # a forger skips __post_init__
    for name, value in changes.items():
        object.__setattr__(layout, name, value)
    remote = copy.copy(SIGNED.remote)
    object.__setattr__(remote, "layout", layout)
    forged = copy.copy(SIGNED)
    object.__setattr__(forged, "remote", remote)
    return forged


@pytest.mark.parametrize(
    "changes",
    [
        {"k_scales": (0.5, 2.0000002)},  # one scale, by one float32 ulp
        {"v_scales": (0.25, 1.0)},  # swapped
        {"k_scales": (), "v_scales": ()},  # dropped (a peer that forgets the manifest)
        {"dtype": "bfloat16", "k_scales": (), "v_scales": ()},
    ],
)
def test_altering_the_scales_in_a_handle_is_refused(changes) -> None:
    assert verify_handoff(KEY, "r1", HASHES, SIGNED)
    assert not verify_handoff(KEY, "r1", HASHES, forged_layout(**changes))


# -- prefix hashes and placement ------------------------------------------------------------


def test_prefix_hashes_differ_by_kv_format() -> None:
    tokens = list(range(40))
    fmt = kv_format(FP8, KVScales.default(2))
    plain = hash_blocks(tokens, 4, hash_keys("m"))
    fp8 = hash_blocks(tokens, 4, hash_keys("m", "", fmt))
    other = hash_blocks(tokens, 4, hash_keys("m", "", kv_format(FP8, KVScales(*SCALES))))
    assert len({*plain, *fp8, *other}) == 3 * len(plain)  # no block shares a hash
    # unchanged for a cache in the model's dtype; a salt cannot pose as a format
    assert hash_keys("m", "s", "") == ("m", "s") and hash_keys("m") == ("m",)
    assert hash_keys("m", "kv:" + fmt) != hash_keys("m", "", fmt)
    assert kv_hash_format(fmt) == fmt and kv_hash_format("bfloat16") == ""


def load(worker_id: str, role: str, fmt: str, **kw: int | str) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker_id, role=role, address=f"{worker_id}:1", num_blocks=1000,
        num_free_blocks=1000, kv_format=fmt, **kw,
    )  # fmt: skip


FMT_A = kv_format(FP8, KVScales.default(2))
FMT_B = "bfloat16"


DRAFT_A, DRAFT_B = "draft-a/4x2", "draft-b/8x2"  # draft formats: opaque, equal or not


@pytest.mark.parametrize("policy", ["kv", "load", "round_robin"])
def test_placement_never_pairs_mismatched_kv_or_draft_formats(policy: str) -> None:
    """Pairs share the KV format and the draft format (speculative draft: the same draft
    model, or none on both); a compatible prefill worker, when there is one, is used."""
    cfg = RoutingConfig(policy=policy, disagg_min_uncached_tokens=16)
    rng = random.Random(3)
    paired_drafts = set()
    for seq in range(120):
        workers = [
            load(f"{role[0]}{i}", role, rng.choice([FMT_A, FMT_B]), num_running=rng.randint(0, 3),
                 draft_format=rng.choice(["", "", DRAFT_A, DRAFT_B]))
            for role in ("prefill", "decode")
            for i in range(rng.randint(1, 3))
        ]  # fmt: skip
        p = choose(RouteRequest(500, 16, sequence=seq), workers, cfg)
        assert p is not None
        compatible = [w for w in workers if w.role == "prefill" and can_hand_off(w, p.decode)]
        if p.prefill is not None:
            assert p.prefill.kv_format == p.decode.kv_format
            assert p.prefill.draft_format == p.decode.draft_format
            paired_drafts.add(p.decode.draft_format)
        elif compatible:
            pytest.fail(f"colocated although {compatible[0].worker_id} can hand off: {p.reason}")
    assert paired_drafts == {"", DRAFT_A, DRAFT_B}


def test_only_equal_draft_formats_hand_off() -> None:
    """A decode worker with a draft model needs its draft's KV from the prefill worker; a
    prefill worker with a draft sends a section a draft-less decode worker refuses."""
    none_p, none_d = load("p0", "prefill", FMT_A), load("d0", "decode", FMT_A)
    a_p = load("p1", "prefill", FMT_A, draft_format=DRAFT_A)
    a_d = load("d1", "decode", FMT_A, draft_format=DRAFT_A)
    b_d = load("d2", "decode", FMT_A, draft_format=DRAFT_B)
    assert can_hand_off(none_p, none_d) and can_hand_off(a_p, a_d)
    assert not can_hand_off(none_p, a_d) and not can_hand_off(a_p, none_d)
    assert not can_hand_off(a_p, b_d)
    # The same draft but another KV format still does not pair.
    assert not can_hand_off(a_p, load("d3", "decode", FMT_B, draft_format=DRAFT_A))
    # Which prefill worker a decode worker gets: the one with its draft format.
    for decode, want in ((none_d, "p0"), (a_d, "p1")):
        p = choose(RouteRequest(500, 16), [none_p, a_p, decode], RoutingConfig())
        assert p is not None and p.prefill is not None and p.prefill.worker_id == want


def test_placement_says_why_no_prefill_worker_is_compatible() -> None:
    workers = [load("p0", "prefill", FMT_B), load("d0", "decode", FMT_A)]
    p = choose(RouteRequest(500, 16), workers, RoutingConfig())
    assert p is not None and p.prefill is None and p.kind == RouteKind.NO_PREFILL_WORKER
    assert p.reason == (
        f"no prefill worker with KV format {FMT_A} (theirs: bfloat16): prefill on d0"
    )
    # Another KV format says so, whatever the drafts.
    workers = [load("p0", "prefill", FMT_B, draft_format=DRAFT_A),
               load("d0", "decode", FMT_A, draft_format=DRAFT_A)]  # fmt: skip
    p = choose(RouteRequest(500, 16), workers, RoutingConfig())
    assert p is not None and p.reason == (
        f"no prefill worker with KV format {FMT_A} (theirs: bfloat16): prefill on d0"
    )


def test_placement_says_when_no_prefill_worker_has_the_draft_model() -> None:
    """Prefill workers of the decode worker's KV format, none with its draft format: the
    reason names the draft formats (none: no draft model), sorted."""
    workers = [
        load("p0", "prefill", FMT_A),
        load("p1", "prefill", FMT_A, draft_format=DRAFT_B),
        load("p2", "prefill", FMT_B, draft_format=DRAFT_A),
        load("d0", "decode", FMT_A, draft_format=DRAFT_A),
    ]
    for policy in ("kv", "load", "round_robin"):
        p = choose(RouteRequest(500, 16), workers, RoutingConfig(policy=policy))
        assert p is not None and p.prefill is None and p.kind == RouteKind.NO_PREFILL_WORKER
        assert p.reason == (
            f"no prefill worker with draft model {DRAFT_A} (theirs: {DRAFT_B}, none): prefill on d0"
        )
    workers = [load("p0", "prefill", FMT_A, draft_format=DRAFT_A), load("d0", "decode", FMT_A)]
    p = choose(RouteRequest(500, 16), workers, RoutingConfig())
    assert p is not None and p.prefill is None
    assert p.reason == f"no prefill worker with draft model none (theirs: {DRAFT_A}): prefill on d0"


def test_the_registry_record_advertises_the_kv_format() -> None:
    info = WorkerInfo(
        worker_id="d0", role="decode", address="h:1", model="m", epoch=1, kv_format=FMT_A
    )
    assert WorkerInfo.from_json(info.to_json()) == info
    assert info.load().kv_format == FMT_A
    assert (
        WorkerInfo(worker_id="d0", role="decode", address="h:1", model="m", epoch=1).kv_format == ""
    )  # an older worker
    with pytest.raises(ValueError, match="kv_format"):
        WorkerInfo(worker_id="d0", role="decode", address="h:1", model="m", epoch=1, kv_format=3)  # type: ignore[arg-type]


def test_the_registry_record_advertises_speculation_and_the_draft_format() -> None:
    ids = {"worker_id": "d0", "role": "decode", "address": "h:1", "model": "m", "epoch": 1}
    info = WorkerInfo(**ids, speculative="draft", draft_format=DRAFT_A)  # type: ignore[arg-type]
    raw = info.to_json()
    assert '"draft_format":"draft-a/4x2"' in raw and '"speculative":"draft"' in raw
    assert WorkerInfo.from_json(raw) == info
    load_ = info.load()
    assert (load_.speculative, load_.draft_format) == ("draft", DRAFT_A)
    # A worker that predates them: no speculation, no draft model.
    old = json.loads(raw)
    del old["speculative"], old["draft_format"]
    older = WorkerInfo.from_json(json.dumps(old))
    assert (older.speculative, older.draft_format) == ("", "")
    assert (older.load().speculative, older.load().draft_format) == ("", "")
    assert not older.accepts_moved and not older.load().accepts_moved  # nor moved streams
    assert (
        WorkerInfo.from_json(WorkerInfo(**ids, accepts_moved=True).to_json()).load().accepts_moved
    )  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="WorkerInfo.accepts_moved must be a bool"):
        WorkerInfo(**ids, accepts_moved=1)  # type: ignore[arg-type]
    for name, bad in (("speculative", 1), ("draft_format", None), ("draft_format", ["x"])):
        with pytest.raises(ValueError, match=f"WorkerInfo.{name} must be a str, got"):
            WorkerInfo(**ids, **{name: bad})  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=f"WorkerInfo.{name} must be a str"):
            WorkerInfo.from_json(json.dumps({**json.loads(raw), name: bad}))


# -- CPU attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (16, 8)])
def test_cpu_attention_over_an_fp8_cache_matches_the_dequantized_reference(
    dtype: torch.dtype, q_heads: int, kv_heads: int
) -> None:
    """Against the reference over the cache's dequantized values (the new K/V included, as
    stored): within float32 rounding (1e-5), or bfloat16's (1.6e-2) for a bfloat16 model.
    Against full-precision K/V the fp8 cache costs more: within 0.15 here (unit-variance
    K/V, e4m3's 3-bit mantissa)."""
    rng = random.Random(q_heads)
    lens = [(1, 1), (7, 1), (33, 1), (5, 5), (19, 19), (23, 6)]
    kv, tables, order, q, k, v, meta = build_case(rng, lens, 4, 512, q_heads, kv_heads)
    scales = KVScales((0.5,), (0.25,))
    cache = torch.stack([quantize_kv(kv[:, 0], 0.5), quantize_kv(kv[:, 1], 0.25)], dim=1)
    attn = TorchAttention()
    attn.use_fp8_kv(scales, dtype)
    q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = attn.forward(q, k, v, cache, meta, scale=0.25)
    values = reference.dequantize_kv_reference(cache, 0.5, 0.25)
    exact = kv.clone()
    slots = (meta.slot_block_ids, meta.slot_offsets)
    reference.write_kv_reference(k.float(), v.float(), exact, *slots)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    start = 0
    for i in order:
        ctx, new = lens[i]
        rows = slice(start, start + new)
        want = reference.paged_attention(q[rows].float(), values, tables[i], ctx, 0.25)
        torch.testing.assert_close(out[rows].float(), want, atol=tol, rtol=tol)
        full = reference.paged_attention(q[rows].float(), exact, tables[i], ctx, 0.25)
        torch.testing.assert_close(out[rows].float(), full, atol=0.15, rtol=0.0)
        start += new


# -- engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_engine(tiny_model_dir, engine_factory):
    return engine_factory(tiny_model_dir, block_size=4, kv_cache_dtype="fp8")


def test_fp8_engine_caches_fp8_blocks_under_their_own_hashes(fp8_engine) -> None:
    e = fp8_engine
    assert e.kv_cache.dtype == FP8_DTYPE and e.kv_scales == KVScales.default(e.kv_scales.num_layers)
    assert e.kv_format == kv_format(FP8, e.kv_scales) and e.kv_hash_format == e.kv_format
    prompt = list(range(5, 25))
    e.generate([prompt], SamplingParams(max_tokens=1))
    fp8_hashes = hash_blocks(prompt, 4, hash_keys(e.model_id, "", e.kv_format))
    plain_hashes = hash_blocks(prompt, 4, hash_keys(e.model_id))
    assert all(e.kv.pool.get_cached_block(h) is not None for h in fp8_hashes)
    assert all(e.kv.pool.get_cached_block(h) is None for h in plain_hashes)


def test_fp8_greedy_output_is_stable_and_close_to_the_full_precision_cache(
    tiny_model_dir, engine_factory, fp8_engine
) -> None:
    """Greedy with an fp8 cache: the same tokens whatever the batch, the chunking or a prefix
    hit (the cache's values are what every path attends over); and mostly the tokens of the
    float32 cache (the tiny random model's logits are close, so they may diverge late)."""
    rng = random.Random(11)
    prompts = [rng.choices(range(5, 512), k=n) for n in (3, 17, 40)]
    alone = [fp8_engine.generate([p], GREEDY)[0].token_ids for p in prompts]
    batched = [c.token_ids for c in fp8_engine.generate(prompts, GREEDY)]
    assert batched == alone
    chunked = engine_factory(
        tiny_model_dir, block_size=4, kv_cache_dtype="fp8", max_num_batched_tokens=8
    )
    assert [chunked.generate([p], GREEDY)[0].token_ids for p in prompts] == alone
    full = engine_factory(tiny_model_dir, block_size=4)
    ref = [full.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert all(a[:4] == r[:4] for a, r in zip(alone, ref, strict=True))
    fp8_engine.check_integrity()


def test_fp8_disaggregated_equals_colocated_in_process(tiny_model_dir, engine_factory) -> None:
    full = engine_factory(tiny_model_dir, block_size=4, kv_cache_dtype="fp8")
    prefill = engine_factory(
        tiny_model_dir, block_size=4, kv_cache_dtype="fp8", role=EngineRole.PREFILL
    )
    decode = engine_factory(
        tiny_model_dir, block_size=4, kv_cache_dtype="fp8", role=EngineRole.DECODE
    )
    rng = random.Random(5)
    for i in range(4):
        prompt = rng.choices(range(5, 512), k=rng.randint(2, 30))
        [ref] = full.generate([prompt], GREEDY)
        assert disaggregated(prefill, decode, f"r{i}", prompt, GREEDY) == ref.token_ids
    for e in (full, prefill, decode):
        e.check_integrity()


def test_kv_cache_bytes_hold_twice_the_tokens_with_fp8(tiny_model_dir, engine_factory) -> None:
    budget = 1 << 20
    wide = engine_factory(tiny_model_dir, num_blocks=None, kv_cache_bytes=budget, dtype="bfloat16")
    narrow = engine_factory(
        tiny_model_dir, num_blocks=None, kv_cache_bytes=budget, dtype="bfloat16",
        kv_cache_dtype="fp8",
    )  # fmt: skip
    assert narrow.num_blocks == 2 * wide.num_blocks
    assert narrow.kv_cache.element_size() == 1


def test_the_router_looks_each_kv_format_up_under_its_own_hashes() -> None:
    """The router's prefix index keys follow the workers': an fp8 worker's cached blocks are
    found under the fp8 hashes, a bfloat16 worker's under the plain ones, and neither
    worker is credited with the other format's blocks."""
    import asyncio

    from tandem.engine.request import RequestSpec
    from tandem.services.router.config import RouterConfig
    from tandem.services.router.placer import Placer

    tokens = tuple(range(5, 69))  # 4 blocks of 16
    plain = hash_blocks(list(tokens), 16, hash_keys("m"))
    fp8 = hash_blocks(list(tokens), 16, hash_keys("m", "", FMT_A))

    class Index:
        def __init__(self) -> None:
            self.asked: list[list[int]] = []

        async def lookup(
            self,
            model: str,
            hashes: list[int],
            marks: list[int] | None = None,
            marks_from: tuple[int, ...] | None = None,
        ) -> dict[str, int]:
            assert marks is None and marks_from is None  # full attention only
            self.asked.append(hashes)
            # Each worker holds the prompt in its own format; d-bf16 also (wrongly) under the
            # fp8 hashes, which must not count for it.
            return {"d-fp8": 4, "d-bf16": 2} if hashes == fp8 else {"d-bf16": 3, "d-fp8": 1}

    config = RouterConfig(model_dir="m", block_size=16, decode_addresses=("d:1",))
    placer = Placer(config, "m")
    index = Index()
    placer._index = index  # type: ignore[assignment]
    workers = [load("d-fp8", "decode", FMT_A), load("d-bf16", "decode", FMT_B)]
    hashes, overlap = asyncio.run(placer._prefix_overlap(RequestSpec("r", tokens), workers))
    assert sorted(map(tuple, index.asked)) == sorted([tuple(plain), tuple(fp8)])
    assert overlap == {"d-fp8": 4, "d-bf16": 3}
    assert hashes in (plain, fp8)
