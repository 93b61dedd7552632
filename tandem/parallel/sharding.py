"""Tensor parallelism's split of a model (Megatron-style): which part of every weight a rank
holds, and the shape of the model a rank runs. Pure arithmetic, no collectives
(those are `tandem.parallel.group`).

    q/k/v   column-parallel by heads: rank r holds KV heads [r*K//T, (r+1)*K//T) and the
            query heads of their groups (shares as even as can be: SmolLM2's 3 KV heads
            over 2 ranks are 1 and 2); past K ranks, KV heads are replicated: rank r holds
            KV head r*K//T, shared with its neighbours, and its share of that head's
            query heads
    o       row-parallel: the input rows of rank r's q heads; one all-reduce after it
    MLA     (DeepSeek-V3, `mla_slices`) q_b / q_proj and kv_b by heads, o as above; the
            latent's projections and norms whole: every rank caches the latent (one KV
            head, replicated); the shared experts split like each expert
    gate/up column-parallel: intermediate columns [r*I//T, (r+1)*I//T)
    down    row-parallel: the same intermediate rows; one all-reduce after it
            (`Shard.exact_sums`: o and down split by their outputs instead, hidden columns
            [r*H//T, (r+1)*H//T); their inputs and outputs all-gathered)
    experts (mixture of experts) each expert as the MLP: its gate/up columns and down rows
            [r*I'//T, (r+1)*I'//T) of its I' = moe_intermediate_size; or, with expert
            parallelism (`Shard.expert_parallel`, EP = T), experts [r*E//T, (r+1)*E//T)
            whole, the others' never read. The router replicated (every rank routes every
            token alike: the tokens are dispatched by routing, not moved, since attention
            leaves every token's hidden state on every rank); one all-reduce after the
            layer's weighted sum combines the ranks' partial sums either way
    embed,  vocab-parallel: vocabulary rows [r*V', (r+1)*V'), V' = ceil(V/T), the last rank's
    lm_head padded with zero rows; an all-reduce after the embedding (each token's row lives
            on one rank, the others add zeros) and an all-gather of the logits
    norms   replicated

In HuggingFace's [out, in] layout column-parallel is a slice of rows (contiguous in the
file) and row-parallel a slice of columns.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

from tandem.model.config import Features, ModelConfig
from tandem.model.moe import expert_names

GUD = ("gate", "up", "down")


@dataclass(frozen=True, slots=True)
class Shard:
    """One rank of a tensor-parallel group of `size` ranks; `expert_parallel`: a mixture of
    experts' experts are split whole among the ranks (EP = size), not each expert's
    columns; `replicate_attention`: every rank computes every head (attention not split,
    no all-reduce after o; its KV cache holds every head).

    `exact_sums`: o and a dense MLP's down are split by their output columns, not their
    inputs: each rank gathers the whole input (the ranks' heads / intermediate columns),
    computes its outputs' whole dot products and the outputs are gathered. Every sum is
    then one GEMM's over the whole input, as at one rank, so the forward equals one rank's
    bit for bit in any dtype (partial sums added after their GEMMs round differently);
    the price is two all-gathers per matrix where Megatron's split has one all-reduce.
    Sparse layers' experts keep the all-reduce."""

    rank: int
    size: int
    expert_parallel: bool = False
    replicate_attention: bool = False
    exact_sums: bool = False

    def __post_init__(self) -> None:
        if self.size <= 0 or not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")


class TensorSlice(NamedTuple):
    """Rows (dim 0) or columns (dim 1) [start, stop) of a stored tensor."""

    dim: int
    start: int
    stop: int


def check_shardable(config: ModelConfig, size: int) -> None:
    """Raise ValueError unless `config` splits over `size` ranks: at most one rank per KV
    head, or whole replicas of every KV head with its query heads split evenly among them."""
    if size <= 0:
        raise ValueError(f"tensor_parallel_size must be positive, got {size}")
    if size > 1 and config.features.mla is not None:
        mla_only = dataclasses.replace(
            config.features, mla=None, attn_scale=None, shared_expert_size=0, mtp_layers=0
        )
        if mla_only != Features():
            raise ValueError(
                f"tensor_parallel_size {size}: {config.architecture} is served on one rank "
                "only for now (multi-head latent attention with other features not sharded)"
            )
        heads = config.num_q_heads
        if heads % size:
            raise ValueError(
                f"tensor_parallel_size {size}: multi-head latent attention splits its "
                f"{heads} heads evenly over the ranks (the latent, every head's, replicated)"
            )
        if 0 < config.features.shared_expert_size < size:
            raise ValueError(
                f"tensor_parallel_size {size} exceeds the shared experts' intermediate size "
                f"({config.features.shared_expert_size})"
            )
    elif size > 1 and config.features != Features():
        raise ValueError(
            f"tensor_parallel_size {size}: {config.architecture} is served on one rank only "
            f"for now (its sinks, biases and norms are not sharded)"
        )
    if config.moe is not None and config.moe.num_experts < size:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the number of experts ({config.moe.num_experts})"
        )
    if config.moe is not None and config.moe.expert_intermediate_size < size:
        raise ValueError(
            f"tensor_parallel_size {size} exceeds the experts' intermediate size "
            f"({config.moe.expert_intermediate_size})"
        )
    q, k = config.num_q_heads, config.num_kv_heads
    if size <= k:
        return
    if size % k or (q // k) % (size // k):
        raise ValueError(
            f"tensor_parallel_size {size} exceeds num_key_value_heads ({k}): it must then be "
            f"a multiple of it whose replicas split each KV head's {q // k} query heads evenly"
        )


def _part(n: int, shard: Shard) -> range:
    """Rank `shard.rank`'s contiguous share of n items, the shares as even as can be (the
    first ranks take one fewer when n does not divide)."""
    return range(shard.rank * n // shard.size, (shard.rank + 1) * n // shard.size)


def q_heads(config: ModelConfig, shard: Shard) -> range:
    """The query heads rank `shard.rank` computes: those of its KV heads' groups (with
    replicated KV heads, its share of its KV head's group)."""
    group = config.num_q_heads // config.num_kv_heads
    if shard.replicate_attention:
        return range(config.num_q_heads)
    if shard.size <= config.num_kv_heads:
        kv = kv_heads(config, shard)
        return range(kv.start * group, kv.stop * group)
    return _part(config.num_q_heads, shard)


def kv_heads(config: ModelConfig, shard: Shard) -> range:
    """The KV heads rank `shard.rank` holds. With more ranks than KV heads, one head each,
    replicated on size / num_kv_heads neighbouring ranks."""
    k = config.num_kv_heads
    if shard.replicate_attention:
        return range(k)
    if shard.size <= k:
        return _part(k, shard)
    head = shard.rank * k // shard.size
    return range(head, head + 1)


def intermediate(config: ModelConfig, shard: Shard) -> range:
    """The MLP's intermediate columns rank `shard.rank` computes."""
    return _part(config.intermediate_size, shard)


def hidden_columns(config: ModelConfig, shard: Shard) -> range:
    """The hidden columns of o's and down's outputs rank `shard.rank` computes
    (`Shard.exact_sums`)."""
    return _part(config.hidden_size, shard)


def expert_intermediate(config: ModelConfig, shard: Shard) -> range:
    """Each expert's intermediate columns rank `shard.rank` computes (all of them under
    expert parallelism)."""
    assert config.moe is not None
    if shard.expert_parallel:
        return range(config.moe.expert_intermediate_size)
    return _part(config.moe.expert_intermediate_size, shard)


def local_experts(config: ModelConfig, shard: Shard) -> range:
    """The experts rank `shard.rank` holds: a share of them under expert parallelism, else
    all (each in part)."""
    assert config.moe is not None
    if shard.expert_parallel and shard.size > 1:
        return _part(config.moe.num_experts, shard)
    return range(config.moe.num_experts)


def foreign_experts(config: ModelConfig, shard: Shard) -> set[str]:
    """The checkpoint tensors of the experts other ranks hold (expert parallelism): this
    rank never reads them."""
    if config.moe is None:
        return set()
    mine = local_experts(config, shard)
    return {
        name
        for i in config.moe.sparse_layers
        for e in range(config.moe.num_experts)
        if e not in mine
        for name in expert_names(config.architecture, i, e)
    }


def vocab_rows(config: ModelConfig, shard: Shard) -> range:
    """The vocabulary rows rank `shard.rank` holds (`vocab_per_rank` of them, fewer on the
    last rank when the vocabulary does not divide; the rest is zero padding)."""
    per = vocab_per_rank(config, shard.size)
    start = min(shard.rank * per, config.vocab_size)
    return range(start, min(start + per, config.vocab_size))


def vocab_per_rank(config: ModelConfig, size: int) -> int:
    return -(-config.vocab_size // size)


def local_config(config: ModelConfig, shard: Shard) -> ModelConfig:
    """The model one rank runs: its heads and its part of the MLP (vocabulary, layers and
    everything else as the model's). At size 1, `config` itself."""
    if shard.size == 1:
        return config
    check_shardable(config, shard.size)
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(
            moe, expert_intermediate_size=len(expert_intermediate(config, shard))
        )
    return dataclasses.replace(
        config,
        num_q_heads=len(q_heads(config, shard)),
        num_kv_heads=len(kv_heads(config, shard)),
        intermediate_size=len(intermediate(config, shard)),
        moe=moe,
    )


def tensor_slices(config: ModelConfig, shard: Shard) -> dict[str, TensorSlice]:
    """HF tensor name -> the part rank `shard.rank` reads; tensors not named are read
    whole (norms). Empty at size 1."""
    if shard.size == 1:
        return {}
    check_shardable(config, shard.size)
    d = config.head_dim
    q, kv = q_heads(config, shard), kv_heads(config, shard)
    qs, kvs = (q.start * d, q.stop * d), (kv.start * d, kv.stop * d)
    mlp_part = intermediate(config, shard)
    inter = (mlp_part.start, mlp_part.stop)
    vocab = vocab_rows(config, shard)
    exact = shard.exact_sums
    hidden = hidden_columns(config, shard)
    out = (hidden.start, hidden.stop)
    slices: dict[str, TensorSlice] = {}
    for i in range(config.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        if config.features.mla is not None:
            slices.update(mla_slices(config, shard, i))
        elif not shard.replicate_attention:
            slices[attn + "q_proj.weight"] = TensorSlice(0, *qs)
            slices[attn + "k_proj.weight"] = TensorSlice(0, *kvs)
            slices[attn + "v_proj.weight"] = TensorSlice(0, *kvs)
            if config.qkv_bias:
                slices[attn + "q_proj.bias"] = TensorSlice(0, *qs)
                slices[attn + "k_proj.bias"] = TensorSlice(0, *kvs)
                slices[attn + "v_proj.bias"] = TensorSlice(0, *kvs)
            slices[attn + "o_proj.weight"] = TensorSlice(0, *out) if exact else TensorSlice(1, *qs)
        if config.moe is not None and i in config.moe.sparse_layers:
            part = expert_intermediate(config, shard)
            if config.features.shared_expert_size and config.features.mla is not None:
                shared = _part(config.features.shared_expert_size, shard)  # DeepSeek-V3's
                gate, up, down = (mlp + f"shared_experts.{x}_proj.weight" for x in GUD)
                slices[gate] = slices[up] = TensorSlice(0, shared.start, shared.stop)
                slices[down] = TensorSlice(1, shared.start, shared.stop)
            if shard.expert_parallel:  # its own experts whole
                continue
            for e in range(config.moe.num_experts):
                gate, up, down = expert_names(config.architecture, i, e)
                slices[gate] = TensorSlice(0, part.start, part.stop)
                slices[up] = TensorSlice(0, part.start, part.stop)
                slices[down] = TensorSlice(1, part.start, part.stop)
            continue
        slices[mlp + "gate_proj.weight"] = TensorSlice(0, *inter)
        slices[mlp + "up_proj.weight"] = TensorSlice(0, *inter)
        slices[mlp + "down_proj.weight"] = TensorSlice(0, *out) if exact else TensorSlice(1, *inter)
    slices["model.embed_tokens.weight"] = TensorSlice(0, vocab.start, vocab.stop)
    if not config.tie_word_embeddings:
        slices["lm_head.weight"] = TensorSlice(0, vocab.start, vocab.stop)
    return slices


def mla_slices(config: ModelConfig, shard: Shard, layer: int) -> dict[str, TensorSlice]:
    """Layer `layer`'s MLA tensors rank `shard.rank` reads (DeepSeek-V3): its heads' rows
    of q_b_proj (or q_proj) and kv_b_proj (each head's [k_nope | v], so W_UK and W_UV split
    with them), o_proj's by `Shard.exact_sums` or its heads' columns. q_a_proj,
    kv_a_proj_with_mqa and the norms are read whole: every rank computes every token's
    latent and caches it (the cache's one KV head, replicated)."""
    m = config.features.mla
    assert m is not None
    if shard.replicate_attention:
        return {}
    heads = q_heads(config, shard)
    a = f"model.layers.{layer}.self_attn."
    q = "q_b_proj" if m.q_lora_rank is not None else "q_proj"
    kv_b = m.qk_nope_head_dim + m.v_head_dim
    hidden = hidden_columns(config, shard)
    return {
        a + q + ".weight": TensorSlice(0, heads.start * m.qk_head_dim, heads.stop * m.qk_head_dim),
        a + "kv_b_proj.weight": TensorSlice(0, heads.start * kv_b, heads.stop * kv_b),
        a + "o_proj.weight": TensorSlice(0, hidden.start, hidden.stop)
        if shard.exact_sums
        else TensorSlice(1, heads.start * m.v_head_dim, heads.stop * m.v_head_dim),
    }


def sliced_shapes(
    shapes: dict[str, tuple[int, ...]], slices: dict[str, TensorSlice]
) -> dict[str, tuple[int, ...]]:
    """`shapes` with each sliced tensor's dimension cut to its slice."""
    out = dict(shapes)
    for name, (dim, start, stop) in slices.items():
        shape = list(shapes[name])
        shape[dim] = stop - start
        out[name] = tuple(shape)
    return out
