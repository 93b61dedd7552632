"""Which state each layer keeps for a request, in groups of layers that keep the same kind
(issue 42's ground: hybrid models mix them).

  full_attention     K and V of every token: pages for the whole sequence (today's cache)
  sliding_attention  K and V of the last `window` tokens only: a token attends to itself and
                     the window - 1 before it (transformers' mask for gpt-oss and Gemma 3), so
                     a page whose tokens all lie before the next token's window is never read
                     again and can be freed while the request runs
  linear_attention   a fixed-size state per request, not per token (Qwen3-Next's Gated
                     DeltaNet: a short convolution's last kernel - 1 inputs and a recurrent
                     matrix per value head)

A config.json names each layer's kind in `layer_types` (transformers' field; absent: every
layer full). `layer_groups` reads it into `LayerGroup`s with their bytes, so memory sizing,
hand-off sizes and prefix-hit rules can be stated per group. Pure: no torch, no engine state.

Prefix hits across groups (`resumable_prefix`): a cached prefix of t tokens is usable only
where every group can resume at t: full layers need the pages of [0, t); sliding layers only
those the next token can read ([t - window + 1, t) rounded out to pages); linear layers a
state checkpoint taken at exactly t. The longest t every group holds is the hit; a hit on one
group but not another is a miss at that length.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class LayerKind(StrEnum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"
    LINEAR = "linear_attention"


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers that keep the same kind of per-request state.

    Attributes:
        kind: what they keep.
        layers: their indices, ascending.
        window: sliding_attention: tokens a query attends to, itself included.
        kv_token_bytes: full/sliding: K and V of one token in one layer.
        state_bytes: linear_attention: one request's state in one layer.
    """

    kind: LayerKind
    layers: tuple[int, ...]
    window: int | None = None
    kv_token_bytes: int = 0
    state_bytes: int = 0

    def live_blocks(self, num_tokens: int, block_size: int) -> range:
        """The blocks of a `num_tokens`-token sequence its next token can still read (none
        for linear layers, which keep no pages)."""
        end = -(-num_tokens // block_size)
        if self.kind is LayerKind.LINEAR:
            return range(0)
        if self.kind is LayerKind.FULL or self.window is None:
            return range(end)
        first_token = max(0, num_tokens + 1 - self.window)  # the next token's window starts here
        return range(first_token // block_size, end)

    def request_bytes(self, num_tokens: int, block_size: int) -> int:
        """What the group holds for one request of `num_tokens` tokens, its out-of-window
        pages freed: also what a hand-off of that request moves for the group."""
        if self.kind is LayerKind.LINEAR:
            return self.state_bytes * len(self.layers)
        pages = len(self.live_blocks(num_tokens, block_size))
        return pages * block_size * self.kv_token_bytes * len(self.layers)


@dataclass(frozen=True, slots=True)
class LinearAttention:
    """A Gated DeltaNet layer's shape (Qwen3-Next's linear_* fields)."""

    num_k_heads: int
    num_v_heads: int
    k_dim: int  # per head
    v_dim: int  # per head
    conv_kernel: int

    FIELDS = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim")  # fmt: skip

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> LinearAttention:
        """From a config.json. Raises ValueError naming the linear_* fields it lacks."""
        missing = [n for n in cls.FIELDS if not raw.get(n)]
        if missing:
            raise ValueError(f"linear_attention layers need {', '.join(missing)}")
        return cls(*(int(raw[n]) for n in cls.FIELDS))

    @property
    def conv_channels(self) -> int:
        """q, k and v, convolved together."""
        return 2 * self.num_k_heads * self.k_dim + self.num_v_heads * self.v_dim

    def state_bytes(self, dtype_bytes: int) -> int:
        """One request's state in one layer: the convolution's last kernel - 1 inputs (in the
        model's dtype, `dtype_bytes`) and a [k_dim, v_dim] matrix per value head (float32,
        as the recurrence keeps it)."""
        conv = self.conv_channels * (self.conv_kernel - 1) * dtype_bytes
        return conv + self.num_v_heads * self.k_dim * self.v_dim * 4


def layer_types(raw: Mapping[str, Any], other: LayerKind, period: int) -> tuple[str, ...]:
    """A config.json's `layer_types` for a model that mixes full layers with `other`
    ones; absent, transformers' default pattern: every `period`-th layer full.

    Raises:
        ValueError: a list of the wrong length, or naming a kind other than these two.
    """
    num_layers = int(raw["num_hidden_layers"])
    types = raw.get("layer_types")
    if types is None:
        types = [LayerKind.FULL.value if (i + 1) % period == 0 else other.value
                 for i in range(num_layers)]  # fmt: skip
    if len(types) != num_layers or set(types) - {other.value, LayerKind.FULL.value}:
        raise ValueError(
            f"layer_types must name {other.value} or full_attention for each of the "
            f"{num_layers} layers, got {types!r}"
        )
    return tuple(types)


def layer_groups(raw: Mapping[str, Any], dtype_bytes: int) -> tuple[LayerGroup, ...]:
    """A config.json's layers as groups, in order of each kind's first layer.

    Args:
        raw: the (text) config: num_hidden_layers, num_key_value_heads, head_dim (else
            hidden_size / num_attention_heads), layer_types, sliding_window, and for linear
            layers linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
            linear_value_head_dim, linear_conv_kernel_dim.
        dtype_bytes: bytes of one element of the cache and state.

    Raises:
        ValueError: a layer kind this module does not know, a layer_types list of the wrong
            length, sliding layers without a window, linear layers without their sizes.
    """
    num_layers = int(raw["num_hidden_layers"])
    types: Sequence[str] = raw.get("layer_types") or [LayerKind.FULL.value] * num_layers
    if len(types) != num_layers:
        raise ValueError(f"layer_types names {len(types)} layers, the model has {num_layers}")
    known = {k.value for k in LayerKind}
    unknown = sorted(set(types) - known)
    if unknown:
        raise ValueError(f"unknown layer types {unknown}; known: {sorted(known)}")
    kinds = [LayerKind(t) for t in types]
    window = raw.get("sliding_window")
    if LayerKind.SLIDING in kinds and not window:
        raise ValueError("sliding_attention layers need a sliding_window")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    kv_heads = raw.get("num_key_value_heads") or raw["num_attention_heads"]
    state = linear_state_bytes(raw, dtype_bytes) if LayerKind.LINEAR in kinds else 0
    return group_layers(kinds, window, 2 * kv_heads * head_dim * dtype_bytes, state)


def group_layers(
    kinds: Sequence[LayerKind],
    window: int | None,
    kv_token_bytes: int = 0,
    state_bytes: int = 0,
) -> tuple[LayerGroup, ...]:
    """Layers of the given kinds (one per layer) as groups, in order of each kind's first
    layer; `window` for the sliding ones, the bytes as `LayerGroup` holds them."""
    groups = []
    for kind in dict.fromkeys(kinds):
        layers = tuple(i for i, k in enumerate(kinds) if k is kind)
        if kind is LayerKind.LINEAR:
            groups.append(LayerGroup(kind, layers, state_bytes=state_bytes))
        else:
            sliding = int(window) if kind is LayerKind.SLIDING and window else None
            groups.append(LayerGroup(kind, layers, sliding, kv_token_bytes=kv_token_bytes))
    return tuple(groups)


def linear_state_bytes(raw: Mapping[str, Any], dtype_bytes: int) -> int:
    """One request's Gated DeltaNet state in one layer (`LinearAttention.state_bytes`)."""
    return LinearAttention.from_raw(raw).state_bytes(dtype_bytes)


def resumable_prefix(
    groups: Sequence[LayerGroup],
    cached_blocks: Mapping[int, Collection[int]],
    checkpoints: Mapping[int, Collection[int]],
    max_tokens: int,
    block_size: int,
) -> int:
    """The longest block-aligned prefix, at most `max_tokens`, from which every group can
    resume: 0 when none can.

    Args:
        groups: the model's groups.
        cached_blocks: group index -> the prefix's block indices that group holds (full and
            sliding groups).
        checkpoints: group index -> token counts at which that (linear) group holds a state.
        max_tokens: the longest prefix to consider (a request recomputes at least its last
            token: callers pass prompt length - 1 or less).
        block_size: tokens per block.
    """
    for t in range(max_tokens // block_size * block_size, 0, -block_size):
        if all(
            _resumes(g, i, t, cached_blocks, checkpoints, block_size) for i, g in enumerate(groups)
        ):
            return t
    return 0


def _resumes(
    group: LayerGroup,
    index: int,
    tokens: int,
    cached_blocks: Mapping[int, Collection[int]],
    checkpoints: Mapping[int, Collection[int]],
    block_size: int,
) -> bool:
    if group.kind is LayerKind.LINEAR:
        return tokens in checkpoints.get(index, ())
    held = cached_blocks.get(index, ())
    # the blocks the first token after the prefix reads (full layers: all of [0, tokens))
    return all(b in held for b in group.live_blocks(tokens, block_size))
