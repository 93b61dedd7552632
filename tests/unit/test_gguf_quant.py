"""GGUF matrices kept quantized (issue 28): Q8_0 -> int8, Q4_0/Q4_1 -> int4 group 32, equal to
their dequantization (Q8_0: within its per-channel requantization's half step), through a
file and through a converted model that keeps its GGUF."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tandem.engine.sampling import SamplingParams
from tandem.quant.gguf import GGUF_FILE, quantized_tensor
from tandem.quant.linear import QuantLinear
from tandem.quant.weight import WeightScheme
from tandem.weights.fetch import convert_gguf_file
from tandem.weights.gguf import dequantize
from tests.conftest import make_engine
from tests.unit.test_gguf import _write_gguf

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("qtype", [QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_blocks_become_quantized_weights_equal_to_their_dequantization(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    data = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block (scale 0)
    data[1, 32:64] = 0.25  # a constant block (Q4_1: scale 0, offset 0.25)
    packed = gguf.quants.quantize(data, qtype)
    ref = dequantize(packed, qtype, data.shape)
    qw = quantized_tensor(packed, qtype, (6, 128))
    got = qw.dequantize(torch.float32)
    if qtype == QT.Q8_0:
        # one scale per row now: each value within half a step of its row's scale
        assert qw.scheme is WeightScheme.INT8
        step = ref.abs().amax(dim=1, keepdim=True) / 127
        assert ((got - ref).abs() <= step / 2 + 1e-6).all()
    elif qtype == QT.Q4_0:
        assert (qw.scheme, qw.group_size, qw.zeros) == (WeightScheme.INT4, 32, None)
        assert torch.equal(got, ref)
    else:
        assert qw.zeros is not None and qw.zeros.dtype == torch.float32
        torch.testing.assert_close(got, ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


@pytest.mark.parametrize(("qtype", "scheme"), [(QT.Q4_1, "int4"), (QT.Q4_0, "int4"),
                                               (QT.Q8_0, "int8")])  # fmt: skip
def test_a_converted_gguf_serves_its_matrices_as_stored(
    tiny_model_dir: Path, tmp_path: Path, qtype: QT, scheme: str
) -> None:
    """The converted directory keeps its GGUF; with --quantization of its scheme the layer
    matrices come from the GGUF's blocks (in float32, the same weights as the dequantized
    model: logits equal to float32 rounding, Q8_0 within its requantization), without it the
    dequantized safetensors serve as before."""
    path = tmp_path / "tiny.gguf"
    _write_gguf(tiny_model_dir, path, qtype)
    converted = convert_gguf_file(path, tmp_path / "cache", progress=lambda _: None)
    assert (converted / GGUF_FILE).is_file()
    dense = make_engine(converted)
    kept = make_engine(converted, quantization=scheme, quantization_group_size=32)
    for lw in kept.model.weights.layers:
        assert all(isinstance(w, QuantLinear) for w in lw.matrices())
        assert all(w.weight is not None and w.weight.group_size in (32, w.in_features)
                   for w in lw.matrices())  # fmt: skip
    assert kept.weight_bytes < dense.weight_bytes
    prompts = ["The quick brown fox", [5, 6, 7, 8, 9]]
    want = [o.token_ids for o in dense.generate(prompts, GREEDY)]
    got = [o.token_ids for o in kept.generate(prompts, GREEDY)]
    if qtype != QT.Q8_0:
        assert got == want


@pytest.mark.parametrize("qtype", [QT.Q4_0, QT.Q4_1])
def test_q4_blocks_equal_gguf_pys_dequantization_per_element(qtype: QT) -> None:
    """Against gguf-py's own dequantization (llama.cpp's rule, not ours): Q4_0 bitwise
    (scale d, zero 8: (q - 8) * d is the same float32 product); Q4_1 within float32 rounding
    of its zero point -m / d, per element |got - ref| <= 2^-21 * (|m| + 16 |d|) of that
    block. Values span every nibble in every position (random, 6 rows x 8 blocks), so a
    nibble re-pairing bug (GGUF's byte j holds elements j and j + 16, ours 2j and 2j + 1)
    moves values by multiples of d, as does a zero point of the wrong sign (+m / d) or not
    divided by d (off by about |m|), a scale read from the offset's bytes, or rows and blocks
    transposed: each fails here by orders of magnitude more than the tolerance."""
    rng = np.random.default_rng(100 + int(qtype))
    data = rng.standard_normal((6, 256)).astype(np.float32) * rng.uniform(0.01, 10, (6, 1))
    data[2] += 3.0  # blocks far from zero: Q4_1's offset m dominates, its zero point is large
    packed = gguf.quants.quantize(data.astype(np.float32), qtype)
    ref = torch.from_numpy(gguf.quants.dequantize(packed, qtype).copy()).reshape(6, 256)
    qw = quantized_tensor(packed, qtype, (6, 256))
    assert (qw.scheme, qw.group_size, qw.g_idx) == (WeightScheme.INT4, 32, None)
    got = qw.dequantize(torch.float32)
    if qtype == QT.Q4_0:
        assert qw.zeros is None
        assert torch.equal(got, ref)
        return
    blocks = np.ascontiguousarray(packed).view(np.uint8).reshape(6, 8, 20)
    d = torch.from_numpy(blocks[..., 0:2].copy().view("<f2")[..., 0].astype(np.float32))
    m = torch.from_numpy(blocks[..., 2:4].copy().view("<f2")[..., 0].astype(np.float32))
    bound = (2.0**-21 * (m.abs() + 16 * d.abs())).repeat_interleave(32, dim=1)
    assert ((got - ref).abs() <= bound).all()
    assert torch.equal(qw.scales, d)  # the GGUF's own scales, not recomputed


def test_int4_keeps_q4_1_blocks_whatever_the_group_size_asked(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """`--quantization int4` with the default group size (64) or 128 on a converted Q4_1
    GGUF: every layer matrix is the GGUF's own blocks (group 32), never requantized with the
    asked groups: its dequantization equals gguf-py's dequantization of the stored blocks
    (rows in HF order, q/k/v and gate/up concatenated), and the log says so."""
    import logging

    from tandem.weights.loader import load_model
    from tests.unit.test_gguf import _write_gguf

    path = tmp_path / "tiny.gguf"
    stored = _write_gguf(tiny_model_dir, path, QT.Q4_1)
    converted = convert_gguf_file(path, tmp_path / "cache", progress=lambda _: None)
    for group in (64, 128):
        with caplog.at_level(logging.INFO, logger="tandem.quant.gguf"):
            model = load_model(converted, quantization="int4", quantization_group_size=group)
        assert any(
            "served from model.gguf's own Q4_1 blocks" in r.getMessage() for r in caplog.records
        )
        caplog.clear()
        for i, lw in enumerate(model.weights.layers):
            attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            want = (
                torch.cat([stored[attn + f"{x}_proj.weight"] for x in "qkv"]),
                stored[attn + "o_proj.weight"],
                torch.cat([stored[mlp + f"{x}_proj.weight"] for x in ("gate", "up")]),
                stored[mlp + "down_proj.weight"],
            )
            for w, ref in zip(lw.matrices(), want, strict=True):
                assert isinstance(w, QuantLinear) and w.weight is not None
                assert w.weight.group_size == 32
                got = w.weight.dequantize(torch.float32)
                torch.testing.assert_close(got, ref, atol=1e-6 * ref.abs().max().item(), rtol=0)


def test_a_converted_gguf_without_its_gguf_warns_of_double_rounding(
    tiny_model_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A directory converted before model.gguf was kept: int4 quantizes the dequantized
    weights again, which the log names (not silently)."""
    import logging

    from tandem.weights.loader import load_model

    path = tmp_path / "tiny.gguf"
    _write_gguf(tiny_model_dir, path, QT.Q4_1)
    converted = convert_gguf_file(path, tmp_path / "cache", progress=lambda _: None)
    (converted / GGUF_FILE).unlink()
    with caplog.at_level(logging.WARNING, logger="tandem.quant.gguf"):
        load_model(converted, quantization="int4", quantization_group_size=32)
    assert any("rounding them twice" in r.getMessage() for r in caplog.records)
