"""What the router does when a worker fails a request in flight. Pure: plain data in and out.

Three faults, each met by one recovery step, all bounded by a per-request budget:

  prefill_failed  the prefill worker died, froze or errored before handing off
  kv_pull_failed  the decode worker could not read the hand-off (read failed, lease lapsed
                  before confirm, owner gone): it freed its reserved blocks and said so
  decode_failed   the decode worker died or froze, before or while streaming
  decode_moved    the decode worker is draining: it handed the stream's KV off (issue 46)

  prefill faults  -> reprefill on another healthy prefill worker (the same decode worker
                     pulls from it), or, for a short prompt, recompute: the decode worker
                     prefills the prompt itself. With no other prefill worker, recompute
                     only when the failed one is gone (unreachable) or the decode worker
                     has room (its queued prompt tokens plus this prompt within
                     `recompute_max_queued_tokens`); otherwise fail promptly: moving a live
                     prefill worker's load onto a busy decode worker only spreads the
                     overload to the streams it serves
  decode_moved    -> migrate, as decode_failed, the new decode worker pulling the moved KV
                     (a pull that fails: recompute there, prompt and output)
  decode_failed   -> migrate: another healthy decode worker continues from the prompt plus
                     the tokens already streamed (it prefills them itself; seeded sampling
                     resumes where it stopped because the engine advances the seed's stream
                     by the carried tokens); with no other healthy decode worker (the only
                     one died), hold: the router keeps the client's stream open and plans
                     again as workers come and go, for at most `hold_s` -- a restarted
                     incarnation of the failed worker (a new registry epoch) counts as a
                     new worker -- then migrates to the first that is back
  budget spent, or no healthy worker of the needed role -> fail with UNAVAILABLE, promptly

"Healthy" is the caller's view: registry members minus open circuit breakers
(`tandem.routing.health`) minus the workers that already failed this request.

Classifying a failed worker call (`worker_fault`, `ejection_reason`, `last_of_role`): a status
in WORKER_FAULT_STATUSES means the worker failed, not the request (CANCELLED only when the
worker ended the call: the router's own cancels are handled before); UNAVAILABLE means it
cannot be reached. A worker that stalled is never ejected when it is the last live one of its
role (that would refuse every request rather than spare them a slow worker).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from tandem.routing.policy import WorkerLoad
from tandem.types import Role


class Fault(enum.Enum):
    PREFILL_FAILED = "prefill_failed"
    KV_PULL_FAILED = "kv_pull_failed"
    DECODE_FAILED = "decode_failed"
    DECODE_MOVED = "decode_moved"  # draining: its KV of the stream is handed off


# gRPC status names of a worker call that mean the worker failed, not the request.
WORKER_FAULT_STATUSES = frozenset({"UNAVAILABLE", "CANCELLED", "INTERNAL", "UNKNOWN", "DATA_LOSS"})


def worker_fault(status: str) -> bool:
    """Whether a worker call that ended with gRPC status `status` (its name) is the
    worker's fault (recover elsewhere) rather than the request's own outcome."""
    return status in WORKER_FAULT_STATUSES


def ejection_reason(unreachable: bool, stalled: bool) -> str:
    """The label of a worker taken out of rotation (tandem_router_ejections_total)."""
    return "unreachable" if unreachable else "stalled" if stalled else "error"


def last_of_role(worker_id: str, workers: Iterable[WorkerLoad]) -> bool:
    """Whether `worker_id` is the only live (healthy, not draining) worker of its role."""
    workers = list(workers)
    role = next((w.role for w in workers if w.worker_id == worker_id), None)
    return role is not None and not any(
        w.role == role and w.worker_id != worker_id and not w.draining for w in workers
    )


HOLD_POLL_S = 0.1  # how often a held stream (or a request waiting for a decode worker) re-plans


class Action(enum.Enum):
    REPREFILL = "reprefill"  # prefill again on `prefill`; `decode` pulls from it
    RECOMPUTE = "recompute"  # `decode` prefills the prompt itself
    MIGRATE = "migrate"  # `decode` (another worker) continues the request
    HOLD = "hold"  # no decode worker to continue on yet: plan again shortly (within hold_s)
    FAIL = "fail"  # end the request with UNAVAILABLE and `reason`


@dataclass(frozen=True, slots=True)
class RecoveryConfig:
    """Attributes:
    max_recoveries: recovery steps one request may take before it fails (the retry budget).
    reprefill: on a prefill fault, try another prefill worker before recomputing on the
        decode worker. Off: always recompute (the decode workers absorb the prefill work).
    recompute_max_queued_tokens: with no other prefill worker and the failed one still
        reachable, the decode worker takes over the prompt only while its queued prompt
        tokens plus this one's stay within this.
    hold_s: how long a stream whose decode worker failed is held, open, when no other
        healthy decode worker exists (the only one died and is being restarted, or a new
        one is starting); 0: fail it at once.
    """

    max_recoveries: int = 3
    reprefill: bool = True
    recompute_max_queued_tokens: int = 8192
    hold_s: float = 60.0

    def __post_init__(self) -> None:
        if self.max_recoveries < 0:
            raise ValueError(f"max_recoveries must be >= 0, got {self.max_recoveries}")
        if self.hold_s < 0:
            raise ValueError(f"hold_s must be >= 0, got {self.hold_s}")
        if self.recompute_max_queued_tokens < 0:
            raise ValueError(
                f"recompute_max_queued_tokens must be >= 0, got {self.recompute_max_queued_tokens}"
            )


@dataclass(frozen=True, slots=True)
class Failure:
    """One request's state when a worker fails it.

    Attributes:
        fault: what failed.
        decode_id: the decode worker the request was placed on.
        prefill_id: the prefill worker that was (or would have been) used; None if colocated.
        recoveries: recovery steps this request already took.
        failed: every worker that failed this request so far (this fault's included).
        num_uncached_tokens: prompt tokens the decode worker would compute on a recompute;
            below `min_reprefill_tokens` a recompute is cheaper than another hand-off.
        min_reprefill_tokens: the router's disaggregation threshold.
        prefill_gone: the failed prefill worker is unreachable (dead, frozen, cut off), so
            its queue is gone with it; False: it is alive (errored or stalled).
        held_s: how long the request has been held so far waiting for a decode worker.
        restarted: workers that failed this request and have since come back as a new
            incarnation (another registry epoch: restarted by supervision): new workers,
            eligible again, `decode_id` included.
    """

    fault: Fault
    decode_id: str
    prefill_id: str | None = None
    recoveries: int = 0
    failed: frozenset[str] = frozenset()
    num_uncached_tokens: int = 0
    min_reprefill_tokens: int = 0
    prefill_gone: bool = True
    held_s: float = 0.0
    restarted: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Recovery:
    action: Action
    reason: str
    decode: WorkerLoad | None = None  # where the request continues (None only for FAIL)
    prefill: WorkerLoad | None = None  # REPREFILL only
    keep_kv: bool = False  # decode_moved: `decode` pulls the moved KV (else it prefills)

    def describe(self) -> str:
        """One line for logs and the response's timings."""
        where = []
        if self.prefill is not None:
            where.append(f"prefill {self.prefill.worker_id}")
        if self.decode is not None and self.action is not Action.FAIL:
            where.append(f"decode {self.decode.worker_id}")
        suffix = f" on {', '.join(where)}" if where else ""
        return f"{self.action.value}{suffix}: {self.reason}"


def plan_recovery(
    failure: Failure, workers: Iterable[WorkerLoad], config: RecoveryConfig
) -> Recovery:
    """The next step for a request a worker just failed. `workers`: the healthy ones."""
    what = failure.fault.value
    if failure.recoveries >= config.max_recoveries:
        return Recovery(
            Action.FAIL,
            f"{what}; gave up after {failure.recoveries} recovery step(s) "
            f"(max_recoveries {config.max_recoveries})",
        )
    live = sorted(
        (w for w in workers if not w.draining and w.worker_id not in failure.failed),
        key=lambda w: w.worker_id,
    )
    if failure.fault in (Fault.DECODE_FAILED, Fault.DECODE_MOVED):
        decodes = [
            w
            for w in live
            if w.role == Role.DECODE
            and (w.worker_id != failure.decode_id or w.worker_id in failure.restarted)
        ]
        if not decodes:
            return _hold_or_fail(f"{what} on {failure.decode_id}", failure, config)
        moved = failure.fault is Fault.DECODE_MOVED
        takes = [w for w in decodes if w.accepts_moved] if moved else []
        target = min(takes or decodes, key=lambda w: (w.decode_load, -w.num_free_blocks))
        how = "" if takes or not moved else " (none continues moved streams: it prefills)"
        return Recovery(
            Action.MIGRATE,
            f"{what} on {failure.decode_id}; continuing on the least loaded healthy decode "
            f"worker (load {target.decode_load}){how}",
            decode=target,
            keep_kv=bool(takes),
        )
    decode = next((w for w in live if w.worker_id == failure.decode_id), None)
    if decode is None:
        # The decode worker is gone too: nothing to hand off to. Migrate (recompute there).
        decodes = [w for w in live if w.role == Role.DECODE]
        if not decodes:
            return _hold_or_fail(what, failure, config)
        decode = min(decodes, key=lambda w: (w.decode_load, -w.num_free_blocks))
        return Recovery(
            Action.MIGRATE,
            f"{what}, and decode worker {failure.decode_id} is unhealthy; prefill on "
            f"{decode.worker_id}",
            decode=decode,
        )
    prefills = [w for w in live if w.role == Role.PREFILL]
    if failure.prefill_id is None:  # a moved stream's KV: another prefill has only the prompt
        return Recovery(
            Action.RECOMPUTE, f"{what}; a moved stream's hand-off: prefill on decode", decode=decode
        )
    if not config.reprefill:
        return Recovery(Action.RECOMPUTE, f"{what}; reprefill is off", decode=decode)
    if failure.num_uncached_tokens < failure.min_reprefill_tokens:
        return Recovery(
            Action.RECOMPUTE,
            f"{what}; {failure.num_uncached_tokens} uncached tokens < "
            f"{failure.min_reprefill_tokens}: cheaper to prefill on decode",
            decode=decode,
        )
    if not prefills:
        queued = decode.prefill_queue + failure.num_uncached_tokens
        if failure.prefill_gone:
            why = "no other healthy prefill worker"
        elif queued <= config.recompute_max_queued_tokens:
            why = f"no other healthy prefill worker; decode has room ({queued} queued tokens)"
        else:
            return Recovery(
                Action.FAIL,
                f"{what}; no other healthy prefill worker, and decode worker "
                f"{decode.worker_id} has no room to prefill {failure.num_uncached_tokens} "
                f"tokens ({queued} queued > recompute_max_queued_tokens "
                f"{config.recompute_max_queued_tokens})",
            )
        return Recovery(Action.RECOMPUTE, f"{what}; {why}", decode=decode)
    prefill = min(prefills, key=lambda w: w.prefill_queue)
    return Recovery(
        Action.REPREFILL,
        f"{what}" + (f" on {failure.prefill_id}" if failure.prefill_id else "")
        + f"; least loaded other prefill worker (queue {prefill.prefill_queue})",
        decode=decode,
        prefill=prefill,
    )  # fmt: skip


def _hold_or_fail(what: str, failure: Failure, config: RecoveryConfig) -> Recovery:
    """No healthy decode worker to continue on: hold the stream while `hold_s` lasts."""
    if failure.held_s < config.hold_s:
        return Recovery(
            Action.HOLD,
            f"{what}; no other healthy decode worker: holding the stream until one is back "
            f"(held {failure.held_s:.1f}s of hold_s {config.hold_s:g}s)",
        )
    held = f" after holding the stream {failure.held_s:.1f}s" if config.hold_s else ""
    return Recovery(Action.FAIL, f"{what}; no other healthy decode worker{held}")
