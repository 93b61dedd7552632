"""Which attention backend an engine runs: Triton's paged kernels on CUDA, torch ops on a
CPU, either one when forced."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.model.attention import TorchAttention
from tandem.model.triton_attention import TritonAttention, make_attention


@pytest.mark.parametrize(
    ("name", "device", "expected"),
    [
        ("auto", "cpu", TorchAttention),
        ("auto", "cuda", TritonAttention),
        ("auto", "cuda:1", TritonAttention),
        ("torch", "cuda", TorchAttention),
        ("triton", "cpu", TritonAttention),
    ],
)
def test_backend_choice(name: str, device: str, expected: type) -> None:
    backend = make_attention(name, device)
    assert type(backend) is expected
    assert backend.needs_paged_batch is (expected is TritonAttention)


def test_cpu_backends_choose_their_decode_path() -> None:
    """auto and native on a CPU decode through the native kernel (a C compiler is here);
    torch never does; native refuses a CUDA device."""
    assert make_attention("auto", "cpu").decode_kernel is not None
    assert make_attention("native", "cpu").decode_kernel is not None
    assert make_attention("torch", "cpu").decode_kernel is None
    with pytest.raises(ValueError, match="the CPU kernel is unavailable"):
        make_attention("native", "cuda")


def test_unknown_backend_is_refused() -> None:
    with pytest.raises(
        ValueError, match="attention_backend must be auto, torch, native or triton"
    ):
        make_attention("flash", "cpu")
    with pytest.raises(ValueError, match="got 'flash'"):
        EngineConfig("m", attention_backend="flash")


def test_whole_model_through_triton_matches_torch(tiny_model_dir, engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The tiny model end to end with the Triton backend (on a CPU: Triton's interpreter)
    gives TorchAttention's greedy tokens and logprobs: decode rows of ragged contexts, a
    chunked prefill, and a prefill over a cached prefix (the second request shares the
    first's leading blocks)."""
    from tandem.engine.sampling import SamplingParams

    prefix = list(range(5, 53))  # 3 blocks of 16
    prompts = [prefix + [60, 61, 62], prefix + [70], list(range(100, 121)), [7]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    results = {}
    for backend in ("torch", "triton"):
        engine = engine_factory(
            tiny_model_dir,
            block_size=16,
            num_blocks=32,
            max_num_batched_tokens=40,  # the 51-token prompt is prefilled in two chunks
            attention_backend=backend,
        )
        first = engine.generate(prompts[:1], params)  # caches the shared prefix
        rest = engine.generate(prompts[1:], params)
        assert rest[0].num_cached_tokens == 48
        results[backend] = first + rest
    for want, got in zip(results["torch"], results["triton"], strict=True):
        assert got.token_ids == want.token_ids
        for (lp_want, _), (lp_got, _) in zip(want.logprobs, got.logprobs, strict=True):
            assert lp_got == pytest.approx(lp_want, abs=1e-4)


def test_engine_sized_by_memory_profiles_warms_up_and_serves_through_triton(  # type: ignore[no-untyped-def]
    tiny_model_dir, engine_factory, monkeypatch
) -> None:
    """An engine built as a GPU worker is (no block count; the cache sized by a memory
    budget, here CPU's kv_cache_bytes) runs the GPU sizing path's profile steps through the
    Triton kernels, warms up and serves the torch backend's tokens. The profile is reached
    through `profile._profile_peak_bytes` with CUDA's memory counters faked, as
    `profile.size_kv_cache` calls it on a GPU. Before the profile built the Triton backend's
    paged metadata, this failed in TritonAttention.forward ("the runner builds
    AttentionMetadata.paged")."""
    import torch

    from tandem.engine.profile import _profile_peak_bytes
    from tandem.engine.sampling import SamplingParams

    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, **kwargs: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *args, **kwargs: 1 << 30)
    prompts = [list(range(5, 40)), [7, 8, 9]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = {}
    for backend in ("torch", "triton"):
        engine = engine_factory(
            tiny_model_dir,
            block_size=16,
            num_blocks=None,
            kv_cache_bytes=1 << 20,
            max_model_len=128,
            max_num_batched_tokens=48,
            max_num_seqs=4,
            attention_backend=backend,
        )
        assert engine.num_blocks == (1 << 20) // engine.kv_cache[0].nbytes
        peak, scratch = _profile_peak_bytes(
            engine.model, engine.config.scheduler, 16, torch.float32, 128, torch.device("cpu")
        )
        assert (peak, scratch) == (1 << 30, 3 * engine.kv_cache[0].nbytes)  # 48 tokens / 16
        engine.warm_up()
        tokens[backend] = [c.token_ids for c in engine.generate(prompts, params)]
        engine.check_integrity()
    assert tokens["triton"] == tokens["torch"]


def test_warm_up_launches_every_split_padding(tiny_model_dir, engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The decode reduction compiles a variant per power of two of the split count; warm-up
    launches each one a step could choose: at 2048 tokens (128 blocks of 16) one row on
    2 kv heads gets 32 splits (66 of the default 132 SMs' worth, 4 blocks each)."""
    engine = engine_factory(
        tiny_model_dir,
        block_size=16,
        num_blocks=128,
        max_num_batched_tokens=16,
        attention_backend="triton",
    )
    assert engine.max_model_len == 2048
    backend, splits = engine.model.attention, []
    real_decode = backend._decode

    def decode(*args, num_splits, **kwargs):  # type: ignore[no-untyped-def]
        splits.append(num_splits)
        return real_decode(*args, num_splits=num_splits, **kwargs)

    backend._decode = decode
    engine.warm_up()
    assert {1 << (n - 1).bit_length() for n in splits} == {1, 2, 4, 8, 16, 32}  # paddings


class EagerGraphs:
    """CPU stand-in for DecodeGraphs: 'replays' by running the captured step function over
    the static buffers, so the runner's graph path (buffer filling, padding rows, the step
    built from buffer views) runs on a CPU exactly as a replay would feed it."""

    def __init__(self, buffers, sizes) -> None:  # type: ignore[no-untyped-def]
        self.buffers, self.sizes, self.replays = buffers, tuple(sizes), []

    def capture(self, run_fn) -> None:  # type: ignore[no-untyped-def]
        self.run_fn = run_fn

    def can_serve(self, n: int) -> bool:
        return 1 <= n <= self.sizes[-1]

    def replay(self, n, *inputs):  # type: ignore[no-untyped-def]
        from tandem.engine.cuda_graphs import graph_size_for

        size = graph_size_for(n, self.sizes)
        self.replays.append((n, size))
        self.buffers.fill(size, *inputs)
        return self.run_fn(self.buffers.views(size))[:n]


def test_decode_steps_through_graph_buffers_match_eager(  # type: ignore[no-untyped-def]
    tiny_model_dir, engine_factory, monkeypatch
) -> None:
    """Decode-only steps served from the graph buffers (padded to a captured size, padding
    rows writing only the reserved block) give the eager steps' tokens."""
    from tandem.engine import runner as runner_module
    from tandem.engine.sampling import SamplingParams

    monkeypatch.setattr(runner_module, "DecodeGraphs", EagerGraphs)
    prompts = [list(range(5, 25)), list(range(30, 37)), [9, 8, 7]]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        engine = engine_factory(
            tiny_model_dir, block_size=16, num_blocks=8, attention_backend="triton"
        )
        if graphs:
            # Block 7 stays free for these prompts (the pool hands out 0, 1, ... first).
            engine.runner.capture_decode_graphs(4, engine.max_model_len, padding_block_id=7)
        results[graphs] = [c.token_ids for c in engine.generate(prompts, params)]
        if graphs:
            replays = engine.runner.graphs.replays
            assert replays and all(size in (1, 2, 4) and n <= size for n, size in replays)
            assert (3, 4) in replays  # three rows padded to the graph of four
    assert results[True] == results[False]
