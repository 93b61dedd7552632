"""tandem/model/linear.py: the matmul chosen per device and dtype, oneDNN's prepacked bf16
path against the plain product, and dtype "auto" on a CPU."""

from __future__ import annotations

import pytest
import torch

import tandem.config
from services.up.config import cpu_threads_per_worker
from tandem.config import EngineConfig
from tandem.model.linear import (
    GatedPair,
    MatmulKind,
    choose_matmul,
    matmul,
    onednn_bf16_available,
    pack,
    pack_gated,
    swiglu,
)

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
    """A request's numbers do not change with who shares its step: each row of a batch of
    64 is bitwise the row computed alone or in smaller batches (disaggregated and colocated
    serving then agree token for token)."""
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(576, 3072, generator=g) * 0.05).bfloat16()
    packed, gated = pack(w, MatmulKind.ONEDNN), pack_gated(w, MatmulKind.ONEDNN)
    x = torch.randn(300, 576, generator=g).bfloat16()
    full = matmul(x, packed, MatmulKind.ONEDNN)
    full_mlp = swiglu(x, gated, MatmulKind.ONEDNN)
    # decode batches, the sizes where other layouts switch kernels (8-32), prefill chunks
    for m in (1, 2, 3, 8, 16, 17, 32, 33, 64, 256):
        rows = x[:m].contiguous()
        assert torch.equal(matmul(rows, packed, MatmulKind.ONEDNN), full[:m])
        assert torch.equal(swiglu(rows, gated, MatmulKind.ONEDNN), full_mlp[:m])
    # a chunk in the middle of a step (decode rows before it)
    assert torch.equal(swiglu(x[37:300].contiguous(), gated, MatmulKind.ONEDNN), full_mlp[37:])


@pytest.mark.parametrize("kind", [MatmulKind.PLAIN, MatmulKind.ONEDNN])
def test_swiglu_is_silu_of_the_gate_times_the_up_product(kind: MatmulKind) -> None:
    """gate/up [in, 2 * inter], gate columns first. oneDNN fuses the SiLU and the multiply
    into its products (each rounded once to bf16), within 2 bf16 ulps of the float32
    reference; the plain path is the three torch ops exactly."""
    if kind is MatmulKind.ONEDNN and not onednn_bf16_available():
        pytest.skip("this CPU does not run bfloat16 natively")
    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if kind is MatmulKind.ONEDNN else torch.float32
    w = (torch.randn(96, 2 * 80, generator=g) * 0.2).to(dtype)
    x = torch.randn(5, 96, generator=g).to(dtype)
    packed = pack_gated(w, kind)
    assert isinstance(packed, GatedPair) == (kind is MatmulKind.ONEDNN)
    got = swiglu(x, packed, kind)
    assert got.dtype == dtype and got.shape == (5, 80)
    gate, up = x.float() @ w[:, :80].float(), x.float() @ w[:, 80:].float()
    ref = torch.nn.functional.silu(gate) * up
    if kind is MatmulKind.PLAIN:
        full_gate, full_up = (x @ w).chunk(2, dim=-1)
        assert torch.equal(got, torch.nn.functional.silu(full_gate) * full_up)
    else:
        assert (got.float() - ref).abs().max().item() <= 2 * 2**-7 * ref.abs().max().item()
        # the halves are not swapped: up's SiLU times gate is far off
        swapped = torch.nn.functional.silu(up) * gate
        assert (got.float() - swapped).abs().max().item() > 0.1 * ref.abs().max().item()


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
