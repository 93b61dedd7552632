"""The ranks of a tensor-parallel worker: rank 0 is the engine (scheduler, sampler, the
worker's process); ranks 1..N-1 are processes it spawns that run the same forward on their
shards (tandem.parallel.sharding) and nothing else.

    rank 0 (engine)                         rank r (follower)
      schedule -> StepPlan ---- pipe ---->    recv StepPlan
      forward on shard 0   <- all-reduce ->   forward on shard r
      logits (all-gather), sample             (logits dropped)

Each step's plan (rows, their tokens and block tables, released requests, whether every
rank replays a decode CUDA graph and which: a few hundred bytes for a decode step) goes to
every follower through its own pipe, so an idle follower waits in `recv`, never in a
collective that could time out. On CUDA, rank 0's warm-up sends `CaptureGraphs` through
the same pipe: every rank then captures the same decode graphs, the forward's NCCL
collectives inside, in the same order (`decode_capture_plan`). Supervision both ways: rank 0
watches its followers' process sentinels and calls `on_rank_exit` when one dies (the
default ends rank 0's process, so the worker's requests migrate and it restarts); a
follower whose pipe closes (rank 0 died) exits.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

import torch

from tandem.config import EngineConfig
from tandem.engine.cuda_graphs import CapturePlan, capture_plan, check_capture_plan
from tandem.engine.device import use_device
from tandem.engine.loading import (
    LoadedModel,
    compile_matmuls,
    load_model_and_cache,
    shard_for,
)
from tandem.engine.runner import CaptureGraphs, ModelRunner, StepPlan
from tandem.engine.sampling import Sampler
from tandem.parallel.group import TPGroup

log = logging.getLogger(__name__)

# Exit status of a worker whose rank died.
RANK_DIED_EXIT = 70
JOIN_TIMEOUT_S = 10.0


def rank_device(device: str, rank: int) -> str:
    """Rank r's device: the r-th device after the engine's on CUDA, the host on a CPU."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return device
    return f"cuda:{(dev.index or 0) + rank}"


def free_address() -> str:
    """A loopback host:port nothing listens on now: rank 0's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def decode_capture_plan(config: EngineConfig, max_model_len: int, num_blocks: int) -> CapturePlan:
    """The decode CUDA graphs a rank captures, from its config and what it loaded: every
    rank derives the same plan. Safe because each input is the same on every rank: the
    config is rank 0's (a follower's differs in its device only), and `max_model_len` and
    `num_blocks` come from `load_model_and_cache`, which gives every rank the fewest blocks
    any rank can hold (an all-reduce) and the context that many blocks fit. The padding
    block is the one past the pool's, which every rank's cache holds (loading.py)."""
    return capture_plan(
        config.scheduler.max_num_seqs, max_model_len, config.cache.block_size, num_blocks
    )


def exit_on_rank_death(rank: int, exitcode: int | None) -> None:
    log.critical("rank %d of this worker exited (status %s): the worker exits", rank, exitcode)
    logging.shutdown()
    os._exit(RANK_DIED_EXIT)


class Followers:
    """Ranks 1..N-1 as spawned processes, each reading its steps from a pipe.

    Args:
        config: the engine's config (each follower builds its shard from it).
        address: rank 0's rendezvous (host:port).
        kv_share: where the ranks make their caches for rank 0 to map (on a CPU;
            `load_model_and_cache`); "" for caches of their own.
        on_rank_exit: called (rank, exit status) from a watcher thread when a follower
            exits while this group is open; the default ends this process.
    """

    def __init__(
        self,
        config: EngineConfig,
        address: str,
        on_rank_exit: Callable[[int, int | None], None] = exit_on_rank_death,
        kv_share: str = "",
    ) -> None:
        self.size = config.tensor_parallel_size
        self._on_rank_exit = on_rank_exit
        self._closing = False
        # Ahead of multiprocessing's own exit handler (atexit runs last-in first-out), which
        # terminates daemonic children: that is an exit, not a rank dying.
        atexit.register(self._mark_closing)
        ctx = mp.get_context("spawn")  # a fresh interpreter: no inherited threads or locks
        self.processes: list[BaseProcess] = []
        self._pipes: list[Connection] = []
        for rank in range(1, self.size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=follow,
                args=(config, rank, address, reader, kv_share),
                name=f"tandem-rank-{rank}",
                daemon=True,
            )
            proc.start()
            reader.close()  # the follower's end: its EOF then means this process is gone
            self.processes.append(proc)
            self._pipes.append(writer)
        self._watcher = threading.Thread(target=self._watch, name="rank-watch", daemon=True)
        self._watcher.start()

    def send(self, message: StepPlan | CaptureGraphs) -> None:
        for pipe in self._pipes:
            pipe.send(message)

    def _watch(self) -> None:
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.processes, 1)}
        ready = wait(list(sentinels))
        if self._closing:
            return
        rank = sentinels[ready[0]]  # type: ignore[index]
        proc = self.processes[rank - 1]
        proc.join(JOIN_TIMEOUT_S)  # reaped: its exit status is known
        self._on_rank_exit(rank, proc.exitcode)

    def _mark_closing(self) -> None:
        self._closing = True

    def close(self) -> None:
        """Stop the followers: each leaves its loop at the end-of-steps message."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self._mark_closing)
        for pipe in self._pipes:
            try:
                pipe.send(None)
            except (BrokenPipeError, OSError):
                pass
            pipe.close()
        for proc in self.processes:
            proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():
                proc.kill()
                proc.join()


def follow(
    config: EngineConfig, rank: int, address: str, steps: Connection, kv_share: str = ""
) -> None:
    """A follower's life: join the group, build its shard of the model and KV cache exactly
    as rank 0 builds its own (the same collectives in the same order), then run every step
    rank 0 sends (and capture decode graphs when it does) until the end-of-steps message or
    rank 0's end."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s rank {rank} %(message)s")
    # The worker's stdout is where it announces itself (READY): a follower must not keep it
    # open past rank 0's end (a supervisor reading it would wait for it).
    os.dup2(2, 1)
    # Rank 0 gone while this rank is inside a collective (loading, a step): leave, instead of
    # waiting out the collective's timeout holding the shard and the KV cache.
    threading.Thread(target=_exit_with_parent, args=(rank,), daemon=True).start()
    config = dataclasses.replace(config, device=rank_device(config.device, rank))
    use_device(config.device)
    torch.set_num_threads(threads_per_rank(config))
    shard = shard_for(config, rank)
    group = TPGroup.init(shard, address, config.device, config.tp_shared_memory)
    loaded = load_model_and_cache(config, group, kv_share=kv_share)
    sampler = Sampler(torch.Generator(device=config.device))  # never samples: rank 0 does
    runner = ModelRunner(
        loaded.model, loaded.kv_cache, config.cache.block_size, sampler, loaded.max_model_len
    )
    compile_matmuls(loaded.model, config)  # as rank 0's warm-up does (no collective)
    try:
        while True:
            try:
                message = steps.recv()
            except (EOFError, OSError):
                log.error("rank 0 is gone: rank %d exits", rank)
                os._exit(RANK_DIED_EXIT)
            if message is None:
                break
            if isinstance(message, CaptureGraphs):
                capture_like_rank_0(runner, config, loaded, message.plan)
            else:
                runner.follow(message)
    finally:
        group.close()


def capture_like_rank_0(
    runner: ModelRunner, config: EngineConfig, loaded: LoadedModel, sent: CapturePlan
) -> None:
    """Capture this rank's decode graphs: the plan it derives itself, which must be the one
    rank 0 sent (else this rank exits with the error, and rank 0 with it, rather than
    capture collectives that pair with none of rank 0's).

    Raises:
        ValueError: this rank wants no graphs (no scratch block in its cache) or derives
            another plan.
    """
    if not loaded.graphs_wanted:
        raise ValueError("rank 0 captures decode graphs; this rank's config wants none")
    own = decode_capture_plan(config, loaded.max_model_len, loaded.num_blocks)
    check_capture_plan(sent, own)
    runner.capture_graphs(own)


def _exit_with_parent(rank: int, interval_s: float = 1.0) -> None:
    parent = os.getppid()
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent:  # re-parented: rank 0 exited
            log.error("rank 0 is gone: rank %d exits", rank)
            os._exit(RANK_DIED_EXIT)


def threads_per_rank(config: EngineConfig) -> int:
    """Each rank's torch threads: `num_threads`, else the host's threads shared out (on a
    CPU the ranks share the cores; oversubscribing them costs more than it gives)."""
    if config.num_threads is not None:
        return config.num_threads
    if torch.device(config.device).type == "cuda":
        return torch.get_num_threads()
    return max(1, torch.get_num_threads() // config.tensor_parallel_size)
