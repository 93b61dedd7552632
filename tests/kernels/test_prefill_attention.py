"""The paged prefill kernel against `tandem.kernels.reference.paged_attention`, request by request.

On a machine without a GPU the kernel runs on CPU tensors under Triton's interpreter
(tests/conftest.py sets TRITON_INTERPRET=1), so the grids stay small: 2 kv heads, a few
hundred tokens. Cache slots that no request's context covers hold NaN: a kernel that reads a
value it should not (past a context, a padded table entry) turns its output NaN.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import pytest
import torch

from tandem.kernels.prefill_attention import paged_prefill_attention
from tandem.kernels.reference import paged_attention, write_kv_reference
from tandem.model.attention import AttentionMetadata, PrefillSpan, TorchAttention
from tests.kernels.compile_check import assert_lowers

# The reference runs in float64 and rounds to the dtype once; the kernel accumulates in fp32
# and rounds P to the cache dtype before P @ V (as flash-attention does), ~1 ulp of the dtype.
TOLERANCES = {  # (atol, rtol)
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}
NUM_KV_HEADS = 2
NUM_LAYERS = 2  # the kernel reads layer 1: a strided view, as kv_cache[:, layer] is


@dataclass
class Case:
    q: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    kv_layer: torch.Tensor  # [num_blocks, 2, block_size, NUM_KV_HEADS, head_dim]
    tables: list[list[int]]  # each request's block ids
    context_lens: list[int]
    query_starts: list[int]
    scale: float

    def run(
        self,
        out: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        max_blocks = max(len(t) for t in self.tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in self.tables]
        return paged_prefill_attention(
            self.q,
            self.kv_layer,
            torch.tensor(padded, dtype=torch.int32),
            torch.tensor(self.query_starts, dtype=torch.int32),
            torch.tensor(self.context_lens, dtype=torch.int32),
            max(end - start for start, end in pairwise(self.query_starts)),
            self.scale,
            out=out,
            window=window,
            sinks=sinks,
        )

    def reference(
        self, i: int, window: int | None = None, sinks: torch.Tensor | None = None
    ) -> torch.Tensor:
        start, end = self.query_starts[i], self.query_starts[i + 1]
        return paged_attention(
            self.q[start:end], self.kv_layer, self.tables[i], self.context_lens[i], self.scale,
            window, sinks,
        )  # fmt: skip

    def check(
        self, out: torch.Tensor, window: int | None = None, sinks: torch.Tensor | None = None
    ) -> None:
        atol, rtol = TOLERANCES[self.q.dtype]
        for i in range(len(self.tables)):
            start, end = self.query_starts[i], self.query_starts[i + 1]
            want = self.reference(i, window, sinks)
            torch.testing.assert_close(out[start:end], want, atol=atol, rtol=rtol)


def make_case(
    lens: list[tuple[int, int]],
    *,
    group: int,
    block_size: int,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    num_blocks: int | None = None,
    seed: int = 0,
) -> Case:
    """lens: (cached prefix, chunk length) per request.

    With `num_blocks` given, the cache is that large but left unallocated by the OS
    (torch.empty, only the requests' blocks are written) and the requests get its highest
    block ids; otherwise it has a few spare blocks and the ids are shuffled.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [-(-(p + n) // block_size) for p, n in lens]
    needed = sum(blocks_per_req)
    block_shape = (NUM_LAYERS, 2, block_size, NUM_KV_HEADS, head_dim)
    if num_blocks is None:
        cache = torch.full((needed + 8, *block_shape), float("nan"), dtype=dtype)
        ids = torch.randperm(needed + 8, generator=gen)[:needed].tolist()
    else:
        cache = torch.empty((num_blocks, *block_shape), dtype=dtype)
        ids = (num_blocks - 1 - torch.randperm(needed, generator=gen)).tolist()
        cache[ids] = float("nan")
    kv_layer = cache[:, 1]
    tables, starts, context_lens = [], [0], []
    for (prefix, num_new), num in zip(lens, blocks_per_req, strict=True):
        table = [ids.pop() for _ in range(num)]
        ctx = prefix + num_new
        positions = torch.arange(ctx)
        kv = torch.randn(2, ctx, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        # The whole context is in the cache: the prefix from earlier steps, the chunk's own
        # K/V written by this step before attention runs.
        write_kv_reference(
            kv[0],
            kv[1],
            kv_layer,
            torch.tensor(table)[positions // block_size],
            positions % block_size,
        )
        tables.append(table)
        starts.append(starts[-1] + num_new)
        context_lens.append(ctx)
    q = torch.randn(starts[-1], NUM_KV_HEADS * group, head_dim, generator=gen).to(dtype)
    return Case(q, kv_layer, tables, context_lens, starts, head_dim**-0.5)


# (cached prefix, chunk length) per request, for block size 16; scaled for 32 below.
CHUNKS = {
    "no-prefix-1": [(0, 1)],
    "no-prefix-bs-1": [(0, 15)],
    "no-prefix-bs+1": [(0, 17)],
    "no-prefix-long": [(0, 150)],
    "prefix-1": [(45, 1)],
    "prefix-at-block-edge-bs-1": [(32, 15)],
    "prefix-bs+1": [(37, 17)],
    "prefix-long": [(70, 130)],
    "prefix-longer-than-chunk": [(180, 40)],
}


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("lens", CHUNKS.values(), ids=CHUNKS.keys())
def test_single_chunk(lens: list[tuple[int, int]], block_size: int) -> None:
    # Lengths relative to the block size: 15 -> block_size - 1, 17 -> block_size + 1, ...
    scaled = [(p * block_size // 16, n + (block_size - 16) * (n in (15, 17))) for p, n in lens]
    case = make_case(scaled, group=4, block_size=block_size, seed=len(CHUNKS) * block_size)
    case.check(case.run())


RAGGED = [(0, 1), (37, 17), (5, 33), (0, 120), (64, 16), (200, 3)]


@pytest.mark.parametrize(
    ("window", "with_sinks"), [(1, False), (24, False), (24, True), (None, True)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_and_sinks(dtype: torch.dtype, window: int | None, with_sinks: bool) -> None:
    """A sliding layer's window (blocks wholly before every query's window are poisoned with
    NaN: never read) and gpt-oss's sinks, over chunks with and without cached prefixes."""
    case = make_case(RAGGED, group=4, block_size=16, dtype=dtype, seed=11)
    if window:
        for (prefix, _), table in zip(RAGGED, case.tables, strict=True):
            first_block = max(0, prefix - window + 1) // 16
            case.kv_layer[torch.tensor(table[:first_block], dtype=torch.long)] = float("nan")
    g = torch.Generator().manual_seed(2)
    sinks = torch.randn(case.q.shape[1], generator=g) * 2 if with_sinks else None
    case.check(case.run(window=window, sinks=sinks), window, sinks)


@pytest.mark.parametrize(
    "dtype, group, head_dim, block_size",
    [
        (torch.float32, 1, 64, 16),
        (torch.float32, 3, 64, 32),  # a group that is not a power of two: padded rows
        (torch.float32, 8, 128, 32),
        (torch.float16, 1, 128, 16),
        (torch.float16, 4, 64, 32),
        (torch.float16, 8, 64, 16),
        (torch.bfloat16, 1, 64, 32),
        (torch.bfloat16, 4, 128, 16),
        (torch.bfloat16, 8, 128, 32),
    ],
)
def test_ragged_batch(dtype: torch.dtype, group: int, head_dim: int, block_size: int) -> None:
    case = make_case(
        RAGGED, group=group, block_size=block_size, head_dim=head_dim, dtype=dtype, seed=group
    )
    case.check(case.run())


def test_high_block_ids() -> None:
    # Block stride 2 layers * 2 * 16 * 2 * 64 = 8192 elements: ids above 2**31 / 8192 =
    # 262144 put their K/V past int32 element offsets (int32 block tables: the kernel must
    # widen them itself). The fp16 cache spans 4 GiB of address space, but only the
    # requests' blocks are ever touched.
    case = make_case(
        [(20, 13), (0, 18)], group=4, block_size=16, dtype=torch.float16, num_blocks=2**18 + 64
    )
    assert min(min(t) for t in case.tables) * case.kv_layer.stride(0) >= 2**31
    case.check(case.run())


def test_writes_into_given_out() -> None:
    case = make_case([(10, 7), (0, 20)], group=2, block_size=16)
    # The backend passes out[num_decode:], a view into the step's output.
    full = torch.full((5 + case.q.shape[0], *case.q.shape[1:]), 7.0)
    result = case.run(out=full[5:])
    assert result.data_ptr() == full[5:].data_ptr()
    assert torch.all(full[:5] == 7.0)
    case.check(full[5:])


def test_matches_torch_attention_backend() -> None:
    """The CPU backend's prefill path, fed the same step, gives the same rows."""
    case = make_case([(24, 9), (0, 21)], group=4, block_size=16)
    spans = [
        PrefillSpan(start, end - start, ctx, torch.tensor(table))
        for (start, end), ctx, table in zip(
            pairwise(case.query_starts), case.context_lens, case.tables, strict=True
        )
    ]
    # TorchAttention writes the chunk's own k/v; give it the values already in the cache.
    slot_blocks, slot_offsets = [], []
    for span, table in zip(spans, case.tables, strict=True):
        for pos in range(span.context_len - span.num_new_tokens, span.context_len):
            slot_blocks.append(table[pos // 16])
            slot_offsets.append(pos % 16)
    blocks, offsets = torch.tensor(slot_blocks), torch.tensor(slot_offsets)
    k, v = case.kv_layer[blocks, 0, offsets], case.kv_layer[blocks, 1, offsets]
    meta = AttentionMetadata(blocks, offsets, prefills=spans)
    expected = TorchAttention().forward(case.q, k, v, case.kv_layer, meta, case.scale)
    atol, rtol = TOLERANCES[torch.float32]
    torch.testing.assert_close(case.run(), expected, atol=atol, rtol=rtol)


def test_empty_batch() -> None:
    kv_layer = torch.zeros(4, 2, 16, 2, 64)
    out = paged_prefill_attention(
        torch.zeros(0, 4, 64),
        kv_layer,
        torch.zeros(0, 1, dtype=torch.int32),
        torch.zeros(1, dtype=torch.int32),
        torch.zeros(0, dtype=torch.int32),
        0,
        0.125,
    )
    assert out.shape == (0, 4, 64)


def _valid_args() -> dict[str, object]:
    return dict(
        q=torch.zeros(5, 4, 64),
        kv_layer=torch.zeros(4, 2, 16, 2, 64),
        block_tables=torch.zeros(2, 1, dtype=torch.int32),
        query_starts=torch.tensor([0, 2, 5], dtype=torch.int32),
        context_lens=torch.tensor([2, 3], dtype=torch.int32),
        max_query_len=3,
        scale=0.125,
    )


BAD_ARGS = {
    "q-2d": (dict(q=torch.zeros(5, 256)), r"q must be \[num_tokens"),
    "kv-not-2": (dict(kv_layer=torch.zeros(4, 3, 16, 2, 64)), r"kv_layer must be"),
    "head-dim-mismatch": (dict(kv_layer=torch.zeros(4, 2, 16, 2, 32)), r"head_dim 64 .* 32"),
    "head-dim-not-pow2": (
        dict(q=torch.zeros(5, 4, 48), kv_layer=torch.zeros(4, 2, 16, 2, 48)),
        r"head_dim must be one of .* got 48",
    ),
    "gqa": (dict(q=torch.zeros(5, 3, 64)), r"num_q_heads 3 .* num_kv_heads 2"),
    "dtype-mismatch": (dict(q=torch.zeros(5, 4, 64, dtype=torch.float16)), r"float16 .*float32"),
    "dtype-unsupported": (
        dict(q=torch.zeros(5, 4, 64).double(), kv_layer=torch.zeros(4, 2, 16, 2, 64).double()),
        r"float64",
    ),
    "starts-length": (
        dict(query_starts=torch.tensor([0, 5], dtype=torch.int32)),
        r"query_starts must be \[batch \+ 1\] = \[3\], got \(2,\)",
    ),
    "tables-batch": (
        dict(block_tables=torch.zeros(3, 1, dtype=torch.int32)),
        r"block_tables must be \[batch=2",
    ),
    "tables-float": (dict(block_tables=torch.zeros(2, 1)), r"block_tables must be int32"),
    "max-query-len": (dict(max_query_len=6), r"max_query_len 6 exceeds num_tokens 5"),
    "device": (
        dict(context_lens=torch.zeros(2, dtype=torch.int32, device="meta")),
        r"one device.*meta",
    ),
    "strided-dim": (dict(q=torch.zeros(5, 4, 128)[:, :, ::2]), r"contiguous.*'q': 2"),
    "out-shape": (dict(out=torch.zeros(5, 4, 32)), r"out must be \(5, 4, 64\)"),
}


@pytest.mark.parametrize("override, match", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_rejects_bad_arguments(override: dict[str, object], match: str) -> None:
    args = {**_valid_args(), **override}
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**args)  # type: ignore[arg-type]


# Compiles the kernel for sm_90 with the wrapper's tile sizes and the alignment a launch
# specialises on, through Triton's own LLVM and ptxas: no GPU needed. The key loop must be
# pipelined (cp.async copies) without register spills. Run in a fresh interpreter without
# TRITON_INTERPRET, which swaps `triton.jit` for the interpreter. Exit code 3: this Triton
# cannot target CUDA.
LOWER_SCRIPT = r"""
import torch

from tandem.kernels.prefill_attention import _prefill_kernel, tiles_for
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

# Pointers and the q/out/cache strides are multiples of 16 in serving (a launch specialises
# on that); the block table's row stride is not specialised, the others are 1.
STRIDES = ("stride_q", "stride_o", "stride_c")
NAMES = _prefill_kernel.arg_names
ALIGNED = aligned_attrs(
    _prefill_kernel, [n for n in NAMES if n.endswith("_ptr") or n.startswith(STRIDES)]
)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
# (q dtype, cache dtype): an fp8 cache is dequantized to q's dtype as its tiles load.
for dtype, cache in (("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")):
    for head_dim, group in ((64, 8), (128, 1), (256, 4)):
        tiles = tiles_for(DTYPES[dtype], head_dim, group)
        constants = dict(
            BLOCK_SIZE=16,
            GROUP=group,
            GROUP_PAD=tiles.group_pad,
            BLOCK_Q=tiles.block_q,
            BLOCK_N=tiles.block_n,
            HEAD_DIM=head_dim,
            DOT_PRECISION="ieee" if dtype == "fp32" else "tf32",
            DOT_FP32=False,
            NUM_STAGES=tiles.num_stages,
            FP8_KV=cache == "fp8e4nv",
            HAS_SINKS=head_dim == 64,  # gpt-oss's head size (its sinks' epilogue compiled)
        )
        signature = {}
        for name in _prefill_kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name in ("q_ptr", "out_ptr"):
                signature[name] = "*" + dtype
            elif name == "cache_ptr":
                signature[name] = "*" + cache
            elif name == "sinks_ptr":
                signature[name] = "*fp32"
            elif name.endswith("_ptr"):
                signature[name] = "*i32"
            elif name in ("qk_scale", "k_scale", "v_scale"):
                signature[name] = "fp32"
            else:
                signature[name] = "i64" if name == "stride_c_block" else "i32"
        kernel = compile_sm90(
            _prefill_kernel, signature, constants, ALIGNED,
            num_warps=tiles.num_warps, enable_fp_fusion=True,
        )
        ptx = kernel.asm["ptx"]
        assert "cp.async" in ptx, f"{dtype} {head_dim} {group}: the key loop is not pipelined"
        registers, spills = ptxas_usage(ptx)
        assert spills == 0, (dtype, head_dim, group, registers, spills)
        print(dtype, cache, head_dim, group, registers, "registers ok")
"""


def test_lowers_for_sm90() -> None:
    """The interpreter runs programs the GPU compiler rejects (tl.dot below 16 rows, a
    dtype mismatch in a loop-carried value): compile for a real target too."""
    assert_lowers(LOWER_SCRIPT, 12)
