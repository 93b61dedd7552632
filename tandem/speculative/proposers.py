"""Proposers: draft the next tokens of a request from text it has already seen. Pure Python.

A proposer keeps an index of each request's tokens (prompt + output), extended as tokens
arrive, and answers `propose(request_id, k)` with at most k tokens. A draft is only a guess:
the engine verifies it against the target model, so a bad draft costs time, never output.

    ngram   prompt lookup: the longest of the last n tokens (ngram_max down to ngram_min)
            seen earlier; the draft is what followed its most recent occurrence.
    suffix  a suffix index: every earlier occurrence of the longest matching suffix votes for
            the next token; the draft follows the majority while it stays confident, so its
            length adapts to how predictable the text is. With `share`, the recent finished
            requests of the same tenant (same non-empty cache_salt) are searched too.

An index maps each n-gram (ngram_min <= n <= ngram_max) to the positions of the tokens that
followed it, so adding a token and looking up a suffix each cost O(ngram_max) dict operations:

    tokens: a b c a b d a b      n=2: (a,b) -> [2, 5]  (c and d followed "a b")
                                 lookup "a b" (the last two tokens): most recent follower 5
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from typing import Protocol

# suffix: a drafted token needs at least this share of the votes of the occurrences still
# matching (the confidence rule that ends a draft early on text that is not repeating).
MIN_VOTE_SHARE = 0.3
# suffix: finished requests kept per tenant, and tenants kept, for shared drafting.
SHARED_REQUESTS_PER_TENANT = 16
SHARED_TENANTS = 256
# suffix: the most recent occurrences that vote (a common n-gram can occur thousands of times)
MAX_VOTERS = 64


class NgramIndex:
    """The positions that followed every n-gram of one token sequence, kept as it grows."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self._followers: dict[tuple[int, ...], list[int]] = {}

    def extend(self, token_ids: Sequence[int]) -> None:
        tokens, followers = self.tokens, self._followers
        for t in token_ids:
            j = len(tokens)  # the new token's position: it follows the n-grams ending at j - 1
            for n in range(self.n_min, min(self.n_max, j) + 1):
                followers.setdefault(tuple(tokens[j - n : j]), []).append(j)
            tokens.append(t)

    def followers(self, context: Sequence[int]) -> list[int]:
        """Positions that followed earlier occurrences of `context` (oldest first)."""
        return self._followers.get(tuple(context), [])

    def longest_match(self, suffix: Sequence[int]) -> tuple[int, list[int]]:
        """(n, positions) for the longest n-gram ending `suffix` seen before; (0, [])."""
        for n in range(min(self.n_max, len(suffix)), self.n_min - 1, -1):
            found = self.followers(suffix[len(suffix) - n :])
            if found:
                return n, found
        return 0, []


class Proposer(Protocol):
    """What the engine's speculator asks of a proposer (tandem.speculative.speculator).

    An EAGLE-style head or MTP layers fit the same shape: `start` and `extend` see the
    request's tokens, `propose` returns a draft; a proposer that runs a model reads the
    target's hidden states through the runner (a later `observe` hook), not this interface's
    callers."""

    name: str

    def start(
        self, request_id: str, token_ids: Sequence[int], tenant: str, num_prompt: int
    ) -> None: ...

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None: ...

    def propose(self, request_id: str, k: int) -> list[int]: ...

    def finish(self, request_id: str) -> None: ...

    def num_requests(self) -> int: ...


class IndexedProposer:
    """What both proposers keep: each live request's `NgramIndex` (and its tenant), built at
    `start`, grown by `extend`, dropped by `finish`."""

    def __init__(self, n_min: int, n_max: int) -> None:
        self.n_min, self.n_max = n_min, n_max
        self._indexes: dict[str, NgramIndex] = {}
        self._tenants: dict[str, str] = {}

    def start(
        self, request_id: str, token_ids: Sequence[int], tenant: str = "", num_prompt: int = 0
    ) -> None:
        index = self._indexes[request_id] = NgramIndex(self.n_min, self.n_max)
        index.extend(token_ids)
        self._tenants[request_id] = tenant

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._indexes[request_id].extend(token_ids)

    def finish(self, request_id: str) -> None:
        self._forget(request_id)

    def _forget(self, request_id: str) -> tuple[NgramIndex | None, str]:
        """Drop the request: (its index, its tenant)."""
        return self._indexes.pop(request_id, None), self._tenants.pop(request_id, "")

    def num_requests(self) -> int:
        return len(self._indexes)


class NgramProposer(IndexedProposer):
    """Prompt lookup: copy what followed the most recent earlier occurrence of the longest
    matching suffix n-gram."""

    name = "ngram"

    def propose(self, request_id: str, k: int) -> list[int]:
        index = self._indexes[request_id]
        _, found = index.longest_match(index.tokens[-self.n_max :])
        if not found:
            return []
        at = found[-1]
        return index.tokens[at : at + k]


class SuffixProposer(IndexedProposer):
    """Majority vote over every earlier occurrence of the longest matching suffix, extended
    token by token while the vote stays above `MIN_VOTE_SHARE`; the request's own tokens
    first, then (with `share`) its tenant's recent requests."""

    name = "suffix"

    def __init__(self, n_min: int, n_max: int, share: bool = False) -> None:
        super().__init__(n_min, n_max)
        self.share = share
        # tenant -> its recent finished requests' indexes, oldest first
        self._shared: OrderedDict[str, list[NgramIndex]] = OrderedDict()

    def propose(self, request_id: str, k: int) -> list[int]:
        index = self._indexes[request_id]
        suffix = index.tokens[-self.n_max :]
        draft = vote(index, suffix, k)
        if draft or not self.share:
            return draft
        for other in reversed(self._shared.get(self._tenants[request_id], ())):
            draft = vote(other, suffix, k)
            if draft:
                return draft
        return []

    def finish(self, request_id: str) -> None:
        index, tenant = self._forget(request_id)
        # Only a named tenant's requests are shared, and only with the same tenant: the
        # empty salt is everyone's, and a draft must not reveal another tenant's text.
        if index is None or not self.share or not tenant:
            return
        kept = self._shared.setdefault(tenant, [])
        self._shared.move_to_end(tenant)
        kept.append(index)
        del kept[:-SHARED_REQUESTS_PER_TENANT]
        while len(self._shared) > SHARED_TENANTS:
            self._shared.popitem(last=False)

    def num_tenants(self) -> int:
        return len(self._shared)


def vote(index: NgramIndex, suffix: Sequence[int], k: int) -> list[int]:
    """Up to k tokens following `suffix` in `index`'s sequence by majority vote of the
    occurrences of its longest match; each next token must take `MIN_VOTE_SHARE` of the
    votes of the occurrences that still match."""
    _, found = index.longest_match(suffix)
    tokens, draft = index.tokens, list[int]()
    positions = [p for p in found[-MAX_VOTERS:] if p < len(tokens)]
    while positions and len(draft) < k:
        votes = Counter(tokens[p] for p in positions)
        latest = {tokens[p]: p for p in positions}  # positions are oldest first
        best = max(votes, key=lambda t: (votes[t], latest[t]))  # a tie: the most recent
        if votes[best] < MIN_VOTE_SHARE * len(positions):
            break
        draft.append(best)
        positions = [p + 1 for p in positions if tokens[p] == best and p + 1 < len(tokens)]
    return draft


def make_proposer(method: str, n_min: int, n_max: int, share: bool = False) -> Proposer:
    if method == "ngram":
        return NgramProposer(n_min, n_max)
    if method == "suffix":
        return SuffixProposer(n_min, n_max, share)
    raise ValueError(f"no proposer named {method!r} (ngram, suffix)")
