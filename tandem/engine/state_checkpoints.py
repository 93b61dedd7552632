"""Which prefix each linear-attention state checkpoint holds (issue 42: prefix caching for
models with Gated DeltaNet layers, Qwen3-Next).

Such a layer's state (its convolution's last inputs and its recurrent matrices) is one per
request, not one per token, so the pages of a cached prefix cannot resume a request alone: it
also needs the state taken after exactly that prefix. The runner takes one at the last block
boundary a step's row crosses (mid-chunk for a prefill, after the token for a decode row),
keyed by that block's prefix hash -- which covers every token before it, the model and the
tenant's salt, so a checkpoint is right for every request whose prefix has that hash, for as
long as it is kept. The KV manager's lookups then stop at the longest prefix whose pages and
checkpoint are both held (`layer_groups.resumable_prefix`: a hit on one group but not on
another is a miss at that length).

Checkpoints live in a fixed number of slots (tandem.model.linear_attention.LinearStates,
reserved at load next to the requests' own) and are evicted least recently used. With
`record_events`, each one kept or evicted is a STORED or REMOVED event of its block's
`prefix_hash.state_mark`, for the cluster's prefix index. Pure bookkeeping: which hash is in
which slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from tandem.engine.block_pool import KVEvent, KVEventKind
from tandem.engine.prefix_hash import state_mark


class StateCheckpoints:
    """Block hash -> checkpoint slot, least recently used first."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"num_slots must be positive, got {num_slots}")
        self.num_slots = num_slots
        self.record_events = False
        self._events: list[KVEvent] = []
        self._slots: OrderedDict[int, int] = OrderedDict()
        self._free: list[int] = []
        self.clear()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slots

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding the state after `block_hash`'s prefix, marked used; None: none."""
        slot = self._slots.get(block_hash)
        if slot is not None:
            self._slots.move_to_end(block_hash)
        return slot

    def claim(self, block_hash: int, pinned: Collection[int] = ()) -> int | None:
        """A slot to write `block_hash`'s checkpoint into, evicting the least recently used
        one not in `pinned` (slots this step still reads or writes). None: that prefix has a
        checkpoint already, or every slot is pinned."""
        if block_hash in self._slots:
            return None
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((h for h, s in self._slots.items() if s not in pinned), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            self._event(KVEventKind.REMOVED, victim)
        self._slots[block_hash] = slot
        self._event(KVEventKind.STORED, block_hash)
        return slot

    def marks(self) -> list[int]:
        """The state mark of every checkpoint held (a snapshot for the prefix index)."""
        return [state_mark(h) for h in self._slots]

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def clear(self) -> None:
        """Forget every checkpoint (the prefix cache was reset)."""
        for h in self._slots:
            self._event(KVEventKind.REMOVED, h)
        self._free = list(range(self.num_slots - 1, -1, -1))  # popped from the end: 0 first
        self._slots.clear()

    def _event(self, kind: KVEventKind, block_hash: int) -> None:
        if self.record_events:
            self._events.append(KVEvent(kind, state_mark(block_hash)))

    def check_integrity(self) -> None:
        used = list(self._slots.values())
        assert len(set(used)) == len(used), "two prefixes share a slot"
        assert not set(used) & set(self._free), "a used slot is also free"
        assert sorted(used + self._free) == list(range(self.num_slots))
