"""Tensor parallelism over quantized checkpoints (AWQ, GPTQ, fp8, compressed-tensors) and
GGUFs kept in their own blocks: each rank reads only its part of the stored tensors, in their
packing, and holds exactly those rows or columns of what one rank holds; TP=2's engine then
gives TP=1's logits (exact sums: bit for bit; Megatron's split: within 1e-5 in float32) and
greedy tokens. A shard boundary inside an int4 group is refused, naming the alternatives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tandem.model.config import ModelConfig
from tandem.model.llama import ModelWeights
from tandem.parallel.sharding import Shard, TensorSlice, tensor_slices
from tandem.quant import gguf as gguf_quant
from tandem.quant.checkpoint import convert, convert_slice, parse_quant_config
from tandem.quant.gguf import quantized_slice, quantized_tensor
from tandem.quant.weight import QuantizedWeight, WeightScheme
from tandem.weights.fetch import convert_gguf_file
from tandem.weights.loader import load_weights
from tandem.weights.safetensors_io import TensorReader
from tests.hf_models import build_hf_model
from tests.unit.test_gguf import _write_gguf
from tests.unit.test_quant_checkpoints import (
    QUANT_CONFIGS,
    gptq_pack_inputs,
    gptq_pack_outputs,
    write_quantized_checkpoint,
)
from tests.unit.test_tensor_parallel import logits_by_row

# Megatron's split adds the ranks' partial sums after their GEMMs: float32 logits within
# this of one rank's (the largest difference seen here: 4e-6, on logits up to 12).
MEGATRON_ATOL = 1e-5

# Each checkpoint format with the scheme it is kept in (--quantization).
SCHEMES = {
    "awq-g32": "int4",
    "gptq-g64": "int4",
    "gptq-g32-act-order": "int4",
    "gptq-v2-per-channel": "int4",
    "gptq-8bit": "int8",
    "fp8-per-tensor": "fp8",
    "fp8-block-one-column": "fp8",
    "compressed-tensors-fp8-channel": "fp8",
    "compressed-tensors-int8-channel": "int8",
}
GGUF_SCHEMES = {QT.Q4_0: "int4", QT.Q4_1: "int4", QT.Q8_0: "int8"}


@pytest.fixture(scope="module")
def checkpoint(hf_model, tmp_path_factory) -> Callable[[str], Path]:
    """checkpoint(fmt): the tiny llama rewritten in checkpoint format `fmt` (once each)."""
    src, _ = hf_model("llama")
    made: dict[str, Path] = {}

    def get(fmt: str) -> Path:
        if fmt not in made:
            made[fmt] = tmp_path_factory.mktemp(fmt) / "model"
            write_quantized_checkpoint(src, made[fmt], fmt)
        return made[fmt]

    return get


@pytest.fixture(scope="module")
def kept_gguf(tiny_model_dir, tmp_path_factory) -> Callable[[QT], Path]:
    """kept_gguf(qtype): the tiny model as a GGUF of `qtype` layer matrices, converted into
    a directory that keeps it (model.gguf beside the safetensors)."""
    made: dict[QT, Path] = {}

    def get(qtype: QT) -> Path:
        if qtype not in made:
            root = tmp_path_factory.mktemp(f"gguf-{qtype.name}")
            _write_gguf(tiny_model_dir, root / "tiny.gguf", qtype)
            made[qtype] = convert_gguf_file(
                root / "tiny.gguf", root / "cache", progress=lambda _: None
            )
        return made[qtype]

    return get


# -- every rank's weights: exactly its part of one rank's ------------------------------------


class ThreadMax:
    """The group's MAX all-reduce for ranks loading in threads of this process."""

    def __init__(self, size: int) -> None:
        self.barrier = threading.Barrier(size)
        self.parts: dict[int, torch.Tensor] = {}

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def reduce(x: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = x.clone()
            self.barrier.wait()
            out = torch.stack([self.parts[r] for r in sorted(self.parts)]).amax(dim=0)
            self.barrier.wait()
            return out

        return reduce


def load(model_dir: Path, scheme: str, shard: Shard | None = None, **kw: Any) -> ModelWeights:
    config = ModelConfig.from_dir(model_dir)
    return load_weights(
        model_dir, config, torch.float32, torch.device("cpu"), quantization=WeightScheme(scheme),
        group_size=32, shard=shard, **kw,
    )  # fmt: skip


def load_ranks(model_dir: Path, scheme: str, exact: bool, size: int = 2) -> list[ModelWeights]:
    """Every rank's weights, loaded at once in threads (Q8_0's and requantized columns take a
    MAX all-reduce)."""
    group = ThreadMax(size)
    weights: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            shard = Shard(rank, size, exact_sums=exact)
            weights[rank] = load(model_dir, scheme, shard, reduce_max=group.for_rank(rank))
        except BaseException as exc:
            errors.append(exc)
            group.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return weights


def as_dense(w: Any) -> torch.Tensor:
    """A layer matrix as float32 [out, in], whatever it is held as."""
    if isinstance(w, QuantizedWeight):
        return w.dequantize(torch.float32)
    return w.t().float()


def assert_rank_holds_its_part(one: ModelWeights, part: ModelWeights, config, shard) -> None:
    """Rank `shard.rank`'s matrices are exactly its slices of one rank's (dequantized)."""
    slices = tensor_slices(config, shard)
    q, kv = config.num_q_heads * config.head_dim, config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    for i, (whole, mine) in enumerate(zip(one.layers, part.layers, strict=True)):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        fused = {
            "qkv": (whole.qkv, mine.qkv, [(attn + f"{x}_proj.weight", n) for x, n in
                                          (("q", q), ("k", kv), ("v", kv))]),
            "gate_up": (whole.gate_up, mine.gate_up, [(mlp + f"{x}_proj.weight", inter) for x
                                                      in ("gate", "up")]),
        }  # fmt: skip
        for key, (w, m, names) in fused.items():
            rows, start = [], 0
            for name, n in names:
                sl = slices[name]
                rows.append(as_dense(w)[start + sl.start : start + sl.stop])
                start += n
            assert torch.equal(as_dense(m), torch.cat(rows)), f"layer {i} {key}"
        for name, w, m in ((attn + "o_proj.weight", whole.o, mine.o),
                           (mlp + "down_proj.weight", whole.down, mine.down)):  # fmt: skip
            dim, a, b = slices[name]
            want = as_dense(w)[a:b] if dim == 0 else as_dense(w)[:, a:b]
            assert torch.equal(as_dense(m), want), name


@pytest.mark.parametrize("exact", [True, False], ids=["exact-sums", "megatron"])
@pytest.mark.parametrize("fmt", SCHEMES)
def test_each_rank_holds_exactly_its_part_of_one_ranks_weights(checkpoint, fmt, exact) -> None:
    """Kept in the checkpoint's scheme and dequantized (--quantization none): each rank's
    matrices are its rows (q/k/v, gate/up; o/down with exact sums) or columns (o/down,
    Megatron) of one rank's, value for value; kept quantized wherever the part has a form
    (GPTQ act-order's columns here use more groups than 32 columns hold: dense)."""
    model_dir = checkpoint(fmt)
    config = ModelConfig.from_dir(model_dir)
    for scheme in (SCHEMES[fmt], "none"):
        one = load(model_dir, scheme)
        for rank, part in enumerate(load_ranks(model_dir, scheme, exact)):
            assert_rank_holds_its_part(one, part, config, Shard(rank, 2, exact_sums=exact))
            kept = [isinstance(w, QuantizedWeight) for w in part.layers[0].matrices()]
            if scheme == "none":
                assert not any(kept)
            elif fmt == "gptq-g32-act-order":  # a g_idx per projection: qkv, gate_up dense
                assert kept == [False, exact, False, exact]
            else:
                assert all(kept)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-sums", "megatron"])
@pytest.mark.parametrize("qtype", GGUF_SCHEMES, ids=[q.name for q in GGUF_SCHEMES])
def test_each_rank_holds_exactly_its_part_of_a_kept_gguf(kept_gguf, qtype, exact) -> None:
    """A GGUF's Q4_0/Q4_1/Q8_0 blocks: each rank's rows (Q/K un-permuted within its heads)
    or columns (whole blocks; Q8_0's int8 scales from the whole rows by a MAX all-reduce)."""
    model_dir = kept_gguf(qtype)
    config = ModelConfig.from_dir(model_dir)
    scheme = GGUF_SCHEMES[qtype]
    one = load(model_dir, scheme)
    for rank, part in enumerate(load_ranks(model_dir, scheme, exact)):
        assert_rank_holds_its_part(one, part, config, Shard(rank, 2, exact_sums=exact))
        assert all(isinstance(w, QuantizedWeight) for w in part.layers[0].matrices())


# -- engines: TP=2 gives TP=1's logits ----------------------------------------------------------


@pytest.fixture
def tp_engine(engine_factory) -> Iterator[Callable[..., Any]]:
    """tp_engine(model_dir, size, **overrides): an engine of `size` ranks, closed after (as
    tests/unit/test_tensor_parallel.py's)."""
    engines: list[Any] = []

    def make(model_dir: Path, size: int, **overrides: Any) -> Any:
        engines.append(engine_factory(model_dir, tensor_parallel_size=size, **overrides))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


PROMPTS = [[3, 14, 15, 92, 65, 35, 89, 79], [2, 71, 82, 81, 82, 84, 59, 4, 52, 35, 36, 2]]
ENGINE = dict(max_num_batched_tokens=7)  # prefill in chunks


def assert_tp2_matches_tp1(one: Any, two: Any, exact: bool) -> None:
    runs = [logits_by_row(engine, PROMPTS, 5) for engine in (one, two)]
    assert set(runs[0]) == set(runs[1])  # the same greedy tokens
    for key, a in runs[0].items():
        if exact:
            assert torch.equal(runs[1][key], a)
        torch.testing.assert_close(runs[1][key], a, atol=MEGATRON_ATOL, rtol=0)
    two.check_integrity()


@pytest.mark.parametrize("exact", [True, False], ids=["exact-sums", "megatron"])
@pytest.mark.parametrize(
    "fmt", ["awq-g32", "gptq-g64", "gptq-g32-act-order", "fp8-block-one-column"]
)
def test_tp2_quantized_checkpoint_matches_tp1(
    checkpoint, engine_factory, tp_engine, fmt, exact
) -> None:
    model_dir = checkpoint(fmt)
    quant = dict(ENGINE, quantization=SCHEMES[fmt])
    one = engine_factory(model_dir, **quant)
    two = tp_engine(model_dir, 2, **quant, tp_exact_sums=exact)
    assert two.weight_bytes < one.weight_bytes
    assert_tp2_matches_tp1(one, two, exact)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-sums", "megatron"])
@pytest.mark.parametrize("qtype", [QT.Q4_1, QT.Q8_0], ids=["Q4_1", "Q8_0"])
def test_tp2_kept_gguf_matches_tp1(kept_gguf, engine_factory, tp_engine, qtype, exact) -> None:
    model_dir = kept_gguf(qtype)
    quant = dict(ENGINE, quantization=GGUF_SCHEMES[qtype], quantization_group_size=32)
    one = engine_factory(model_dir, **quant)
    two = tp_engine(model_dir, 2, **quant, tp_exact_sums=exact)
    assert_tp2_matches_tp1(one, two, exact)


# -- refusals -------------------------------------------------------------------------------


def test_a_shard_boundary_inside_a_group_is_refused(tmp_path) -> None:
    """An MLP of 96 over 2 ranks, AWQ groups of 32: Megatron's split gives each rank 48 of
    down's input columns, which split group 1 (inputs 32..63). Refused, naming the
    alternatives; both of which load: o and down split by their outputs (exact sums), or
    the checkpoint dequantized."""
    src = tmp_path / "src"
    build_hf_model("llama", src, intermediate_size=96)
    write_quantized_checkpoint(src, tmp_path / "awq", "awq-g32")
    with pytest.raises(
        ValueError,
        match=r"down_proj: this tensor-parallel rank's input columns \[0, 48\) of 96 split a "
        r"quantization group of 32 .*tp_exact_sums true.*--quantization none",
    ):
        load(tmp_path / "awq", "int4", Shard(0, 2, exact_sums=False))
    config = ModelConfig.from_dir(tmp_path / "awq")
    for scheme, exact in (("int4", True), ("none", False)):
        one = load(tmp_path / "awq", scheme)
        for rank, part in enumerate(load_ranks(tmp_path / "awq", scheme, exact)):
            assert_rank_holds_its_part(one, part, config, Shard(rank, 2, exact_sums=exact))


def test_gguf_columns_that_split_a_block_are_refused() -> None:
    rng = np.random.default_rng(0)
    data = rng.standard_normal((4, 96)).astype(np.float32)
    packed = gguf.quants.quantize(data, QT.Q4_0)
    whole = quantized_tensor(packed, QT.Q4_0, (4, 96)).dequantize()
    part = quantized_slice(packed, QT.Q4_0, (4, 96), TensorSlice(1, 32, 64))
    assert torch.equal(part.dequantize(), whole[:, 32:64])
    with pytest.raises(ValueError, match=r"Q4_0 blocks of 32 inputs: .*\[0, 48\) of 96 split"):
        quantized_slice(packed, QT.Q4_0, (4, 96), TensorSlice(1, 0, 48))
    with pytest.raises(ValueError, match=r"MAX all-reduce"):
        quantized_slice(
            gguf.quants.quantize(data, QT.Q8_0), QT.Q8_0, (4, 96), TensorSlice(1, 0, 48)
        )


def test_act_order_columns_keep_their_groups_where_they_fit() -> None:
    """GPTQ act-order columns whose inputs use no more groups than their width holds stay
    int4 with a g_idx of their own (here: each half of 64 inputs permuted within itself);
    where they do not (a permutation over all 64) the part is dense, equal either way."""
    gen = torch.Generator().manual_seed(3)
    out, inp, group = 8, 64, 32
    q = torch.randint(0, 16, (out, inp), generator=gen)
    zeros = torch.randint(1, 16, (out, inp // group), generator=gen)
    scales = (torch.rand(out, inp // group, generator=gen) * 0.02 + 0.001).half()
    quant = parse_quant_config(QUANT_CONFIGS["gptq-g32-act-order"][0])
    halves = torch.cat([torch.randperm(32, generator=gen), 32 + torch.randperm(32, generator=gen)])
    for g_idx, kept in (
        (halves // group, True),
        (torch.randperm(inp, generator=gen) // group, False),
    ):
        tensors = {
            "l.qweight": gptq_pack_inputs(q.t(), 4),
            "l.qzeros": gptq_pack_outputs((zeros - 1).t().contiguous(), 4),
            "l.scales": scales.t().contiguous(),
            "l.g_idx": g_idx.to(torch.int32),
        }
        whole = convert(quant, "l", tensors.__getitem__, out, inp).dequantize()
        for a, b in ((0, 32), (32, 64)):
            part_tensors = dict(tensors)
            part_tensors["l.qweight"] = tensors["l.qweight"][a // 8 : b // 8]
            part_tensors["l.g_idx"] = tensors["l.g_idx"][a:b]
            got = convert_slice(
                quant, "l", part_tensors.__getitem__, out, inp, TensorSlice(1, a, b)
            )
            assert isinstance(got, QuantizedWeight) == kept
            dense = got.dequantize() if isinstance(got, QuantizedWeight) else got
            assert torch.equal(dense, whole[:, a:b])


# -- what a rank reads -----------------------------------------------------------------------


class CountingReader(TensorReader):
    """Counts the bytes of every tensor (or part) the reader hands out."""

    handed: dict[str, int] = {}

    def read(self, name: str) -> torch.Tensor:
        t = super().read(name)
        CountingReader.handed[name] = CountingReader.handed.get(name, 0) + t.numel() * t.itemsize
        return t


def bytes_read(monkeypatch, model_dir: Path, scheme: str, shard: Shard | None) -> dict[str, int]:
    CountingReader.handed = {}
    monkeypatch.setattr("tandem.weights.loader.TensorReader", CountingReader)
    load(model_dir, scheme, shard, reduce_max=lambda x: x)  # one rank: its own max
    return dict(CountingReader.handed)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-sums", "megatron"])
@pytest.mark.parametrize("fmt", ["awq-g32", "gptq-g64", "fp8-per-tensor"])
def test_a_rank_reads_only_its_part_of_the_stored_tensors(
    checkpoint, monkeypatch, fmt, exact
) -> None:
    """A rank of 2 reads half of every quantized layer's packed values (qweight, weight) and
    of AWQ's scales and zeros; what it reads whole is small: GPTQ's g_idx, and for its
    columns GPTQ's scales and zeros (an act-order g_idx may name any group), fp8's scale."""
    model_dir = checkpoint(fmt)
    whole = bytes_read(monkeypatch, model_dir, SCHEMES[fmt], None)
    part = bytes_read(monkeypatch, model_dir, SCHEMES[fmt], Shard(0, 2, exact_sums=exact))
    assert part.keys() == whole.keys()
    values = [n for n in whole if n.endswith((".qweight", "proj.weight")) and "layers" in n]
    assert values and all(2 * part[n] == whole[n] for n in values)
    layer_parts = [n for n in whole if "layers" in n and "norm" not in n]
    read_whole = [n for n in layer_parts if part[n] == whole[n]]
    if fmt == "awq-g32":
        assert read_whole == []
    small = sum(whole[n] for n in read_whole)
    assert small < 0.2 * sum(whole[n] for n in values)
    assert sum(part[n] for n in layer_parts) < 0.6 * sum(whole[n] for n in layer_parts)


def test_a_rank_reads_only_its_blocks_of_a_kept_gguf(kept_gguf, monkeypatch) -> None:
    """The GGUF is a memory map: a rank's rows or columns of blocks are the only bytes of a
    matrix it touches (counted as they are decoded)."""
    model_dir = kept_gguf(QT.Q4_0)
    seen: list[int] = []
    blocks = gguf_quant._blocks

    def counting(raw: Any, qtype: Any, shape: Any) -> Any:
        seen.append(np.asarray(raw).nbytes)
        return blocks(raw, qtype, shape)

    monkeypatch.setattr(gguf_quant, "_blocks", counting)
    load(model_dir, "int4")
    whole = sum(seen)
    for exact in (True, False):
        seen.clear()
        load(model_dir, "int4", Shard(1, 2, exact_sums=exact))
        assert 2 * sum(seen) == whole
