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
from tandem.model.fetch import convert_gguf_file
from tandem.model.gguf import dequantize
from tandem.model.gguf_quant import GGUF_FILE, quantized_tensor
from tandem.model.quant import WeightScheme
from tandem.model.quant_linear import QuantLinear
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
