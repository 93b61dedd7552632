"""Decode CUDA graphs with tensor parallelism: every rank captures the same graphs in the same
order and every step replays the same graph on every rank (rank 0 decides, the step carries
the decision), or runs eagerly on every rank.

No GPU here (and TP needs two): the graphs are `EagerGraphs`, a CPU stand-in that keeps
`DecodeGraphs`' own capture loop, buffer filling and size choice and replaces its three CUDA
calls (warm-up, record, launch) by running the captured step function eagerly, collectives
included, and logging what each rank did. It reaches the follower processes through their
entry point: the test points `ranks.follow` at `follow_with_eager_graphs`, which installs
the stand-in in the spawned process before running the real `follow`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import CacheConfig, EngineConfig, EngineRole, SchedulerConfig
from tandem.engine import loading, ranks
from tandem.engine import runner as runner_module
from tandem.engine.cuda_graphs import (
    CapturePlan,
    DecodeBuffers,
    DecodeGraphs,
    DecodeInputs,
    capture_order,
    capture_plan,
    check_capture_plan,
)
from tandem.engine.engine import LLMEngine
from tandem.engine.runner import (
    CaptureGraphs,
    ModelRunner,
    StepPlan,
    StepRow,
    order_rows,
    replay_size,
)
from tandem.engine.sampling import SamplingParams

# -- the CPU stand-in, in every rank's process ----------------------------------------------


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs on a CPU: a 'capture' keeps the step function, a 'replay' runs it over
    the buffers' views (what a graph would read). Logs its plan, captures and replays to
    `<log_dir>/rank<r>.jsonl`."""

    device_type = "cpu"
    log_dir = ""
    rank = 0

    def __init__(self, buffers: DecodeBuffers, sizes: Any) -> None:
        super().__init__(buffers, sizes)
        self._fns: dict[int, Callable[[DecodeInputs], torch.Tensor]] = {}
        log_event("plan", list(self.sizes), buffers.max_blocks, buffers.padding_block_id)

    def _warm_up(
        self, run_fn: Callable[[DecodeInputs], torch.Tensor], inputs: DecodeInputs
    ) -> None:
        run_fn(inputs)

    def _record(
        self, size: int, run_fn: Callable[[DecodeInputs], torch.Tensor], inputs: DecodeInputs
    ) -> None:
        log_event("capture", size)
        self._fns[size] = run_fn

    def _launch(self, size: int) -> torch.Tensor:
        log_event("replay", size)
        return self._fns[size](self.buffers.views(size))


def log_event(*event: Any) -> None:
    if EagerGraphs.log_dir:
        with open(Path(EagerGraphs.log_dir) / f"rank{EagerGraphs.rank}.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")


def graphs_anywhere(config: EngineConfig, paged_backend: bool) -> bool:
    """`wants_decode_graphs` as on CUDA, on any device (the stand-in captures on a CPU)."""
    return config.cuda_graphs and paged_backend and config.role != EngineRole.PREFILL


def follow_with_eager_graphs(
    log_dir: str,
    config: EngineConfig,
    rank: int,
    address: str,
    steps: Connection,
    kv_share: str = "",
) -> None:
    """A follower's entry point (spawned: a fresh interpreter): the stand-in installed,
    each received step logged, then the real `follow`."""
    EagerGraphs.log_dir, EagerGraphs.rank = log_dir, rank
    runner_module.DecodeGraphs = EagerGraphs  # type: ignore[misc]
    loading.wants_decode_graphs = graphs_anywhere
    follow_step = ModelRunner.follow

    def logged(self: ModelRunner, plan: StepPlan) -> None:
        log_event("step", len(plan.rows), plan.graph_size)
        follow_step(self, plan)

    ModelRunner.follow = logged  # type: ignore[method-assign]
    ranks.follow(config, rank, address, steps, kv_share)


def read_log(log_dir: Path, rank: int) -> list[list[Any]]:
    path = log_dir / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def of_kind(events: list[list[Any]], kind: str) -> list[list[Any]]:
    return [e[1:] for e in events if e[0] == kind]


@pytest.fixture
def eager_graphs(monkeypatch: pytest.MonkeyPatch) -> Callable[[Path], None]:
    """eager_graphs(log_dir): graphs wanted on a CPU and served by the stand-in, in this
    process (rank 0) and in the followers engines start from now on; rank 0 logs each
    message it sends its followers."""

    send = ranks.Followers.send

    def install(log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        monkeypatch.setattr(EagerGraphs, "log_dir", str(log_dir))
        monkeypatch.setattr(EagerGraphs, "rank", 0)
        monkeypatch.setattr(runner_module, "DecodeGraphs", EagerGraphs)
        monkeypatch.setattr(loading, "wants_decode_graphs", graphs_anywhere)
        monkeypatch.setattr(
            ranks, "follow", functools.partial(follow_with_eager_graphs, str(log_dir))
        )

        def logged(self: ranks.Followers, message: StepPlan | CaptureGraphs) -> None:
            if isinstance(message, CaptureGraphs):
                log_event("sent-capture", *message.plan)
            else:
                log_event("sent-step", len(message.rows), message.graph_size)
            send(self, message)

        monkeypatch.setattr(ranks.Followers, "send", logged)

    return install


@pytest.fixture
def engines(engine_factory: Callable[..., Any]) -> Iterator[Callable[..., Any]]:
    """engines(model_dir, **overrides): engines closed after the test (their ranks with
    them). With `on_rank_exit`, an engine of `tensor_parallel_size` ranks whose dead rank
    is reported there instead of ending this process."""
    made: list[Any] = []

    def make(model_dir: Path, on_rank_exit: Any = None, **overrides: Any) -> Any:
        if on_rank_exit is None:
            made.append(engine_factory(model_dir, **overrides))
            return made[-1]
        sched = {k: overrides.pop(k) for k in ("max_num_seqs", "max_model_len") if k in overrides}
        sched["max_num_batched_tokens"] = overrides.pop("max_num_batched_tokens")
        config = EngineConfig(
            model_dir=str(model_dir),
            dtype="float32",
            cache=CacheConfig(block_size=4, num_blocks=256),
            scheduler=SchedulerConfig(**sched),
            **overrides,
        )
        made.append(LLMEngine(config, on_rank_exit=on_rank_exit))
        return made[-1]

    yield make
    for engine in made:
        engine.close()


# Small enough that a graph step (attending over the whole table width) stays quick on a CPU.
SHAPE = dict(
    attention_backend="triton", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=32
)
PROMPTS = [list(range(5, 25)), list(range(30, 37)), [9, 8, 7]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


# -- pure parts -----------------------------------------------------------------------------


def test_tensor_parallel_engines_on_cuda_want_graphs() -> None:
    for device, size, wanted in [("cuda", 2, True), ("cuda:1", 4, True), ("cpu", 2, False)]:
        config = EngineConfig(model_dir="m", device=device, tensor_parallel_size=size)
        assert loading.wants_decode_graphs(config, True) is wanted


def test_every_rank_derives_rank_0s_capture_plan() -> None:
    """A follower's config is rank 0's on another device; with the blocks and context every
    rank agreed on at load, each derives rank 0's plan."""
    config = EngineConfig(model_dir="m", device="cuda", tensor_parallel_size=4)
    config = dataclasses.replace(
        config, scheduler=dataclasses.replace(config.scheduler, max_num_seqs=40)
    )
    plan = ranks.decode_capture_plan(config, max_model_len=1000, num_blocks=123)
    assert plan == CapturePlan((1, 2, 4, 8, 16, 24, 32, 40), -(-1000 // 16), 123)
    assert plan.order == (40, 32, 24, 16, 8, 4, 2, 1) == capture_order(plan.sizes)
    for rank in range(1, 4):
        follower = dataclasses.replace(config, device=ranks.rank_device(config.device, rank))
        assert follower.device == f"cuda:{rank}"
        assert ranks.decode_capture_plan(follower, 1000, 123) == plan


def test_a_follower_refuses_a_plan_it_does_not_derive() -> None:
    plan = capture_plan(8, 64, 4, padding_block_id=50)
    check_capture_plan(plan, capture_plan(8, 64, 4, padding_block_id=50))
    for other in (
        capture_plan(16, 64, 4, padding_block_id=50),  # other sizes
        capture_plan(8, 128, 4, padding_block_id=50),  # other table width
        capture_plan(8, 64, 4, padding_block_id=49),  # another padding block
    ):
        with pytest.raises(ValueError, match="rank 0 captures decode graphs as"):
            check_capture_plan(plan, other)


def test_rank_0_decides_replay_or_eager() -> None:
    graphs = EagerGraphs(DecodeBuffers(4, 2, padding_block_id=9, device="cpu"), (1, 2, 4))

    def rows(n: int, prefill: bool = False) -> list[StepRow]:
        out = [StepRow(f"r{i}", 10, 1, (0,), True, [1]) for i in range(n)]
        return out + ([StepRow("p", 0, 3, (1,), True, [1, 2, 3])] if prefill else [])

    assert replay_size(rows(3), graphs) is None  # nothing captured yet
    graphs.capture(lambda inputs: torch.zeros(inputs.input_ids.shape[0], 5))
    assert graphs.captured == [4, 2, 1]
    assert [replay_size(rows(n), graphs) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, None]
    assert replay_size(rows(2, prefill=True), graphs) is None  # prefill tokens: eager
    assert replay_size([], graphs) is None
    assert replay_size(rows(2), None) is None


# -- a follower replays what the step says, nothing else --------------------------------------


def decode_rows(engine: Any) -> list[StepRow]:
    """The next step's rows, as rank 0 would send them (the step itself is not run)."""
    return [StepRow.of(s) for s in order_rows(engine.scheduler.schedule())]


def test_a_follower_replays_the_graph_the_step_names(
    tiny_model_dir: Path, engines: Callable[..., Any], eager_graphs: Any, tmp_path: Path
) -> None:
    """`ModelRunner.follow` replays exactly the size the step carries and runs eagerly when
    it carries none, whatever it could serve itself; a size it cannot replay is an error."""
    eager_graphs(tmp_path)
    engine = engines(tiny_model_dir, num_blocks=32, **SHAPE)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(engine.spec(f"q{i}", prompt, GREEDY))
    engine.step()  # every prompt prefilled: three requests decoding
    rows = decode_rows(engine)
    assert len(rows) == 3 and all(r.is_decode for r in rows)
    runner = engine.runner
    with pytest.raises(RuntimeError, match="this rank's graphs: None"):
        runner.follow(StepPlan(rows, [], graph_size=4))  # nothing captured
    # Block 31 stays free for these prompts (the pool hands out 0, 1, ... first).
    runner.capture_decode_graphs(4, engine.max_model_len, padding_block_id=31)
    replays = lambda: of_kind(read_log(tmp_path, 0), "replay")  # noqa: E731
    runner.follow(StepPlan(rows, [], graph_size=None))
    assert replays() == []  # eager: the step said so, though a graph holds 3 rows
    runner.follow(StepPlan(rows, [], graph_size=4))
    assert replays() == [[4]]
    with pytest.raises(RuntimeError, match="graph of 2 rows for a step of 3 rows"):
        runner.follow(StepPlan(rows, [], graph_size=2))
    assert replays() == [[4]]


# -- an engine of 2 ranks --------------------------------------------------------------------


def generate_tp2(
    model_dir: Path, engines: Callable[..., Any], cuda_graphs: bool
) -> tuple[CapturePlan, list[list[int]]]:
    """Warm up an engine of 2 ranks, decode, close it (one group a process at a time).
    Returns the capture plan its rank 0 derives and the tokens."""
    died: list[tuple[int, int | None]] = []
    engine = engines(
        model_dir,
        on_rank_exit=lambda rank, status: died.append((rank, status)),
        tensor_parallel_size=2,
        cuda_graphs=cuda_graphs,
        **SHAPE,
    )
    engine.warm_up()
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(PROMPTS):  # 3 rows decoding, then 2, then 1
        params = dataclasses.replace(GREEDY, max_tokens=4 + 2 * i)
        engine.add_request(engine.spec(f"q{i}", prompt, params))
        tokens[f"q{i}"] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    engine.check_integrity()
    assert not died
    plan = ranks.decode_capture_plan(engine.config, engine.max_model_len, engine.num_blocks)
    assert engine.num_blocks == 256
    engine.close()
    return plan, list(tokens.values())


def test_tp2_ranks_capture_and_replay_in_lockstep(
    tiny_model_dir: Path, engines: Callable[..., Any], eager_graphs: Any, tmp_path: Path
) -> None:
    """TP=2 with graphs: the tokens of TP=2 without; both ranks capture the plan each derived
    (the same), the same sizes in the same order; every step the follower receives carries
    rank 0's decision, and both ranks replay the same sizes, step by step."""
    eager_graphs(tmp_path / "off")
    _, eager_tokens = generate_tp2(tiny_model_dir, engines, cuda_graphs=False)
    off = [read_log(tmp_path / "off", r) for r in (0, 1)]
    assert not any(of_kind(log, k) for log in off for k in ("plan", "capture", "replay"))
    assert {tuple(s) for s in of_kind(off[1], "step")} >= {(3, None), (2, None), (1, None)}
    assert all(size is None for _, size in of_kind(off[1], "step"))

    eager_graphs(tmp_path / "on")
    plan, tokens = generate_tp2(tiny_model_dir, engines, cuda_graphs=True)
    assert tokens == eager_tokens
    rank0, rank1 = (read_log(tmp_path / "on", r) for r in (0, 1))
    assert plan == CapturePlan((1, 2, 4), 16, 256)  # padding: the block past the pool's
    assert of_kind(rank0, "sent-capture") == [[list(plan.sizes), *plan[1:]]]
    for log in (rank0, rank1):
        assert of_kind(log, "plan") == [[list(plan.sizes), plan.max_blocks, plan.padding_block_id]]
        assert of_kind(log, "capture") == [[4], [2], [1]]

    sent, received = of_kind(rank0, "sent-step"), of_kind(rank1, "step")
    assert sent == received  # each step's rows and graph decision, as rank 0 made them
    decided = [[size] for _, size in sent if size is not None]
    assert decided == of_kind(rank0, "replay") == of_kind(rank1, "replay")
    assert [3, 4] in sent and [1, 1] in sent  # 3 rows padded to the graph of 4
    kinds = [e[0] for e in rank0]
    before = kinds.index("sent-capture")
    assert "sent-step" in kinds[:before]  # warm-up's steps, before the graphs exist: eager
    assert all(e[2] is None for e in rank0[:before] if e[0] == "sent-step")
