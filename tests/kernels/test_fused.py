"""The fused element-wise kernels (tandem.kernels.fused) against the torch ops the model runs
without them (`rms_norm`, `apply_rotary`, `F.silu(gate) * up`), under Triton's interpreter.

float32: equal to float32 rounding (the RMSNorm's sum of squares runs in another order).
float16: within one unit in the last place of the output. bfloat16: within a few units, since
the interpreter rounds fp32 -> bf16 toward zero where a GPU (and torch) round to nearest, at
every rounding an output goes through."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.fused import add_rms_norm, rope, silu_mul
from tandem.model.llama import rms_norm
from tandem.model.rope import apply_rotary
from tests.kernels.compile_check import assert_lowers

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_within_ulp(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32: 1e-6 relative; float16: one unit in the last place of `want`; bfloat16: two
    units relative, plus two of the tensor's largest value (the interpreter's truncating
    casts compound where a sum cancels its rounded terms). A wrong half, sign, weight or
    scale is off by the value itself."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    elif want.dtype == torch.float16:
        wf = want.float()
        ulp = torch.exp2(torch.floor(torch.log2(wf.abs().clamp_min(1e-30))) - 10)
        assert bool(((got.float() - wf).abs() <= ulp * 1.0001 + 2**-24).all())
    else:
        scale = want.float().abs().max().item()
        torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_y", [True, False])
def test_add_rms_norm_is_the_residual_add_then_rms_norm(dtype: torch.dtype, with_y: bool) -> None:
    """h += y in place (exactly torch's add), then rms_norm of the sum; a hidden size that
    is not a power of two masks its tail."""
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(5, 96, generator=g) * 3).to(dtype)
    y = torch.randn(5, 96, generator=g).to(dtype) if with_y else None
    w = (torch.rand(96, generator=g) + 0.5).to(dtype)
    want_h = h + y if y is not None else h.clone()
    want = rms_norm(want_h, w, 1e-5)
    got = add_rms_norm(h, y, w, 1e-5)
    assert_within_ulp(h, want_h)  # the residual stream, updated in place
    assert_within_ulp(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_rotates_q_and_k_heads_like_apply_rotary(dtype: torch.dtype) -> None:
    """A strided qk view (the qkv GEMM's output: v's columns beside), 6 heads (padded to 8),
    tables of real positions."""
    from tandem.model.config import Features
    from tandem.model.rope import RotaryEmbedding

    g = torch.Generator().manual_seed(2)
    n, heads, head_dim = 4, 6, 16
    qkv = torch.randn(n, (heads + 2) * head_dim, generator=g).to(dtype)
    qk = qkv[:, : heads * head_dim].view(n, heads, head_dim)
    cfg = type("Cfg", (), {"head_dim": head_dim, "rope_theta": 10000.0, "rope_scaling": None,
                           "features": Features()})  # fmt: skip
    table = RotaryEmbedding(cfg, 64, torch.device("cpu"))  # type: ignore[arg-type]
    cos, sin = table.tables(torch.tensor([0, 5, 17, 63]), dtype)
    got = rope(qk, cos, sin)
    assert got.is_contiguous()
    assert_within_ulp(got, apply_rotary(qk, cos, sin))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_is_silu_of_gate_times_up(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(3, 2 * 80, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    got = silu_mul(gate_up)
    want = F.silu(gate) * up
    if dtype == torch.float32:  # exp on another path than torch's: a few float32 ulps
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    else:
        assert_within_ulp(got, want)


def test_empty_and_misshapen_inputs() -> None:
    h = torch.zeros(0, 8)
    assert add_rms_norm(h, None, torch.ones(8), 1e-5).shape == (0, 8)
    with pytest.raises(ValueError, match="weight must be"):
        add_rms_norm(torch.zeros(2, 8), None, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="power of two"):
        rope(torch.zeros(1, 2, 12), torch.zeros(1, 1, 12), torch.zeros(1, 1, 12))
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.zeros(2, 7))


LOWER_SCRIPT = """
from tandem.kernels.fused import _add_rms_norm_kernel, _rope_kernel, _silu_mul_kernel
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

def build(kernel, types, constants, warps, name):
    signature = {
        a: "constexpr" if a in constants else types.get(a, "i32") for a in kernel.arg_names
    }
    names = [a for a in kernel.arg_names if a.endswith("_ptr")]
    compiled = compile_sm90(
        kernel, signature, constants, aligned_attrs(kernel, names), num_warps=warps,
        enable_fp_fusion=False,
    )
    registers, spills = ptxas_usage(compiled.asm["ptx"])
    assert spills == 0, (name, registers, spills)
    print(name, registers, "registers ok")

for x in ("bf16", "fp16"):
    ptrs = dict(h_ptr="*" + x, y_ptr="*" + x, w_ptr="*" + x, out_ptr="*" + x, eps="fp32")
    build(_add_rms_norm_kernel, ptrs, dict(HAS_Y=True, BLOCK=4096), 8, "add_rms_norm " + x)
    ptrs = dict(x_ptr="*" + x, cos_ptr="*" + x, sin_ptr="*" + x, out_ptr="*" + x)
    build(_rope_kernel, ptrs, dict(HALF=64, BLOCK_H=64), 8, "rope " + x)
    ptrs = dict(gu_ptr="*" + x, out_ptr="*" + x)
    build(_silu_mul_kernel, ptrs, dict(BLOCK=1024), 4, "silu_mul " + x)
"""


def test_lowers_for_sm90() -> None:
    """Compiles for an H100/H200 (Llama-3-8B's widths) without spills."""
    assert_lowers(LOWER_SCRIPT, 6)


def test_the_model_with_the_fused_kernels_gives_the_same_tokens(  # type: ignore[no-untyped-def]
    tiny_model_dir, engine_factory, monkeypatch
) -> None:
    """The CUDA arrangement (Triton attention, `triton_ops` on) run on a CPU through the
    interpreter: greedy tokens in float32 equal the torch element-wise ops', with prefills
    and decode steps, and every fused kernel ran."""
    from tandem.engine.sampling import SamplingParams
    from tandem.kernels import fused

    calls = {"add_rms_norm": 0, "rope": 0, "silu_mul": 0}
    for name in calls:
        real = getattr(fused, name)

        def counted(*args, _real=real, _name=name, **kwargs):  # type: ignore[no-untyped-def]
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(fused, name, counted)
    prompts = [list(range(5, 25)), [9, 8, 7]]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = {}
    for on in (False, True):
        engine = engine_factory(
            tiny_model_dir, block_size=16, num_blocks=8, attention_backend="triton"
        )
        assert engine.model.triton_ops is False  # a CPU engine keeps the torch ops
        engine.model.triton_ops = on
        tokens[on] = [c.token_ids for c in engine.generate(prompts, params)]
    assert tokens[True] == tokens[False]
    layers = len(engine.model.weights.layers)
    assert calls["silu_mul"] >= 2 * layers and calls["rope"] >= 2 * layers
    assert calls["add_rms_norm"] >= 2 * (2 * layers + 1)


def test_the_fused_kernels_follow_the_attention_backend() -> None:
    """CUDA with the Triton backend only: where the GPU check (or a user) falls back to the
    torch backend because Triton cannot launch, the model must not launch Triton kernels."""
    from tandem.model.attention import TorchAttention
    from tandem.model.llama import triton_ops_for
    from tandem.model.triton_attention import TritonAttention

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_ops_for(cuda, TritonAttention()) is True
    assert triton_ops_for(cuda, TorchAttention()) is False
    assert triton_ops_for(cpu, TritonAttention()) is False
