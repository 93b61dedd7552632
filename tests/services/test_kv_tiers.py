"""KV tiers (issue 44) over real worker processes: a prefill and a decode worker whose device
caches hold fewer prompts than a test sends, each with a host tier and a disk tier, and a
router that knows them by address. What the device cache evicted comes back from the tiers:
repeats are prefix hits (the replies' cached-token counts say so) and token-identical to an
engine that recomputes everything, disaggregated over the real KV hand-off, colocated on
the decode worker, and from the disk after the prefill worker is SIGKILLed and restarted.
"""

from __future__ import annotations

import random
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient
from tandem.engine.sampling import SamplingParams
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.processes import free_port, spawn_logged, stop
from tests.services.workers import decode_result, prefill_result, wait_all_free

BLOCK = 16  # DEFAULT_BLOCK_SIZE: the workers' block size
NUM_BLOCKS = 12  # a worker's device cache: the full blocks of 3 prompts, not 4
PROMPT_LEN = 70  # 4 full blocks (64 tokens, the most a repeat can hit) and 6 more
FULL = PROMPT_LEN // BLOCK * BLOCK
MAX_TOKENS = 4
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
SAMPLING = rpb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(5, 512), k=PROMPT_LEN) for _ in range(n)]


def tier_flags(disk_dir: Path) -> tuple[str, ...]:
    return (
        "--num-blocks", str(NUM_BLOCKS), "--kv-host-bytes", str(8 << 20),
        "--kv-disk-dir", str(disk_dir), "--kv-disk-bytes", str(32 << 20),
    )  # fmt: skip


def disk_records(disk_dir: Path) -> int:
    return len(list(disk_dir.glob("*.kv")))


class Tiered:
    """The three processes; the prefill worker on a fixed port, so that a restarted one is
    where the router left it."""

    def __init__(self, model_dir: Path, root: Path) -> None:
        self.model_dir, self.root = model_dir, root
        self.prefill_disk, self.decode_disk = root / "prefill-kv", root / "decode-kv"
        self.prefill_port = free_port()
        self.common = ("--model-dir", str(model_dir), "--device", "cpu")
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.address: dict[str, str] = {}
        self.channels: list[grpc.Channel] = []
        self.restarts = 0

    def _start(self, name: str, module: str, *args: str) -> None:
        log = self.root / f"{name}-{self.restarts}.log"
        self.procs[name], self.address[name] = spawn_logged(module, log, *args)

    def start_prefill(self) -> None:
        self._start(
            "prefill", "tandem.services.prefill", *self.common, "--worker-id", "prefill-0",
            "--port", str(self.prefill_port), *tier_flags(self.prefill_disk),
        )  # fmt: skip

    def start(self) -> None:
        self.start_prefill()
        self._start(
            "decode", "tandem.services.decode", *self.common, "--worker-id", "decode-0",
            *tier_flags(self.decode_disk),
        )  # fmt: skip
        self._start(
            "router", "tandem.services.router", "--model-dir", str(self.model_dir),
            "--port", "0", "--prefill-addresses", self.address["prefill"],
            "--decode-addresses", self.address["decode"], "--disagg-min-uncached-tokens", "0",
        )  # fmt: skip

    def kill_and_restart_prefill(self) -> None:
        proc = self.procs["prefill"]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        self.restarts += 1
        self.start_prefill()

    def stop(self) -> None:
        for channel in self.channels:
            channel.close()
        stop(*(self.procs[n] for n in ("router", "decode", "prefill") if n in self.procs))

    def stub(self, role: str):  # type: ignore[no-untyped-def]
        channel = grpc.insecure_channel(self.address[role])
        self.channels.append(channel)
        cls = wgrpc.PrefillWorkerStub if role == "prefill" else wgrpc.DecodeWorkerStub
        return cls(channel)

    def assert_all_free(self) -> None:
        wait_all_free(
            lambda: [
                self.stub(r).GetStats(wpb.GetStatsRequest(), timeout=10)
                for r in ("prefill", "decode")
            ]
        )


@pytest.fixture(scope="module")
def tiered(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiered]:
    t = Tiered(tiny_model_dir, tmp_path_factory.mktemp("kv-tiers"))
    try:
        t.start()
        yield t
    finally:
        t.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, engine_factory):  # type: ignore[no-untyped-def]
    """What recomputing every prompt gives: no prefix cache, no tiers."""
    engine = engine_factory(tiny_model_dir, block_size=BLOCK, enable_prefix_caching=False)
    yield lambda batch: [c.token_ids for c in engine.generate(batch, GREEDY)]
    engine.close()


def wait_for_records(disk_dir: Path, at_least: int, timeout_s: float = 10) -> None:
    """Until the disk tier's write-through has `at_least` records on disk."""
    deadline = time.monotonic() + timeout_s
    while disk_records(disk_dir) < at_least and time.monotonic() < deadline:
        time.sleep(0.05)
    assert disk_records(disk_dir) >= at_least


def test_disaggregated_repeats_come_back_from_the_tiers(tiered: Tiered, reference) -> None:  # type: ignore[no-untyped-def]
    """Four prompts through the router, then the same four: the prefill worker's device
    cache holds the full blocks of three at most (the fourth evicts the first, and each
    repeat the next one's, least recently used first), yet every repeat hits all its full
    blocks -- brought back from the tiers -- and answers exactly as recomputing does."""
    batch = prompts(4, seed=44)
    want, prefill = reference(batch), tiered.address["prefill"]
    with TandemClient(tiered.address["router"], timeout_s=60) as client:
        rounds = [
            [client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
             for p in batch]
            for _ in range(2)
        ]  # fmt: skip
    for results in rounds:
        assert [r.token_ids for r in results] == want
        # (a router with static addresses names workers by address)
        assert all(r.disaggregated and r.prefill_worker == prefill for r in results)
    assert [r.cached_prompt_tokens for r in rounds[0]] == [0] * 4
    assert [r.cached_prompt_tokens for r in rounds[1]] == [FULL] * 4
    # Write-through: every full block of the four prompts is on the prefill worker's disk.
    wait_for_records(tiered.prefill_disk, 4 * FULL // BLOCK)
    tiered.assert_all_free()


def test_colocated_repeats_come_back_from_the_tiers(tiered: Tiered, reference) -> None:  # type: ignore[no-untyped-def]
    """The decode worker prefilling prompts itself (no hand-off): the same, briefly."""
    batch = prompts(4, seed=45)
    want = reference(batch)
    decode = tiered.stub("decode")
    for round_ in range(2):
        for i, (prompt, w) in enumerate(zip(batch, want, strict=True)):
            request = wpb.DecodeRequest(
                request_id=f"colocated-{round_}-{i}", prompt_token_ids=prompt, sampling=SAMPLING
            )
            tokens, complete = decode_result(decode.Decode(request, timeout=60))
            assert tokens == w
            assert complete.num_cached_tokens == (FULL if round_ else 0)
    tiered.assert_all_free()


def test_a_restarted_prefill_worker_serves_its_disk_tier(tiered: Tiered, reference) -> None:  # type: ignore[no-untyped-def]
    """Prompts prefilled (their leases released unread: the decode worker never saw them),
    the worker SIGKILLed once its disk holds them and started again on the same directory:
    its first request is a disk hit on every full block, and the decode worker, reading
    those blocks over the real hand-off, finishes it exactly as recomputing does."""
    batch = prompts(2, seed=46)
    want = reference(batch)
    before = disk_records(tiered.prefill_disk)
    prefill = tiered.stub("prefill")
    for i, prompt in enumerate(batch):
        request = wpb.PrefillRequest(request_id=f"held-{i}", prompt_token_ids=prompt,
                                     sampling=SAMPLING)  # fmt: skip
        first = prefill_result(prefill.Prefill(request, timeout=60))
        assert first.first_token_id == want[i][0] and first.num_cached_tokens == 0
        lease = first.kv.lease
        release = wpb.ReleaseKvRequest(request_id=f"held-{i}", lease_id=lease.lease_id,
                                       epoch=lease.epoch)  # fmt: skip
        assert prefill.ReleaseKv(release, timeout=10).valid
    wait_for_records(tiered.prefill_disk, before + len(batch) * FULL // BLOCK)

    tiered.kill_and_restart_prefill()
    prefill = tiered.stub("prefill")
    for i, prompt in enumerate(batch):
        request = wpb.PrefillRequest(request_id=f"again-{i}", prompt_token_ids=prompt,
                                     sampling=SAMPLING)  # fmt: skip
        first = prefill_result(prefill.Prefill(request, timeout=60))
        assert first.num_cached_tokens == FULL, f"prompt {i} after the restart"
        decode = wpb.DecodeRequest(
            request_id=f"again-{i}", prompt_token_ids=prompt,
            output_token_ids=[first.first_token_id], sampling=SAMPLING, kv=first.kv,
        )  # fmt: skip
        tokens, complete = decode_result(tiered.stub("decode").Decode(decode, timeout=60))
        assert [first.first_token_id, *tokens] == want[i]
        assert not complete.recomputed and complete.num_cached_tokens == 0
    tiered.assert_all_free()
