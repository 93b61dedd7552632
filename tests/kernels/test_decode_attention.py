"""The paged decode attention kernel against the pure-torch reference in kernels/reference.py.

Without a GPU the kernels run on CPU tensors under Triton's interpreter (tests/conftest.py
sets TRITON_INTERPRET=1), about 0.6 ms per program instance, so shapes stay small: 2 kv
heads, head_dim 64 unless a test is about head_dim.

Tolerances (the reference computes in float64 and casts to the input dtype):
    fp32  atol = rtol = 1e-5    (seen: ~5e-7)
    fp16  atol = rtol = 2e-3    (~1 ulp of the output at |x| ~ 1, plus p rounded to fp16
                                 before the P @ V dot)
    bf16  atol = rtol = 1.6e-2  (bf16 has 3 fewer mantissa bits than fp16: 8x the ulp)
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels.decode_attention import MAX_SPLITS, choose_num_splits, paged_decode_attention
from tandem.kernels.reference import paged_attention
from tests.kernels.compile_check import assert_lowers

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# dtype -> (atol, rtol)
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
NUM_KV_HEADS = 2
HEAD_DIM = 64


def make_case(
    context_lens: list[int],
    *,
    block_size: int,
    group: int,
    dtype: torch.dtype,
    num_blocks: int = 64,
    head_dim: int = HEAD_DIM,
    num_kv_heads: int = NUM_KV_HEADS,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, kv_layer, block_tables, context_lens for a ragged batch.

    kv_layer is layer 1 of a 2-layer cache (strided across blocks, like `kv_cache[:, 1]`).
    Every slot no request owns is NaN: padded block-table entries point at a NaN block and
    the tail of each request's last block is NaN, so reading either poisons the output.
    Block ids are shuffled and include the last one.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    cache = torch.full(
        (num_blocks, 2, 2, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype
    )
    kv_layer = cache[:, 1]
    # Block 0 stays NaN (the padding target); the last block is used first.
    shuffled = torch.randperm(num_blocks - 2, generator=gen) + 1
    ids = torch.cat([torch.tensor([num_blocks - 1]), shuffled])
    max_blocks = max(math.ceil(n / block_size) for n in context_lens) + 1  # >= 1 padded entry
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, ctx in enumerate(context_lens):
        n = math.ceil(ctx / block_size)
        tables[r, :n] = ids[used : used + n]
        used += n
        for t in range(ctx):
            block, slot = int(tables[r, t // block_size]), t % block_size
            kv_layer[block, :, slot] = torch.randn(2, num_kv_heads, head_dim, generator=gen).to(
                dtype
            )
    q = torch.randn(len(context_lens), num_kv_heads * group, head_dim, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    # Move the whole cache, then view it: moving the view alone would make it contiguous.
    return q.to(DEVICE), cache.to(DEVICE)[:, 1], tables.to(DEVICE), lens.to(DEVICE)


def reference(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[batch, num_q_heads, head_dim]: the reference one request (one query) at a time."""
    kv_cpu = kv_layer.cpu()
    rows = [
        paged_attention(q[r : r + 1].cpu(), kv_cpu, tables[r].tolist(), int(lens[r]), scale)[0]
        for r in range(q.shape[0])
    ]
    return torch.stack(rows).to(q.device)


def check(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    tables: torch.Tensor,
    lens: torch.Tensor,
    scale: float,
    num_splits: int | None,
) -> None:
    out = paged_decode_attention(q, kv_layer, tables, lens, scale, num_splits=num_splits)
    assert out.shape == q.shape and out.dtype == q.dtype
    expected = reference(q, kv_layer, tables, lens, scale)
    atol, rtol = TOLERANCES[q.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_ragged_batch_matches_reference(
    dtype: torch.dtype, group: int, block_size: int, num_splits: int | None
) -> None:
    # 1 token, one short of a block, one past a block, exactly two blocks, a long one.
    lens = [1, block_size - 1, block_size + 1, 2 * block_size, 300]
    q, kv, tables, ctx = make_case(lens, block_size=block_size, group=group, dtype=dtype)
    check(q, kv, tables, ctx, 1 / math.sqrt(HEAD_DIM), num_splits)


@pytest.mark.parametrize("num_splits", [1, 2, 5, 32])
def test_peaked_softmax_across_splits(num_splits: int) -> None:
    # scale 1 makes scores spread over tens of units: the running max changes between blocks
    # and splits, so every rescaling (in the loop and in the reduction) matters.
    q, kv, tables, ctx = make_case([333, 40], block_size=16, group=4, dtype=torch.float32)
    check(q, kv, tables, ctx, 1.0, num_splits)


def test_splits_past_the_context_are_ignored() -> None:
    # 8 splits over 1 and 2 blocks: most splits are empty and must write lse = -inf.
    q, kv, tables, ctx = make_case([1, 17], block_size=16, group=4, dtype=torch.float16)
    check(q, kv, tables, ctx, 0.125, num_splits=8)


@pytest.mark.parametrize(
    "head_dim,dtype", [(128, torch.float16), (128, torch.bfloat16), (16, torch.float32)]
)
@pytest.mark.parametrize("group", [1, 4])
def test_head_dims(head_dim: int, dtype: torch.dtype, group: int) -> None:
    q, kv, tables, ctx = make_case(
        [5, 70], block_size=16, group=group, dtype=dtype, head_dim=head_dim
    )
    check(q, kv, tables, ctx, 1 / math.sqrt(head_dim), num_splits=2)


def test_block_size_below_dot_minimum() -> None:
    # block_size 8 is below tl.dot's 16: a tile of whole blocks (several per iteration)
    # still gives the GQA group's dot 16 keys or more.
    q, kv, tables, ctx = make_case([3, 8, 29], block_size=8, group=4, dtype=torch.float32)
    check(q, kv, tables, ctx, 0.125, num_splits=2)


def test_high_block_ids_in_a_large_cache() -> None:
    # 50k blocks (~400 MB of virtual memory, only the used blocks touched); requests use the
    # last ids, so block offsets are far from the base pointer.
    num_blocks, block_size, dim = 50_000, 16, HEAD_DIM
    cache = torch.empty(
        (num_blocks, 2, 2, block_size, NUM_KV_HEADS, dim), dtype=torch.float16, device=DEVICE
    )
    kv = cache[:, 0]
    lens = [40, 17]
    tables = torch.tensor(
        [[num_blocks - 1, num_blocks - 5, num_blocks - 3], [num_blocks - 2, num_blocks - 4, 0]],
        dtype=torch.int32,
        device=DEVICE,
    )
    gen = torch.Generator(device="cpu").manual_seed(1)
    for block in range(num_blocks - 5, num_blocks):
        kv[block] = torch.randn(2, block_size, NUM_KV_HEADS, dim, generator=gen).half()
    q = torch.randn(2, NUM_KV_HEADS * 4, dim, generator=gen).half().to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    check(q, kv, tables, ctx, 0.125, num_splits=2)


def test_block_offsets_past_2_pow_31_are_computed_in_int64() -> None:
    """Blocks 4096.. of a cache whose block stride is 2**20 elements (a 32-layer cache with
    16 tokens x 8 heads x 128 dims per layer has exactly that) start past element 2**32.

    If the kernel multiplied the int32 block id by the stride in int32, the offset would
    wrap modulo 2**32 to block_id - 4096 blocks: blocks 0.. of the same buffer, which hold
    other values, so the output would differ (a clean mismatch, not a wild read: the wrapped
    address is inside the buffer). The buffer is ~8.6 GB of virtual memory of which only the
    blocks written are touched.
    """
    block_stride, block_size, dim, first = 2**20, 16, HEAD_DIM, 4096
    ids = [first, first + 1, first + 2]
    per_block = 2 * block_size * NUM_KV_HEADS * dim
    numel = (ids[-1] + 1) * block_stride
    try:
        buffer = torch.empty(numel, dtype=torch.float16, device=DEVICE)
    except RuntimeError as exc:  # no 8 GB of address space / device memory here
        pytest.skip(f"cannot reserve {numel * 2 / 2**30:.1f} GiB: {exc}")
    kv = buffer.as_strided(
        (ids[-1] + 1, 2, block_size, NUM_KV_HEADS, dim),
        (block_stride, block_size * NUM_KV_HEADS * dim, NUM_KV_HEADS * dim, dim, 1),
    )
    assert ids[0] * kv.stride(0) >= 2**32  # the element offset, let alone the byte offset
    gen = torch.Generator(device="cpu").manual_seed(2)
    for block in ids + [i - first for i in ids]:  # the real blocks and their wrapped aliases
        values = torch.randn(per_block, generator=gen).half().view(kv.shape[1:])
        kv[block] = values.to(DEVICE)
    lens = torch.tensor([40], dtype=torch.int32, device=DEVICE)
    tables = torch.tensor([ids], dtype=torch.int32, device=DEVICE)
    q = torch.randn(1, NUM_KV_HEADS * 4, dim, generator=gen).half().to(DEVICE)
    check(q, kv, tables, lens, 0.125, num_splits=1)
    del kv, buffer


def test_writes_into_out_with_strided_q_and_out() -> None:
    q, kv, tables, ctx = make_case([9, 50], block_size=16, group=4, dtype=torch.float32)
    # q and out as head slices of wider rows (e.g. q split off a fused qkv projection).
    q_wide = torch.zeros(2, 3 * q.shape[1], HEAD_DIM, device=DEVICE)
    q_wide[:, : q.shape[1]] = q
    out_wide = torch.zeros(2, 2 * q.shape[1], HEAD_DIM, device=DEVICE)
    out = out_wide[:, q.shape[1] :]
    result = paged_decode_attention(q_wide[:, : q.shape[1]], kv, tables, ctx, 0.125, out=out)
    assert result is out
    assert torch.all(out_wide[:, : q.shape[1]] == 0)  # nothing written outside `out`
    torch.testing.assert_close(out, reference(q, kv, tables, ctx, 0.125), atol=1e-5, rtol=1e-5)


def test_empty_batch() -> None:
    q, kv, tables, ctx = make_case([5], block_size=16, group=1, dtype=torch.float32)
    out = paged_decode_attention(q[:0], kv, tables[:0], ctx[:0], 0.125)
    assert out.shape == (0, NUM_KV_HEADS, HEAD_DIM)


def test_splits_grow_with_the_longest_context_whatever_the_batch() -> None:
    # 256 rows x 8 kv heads fill the GPU many times: only the longest context counts, cut
    # into runs of BLOCKS_PER_SPLIT = 16 blocks.
    splits = [choose_num_splits(256, 8, blocks) for blocks in (1, 16, 17, 64, 256, 480)]
    assert splits == [1, 1, 2, 4, 16, 30]


def test_short_contexts_keep_one_split() -> None:
    assert choose_num_splits(batch=64, num_kv_heads=8, max_context_blocks=16) == 1
    # One request on an idle GPU: too short to split (MIN_BLOCKS_PER_SPLIT = 4 blocks).
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_blocks=7) == 1


def test_splits_fill_the_sms_of_a_small_batch() -> None:
    # 1 x 8 programs on 132 SMs: 17 splits would fill them; 64 blocks allow 16 of >= 4.
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_blocks=64) == 16
    assert choose_num_splits(batch=2, num_kv_heads=8, max_context_blocks=64) == 9  # 18 x 8
    assert choose_num_splits(batch=1, num_kv_heads=8, max_context_blocks=64, num_sms=66) == 9
    assert choose_num_splits(batch=8, num_kv_heads=8, max_context_blocks=64) == 4  # by length


def test_splits_are_capped() -> None:
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context_blocks=2048) == MAX_SPLITS
    assert choose_num_splits(batch=1, num_kv_heads=1, max_context_blocks=4096) == MAX_SPLITS


def test_a_short_row_beside_a_long_one_skips_its_splits() -> None:
    # The long row sets 8 splits; the 1-token row's splits 1..7 are empty: they write only
    # lse = -inf, and the reduction must not read their (never written) partials.
    q, kv, tables, ctx = make_case([1, 400], block_size=16, group=4, dtype=torch.float32)
    check(q, kv, tables, ctx, 0.125, num_splits=8)


def _inputs() -> dict[str, object]:
    q, kv, tables, ctx = make_case([5, 20], block_size=16, group=2, dtype=torch.float32)
    return dict(q=q, kv_layer=kv, block_tables=tables, context_lens=ctx, scale=0.125)


def _bad_cases() -> list[tuple[str, dict[str, object], str]]:
    """(id, arguments, expected message): each case breaks one thing of a valid call."""
    valid = _inputs()
    q, kv, tables, ctx = (valid[k] for k in ("q", "kv_layer", "block_tables", "context_lens"))
    assert isinstance(q, torch.Tensor) and isinstance(kv, torch.Tensor)
    assert isinstance(tables, torch.Tensor) and isinstance(ctx, torch.Tensor)
    wide = torch.zeros(2, 4, 2 * HEAD_DIM, device=DEVICE)

    def _replace(**changes: object) -> dict[str, object]:
        return {**valid, **changes}

    return [
        ("q 2-d", _replace(q=q[0]), r"q must be \[batch"),
        ("kv 4-d", _replace(kv_layer=kv[:, 0]), r"kv_layer must be"),
        ("q int", _replace(q=q.to(torch.int32)), r"q dtype torch.int32"),
        (
            "kv dtype",
            _replace(kv_layer=kv.half()),
            r"kv_layer dtype torch.float16 is neither q's torch.float32 nor fp8",
        ),
        ("head_dim", _replace(q=q[..., :32]), r"kv_layer head_dim 64 != q head_dim 32"),
        (
            "head_dim pow2",
            _replace(q=q[..., :48], kv_layer=kv[..., :48]),
            r"head_dim 48 must be a power of two",
        ),
        ("block_size", _replace(kv_layer=kv[:, :, :12]), r"block_size 12 must be a power"),
        ("group", _replace(q=q[:, :3]), r"num_q_heads 3 must be a multiple of num_kv_heads 2"),
        ("q stride", _replace(q=wide[..., ::2]), r"last dim of q and kv_layer"),
        ("tables batch", _replace(block_tables=tables[:1]), r"block_tables must be \[batch=2"),
        ("tables dtype", _replace(block_tables=tables.long()), r"block_tables dtype torch.int64"),
        ("lens shape", _replace(context_lens=ctx[:1]), r"context_lens must be \[batch=2\]"),
        ("lens dtype", _replace(context_lens=ctx.long()), r"context_lens dtype torch.int64"),
        ("splits", _replace(num_splits=0), r"num_splits 0 must be >= 1"),
        ("out", _replace(out=torch.empty_like(q).half()), r"out is \(2, 4, 64\) torch.float16"),
        ("out stride", _replace(out=wide[..., ::2]), r"last dim of out must be contiguous"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_rejects_bad_inputs(case: tuple[str, dict[str, object], str]) -> None:
    _, kwargs, message = case
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**kwargs)  # type: ignore[arg-type]


@pytest.mark.skipif(DEVICE.type != "cpu", reason="device mismatch needs a second device")
def test_rejects_tensors_on_another_device() -> None:
    kwargs = _inputs()
    kwargs["context_lens"] = kwargs["context_lens"].to("meta")  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"context_lens is on meta, q on cpu"):
        paged_decode_attention(**kwargs)  # type: ignore[arg-type]


# Compiles both kernels for sm_90a with the wrapper's configuration and the alignment a
# launch specialises on, through Triton's own LLVM and ptxas: no GPU needed. Run in a fresh
# interpreter without TRITON_INTERPRET, which swaps `triton.jit` for the interpreter. Exit
# code 3: this Triton cannot target CUDA. The split kernel's loop must be pipelined (its K/V
# loads become cp.async copies into shared memory) with no spills, and a program's registers
# (per thread x threads) within REGISTER_BUDGET: two programs' worth of an SM's 65,536, so
# at least two stream at once. (4 warps at 139 registers measured faster on an H200 than 8
# at 128: decode_tiles.)
REGISTER_BUDGET = 32768


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize(("window", "with_sinks"), [(1, False), (40, False), (40, True), (0, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_and_sinks(
    dtype: torch.dtype, window: int, with_sinks: bool, num_splits: int | None
) -> None:
    """A sliding layer's window (only its blocks read: every block before it is poisoned
    with NaN) and gpt-oss's sinks, across splits, against the reference."""
    lens = [1, 15, 17, 41, 300]
    q, kv, tables, ctx = make_case(lens, block_size=16, group=4, dtype=dtype, seed=7)
    if window:
        for r, n in enumerate(lens):
            first_block = max(0, n - window) // 16
            kv[tables[r, :first_block].long()] = float("nan")
    sinks = torch.randn(q.shape[1], generator=torch.Generator().manual_seed(1)) * 2
    sinks = sinks.to(DEVICE) if with_sinks else None
    out = paged_decode_attention(
        q, kv, tables, ctx, 0.125, num_splits=num_splits, window=window or None, sinks=sinks
    )
    kv_cpu = kv.cpu()
    want = torch.stack([
        paged_attention(q[r : r + 1].cpu(), kv_cpu, tables[r].tolist(), n, 0.125,
                        window or None, None if sinks is None else sinks.cpu())[0]
        for r, n in enumerate(lens)
    ]).to(q.device)  # fmt: skip
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


LOWER_SCRIPT = r"""
import sys

import torch

from tandem.kernels.decode_attention import (
    _MIN_DOT_DIM, _decode_reduce_kernel, _decode_split_kernel, decode_tiles,
)
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

BUDGET = int(sys.argv[1])
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}


def build(kernel, signature, constants, attrs, num_warps):
    return compile_sm90(
        kernel, signature, constants, attrs, num_warps=num_warps, enable_fp_fusion=True
    )


names = _decode_split_kernel.arg_names
# Pointers and the q/KV strides are multiples of 16 in serving; the block table's row stride
# is not specialised (do_not_specialize) and the other strides are 1.
aligned = [n for n in names if n.endswith("_ptr") or n.startswith(("stride_q", "stride_kv"))]
# (q dtype, cache dtype): an fp8 cache is dequantized to q's dtype as its tiles load.
for dtype, cache in (("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")):
    for head_dim, group, block_size in ((128, 4, 16), (128, 1, 16), (64, 8, 16), (128, 8, 64)):
        use_dot = group > 1 and head_dim >= _MIN_DOT_DIM
        block_h = 1 << (group - 1).bit_length()
        tiles = decode_tiles(DTYPES[dtype], head_dim, block_size, use_dot)
        constants = dict(
            GROUP=group,
            BLOCK_H=max(block_h, _MIN_DOT_DIM) if use_dot else block_h,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=block_size,
            TILE_BLOCKS=tiles.tile_blocks,
            NUM_STAGES=tiles.num_stages,
            USE_DOT=use_dot,
            UPCAST=not use_dot,
            FP8_KV=cache == "fp8e4nv",
        )
        signature = {}
        for name in names:
            if name in constants:
                signature[name] = "constexpr"
            elif name == "q_ptr":
                signature[name] = "*" + dtype
            elif name == "kv_ptr":
                signature[name] = "*" + cache
            elif name in ("part_out_ptr", "part_lse_ptr"):
                signature[name] = "*fp32"
            elif name.endswith("_ptr"):
                signature[name] = "*i32"
            elif name in ("scale", "k_scale", "v_scale"):
                signature[name] = "fp32"
            else:
                signature[name] = "i64" if name == "stride_kv_block" else "i32"
        attrs = aligned_attrs(_decode_split_kernel, aligned)
        kernel = build(_decode_split_kernel, signature, constants, attrs, tiles.num_warps)
        ptx = kernel.asm["ptx"]
        assert "cp.async" in ptx, f"{dtype} {head_dim} {group}: the loop is not pipelined"
        registers, spills = ptxas_usage(ptx)
        per_program = registers * tiles.num_warps * 32
        assert per_program <= BUDGET and spills == 0, (dtype, head_dim, group, registers, spills)
        print(dtype, cache, head_dim, group, block_size, registers, "registers ok")

for dtype in DTYPES:
    constants = dict(HEAD_DIM=128, SPLITS_PAD=32, HAS_SINKS=dtype == "bf16")
    signature = {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*" + dtype,
        "sinks_ptr": "*fp32", "stride_out_req": "i32", "stride_out_head": "i32",
        "num_splits": "i32", "HEAD_DIM": "constexpr", "SPLITS_PAD": "constexpr",
        "HAS_SINKS": "constexpr",
    }
    ptrs = ["part_out_ptr", "part_lse_ptr", "out_ptr", "sinks_ptr"]
    kernel = build(
        _decode_reduce_kernel, signature, constants, aligned_attrs(_decode_reduce_kernel, ptrs), 4
    )
    assert "cubin" in kernel.asm
    print(dtype, "reduce ok")
"""


def test_lowers_for_sm90_pipelined_within_the_register_budget() -> None:
    """The interpreter runs programs the GPU compiler rejects, and cannot show whether the
    loop is pipelined: compile for a real target too."""
    assert_lowers(LOWER_SCRIPT, 4 * 4 + 3, str(REGISTER_BUDGET))
