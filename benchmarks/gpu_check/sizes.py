"""What differs between the CUDA run and the `--cpu` smoke run: model shapes, workloads and
each part's time budget (`CUDA_SIZES`: full sizes, the default parts' budgets summing to 445 s
on one H200; `CPU_SIZES`: tiny, ~15 s in CI)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Sizes:
    """Everything that differs between the CUDA run and the --cpu smoke run."""

    device: str
    # parity: HF config fields shared by the tiny models, and the workload
    parity_shape: dict[str, Any]
    parity_qwen3_head_dim: int
    parity_block_size: int
    parity_num_prompts: int
    parity_prompt_len: tuple[int, int]
    parity_max_tokens: int
    parity_chunk_tokens: int  # max_num_batched_tokens of the chunked engine (< every prompt)
    parity_bf16_prompt_len: int
    parity_bf16_max_tokens: int
    # throughput: the model shape, dtype and workload W
    tp_shape: dict[str, Any]
    tp_dtype: str
    tp_num_requests: int
    tp_prompt_len: tuple[int, int]
    tp_output_len: tuple[int, int]
    tp_matmul_n: int  # the n x n x n bf16 GEMM timed as the prefill compute roofline
    tp_max_num_batched_tokens: int
    # kernels: the attention shape (Llama-3-8B's on CUDA), correctness cases, benchmark cases
    kn_dtype: str
    kn_num_q_heads: int
    kn_num_kv_heads: int
    kn_head_dim: int
    kn_block_size: int
    kn_check_context_lens: tuple[int, ...]  # decode correctness: one ragged batch
    kn_check_chunks: tuple[tuple[int, int], ...]  # prefill correctness: (new tokens, context)
    kn_decode_batches: tuple[int, ...]  # decode bandwidth: every batch x every context
    kn_decode_contexts: tuple[int, ...]
    kn_decode_fp8_cases: tuple[tuple[int, int], ...]  # (batch, context) over an e4m3 cache
    kn_prefill_cases: tuple[tuple[int, int, int], ...]  # (batch, chunk tokens, cached prefix)
    kn_copy_bytes: int  # of the copy_ that measures device bandwidth
    kn_flush_bytes: int  # zeroed before each timed call (> L2), 0 = none
    kn_reps: int  # timed calls per case (median)
    # e2e: one greedy request on the throughput part's model
    e2e_prompt_len: int
    e2e_steps: int  # decode steps timed (after e2e_warm_steps untimed)
    e2e_warm_steps: int
    e2e_num_blocks: int
    e2e_max_num_seqs: int  # sizes the CUDA graphs captured (1, 2, 4, ...)
    e2e_max_num_batched_tokens: int  # also warm_up's prefill
    # quant: correctness of each scheme's production linear on one [N, K] matrix, speed of
    # the linear alone in Llama-3-8B's shapes, then the engine with fp8 weights (e2e's config)
    quant_check_shape: tuple[int, int]  # (out N, in K)
    quant_check_rows: tuple[int, ...]  # activation rows M
    quant_int4_group: int
    quant_bench_shapes: tuple[tuple[str, int, int], ...]  # (name, out N, in K)
    quant_bench_rows: tuple[int, ...]
    quant_prefill_len: int  # one prompt, prefilled in one step (<= e2e_max_num_batched_tokens)
    quant_prefill_reps: int  # prompts timed (median)
    quant_batch: int  # the engines' second ITL: this many requests decoding together
    quant_batch_prompt_len: int
    # moe: one sparse layer (hidden, experts, top_k, expert width) and the token counts timed
    moe_shape: tuple[int, int, int, int]
    moe_tokens: tuple[int, ...]
    # nixl: one KV block [num_layers, 2, block_size, num_kv_heads, head_dim] (bf16)
    nixl_block_shape: tuple[int, int, int, int, int]
    nixl_owner_blocks: int
    nixl_read_blocks: tuple[int, ...]
    nixl_reps: int
    # serve
    serve_dtype: str
    serve_num_requests: int
    serve_prompt_len: tuple[int, int]
    serve_max_tokens: int
    serve_num_blocks: int
    # seconds per part; throughput's engine and HF runs each stop at half of theirs
    budget_s: dict[str, float] = field(default_factory=dict)


CUDA_SIZES = Sizes(
    device="cuda",
    parity_shape=dict(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    parity_qwen3_head_dim=128,
    parity_block_size=16,
    parity_num_prompts=8,
    parity_prompt_len=(65, 300),
    parity_max_tokens=32,
    parity_chunk_tokens=64,
    parity_bf16_prompt_len=100,
    parity_bf16_max_tokens=16,
    # Llama-3-8B (rope scaling left out: it changes no cost)
    tp_shape=dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    tp_dtype="bfloat16",
    tp_num_requests=64,
    tp_prompt_len=(32, 512),
    tp_output_len=(16, 256),
    tp_matmul_n=8192,
    tp_max_num_batched_tokens=8192,
    kn_dtype="bfloat16",
    kn_num_q_heads=32,
    kn_num_kv_heads=8,
    kn_head_dim=128,
    kn_block_size=16,
    kn_check_context_lens=(1, 17, 300, 1000, 4099),
    kn_check_chunks=((1, 1), (17, 40), (100, 100), (300, 1300)),
    kn_decode_batches=(1, 16, 64, 256),
    kn_decode_contexts=(1024, 4096, 16384),  # 256 x 16k: a 16 GiB cache (one layer)
    kn_decode_fp8_cases=((1, 4096), (64, 4096), (64, 16384)),
    kn_prefill_cases=(
        (1, 2048, 0),
        (4, 2048, 0),
        (1, 2048, 6144),
        (4, 2048, 6144),
        (1, 2048, 30720),
        (2, 2048, 30720),
    ),
    kn_copy_bytes=2 << 30,
    kn_flush_bytes=512 << 20,  # H200 L2: 50 MiB
    kn_reps=20,
    e2e_prompt_len=512,
    e2e_steps=64,
    e2e_warm_steps=4,
    e2e_num_blocks=256,  # 4096 tokens, 512 MiB of bf16 KV
    e2e_max_num_seqs=4,
    e2e_max_num_batched_tokens=2048,
    quant_check_shape=(4096, 4096),
    quant_check_rows=(1, 16, 512, 4096),
    quant_int4_group=128,
    quant_bench_shapes=(
        ("qkv", 6144, 4096),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
    ),
    quant_bench_rows=(1, 16, 64, 256, 4096),
    quant_prefill_len=2048,
    quant_prefill_reps=3,
    quant_batch=64,
    quant_batch_prompt_len=128,
    moe_shape=(2048, 128, 8, 768),  # Qwen3-30B-A3B
    moe_tokens=(1, 16, 64, 256, 2048),
    # Llama-3-8B's KV block: 2 MiB
    nixl_block_shape=(32, 2, 16, 8, 128),
    nixl_owner_blocks=1024,
    nixl_read_blocks=(32, 512),  # 512- and 8192-token prompts
    nixl_reps=10,
    serve_dtype="bfloat16",
    serve_num_requests=4,
    serve_prompt_len=(100, 600),
    serve_max_tokens=32,
    serve_num_blocks=1024,
    # The default parts (cli.DEFAULT_PARTS) in 445 s of budgets, inside one `timeout 470`
    # command: startup's first H200 run took 47-57 s; throughput 79 s of which HF generate
    # (now dropped) 44; kernels 15 s (now with the FP8 KV cases); e2e 19 s (now with a
    # profile); quant 74-80 s with three engines (now four, each also at batch 64, and every
    # candidate kernel timed); moe: one 1.2 GB layer. The other parts run when named.
    budget_s=dict(
        preflight=15,
        startup=60,
        parity=45,
        throughput=65,
        kernels=45,
        e2e=45,
        quant=170,
        moe=45,
        nixl=30,
        serve=60,
        tiles=75,
        hybrid=120,  # its engine check builds four tiny models and runs transformers on them
        mla=60,  # 9 decode cases (the largest cache 1.2 GB) and a reference check
        tiers=60,  # 128 MiB of block copies, a 46M model's engine, eight requests
    ),
)

CPU_SIZES = Sizes(
    device="cpu",
    parity_shape=dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    parity_qwen3_head_dim=24,  # q width 96 != hidden 64: catches a head_dim taken from hidden
    parity_block_size=4,
    parity_num_prompts=4,
    parity_prompt_len=(9, 40),
    parity_max_tokens=8,
    parity_chunk_tokens=8,
    parity_bf16_prompt_len=16,
    parity_bf16_max_tokens=6,
    tp_shape=dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    tp_dtype="float32",
    tp_num_requests=8,
    tp_prompt_len=(8, 64),
    tp_output_len=(4, 16),
    tp_matmul_n=256,
    tp_max_num_batched_tokens=512,
    # Under Triton's interpreter (~0.6 ms per program instance): a few programs per launch.
    kn_dtype="bfloat16",
    kn_num_q_heads=8,
    kn_num_kv_heads=2,
    kn_head_dim=32,
    kn_block_size=16,
    kn_check_context_lens=(1, 17, 40, 130),  # 2 splits
    kn_check_chunks=((1, 1), (9, 30), (20, 20)),
    kn_decode_batches=(2,),
    kn_decode_contexts=(64, 256),  # 1 and 4 splits
    kn_decode_fp8_cases=((2, 256),),
    kn_prefill_cases=((1, 32, 0), (2, 32, 40)),
    kn_copy_bytes=16 << 20,
    kn_flush_bytes=0,
    kn_reps=3,
    e2e_prompt_len=16,
    e2e_steps=16,
    e2e_warm_steps=2,
    e2e_num_blocks=64,
    e2e_max_num_seqs=4,
    e2e_max_num_batched_tokens=128,
    # int4_packed needs N % 64 == 0; K a multiple of the group
    quant_check_shape=(256, 256),
    quant_check_rows=(1, 4),
    quant_int4_group=128,
    quant_bench_shapes=(("qkv", 384, 128), ("down", 128, 256)),
    quant_bench_rows=(1, 4),
    quant_prefill_len=32,
    quant_prefill_reps=2,
    quant_batch=4,
    quant_batch_prompt_len=8,
    moe_shape=(64, 8, 2, 32),
    moe_tokens=(1, 5),
    nixl_block_shape=(4, 2, 16, 4, 64),  # 64 KiB
    nixl_owner_blocks=512,
    nixl_read_blocks=(256,),
    nixl_reps=5,
    serve_dtype="float32",
    serve_num_requests=3,
    serve_prompt_len=(20, 80),
    serve_max_tokens=8,
    serve_num_blocks=256,
    budget_s=dict(
        preflight=30,
        startup=60,
        parity=60,
        throughput=60,
        kernels=60,
        e2e=60,
        quant=60,
        moe=60,
        nixl=60,
        serve=120,
        tiles=60,
        hybrid=90,
        mla=60,
        tiers=60,
    ),
)
