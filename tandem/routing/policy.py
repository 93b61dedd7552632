"""Placement: which (prefill, decode) pair serves a request. Pure: plain data in and out.

Three policies (`RoutingConfig.policy`):
  kv           cache affinity within a load band (below), the default
  load         least loaded, ignoring caches
  round_robin  rotate through workers (a baseline for benchmarks)

The kv policy, for a request of `num_prompt_tokens` whose leading blocks are held by some
workers (`overlap`, from the prefix index):
  1. decode worker: least loaded (running + waiting + this router's in-flight requests) among
     those with KV headroom for the prompt; ties go to the larger cached prefix, then to
     more free blocks.
  2. conditional disaggregation: if the decode worker's *uncached* part of the prompt is
     below `disagg_min_uncached_tokens`, it prefills the prompt itself (shipping KV would
     cost more than computing it).
  3. prefill worker: among workers whose queued prefill tokens are within
     `imbalance_threshold_tokens` of the least loaded one, pick the lowest
     `cache_weight` x uncached tokens + queued tokens, i.e. affinity wins while loads are
     close and load wins once the imbalance crosses the threshold. An uncached token
     weighs more than a queued one (default 2x): computing a prefix on a second worker
     costs not only this request's time but also the prefix it evicts there. The band
     also spreads a hot prefix: once its holder is busier than the band, requests go to
     another worker, which then caches the prefix too, and affinity splits the traffic
     between the holders.
  4. ties (typically a prefix nobody holds, at low load) go to the prefix's *home*: the
     worker ranked first for `request.prefix_key` by rendezvous hashing. Each prefix so
     has one preferred prefill worker, the same in every router and after an eviction,
     and the prompts of a fleet are split between the workers' caches instead of all
     landing on the first worker (or on every worker in turn). Requests without a key
     (shorter than one block, so below any sensible disaggregation threshold; the
     simulator's, which carry no tokens) take the first tied worker by id.
  5. KV format: a prefill worker is paired only with a decode worker of the same KV format
     (dtype and fp8 scales, `WorkerLoad.kv_format`): the decode worker would refuse any
     other's blocks. Tensor-parallel sizes may differ (`WorkerLoad.tensor_parallel_size`:
     the decode worker's ranks each pull their KV heads from the prefill ranks holding
     them), but a tensor-parallel worker hands off only when its rank 0 maps every rank's
     cache (`WorkerLoad.kv_handoff`: on a CPU); one that cannot is never paired (as a
     decode worker it prefills its requests itself). Speculative decoding with a draft
     model: a prefill worker is paired only with a decode worker of the same draft format
     (`WorkerLoad.draft_format`, "" for none): a decode worker with a draft model needs
     the prefill worker to prefill that draft too and hand its KV over, and a prefill
     worker with a draft sends a section a draft-less decode worker refuses. With no
     compatible prefill worker, the decode worker prefills and the reason says why.
  6. KV tiers: for a worker whose host and disk tiers the prefix index shows
     (`request.tiers`, tandem.routing.tiers), the uncached tokens of step 3 are its
     tier-aware equivalent: each tier segment that onloads faster than the worker
     recomputes costs t x prefill rate / tier rate instead of t. A worker without tier
     entries scores exactly as without tiers. The decode side (headroom, step 2) counts
     device blocks alone: onloaded blocks need device blocks as much as computed ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from tandem.load import Load
from tandem.routing.tiers import TierCost, TierOverlap, tier_cost
from tandem.types import Role

POLICIES = ("kv", "load", "round_robin")


class RouteKind(StrEnum):
    """The category of a placement, set by `choose` (a metric label takes only these)."""

    KV_AFFINITY = "kv_affinity"  # kv policy: prefill worker by cached tokens and load
    LOAD = "load"  # load policy: the least loaded prefill worker
    ROUND_ROBIN = "round_robin"  # round_robin policy (either path)
    SHORT_PROMPT = "short_prompt"  # colocated: too few uncached tokens to be worth a hand-off
    NO_PREFILL_WORKER = "no_prefill_worker"  # colocated: no healthy prefill worker


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    """Placement knobs (router flags of the same names).

    Attributes:
        policy: "kv", "load" or "round_robin".
        disagg_min_uncached_tokens: prompts with fewer uncached tokens (on the chosen decode
            worker) skip the prefill worker; 0 = always disaggregate.
        imbalance_threshold_tokens: prefill workers whose queued prefill tokens exceed the
            least loaded one's by more than this are not chosen for cache affinity.
        min_free_block_fraction: a decode worker needs this fraction of its blocks free
            beyond the prompt's needs to be preferred.
        cache_weight: how many queued prefill tokens one uncached prompt token is worth when
            choosing the prefill worker (>= 1). 1 picks the soonest prefill for this
            request alone; more keeps a prefix on the worker that holds it while that
            worker's queue is up to (cache_weight - 1) x the prompt longer, instead of
            copying it onto a second worker and evicting what that one held.
        affinity_blocks: a prompt's prefix key (`prefix_key`: its home prefill worker when
            no worker caches it) is the chained hash of this many leading blocks, or of all
            full blocks of a shorter prompt. Deep enough to tell apart system prompts that
            open with the same boilerplate; 16 blocks = 256 tokens.
    """

    policy: str = "kv"
    disagg_min_uncached_tokens: int = 64
    imbalance_threshold_tokens: int = 2048
    min_free_block_fraction: float = 0.05
    cache_weight: float = 2.0
    affinity_blocks: int = 16

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.disagg_min_uncached_tokens < 0:
            raise ValueError(
                f"disagg_min_uncached_tokens must be >= 0, got {self.disagg_min_uncached_tokens}"
            )
        if self.imbalance_threshold_tokens < 0:
            raise ValueError(
                f"imbalance_threshold_tokens must be >= 0, got {self.imbalance_threshold_tokens}"
            )
        if self.cache_weight < 1.0:
            raise ValueError(f"cache_weight must be >= 1, got {self.cache_weight}")
        if self.affinity_blocks <= 0:
            raise ValueError(f"affinity_blocks must be positive, got {self.affinity_blocks}")
        if not 0.0 <= self.min_free_block_fraction < 1.0:
            raise ValueError(
                f"min_free_block_fraction must be in [0, 1), got {self.min_free_block_fraction}"
            )


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerLoad(Load):
    """What the router knows about one worker when it places a request: its `Load` (as its
    registry record gave it; `prefill_tokens_per_s` 0 until measured) and what this router
    adds."""

    worker_id: str
    role: Role
    address: str
    draining: bool = False
    inflight_requests: int = 0  # sent by this router, not yet finished
    inflight_prefill_tokens: int = 0
    kv_format: str = ""  # the KV cache's format (dtype, fp8 scales); pairs must be equal
    tensor_parallel_size: int = 1  # ranks (any sizes pair; see above)
    kv_handoff: bool = False  # a tensor-parallel worker's KV can be handed off (see above)
    accepts_moved: bool = False  # continues a draining decode worker's moved streams
    speculative: str = ""  # the speculative method ("", ngram, suffix, draft); not placed on
    draft_format: str = ""  # a draft model's KV section format ("": none); pairs must be equal

    @property
    def prefill_queue(self) -> int:
        return self.queued_prefill_tokens + self.inflight_prefill_tokens

    @property
    def decode_load(self) -> int:
        return max(self.num_running + self.num_waiting, self.inflight_requests)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request as placement sees it.

    Attributes:
        num_prompt_tokens: prompt length.
        block_size: tokens per KV block (to turn cached blocks into tokens).
        overlap: worker id -> leading blocks of the prompt it holds (prefix index lookup).
        sequence: a counter the caller advances per request (round robin, and the load
            policy's ties).
        prefix_key: identifies the prompt's leading blocks (the router passes the chained
            hash of block `affinity_blocks`, or of the last full block of a shorter
            prompt); None for prompts shorter than one block.
        tiers: worker id -> leading blocks of the prompt it holds per KV tier (device, host,
            disk; three prefix index lookups), for workers with tiers; its device count is
            `overlap`'s. None or a worker absent: device blocks alone (`overlap`).
    """

    num_prompt_tokens: int
    block_size: int = 16
    overlap: Mapping[str, int] | None = None
    sequence: int = 0
    prefix_key: int | None = None
    tiers: Mapping[str, TierOverlap] | None = None

    def cached_tokens(self, worker_id: str) -> int:
        blocks = (self.overlap or {}).get(worker_id, 0)
        # The last prompt token is always computed, whatever the cache holds.
        return min(blocks * self.block_size, max(self.num_prompt_tokens - 1, 0))

    def prefill_cost(self, worker: WorkerLoad) -> TierCost:
        """What prefilling the prompt on `worker` takes: the tokens its device cache and its
        tiers serve and the rest's cost in prefill-token equivalents (tandem.routing.tiers);
        without tier entries, its cached tokens and the uncached ones."""
        tiers = (self.tiers or {}).get(worker.worker_id)
        if tiers is None:
            cached = self.cached_tokens(worker.worker_id)
            return TierCost(cached, 0, 0, self.num_prompt_tokens - cached)
        return tier_cost(
            tiers,
            self.block_size,
            self.num_prompt_tokens,
            worker.prefill_tokens_per_s,
            worker.host_onload_tokens_per_s,
            worker.disk_onload_tokens_per_s,
        )


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as `choose` weighed it, with the figures its rule compares.

    Attributes:
        cached_tokens: prompt tokens it holds in its device cache (0 unless the policy is kv).
        load: a decode worker's load (`WorkerLoad.decode_load`); None for a prefill worker.
        free_blocks: a decode worker's free KV blocks; None for a prefill worker.
        queue: a prefill worker's queued prefill tokens; None for a decode worker.
        cost: a prefill worker's cost, cache_weight x uncached tokens + queued tokens (the
            kv policy takes the lowest within the imbalance band; uncached tokens in
            prefill-token equivalents where tiers serve some); None for a decode worker.
        tier_tokens: prompt tokens a prefill worker would onload from its host and disk
            tiers (where that beats recomputing them; 0 unless the policy is kv).
    """

    worker_id: str
    role: Role
    cached_tokens: int
    draining: bool = False
    load: int | None = None
    free_blocks: int | None = None
    queue: int | None = None
    cost: float | None = None
    tier_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request runs, why (`reason`: free text for people; `kind`: its category),
    and every worker the policy weighed (`candidates`, by worker id)."""

    decode: WorkerLoad
    prefill: WorkerLoad | None  # None: the decode worker prefills (colocated)
    kind: RouteKind
    reason: str
    cached_tokens: int = 0  # prompt tokens the chosen prefilling worker already holds
    candidates: tuple[Candidate, ...] = ()

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None


def choose(
    request: RouteRequest, workers: Iterable[WorkerLoad], config: RoutingConfig
) -> Placement | None:
    """Pick the pair for `request`. None when no decode worker is available (UNAVAILABLE).

    Equal inputs place deterministically: ties break on worker id, except that the load
    policy rotates (by `request.sequence`) among equally loaded prefill workers and the kv
    policy sends a keyed request to its prefix's home among tied prefill workers.
    """
    workers = sorted(workers, key=lambda w: w.worker_id)
    candidates = weigh(request, workers, config)
    live = [w for w in workers if not w.draining]
    decodes = [w for w in live if w.role == Role.DECODE]
    prefills = [w for w in live if w.role == Role.PREFILL]
    if not decodes:
        return None
    if config.policy == "round_robin":
        return _round_robin(request, decodes, prefills, config, candidates)
    kv = config.policy == "kv"
    decode = min(decodes, key=lambda w: _decode_key(w, request, kv, config))
    local = request.cached_tokens(decode.worker_id) if kv else 0
    uncached = request.num_prompt_tokens - local
    if uncached < config.disagg_min_uncached_tokens:
        return Placement(
            decode,
            None,
            RouteKind.SHORT_PROMPT,
            f"{uncached} uncached tokens < {config.disagg_min_uncached_tokens}: "
            f"prefill on {decode.worker_id}",
            local,
            candidates,
        )
    if not prefills:
        return Placement(
            decode,
            None,
            RouteKind.NO_PREFILL_WORKER,
            "no prefill worker: prefill on decode",
            local,
            candidates,
        )
    compatible = [w for w in prefills if can_hand_off(w, decode)]
    if not compatible:
        return _no_compatible_prefill(decode, prefills, local, candidates)
    prefills = compatible
    if not kv:
        # Rotate among equally loaded workers: at low load every queue reads 0, and a fixed
        # tie-break would send everything to one worker.
        least = min(w.prefill_queue for w in prefills)
        tied = [w for w in prefills if w.prefill_queue == least]
        prefill = tied[request.sequence % len(tied)]
        reason = f"least loaded: queue {prefill.prefill_queue}"
        return Placement(decode, prefill, RouteKind.LOAD, reason, candidates=candidates)
    least = min(w.prefill_queue for w in prefills)
    band = [w for w in prefills if w.prefill_queue - least <= config.imbalance_threshold_tokens]
    costs = {c.worker_id: c.cost for c in candidates if c.cost is not None}
    best = min(costs[w.worker_id] for w in band)
    tied = [w for w in band if costs[w.worker_id] == best]
    prefill = _home(tied, request)
    cached = request.cached_tokens(prefill.worker_id)
    skipped = len(prefills) - len(band)
    reason = f"kv: {cached} cached tokens, queue {prefill.prefill_queue}"
    tiered = request.prefill_cost(prefill)
    if tiered.tier_tokens:
        reason += f", {tiered.host_tokens} from host + {tiered.disk_tokens} from disk tiers"
    if len(tied) > 1 and request.prefix_key is not None:
        reason += f", prefix home among {len(tied)} tied"
    if skipped:
        reason += f" ({skipped} busier prefill worker(s) outside the imbalance band)"
    return Placement(decode, prefill, RouteKind.KV_AFFINITY, reason, cached, candidates)


def weigh(
    request: RouteRequest, workers: Iterable[WorkerLoad], config: RoutingConfig
) -> tuple[Candidate, ...]:
    """Every worker (draining ones too, marked) with the figures `choose` compares, by
    worker id: a decode worker's load and free blocks, a prefill worker's queue and cost.
    `choose` decides on these costs and returns them in `Placement.candidates`."""
    kv = config.policy == "kv"
    out = []
    for w in sorted(workers, key=lambda w: w.worker_id):
        cached = request.cached_tokens(w.worker_id) if kv else 0
        if w.role == Role.DECODE:
            out.append(
                Candidate(
                    w.worker_id,
                    w.role,
                    cached,
                    w.draining,
                    load=w.decode_load,
                    free_blocks=w.num_free_blocks,
                )  # fmt: skip
            )
        else:
            split = request.prefill_cost(w) if kv else TierCost(0, 0, 0, request.num_prompt_tokens)
            cost = config.cache_weight * split.uncached_cost + w.prefill_queue
            out.append(
                Candidate(
                    w.worker_id,
                    w.role,
                    split.device_tokens,
                    w.draining,
                    queue=w.prefill_queue,
                    cost=cost,
                    tier_tokens=split.tier_tokens,
                )  # fmt: skip
            )
    return tuple(out)


def prefix_key(block_hashes: Sequence[int], affinity_blocks: int) -> int | None:
    """A prompt's prefix key: the chained hash of its block `affinity_blocks` (it covers every
    block before it), or of its last full block when it has fewer; None below one block.

    Args:
        block_hashes: the prompt's chained prefix hashes (`tandem.engine.prefix_hash`).
    """
    if not block_hashes:
        return None
    return block_hashes[min(len(block_hashes), affinity_blocks) - 1]


def home_rank(prefix_key: int, worker_id: str) -> int:
    """Rendezvous weight of `worker_id` for a prefix: stable across processes and hosts
    (Python's hash() of a str is salted per process, so two routers would disagree)."""
    digest = hashlib.blake2b(f"{prefix_key}/{worker_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def _home(tied: list[WorkerLoad], request: RouteRequest) -> WorkerLoad:
    """The tied worker a prefix prefers; without a key, the first by worker id."""
    if len(tied) == 1 or request.prefix_key is None:
        return tied[0]
    key = request.prefix_key
    return max(tied, key=lambda w: home_rank(key, w.worker_id))


def _decode_key(
    w: WorkerLoad, request: RouteRequest, kv: bool, config: RoutingConfig
) -> tuple[int, int, int, int]:
    cached = request.cached_tokens(w.worker_id) if kv else 0
    need = -(-(request.num_prompt_tokens - cached) // request.block_size)
    spare = w.num_free_blocks - need - int(config.min_free_block_fraction * w.num_blocks)
    short = 1 if w.num_blocks and spare < 0 else 0  # known to lack headroom: last resort
    return (short, w.decode_load, -cached, -w.num_free_blocks)


def _round_robin(
    request: RouteRequest,
    decodes: list[WorkerLoad],
    prefills: list[WorkerLoad],
    config: RoutingConfig,
    candidates: tuple[Candidate, ...],
) -> Placement:
    decode = decodes[request.sequence % len(decodes)]
    kind = RouteKind.ROUND_ROBIN
    if request.num_prompt_tokens < config.disagg_min_uncached_tokens or not prefills:
        reason = "round robin: prefill on decode"
        return Placement(decode, None, kind, reason, candidates=candidates)
    compatible = [w for w in prefills if can_hand_off(w, decode)]
    if not compatible:
        return _no_compatible_prefill(decode, prefills, 0, candidates)
    prefills = compatible
    prefill = prefills[request.sequence % len(prefills)]
    return Placement(decode, prefill, kind, "round robin", candidates=candidates)


def can_hand_off(prefill: WorkerLoad, decode: WorkerLoad) -> bool:
    """Whether `decode` can read `prefill`'s blocks: the same KV format and the same draft
    format (the same draft model, or none on both), and each side single-rank or
    tensor-parallel with every rank's cache mapped (`kv_handoff`)."""
    return (
        prefill.kv_format == decode.kv_format
        and prefill.draft_format == decode.draft_format
        and _hands_off(prefill)
        and _hands_off(decode)
    )


def _hands_off(worker: WorkerLoad) -> bool:
    return worker.tensor_parallel_size == 1 or worker.kv_handoff


def _no_compatible_prefill(
    decode: WorkerLoad,
    prefills: list[WorkerLoad],
    cached: int,
    candidates: tuple[Candidate, ...],
) -> Placement:
    """Colocated on `decode`: no prefill worker can hand off to it."""
    if not _hands_off(decode):
        reason = (
            f"decode worker of {decode.tensor_parallel_size} tensor-parallel ranks whose "
            f"caches its rank 0 does not map (hand-offs into tensor-parallel workers are "
            f"built on a CPU only): prefill on {decode.worker_id}"
        )
        return Placement(decode, None, RouteKind.NO_PREFILL_WORKER, reason, cached, candidates)
    same_format = [w for w in prefills if w.kv_format == decode.kv_format]
    same_draft = [w for w in same_format if w.draft_format == decode.draft_format]
    if same_format and not same_draft:
        others = sorted({w.draft_format or "none" for w in same_format})
        reason = (
            f"no prefill worker with draft model {decode.draft_format or 'none'} "
            f"(theirs: {', '.join(others)}): prefill on {decode.worker_id}"
        )
        return Placement(decode, None, RouteKind.NO_PREFILL_WORKER, reason, cached, candidates)
    if same_draft:  # all of them tensor-parallel without mapped caches
        sizes = sorted({w.tensor_parallel_size for w in same_draft})
        reason = (
            f"no prefill worker with KV format {decode.kv_format or 'unknown'} that can hand "
            f"off (tensor-parallel sizes: {', '.join(map(str, sizes))}, their ranks' caches "
            f"not mapped: built on a CPU only): prefill on {decode.worker_id}"
        )
        return Placement(decode, None, RouteKind.NO_PREFILL_WORKER, reason, cached, candidates)
    others = sorted({w.kv_format or "unknown" for w in prefills})
    reason = (
        f"no prefill worker with KV format {decode.kv_format or 'unknown'} "
        f"(theirs: {', '.join(others)}): prefill on {decode.worker_id}"
    )
    return Placement(decode, None, RouteKind.NO_PREFILL_WORKER, reason, cached, candidates)
