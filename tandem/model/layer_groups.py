"""Which state each layer keeps for a request, in groups of layers that keep the same kind
(issue 42's ground: hybrid models mix them).

  full_attention     K and V of every token: pages for the whole sequence (today's cache;
                     an MLA layer's per-token latent and rope key, `Mla`, fill the same pages)
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

How attention layers share the paged cache (`KVLayout`, `kv_layout`): sliding layers keep
their pages in KV tables apart from the full ones, so the pages a window has passed are freed
while the request runs and a hand-off moves a sliding table's window only.

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


@dataclass(frozen=True, slots=True)
class Mla:
    """An MLA layer's shape (config.json's names).

    Attributes:
        q_lora_rank: the query's low-rank width (q_a_proj, q_a_layernorm, q_b_proj); None:
            one q_proj.
        kv_lora_rank: the latent's width, cached per token.
        qk_nope_head_dim: each head's query/key dims without rope.
        qk_rope_head_dim: the rope dims: each head's q_rot, the one shared k_rot (cached).
        v_head_dim: each head's value width.
        rope_interleave: rope over interleaved pairs (x0, x1), (x2, x3), ... (DeepSeek's
            checkpoints), its output de-interleaved; False: rotate-half like Llama.
    """

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim ({self.qk_rope_head_dim}) must be even for RoPE")
        if self.entry_dim % 2:
            raise ValueError(
                f"kv_lora_rank + qk_rope_head_dim ({self.kv_lora_rank} + "
                f"{self.qk_rope_head_dim}) must be even: the cache's K and V halves hold a "
                "token's latent and rope key together"
            )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def entry_dim(self) -> int:
        """Elements a token keeps per layer: its latent and its rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_head_dim(self) -> int:
        """The cache's head_dim (one KV head): half an entry in K, half in V."""
        return self.entry_dim // 2

    @classmethod
    def from_raw(cls, raw: Mapping[str, Any]) -> Mla:
        q_lora = raw.get("q_lora_rank")
        return cls(
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=int(raw["kv_lora_rank"]),
            qk_nope_head_dim=int(raw["qk_nope_head_dim"]),
            qk_rope_head_dim=int(raw["qk_rope_head_dim"]),
            v_head_dim=int(raw.get("v_head_dim") or raw["qk_nope_head_dim"]),
            rope_interleave=bool(raw.get("rope_interleave", True)),
        )


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
    token_bytes = 2 * kv_heads * head_dim * dtype_bytes
    if raw.get("kv_lora_rank"):  # MLA: a latent and a rope key per token (`Mla`)
        token_bytes = Mla.from_raw(raw).entry_dim * dtype_bytes
    state = linear_state_bytes(raw, dtype_bytes) if LayerKind.LINEAR in kinds else 0
    return group_layers(kinds, window, token_bytes, state)


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
    groups: Sequence[LayerGroup | KVTable],
    cached_blocks: Mapping[int, Collection[int]],
    checkpoints: Mapping[int, Collection[int]],
    max_tokens: int,
    block_size: int,
) -> int:
    """The longest block-aligned prefix, at most `max_tokens`, from which every group can
    resume: 0 when none can.

    Args:
        groups: the model's groups (or, for the pages, its `KVTable`s).
        cached_blocks: group index -> the prefix's block indices that group holds (full and
            sliding groups; a range: a leading run).
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
    group: LayerGroup | KVTable,
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
    live = group.live_blocks(tokens, block_size)
    if isinstance(held, range) and held.step == 1:  # a leading run: no per-block test
        return not live or (held.start <= live.start and live.stop <= held.stop)
    return all(b in held for b in live)


@dataclass(frozen=True, slots=True)
class KVTable:
    """Attention layers of one kind that share a block table: block b of the table holds
    K and V of each of `layers` (at slots 0, 1, ... of the block) for the table's tokens of
    logical block b.

    Attributes:
        kind: full or sliding.
        layers: at most `KVLayout.slots` of them, ascending.
        window: sliding: tokens a query attends to, itself included.
    """

    kind: LayerKind
    layers: tuple[int, ...]
    window: int | None = None

    def live_blocks(self, num_tokens: int, block_size: int) -> range:
        """The logical blocks of a `num_tokens`-token sequence the next token reads."""
        return LayerGroup(self.kind, self.layers, self.window).live_blocks(num_tokens, block_size)


def window_marks_from(num_blocks: int, window: int, block_size: int) -> tuple[int, ...]:
    """`PrefixIndex.lookup`'s marks_from for a sliding table of `window` tokens: entry n - 1
    is the first block the next token after an n-block prefix reads (`KVTable.live_blocks`'
    start), since that token attends to itself and the window - 1 tokens before it. A worker
    resumes n blocks only where it holds the table's keys of blocks [entry, n): blocks
    before fell out of the window, so it may have freed them.

    Raises:
        ValueError: a window below 2 (whose next token reads no cached block, which marks
            cannot say), a block size below 1 or a negative num_blocks.
    """
    if window < 2 or block_size < 1 or num_blocks < 0:
        raise ValueError(f"need window >= 2, block_size >= 1 and num_blocks >= 0, got "
                         f"{window}, {block_size} and {num_blocks}")  # fmt: skip
    return tuple(max(0, n * block_size + 1 - window) // block_size
                 for n in range(1, num_blocks + 1))  # fmt: skip


@dataclass(frozen=True, slots=True)
class KVLayout:
    """How attention layers share the paged cache (issue 42).

    Every block of the pool holds `slots` layers' K and V. Each group of attention layers
    (full, sliding) is cut into tables of `slots` layers; a request keeps one block table per
    table, so a sliding table frees the pages that fell out of its window while the full
    tables keep theirs. One pool serves every table, so memory moves freely between them:

        gpt-oss (12 sliding, 12 full):  slots 12, tables [full 12][sliding 12]
        Gemma 3 1B (4 full, 22 sliding): slots 2, tables [full 2] x 2, [sliding 2] x 11
        a dense model (n full):          slots n, one table (the cache as it always was)

    Full tables come first, so table 0 is a full one wherever the model has full layers.
    A group whose size is not a multiple of `slots` leaves its last table's extra slots
    unused (`kv_layout` keeps that waste small).
    """

    slots: int
    tables: tuple[KVTable, ...]

    def place(self, layer: int) -> tuple[int, int]:
        """(table, slot) of an attention layer's pages."""
        for t, table in enumerate(self.tables):
            if layer in table.layers:
                return t, table.layers.index(layer)
        raise KeyError(f"layer {layer} keeps no K/V pages")

    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def sliding(self) -> int | None:
        """The first sliding table (what the prefix index is told about), None if none."""
        return next((t for t, tab in enumerate(self.tables) if tab.kind is LayerKind.SLIDING),
                    None)  # fmt: skip

    def describe(self) -> str:
        """The layout in a format string: two workers exchange pages only when it is equal."""
        kinds = ",".join(
            f"{tab.kind.value[0]}{tab.window or ''}:{'.'.join(map(str, tab.layers))}"
            for tab in self.tables
        )
        return f"slots{self.slots}[{kinds}]"

    def cache_layers(self) -> tuple[int | None, ...]:
        """The layer at each (table, slot) of the cache, table by table: what the cache's
        per-layer data (FP8 scales) is indexed by, at table * slots + slot; None for an
        unused slot."""
        return tuple(
            tab.layers[s] if s < len(tab.layers) else None
            for tab in self.tables
            for s in range(self.slots)
        )

    def peak_blocks(self, num_tokens: int, block_size: int, chunk_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, computed in chunks
        of at most `chunk_tokens`: every logical block in a full table; in a sliding one the
        blocks a chunk [s, e) holds when it runs (from the block of key s + 1 - window to
        e's), at most cdiv(window - 1 + chunk, block) + 1."""
        logical = -(-num_tokens // block_size)
        peak = 0
        for tab in self.tables:
            if tab.kind is LayerKind.SLIDING and tab.window is not None:
                peak += min(logical, -(-(tab.window - 1 + chunk_tokens) // block_size) + 1)
            else:
                peak += logical
        return peak

    def max_tokens(self, num_blocks: int, block_size: int, chunk_tokens: int) -> int:
        """The longest request (a multiple of `block_size` tokens) `num_blocks` blocks hold
        (`peak_blocks`); one table: num_blocks x block_size."""
        lo, hi = 0, num_blocks  # logical blocks: peak_blocks grows with them, >= 1 each
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.peak_blocks(mid * block_size, block_size, chunk_tokens) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo * block_size

    def live_blocks(self, num_tokens: int, block_size: int) -> list[range]:
        """Each table's logical blocks the next token of a `num_tokens`-token sequence reads:
        what a request holds, and what a hand-off of it moves."""
        return [tab.live_blocks(num_tokens, block_size) for tab in self.tables]


# A layout may leave at most this share of its slots unused to get fewer, wider tables.
MAX_SLOT_WASTE = 1 / 16


def kv_layout(groups: Sequence[LayerGroup]) -> KVLayout:
    """The tables of a model's attention groups (linear groups keep no pages).

    One attention group: one table of all its layers. Several: the widest `slots` (at most
    the smallest group's size) that leaves at most `MAX_SLOT_WASTE` of the slots unused --
    wider tables mean fewer tables to allocate and index per request -- which exists, as
    their sizes' gcd wastes none.
    """
    attention = [g for g in groups if g.kind is not LayerKind.LINEAR]
    attention.sort(key=lambda g: g.kind is not LayerKind.FULL)  # full tables first
    if not attention:
        return KVLayout(0, ())
    sizes = [len(g.layers) for g in attention]
    slots = 1
    for s in range(min(sizes), 0, -1):
        used = sum(-(-n // s) * s for n in sizes)
        if used - sum(sizes) <= MAX_SLOT_WASTE * used:
            slots = s
            break
    tables = tuple(
        KVTable(g.kind, g.layers[i : i + slots], g.window)
        for g in attention
        for i in range(0, len(g.layers), slots)
    )
    return KVLayout(slots, tables)
