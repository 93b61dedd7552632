"""tandem/model/linear.py: the matmul chosen per device and dtype, oneDNN's prepacked bf16
path against the plain product, and dtype "auto" on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.config
from tandem.config import EngineConfig
from tandem.model.linear import (
    MatmulKind,
    choose_matmul,
    matmul,
    onednn_bf16_available,
    onednn_row_counts,
    onednn_rows,
    pack,
)
from tandem.services.up.config import cpu_threads_per_worker

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
needs_onednn = pytest.mark.skipif(
    not onednn_bf16_available(), reason="this CPU does not run bfloat16 natively"
)


def test_choose_matmul_packs_only_bf16_on_a_cpu_that_runs_it() -> None:
    assert choose_matmul(CPU, torch.bfloat16, True) is MatmulKind.ONEDNN
    assert choose_matmul(CPU, torch.bfloat16, False) is MatmulKind.PLAIN
    assert choose_matmul(CPU, torch.float32, True) is MatmulKind.PLAIN
    assert choose_matmul(CPU, torch.float16, True) is MatmulKind.PLAIN
    assert choose_matmul(CUDA, torch.bfloat16, True) is MatmulKind.PLAIN


def test_cpu_matmul_setting_overrides_the_choice_where_onednn_runs_the_dtype() -> None:
    assert choose_matmul(CPU, torch.bfloat16, True, "plain") is MatmulKind.PLAIN
    assert choose_matmul(CPU, torch.float32, False, "onednn") is MatmulKind.ONEDNN
    assert choose_matmul(CPU, torch.bfloat16, True, "onednn") is MatmulKind.ONEDNN
    assert choose_matmul(CUDA, torch.float32, True, "onednn") is MatmulKind.PLAIN  # CPU only
    with pytest.raises(ValueError, match="AVX512-BF16 or AMX"):
        choose_matmul(CPU, torch.bfloat16, False, "onednn")
    with pytest.raises(ValueError, match="float16"):
        choose_matmul(CPU, torch.float16, True, "onednn")
    with pytest.raises(ValueError, match="cpu_matmul must be one of"):
        choose_matmul(CPU, torch.float32, True, "mkl")
    with pytest.raises(ValueError, match="cpu_matmul must be auto, plain or onednn"):
        EngineConfig(model_dir="m", cpu_matmul="mkl")


def test_plain_is_x_at_w_with_or_without_bias() -> None:
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(3, 8, generator=g), torch.randn(8, 5, generator=g), torch.randn(5)
    assert pack(w, MatmulKind.PLAIN) is w
    assert torch.equal(matmul(x, w, MatmulKind.PLAIN), x @ w)
    assert torch.allclose(matmul(x, w, MatmulKind.PLAIN, b), x @ w + b)


@needs_onednn
@pytest.mark.parametrize("shape", [(64, 96), (576, 960), (1536, 576)])
def test_onednn_packed_matches_the_float32_product_within_bf16_rounding(
    shape: tuple[int, int],
) -> None:
    """bf16 inputs, float32 accumulation: within a few bf16 ulps of the float32 product of
    the same bf16 values; the bias is added."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(*shape, generator=g) * 0.05).bfloat16()
    x = torch.randn(7, shape[0], generator=g).bfloat16()
    bias = torch.randn(shape[1], generator=g).bfloat16()
    packed = pack(w, MatmulKind.ONEDNN)
    ref = x.float() @ w.float()
    got = matmul(x, packed, MatmulKind.ONEDNN)
    assert got.dtype == torch.bfloat16 and got.shape == (7, shape[1])
    tol = 2**-7 * ref.abs().max().item()  # a bf16 ulp at the largest output
    assert (got.float() - ref).abs().max().item() <= tol
    with_bias = matmul(x, packed, MatmulKind.ONEDNN, bias)
    assert (with_bias.float() - (ref + bias.float())).abs().max().item() <= 2 * tol


@needs_onednn
def test_onednn_rows_do_not_depend_on_the_batch() -> None:
    """For this shape (SmolLM2's gate/up; every matrix of up to 576 inputs measured behaves
    the same) a request's numbers do not change with who shares its step: each row of a
    300-row batch is bitwise the row computed alone or in smaller batches. A layout packed
    for more rows fails this (BENCHMARKS.md, issue 24); matrices of 1536 inputs or more do
    not have it (down projections), so bfloat16 serving is held to a tolerance elsewhere and
    float32 to token identity."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(576, 3072, generator=g) * 0.05).bfloat16()
    packed = pack(w, MatmulKind.ONEDNN)
    x = torch.randn(300, 576, generator=g).bfloat16()
    full = matmul(x, packed, MatmulKind.ONEDNN)
    # decode batches, the sizes where a layout packed for more rows switches kernels (5-32),
    # prefill chunks
    for m in (1, 2, 3, 5, 8, 16, 17, 32, 33, 64, 256):
        assert torch.equal(matmul(x[:m].contiguous(), packed, MatmulKind.ONEDNN), full[:m])
    # a chunk in the middle of a step (decode rows before it)
    assert torch.equal(matmul(x[37:].contiguous(), packed, MatmulKind.ONEDNN), full[37:])


def test_onednn_rows_are_exact_to_64_then_rounded_up_by_less_than_an_eighth() -> None:
    """Issue 38: every distinct row count is a kernel in oneDNN's cache; the counts are
    bounded by rounding, never by more than 1/8 of the rows."""
    assert [onednn_rows(n) for n in (1, 17, 64, 65, 72, 73, 128, 129, 2047, 2048, 2049)] == [
        1, 17, 64, 72, 72, 80, 128, 144, 2048, 2048, 2304,
    ]  # fmt: skip
    counts = onednn_row_counts(4096)
    assert counts == sorted(set(counts)) and counts[-1] == 4096
    for n in range(1, 4097):
        rows = onednn_rows(n)
        assert rows in counts and n <= rows and 8 * (rows - n) < max(n, 1)
    # 64 exact counts, then 8 per doubling: SmolLM2's 2048-token budget gives 104 kernels
    # per matrix shape, against 2048 unrounded.
    assert len(onednn_row_counts(2048)) == 64 + 8 * 5
    assert onednn_row_counts(10) == list(range(1, 11))


@pytest.mark.parametrize("num_rows", [1, 63, 64, 65, 100, 300])
def test_onednn_product_of_padded_rows_is_the_product_of_the_rows(num_rows: int) -> None:
    """The zero rows appended to reach `onednn_rows` are dropped: [n, out], each row the
    product of its own input (float32 packed weights run on any oneDNN CPU)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(96, 40, generator=g), torch.randn(40, generator=g)
    x = torch.randn(num_rows, 96, generator=g)
    packed = pack(w, MatmulKind.ONEDNN)
    got = matmul(x, packed, MatmulKind.ONEDNN, b)
    assert got.shape == (num_rows, 40) and got.is_contiguous()
    torch.testing.assert_close(got, x @ w + b, rtol=1e-5, atol=1e-4)


def test_auto_dtype_is_bf16_on_cuda_and_on_a_cpu_that_runs_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tandem.config, "cpu_runs_bf16", lambda: True)
    assert EngineConfig(model_dir="m").resolved_dtype == "bfloat16"
    assert EngineConfig(model_dir="m", dtype="float32").resolved_dtype == "float32"
    monkeypatch.setattr(tandem.config, "cpu_runs_bf16", lambda: False)
    assert EngineConfig(model_dir="m").resolved_dtype == "float32"
    assert EngineConfig(model_dir="m", device="cuda").resolved_dtype == "bfloat16"
    assert EngineConfig(model_dir="m", dtype="bfloat16").resolved_dtype == "bfloat16"


@pytest.mark.parametrize(
    ("cores", "workers", "autoscale", "threads"),
    [
        (2, 2, False, 1),  # tandem up's default on this box: one core left to the router
        (2, 1, False, 1),
        (1, 2, False, 1),
        (16, 2, False, 7),
        (16, 3, False, 5),
        (8, 1, False, 7),
        (16, 2, True, 1),  # autoscale adds a worker per free core
        (4, 0, False, 1),
    ],
)
def test_cpu_threads_per_worker_leave_a_core_and_split_the_rest(
    cores: int, workers: int, autoscale: bool, threads: int
) -> None:
    assert cpu_threads_per_worker(cores, workers, autoscale) == threads


def test_warm_up_compiles_every_onednn_kernel_the_engine_can_ask_for(
    tiny_model_dir: Path, engine_factory: Callable[..., Any]
) -> None:
    """Issue 38: a oneDNN worker's kernel set is complete after warm-up (every packed shape
    at every `onednn_rows` count up to the token budget, the lm_head up to max_num_seqs),
    so traffic of any prompt lengths and batch sizes compiles nothing more and its memory
    does not fill towards the bound for hours."""
    from tandem.engine.footprint import engine_footprint
    from tandem.engine.request import RequestSpec
    from tandem.engine.sampling import SamplingParams

    budget, seqs = 160, 6
    engine = engine_factory(
        tiny_model_dir, cpu_matmul="onednn", max_num_batched_tokens=budget, max_num_seqs=seqs
    )
    model = engine.model
    assert model.matmul is MatmulKind.ONEDNN and not model.onednn_row_counts
    engine.warm_up()
    assert model.onednn_row_counts == set(onednn_row_counts(budget))
    # the tiny preset's four layer shapes (qkv, o, gate_up, down), then the lm_head
    runs = model.compile_matmuls(budget, seqs)
    assert runs == 4 * len(onednn_row_counts(budget)) + len(onednn_row_counts(seqs))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for i, length in enumerate((1, 5, 29, 64, 65, 97, 150)):
        prompt = tuple((3 + 7 * j) % 50 + 1 for j in range(length))
        engine.add_request(RequestSpec(f"r{i}", prompt, params))
    while engine.has_unfinished():
        engine.step()
    assert model.onednn_row_counts == set(onednn_row_counts(budget))
    entries = engine_footprint(engine)["onednn_row_counts"]
    assert entries.entries == entries.bound == len(onednn_row_counts(budget))


def test_compile_matmuls_runs_nothing_for_plain_matmuls(
    tiny_model_dir: Path, engine_factory: Callable[..., Any]
) -> None:
    engine = engine_factory(tiny_model_dir, cpu_matmul="plain")
    assert engine.model.compile_matmuls(64, 8) == 0 and not engine.model.onednn_row_counts


def test_quantized_layers_record_only_the_lm_head_s_onednn_row_counts(
    tiny_model_dir: Path, engine_factory: Callable[..., Any]
) -> None:
    """int8 layer matrices run through their own kernels, not oneDNN: only the lm_head's
    products are oneDNN's, so only its row counts are compiled and recorded (the gauge does
    not count products that compile nothing)."""
    from tandem.engine.request import RequestSpec
    from tandem.engine.sampling import SamplingParams

    engine = engine_factory(
        tiny_model_dir, cpu_matmul="onednn", quantization="int8", max_num_seqs=4,
        max_num_batched_tokens=96,
    )  # fmt: skip
    engine.warm_up()
    assert engine.model.onednn_row_counts == set(onednn_row_counts(4))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for i, length in enumerate((3, 40, 90)):
        prompt = tuple((5 + 3 * j) % 50 + 1 for j in range(length))
        engine.add_request(RequestSpec(f"q{i}", prompt, params))
    while engine.has_unfinished():
        engine.step()
    assert engine.model.onednn_row_counts == set(onednn_row_counts(4))
