"""Quantized weights through the model (issue 28): a tiny model quantized as it loads matches
the dense model built from the dequantized weights, on every CPU matmul path; the weight bytes
count the quantized form; the CPU paths against their reference product."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

import tandem.quant.linear as quant_linear
from tandem.engine.sampling import SampleResult, SampleRow, SamplingParams
from tandem.model.linear import onednn_bf16_available
from tandem.quant.linear import (
    INT4_PACKED_MAX_ROWS,
    TINYGEMM_MAX_ROWS,
    QuantLinear,
    QuantPath,
    Workspace,
    choose_path,
    int4_scale_zero,
    pack_quantized,
    quant_matmul,
    tinygemm_fits,
    tinygemm_inner_k_tiles,
    tinygemm_nibbles,
)
from tandem.quant.weight import (
    WeightScheme,
    fp8_reference_matmul,
    quantize,
    quantize_fp8,
    quantize_fp8_activations,
    unpack_int4,
)
from tests.conftest import make_engine

MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 32
# A prompt longer than the packed kernels' row limit: its prefill takes the dequantizing
# branch, its decode steps the packed kernel.
PROMPT = random.Random(0).choices(range(5, 500), k=INT4_PACKED_MAX_ROWS + 6)
STEPS = 6


class RecordingSampler:
    """Keeps every row's logits, in order, then samples as the engine's own."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
        self.logits += [row.float().clone() for row in logits]
        return self.inner(logits, rows)


def dequantized_copy(src: Path, dst: Path, scheme: WeightScheme) -> Path:
    """`src` with every layer matrix replaced by dequantize(quantize(.)), in float32: the
    dense model of exactly the weights an online-quantized load holds."""
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for name, t in tensors.items():
        if name.split(".")[-2] in MATRICES:
            tensors[name] = quantize(t.float(), scheme, GROUP).dequantize(torch.float32)
        else:
            tensors[name] = t.float()
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["torch_dtype"] = "float32"
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def fp8_activations_on_layer_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense model's layer matmuls (every matmul but lm_head's, whose output is the
    vocabulary) given fp8's per-token e4m3 activations: the dense reference of W8A8."""
    import tandem.model.llama as llama

    dense_matmul = llama.matmul

    def matmul(x: torch.Tensor, w: Any, kind: Any, bias: Any = None) -> torch.Tensor:
        if isinstance(w, torch.Tensor) and w.shape[-1] != VOCAB[0]:
            xq, sx = quantize_fp8_activations(x)
            x = (xq.float() * sx).to(x.dtype)
        return dense_matmul(x, w, kind, bias)

    monkeypatch.setattr(llama, "matmul", matmul)


VOCAB = [0]  # the tiny model's vocabulary size, set by the test


def run(model_dir: Path, **config: Any) -> tuple[list[int], list[torch.Tensor], Any]:
    engine = make_engine(model_dir, quantization_group_size=GROUP, **config)
    rec = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = rec
    [done] = engine.generate([PROMPT], SamplingParams(max_tokens=STEPS, temperature=0.0))
    return done.token_ids, rec.logits, engine


CASES = [
    # (scheme, dtype, the path its matrices take, tolerance on logits relative to their max)
    ("int8", "float32", QuantPath.DEQUANT, 1e-5),
    ("int4", "float32", QuantPath.DEQUANT, 1e-5),
    ("fp8", "float32", QuantPath.FP8_DECODED, 1e-5),
    ("int8", "bfloat16", QuantPath.INT8_PACKED, 0.05),
    ("int4", "bfloat16", QuantPath.INT4_PACKED, 0.05),
    # fp8 in bfloat16: both models' activations differ by bfloat16 rounding, and each
    # layer's e4m3 rounding of them turns a difference across a rounding boundary into a
    # whole e4m3 step (2^-3 of the value): 0.1 (float32 above: 1e-5, the same activations)
    ("fp8", "bfloat16", QuantPath.FP8_DECODED, 0.1),
]


@pytest.mark.parametrize(("scheme", "dtype", "path", "tol"), CASES)
def test_online_quantized_model_matches_its_dequantized_weights(
    tiny_model_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    scheme: str,
    dtype: str,
    path: QuantPath,
    tol: float,
) -> None:
    """float32: the dequantizing path is the reference itself (logits equal to float32
    rounding, greedy tokens identical). bfloat16: both models run in bfloat16 (the
    reference through oneDNN's dense path), so the gap is bfloat16 rounding of two different
    kernels over 2 layers: within 5% of the largest logit. fp8 is W8A8: the reference's
    layer matmuls get the same per-token e4m3 activations (without them, float32 logits
    differ by ~1e-2 of their largest: the activations' rounding is in the scheme)."""
    if dtype == "bfloat16" and not onednn_bf16_available():
        pytest.skip("this CPU does not run bfloat16 natively (no packed bf16 paths)")
    ref_dir = dequantized_copy(tiny_model_dir, tmp_path / "dequantized", WeightScheme(scheme))
    tokens, logits, engine = run(tiny_model_dir, dtype=dtype, quantization=scheme)
    if scheme == "fp8":
        VOCAB[0] = engine.model.config.vocab_size
        fp8_activations_on_layer_matmuls(monkeypatch)
    ref_tokens, ref_logits, _ = run(ref_dir, dtype=dtype)
    layer = engine.model.weights.layers[0]
    assert all(isinstance(w, QuantLinear) and w.path is path for w in layer.matrices())
    assert isinstance(engine.model.weights.lm_head, torch.Tensor)  # stays dense
    assert len(logits) == len(ref_logits) == STEPS
    if dtype == "float32":
        assert tokens == ref_tokens
    for got, ref in zip(logits, ref_logits, strict=True):
        assert (got - ref).abs().max().item() <= tol * ref.abs().max().item()


def test_weight_bytes_count_the_quantized_form(tiny_model_dir: Path) -> None:
    dense = make_engine(tiny_model_dir, dtype="float32")
    quant = make_engine(tiny_model_dir, dtype="float32", quantization="int8")
    cfg = dense.model.config
    per_layer = sum(
        (o * i) for o, i in (
            ((cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim, cfg.hidden_size),
            (cfg.hidden_size, cfg.num_q_heads * cfg.head_dim),
            (2 * cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.intermediate_size),
        )
    )  # fmt: skip
    out_rows = (cfg.num_q_heads + 2 * cfg.num_kv_heads) * cfg.head_dim + cfg.hidden_size * 2
    out_rows += 2 * cfg.intermediate_size
    # fp32 matrices (4 bytes each) become int8 values (1 byte) plus an fp32 scale per row
    saved = cfg.num_layers * (per_layer * 3 - out_rows * 4)
    assert dense.weight_bytes - quant.weight_bytes == saved
    assert quant.weight_bytes == quant.model.weights.num_bytes()


@pytest.mark.parametrize("scheme", ["int4", "int8"])
@pytest.mark.parametrize("rows", [1, 3, INT4_PACKED_MAX_ROWS + 1, 200])
def test_packed_cpu_paths_match_the_reference_product(scheme: str, rows: int) -> None:
    """bfloat16 activations through the packed kernel (few rows) or the dequantizing branch
    (many): within bfloat16 rounding (2^-7 of the largest output, plus the bias's) of the
    float32 product of the same bf16 inputs with the reference dequantization."""
    if not onednn_bf16_available():
        pytest.skip("this CPU does not run bfloat16 natively")
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(192, 96, generator=g) * 0.05
    qw = quantize(w, WeightScheme(scheme), GROUP)
    ql = pack_quantized(qw, torch.bfloat16, Workspace())
    assert ql.path is (QuantPath.INT4_PACKED if scheme == "int4" else QuantPath.INT8_PACKED)
    x = torch.randn(rows, 96, generator=g).bfloat16()
    bias = torch.randn(192, generator=g).bfloat16()
    ref = x.float() @ qw.dequantize().t() + bias.float()
    got = quant_matmul(x, ql, bias)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 192)
    assert (got.float() - ref).abs().max().item() <= 2**-6 * ref.abs().max().item()


def test_int4_with_g_idx_or_odd_rows_takes_the_dequantizing_path() -> None:
    w = torch.randn(96, 64)
    qw = quantize(w, WeightScheme.INT4, GROUP)
    assert pack_quantized(qw, torch.bfloat16, Workspace()).path is QuantPath.DEQUANT  # 96 rows
    with pytest.raises(ValueError, match="int4_packed needs"):
        pack_quantized(qw, torch.bfloat16, Workspace(), QuantPath.INT4_PACKED)


def test_generate_serves_a_quantized_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    """`tandem generate --quantization int8` (flags as a user passes them): the same greedy
    tokens as the dense model of its dequantized weights, in float32."""
    import subprocess
    import sys

    def generate(model: Path, *flags: str) -> list[int]:
        res = subprocess.run(
            [sys.executable, "-m", "tandem.services.cli", "generate", "--model", str(model),
             "--dtype", "float32", "--max-tokens", "6", "--ignore-eos", "--token-ids",
             *flags, "hello"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        return [int(t) for t in res.stdout.split()]

    ref = dequantized_copy(tiny_model_dir, tmp_path / "dequantized", WeightScheme.INT8)
    got = generate(tiny_model_dir, "--quantization", "int8", "--quantization-group-size", "32")
    assert len(got) == 6 and got == generate(ref)


def test_worker_metrics_report_the_weight_bytes() -> None:
    from tandem.services.common.observe.metrics import WorkerMetrics

    metrics = WorkerMetrics("decode")
    metrics.weights(179_671_680, "int4")
    got = metrics.registry.get_sample_value(
        "tandem_worker_weight_bytes", {"role": "decode", "quantization": "int4"}
    )
    assert got == 179_671_680


@pytest.mark.parametrize(
    ("fmt", "scheme"),
    [("awq-g32", "int4"), ("gptq-g32-act-order", "int4"), ("gptq-8bit", "int8"),
     ("fp8-per-tensor", "fp8")],
)  # fmt: skip
def test_a_quantized_checkpoint_is_kept_as_stored(
    hf_model: Any, tmp_path: Path, fmt: str, scheme: str
) -> None:
    """--quantization of the checkpoint's scheme: each layer matrix stays the checkpoint's
    integers (its dequantization equals the dense weights the checkpoint stands for, exactly;
    q/k/v and gate/up concatenated by rows; fp8 per-tensor scales repeated per row)."""
    from tandem.weights.loader import load_model
    from tests.unit.test_quant_checkpoints import write_quantized_checkpoint

    src, _ = hf_model("llama")
    dst = tmp_path / "model"
    _, dense = write_quantized_checkpoint(src, dst, fmt)

    model = load_model(dst, quantization=scheme, quantization_group_size=32)
    for i, lw in enumerate(model.weights.layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        want = (
            torch.cat([dense[attn + f"{x}_proj.weight"] for x in "qkv"]),
            dense[attn + "o_proj.weight"],
            torch.cat([dense[mlp + f"{x}_proj.weight"] for x in ("gate", "up")]),
            dense[mlp + "down_proj.weight"],
        )
        for j, (w, ref) in enumerate(zip(lw.matrices(), want, strict=True)):
            if fmt == "gptq-g32-act-order" and j in (0, 2):
                # q/k/v and gate/up: a g_idx per projection, which one matrix cannot hold:
                # kept dense (dequantized, [in, out]) rather than rounded twice
                assert isinstance(w, torch.Tensor)
                torch.testing.assert_close(w, ref.t(), atol=0, rtol=0)
                continue
            assert isinstance(w, QuantLinear) and w.weight is not None
            assert w.weight.scheme is WeightScheme(scheme)
            torch.testing.assert_close(w.weight.dequantize(), ref, atol=0, rtol=0)


@pytest.mark.parametrize("max_rows", [256, 2])
@pytest.mark.parametrize("scheme", ["int4", "int8", "fp8"])
def test_the_triton_path_matches_the_reference_under_the_interpreter(
    scheme: str, max_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDA's path (tandem.kernels.quant_matmul.quantized_linear) dispatched by quant_matmul, run by
    Triton's interpreter on the CPU (tests/conftest.py sets TRITON_INTERPRET=1); with more
    rows than TRITON_MAX_ROWS (2 here) its dequantize-then-GEMM branch, which must not call
    the kernel."""
    pytest.importorskip("triton")
    import tandem.kernels.quant_matmul
    import tandem.quant.linear as quant_linear

    monkeypatch.setattr(quant_linear, "TRITON_MAX_ROWS", max_rows)
    if max_rows < 3:
        monkeypatch.setattr(tandem.kernels.quant_matmul, "quantized_linear", None)  # not called
    g = torch.Generator().manual_seed(3)
    qw = quantize(torch.randn(64, 64, generator=g) * 0.05, WeightScheme(scheme), GROUP)
    ql = pack_quantized(qw, torch.float32, Workspace(), QuantPath.TRITON)
    x = torch.randn(3, 64, generator=g)
    bias = torch.randn(64, generator=g)
    if scheme == "fp8":  # W8A8: the per-token e4m3 activations
        ref = fp8_reference_matmul(x, qw) + bias
    else:
        ref = x @ qw.dequantize().t() + bias
    torch.testing.assert_close(quant_matmul(x, ql, bias), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize(
    ("path", "dtype", "kernel_rows"),
    [(QuantPath.FP8_DECODED, torch.float32, 0), (QuantPath.FP8_DECODED, torch.bfloat16, 0),
     (QuantPath.FP8_SCALED_MM, torch.bfloat16, 0), (QuantPath.FP8_SCALED_MM, torch.bfloat16, 16),
     (QuantPath.TRITON, torch.bfloat16, 0), (QuantPath.DEQUANT, torch.float32, 0)],
)  # fmt: skip
def test_fp8_paths_quantize_the_activations_per_token(
    path: QuantPath,
    dtype: torch.dtype,
    kernel_rows: int,
    per_tensor: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every fp8 path computes the W8A8 product of `fp8_reference_matmul`: float32 to float32
    rounding; bfloat16 within its rounding of the output (2^-7 of the largest, the bias's
    included). fp8_scaled_mm is CUDA's (torch._scaled_mm, row-wise scales) run by torch's CPU
    implementation of the same op, or, up to FP8_TRITON_MAX_ROWS (`kernel_rows`), the Triton
    W8A8 kernel under the interpreter, as is the triton path. Rows of very different sizes: a
    per-tensor activation scale (or none) would miss by far more on the small row, which is
    what fails here if a path drops the activation quantization or takes one scale for the
    whole batch."""
    monkeypatch.setattr(quant_linear, "FP8_TRITON_MAX_ROWS", kernel_rows)
    if path is QuantPath.FP8_SCALED_MM and kernel_rows == 0:
        monkeypatch.setattr("tandem.kernels.quant_matmul.quantized_linear", None)  # not called
    g = torch.Generator().manual_seed(5)
    qw = quantize_fp8(torch.randn(48, 96, generator=g) * 0.05, per_tensor=per_tensor)
    x = torch.randn(4, 96, generator=g) * torch.tensor([[1.0], [1e-3], [30.0], [0.2]])
    x = x.to(dtype)
    ql = pack_quantized(qw, dtype, Workspace(), path)
    got = quant_matmul(x, ql).float()
    ref = fp8_reference_matmul(x.float(), qw)
    unquantized = x.float() @ qw.dequantize().t()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for row in range(4):  # each row against its own size: the small row is checked too
        scale = ref[row].abs().max().item()
        assert (got[row] - ref[row]).abs().max().item() <= tol * scale
        # the activations' e4m3 rounding is visible: the check above could tell it apart
        assert (unquantized[row] - ref[row]).abs().max().item() > 2 * tol * scale
    bias = torch.randn(48, generator=g).to(dtype)
    with_bias = quant_matmul(x, ql, bias).float()
    assert (with_bias - (got + bias.float())).abs().max().item() <= tol * with_bias.abs().max()


def test_int4_scale_zero_is_torchs_affine_form_of_the_weight() -> None:
    """torch's int4 kernels (CPU and CUDA) compute (q - 8) * scale + zero per group: with the
    floats int4_scale_zero builds, that is the weight's own dequantization, zero points or
    not."""
    g = torch.Generator().manual_seed(8)
    for zero_point in (True, False):
        qw = quantize(torch.randn(16, 64, generator=g), WeightScheme.INT4, GROUP)
        if not zero_point:
            qw = dataclasses.replace(qw, zeros=None)  # zero point 8
        sz = int4_scale_zero(qw, torch.float32)  # [in // group, out, 2]
        assert sz.shape == (64 // GROUP, 16, 2)
        q = unpack_int4(qw.qweight).float()  # [out, in]
        scale = sz[..., 0].t().repeat_interleave(GROUP, dim=1)  # [out, in]
        zero = sz[..., 1].t().repeat_interleave(GROUP, dim=1)
        torch.testing.assert_close((q - 8) * scale + zero, qw.dequantize(), atol=1e-6, rtol=0)


def test_tinygemm_nibbles_put_the_even_input_high() -> None:
    """`_convert_weight_to_int4pack` reads input 2j from the high nibble; ours is low."""
    q = torch.tensor([[1, 2, 3, 4], [15, 0, 7, 9]], dtype=torch.uint8)  # [out, in]
    ours = (q[:, 0::2] | q[:, 1::2] << 4).contiguous()
    torch.testing.assert_close(unpack_int4(ours), q, atol=0, rtol=0)
    got = tinygemm_nibbles(ours)
    assert got.dtype == torch.uint8 and got.is_contiguous()
    assert got.tolist() == [[0x12, 0x34], [0xF0, 0x79]]


def test_tinygemm_takes_what_its_layout_can_hold() -> None:
    """CUDA's choice for int4 with bfloat16 activations: tinygemm where its layout holds the
    matrix (8-output tiles, a group size it knows, which makes whole pairs of 16-input k
    tiles, no g_idx), the Triton kernels otherwise; the k tiles packed together are the most
    that divide the inputs."""
    cuda = torch.device("cuda")  # choose_path only reads the device type for int4
    g = torch.Generator().manual_seed(9)

    def int4(out: int, inp: int, group: int = GROUP) -> Any:
        return quantize(torch.randn(out, inp, generator=g), WeightScheme.INT4, group)

    assert choose_path(int4(64, 128), cuda, torch.bfloat16) is QuantPath.INT4_TINYGEMM
    assert tinygemm_fits(int4(8, 32), torch.bfloat16)
    assert not tinygemm_fits(int4(12, 64), torch.bfloat16)  # outputs not whole 8-row tiles
    assert tinygemm_fits(int4(64, 96), torch.bfloat16)  # three pairs of k tiles
    act_order = dataclasses.replace(
        int4(64, 128), g_idx=torch.arange(128, dtype=torch.int32).flip(0) // GROUP
    )
    assert not tinygemm_fits(act_order, torch.bfloat16)  # groups out of input order
    assert not tinygemm_fits(int4(64, 128), torch.float16)  # tinygemm is bfloat16 only
    assert choose_path(int4(64, 128), cuda, torch.float16) in (QuantPath.TRITON, QuantPath.DEQUANT)
    with pytest.raises(ValueError, match="int4_tinygemm needs"):
        pack_quantized(int4(12, 64), torch.bfloat16, Workspace(), QuantPath.INT4_TINYGEMM)
    assert [tinygemm_inner_k_tiles(k) for k in (32, 64, 96, 128, 4096, 14336)] == [2, 4, 2, 8, 8, 8]


def test_tinygemm_rows_above_its_limit_dequantize() -> None:
    """Above TINYGEMM_MAX_ROWS the int4_tinygemm path never calls torch's kernel (a CUDA op:
    `packed` is None here, so a call would fail): one dequantization and one GEMM, the
    reference product."""
    g = torch.Generator().manual_seed(10)
    qw = quantize(torch.randn(64, 128, generator=g) * 0.05, WeightScheme.INT4, GROUP)
    sz = int4_scale_zero(qw, torch.bfloat16)
    ql = QuantLinear(qw.scheme, QuantPath.INT4_TINYGEMM, 64, 128, qw, None, sz, GROUP, Workspace())
    x = torch.randn(TINYGEMM_MAX_ROWS + 1, 128, generator=g)
    torch.testing.assert_close(quant_matmul(x, ql), x @ qw.dequantize().t(), atol=1e-5, rtol=1e-5)
