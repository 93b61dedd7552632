"""The soak's traffic (issue 26): closed-loop clients of the OpenAI HTTP API over a mix of
everyday requests. Shared by `benchmarks/bench_soak.py` (for a duration, the real default
model) and `tests/services/test_soak.py` (a bounded number of requests, the tiny model).

    client i:  rng_i = Random(f"{seed}:{i}")
               loop: spec = make_spec(rng_i, mix); record = await send(spec)   (closed loop)

Kinds of request (`Mix` weighs them):
  chat / chat_stream  a one-line question, max_tokens `chat_max_tokens`, not streamed / streamed
  document            "Summarize this: ..." over 300-1500 seeded random words, streamed
  invalid_*           a body the API must refuse with a 4xx, sent with raw httpx (the openai
                      client would refuse some itself): an unknown role, max_tokens -1,
                      temperature 9, a prompt over the model's context, bad JSON
A stream is closed by its client after 1-5 chunks (any SSE chunk, the opening one with the
role included) with probability `disconnect_fraction`; with `early_disconnect_fraction` (0 in
the issue's mix) a request's client gives up after a random delay, before its first chunk (or
its answer, not streamed): the disconnect then lands wherever the request is (queued, placed,
mid-prefill, handed off). Every invalid kind is also sent once at the start of a run
(`SoakTraffic.run`), so each is seen whatever the draw.

Outcome of a request (`Record.outcome`): completed; disconnected (our own close); http_<status>
(a refusal, e.g. http_400, http_429); error (a broken stream, an SSE error event, a timeout, a
stream that ended without a finish reason); unfinished (still running when the run gave up
waiting for it).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx2
import openai

INVALID_KINDS = (
    "invalid_role",
    "invalid_max_tokens",
    "invalid_temperature",
    "invalid_over_context",
    "invalid_json",
)
OK_OUTCOMES = ("completed", "disconnected")
README_QUESTION = "What is the capital of France?"

QUESTIONS = (
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Name three primary colours.",
    "Why do leaves change colour in autumn?",
    "What is the boiling point of water at sea level?",
    "Give me a synonym for happy.",
    "Who wrote Romeo and Juliet?",
    "What does a bee make?",
    "How far is the moon from the earth, roughly?",
    "Suggest a name for a small grey cat.",
    "What is seven times eight?",
    "Which planet is known as the red planet?",
    "What language is spoken in Brazil?",
    "Tell me a fun fact about octopuses.",
    "How do I boil an egg?",
    "What is the opposite of ancient?",
)

# Common English words for the documents: real-looking text, drawn by a seeded RNG.
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war "
    "history party result change morning reason research girl guy moment air teacher force "
    "education foot boy age policy music market sense nation plan college interest death "
    "experience effect use class control care field development role effort rate heart drug "
    "show leader light voice wife police mind price report decision son view relationship town "
    "road arm difference value building action model season society tax director position "
    "player record paper space ground form event official matter center couple site project "
    "activity star table need court oil situation cost industry figure street image phone data "
    "picture practice piece land product doctor wall patient worker news test movie north love "
    "support technology step baby computer type attention film tree source organization hair "
    "window evidence population site river garden bridge harbour village mountain forest "
    "is was are be have do say get make go know take see come think look want give find tell "
    "ask seem feel try leave call keep let begin help talk turn start show hear play run move "
    "like live believe hold bring happen write provide sit stand lose pay meet include continue "
    "set learn lead understand watch follow stop create speak read allow add spend grow open "
    "walk win offer remember consider appear buy wait serve die send expect build stay fall cut "
    "reach kill remain suggest raise pass sell require decide return explain hope develop carry "
    "good new first last long great little own other old right big high different small large "
    "next early young important few public bad same able late hard major better economic "
    "strong possible whole free military true federal international full special easy clear "
    "recent certain personal open red difficult available likely short single medical current "
    "wrong private past foreign fine common poor natural significant similar hot dead central "
    "happy serious ready simple left physical general environmental financial blue democratic "
    "the of and to in for on with at by from up about into over after beneath under between "
    "through during without before again further then once here there when where why how all "
    "any both each more most some such only very quite rather almost often always never"
).split()


@dataclass(frozen=True, slots=True)
class Mix:
    """What the clients send. Weights are relative (each >= 0, some > 0); ranges inclusive."""

    chat_weight: float = 0.35
    document_weight: float = 0.6
    invalid_weight: float = 0.05
    chat_stream_fraction: float = 0.5  # of chats, streamed
    disconnect_fraction: float = 0.2  # of streams, closed by the client early
    disconnect_chunks: tuple[int, int] = (1, 5)  # ... after this many chunks
    early_disconnect_fraction: float = 0.0  # of valid requests, given up before any answer
    early_disconnect_s: tuple[float, float] = (0.005, 0.5)  # ... after this long (uniform)
    document_words: tuple[int, int] = (300, 1500)
    chat_max_tokens: int = 32
    document_max_tokens: int = 96
    temperature: float = 0.7
    # of valid requests, answering in JSON to a schema (one of STRUCTURED_KEYS' many, so
    # that the workers' grammar caches fill and evict): kind "<kind>_json"
    structured_fraction: float = 0.0

    def __post_init__(self) -> None:
        weights = (self.chat_weight, self.document_weight, self.invalid_weight)
        if min(weights) < 0 or sum(weights) <= 0:
            raise ValueError(f"weights must be >= 0 with a positive sum, got {weights}")
        for name in (
            "chat_stream_fraction",
            "disconnect_fraction",
            "early_disconnect_fraction",
            "structured_fraction",
        ):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("disconnect_chunks", "document_words"):
            lo, hi = getattr(self, name)
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} must be 1 <= lo <= hi, got {(lo, hi)}")
        if self.disconnect_fraction + self.early_disconnect_fraction > 1:
            raise ValueError("disconnect_fraction + early_disconnect_fraction must be <= 1")
        lo_s, hi_s = self.early_disconnect_s
        if not 0 < lo_s <= hi_s:
            raise ValueError(f"early_disconnect_s must be 0 < lo <= hi, got {(lo_s, hi_s)}")
        if min(self.chat_max_tokens, self.document_max_tokens) < 1:
            raise ValueError("max tokens must be >= 1")


@dataclass(frozen=True, slots=True)
class Spec:
    """One request to send. `body`: the openai call's arguments (valid) or the JSON posted
    (invalid); `raw`: bytes posted as they are (bad JSON)."""

    kind: str
    body: dict[str, Any]
    stream: bool = False
    disconnect_after: int | None = None  # chunks; None: read the stream to its end
    give_up_after_s: float | None = None  # no answer (no first chunk) by then: disconnect
    raw: bytes | None = None

    @property
    def valid(self) -> bool:
        return not self.kind.startswith("invalid")


@dataclass(slots=True)
class Record:
    """What became of one request. Times in seconds: `start_s` from the run's start, `ttft_s`
    send -> first chunk with text (streams only), `total_s` send -> the end of our call."""

    kind: str
    valid: bool
    client: int
    start_s: float
    outcome: str = "unfinished"
    status: int | None = None
    ttft_s: float | None = None
    total_s: float | None = None
    chunks: int = 0
    retry_after: str | None = None  # a refusal's Retry-After header
    text: str = ""  # the answer, for non-streamed chats only (the README check)
    detail: str = ""

    @property
    def ok(self) -> bool:
        """A valid request completed or ended by our own disconnect; an invalid one got 4xx."""
        if self.valid:
            return self.outcome in OK_OUTCOMES
        return self.status is not None and 400 <= self.status < 500

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        del out["text"]
        return out


def document(rng: random.Random, num_words: int) -> str:
    """`num_words` words in sentences of 6-18 words."""
    sentences: list[str] = []
    left = num_words
    while left > 0:
        n = min(rng.randint(6, 18), left)
        words = [rng.choice(WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        sentences.append(" ".join(words) + rng.choice(".....?!"))
        left -= n
    return " ".join(sentences)


# The structured requests' schemas: an object with one required string property, named from
# these (more than a worker's grammar cache holds, tandem.engine.grammar.DEFAULT_CACHE_SIZE).
STRUCTURED_KEYS = tuple(f"{w}_{i}" for i in range(20) for w in ("answer", "summary", "topic"))


def structured_format(rng: random.Random) -> dict[str, Any]:
    """An OpenAI `response_format` asking for {"<key>": "<string>"}."""
    key = rng.choice(STRUCTURED_KEYS)
    schema = {
        "type": "object",
        "properties": {key: {"type": "string", "maxLength": 40}},
        "required": [key],
        "additionalProperties": False,
    }
    return {"type": "json_schema", "json_schema": {"name": key, "schema": schema}}


def make_spec(rng: random.Random, mix: Mix, max_model_len: int) -> Spec:
    """The next request of a client."""
    kind = rng.choices(
        ("chat", "document", "invalid"),
        weights=(mix.chat_weight, mix.document_weight, mix.invalid_weight),
    )[0]
    if kind == "invalid":
        return invalid_spec(rng.choice(INVALID_KINDS), rng, max_model_len)
    if kind == "chat":
        stream = rng.random() < mix.chat_stream_fraction
        content, max_tokens = rng.choice(QUESTIONS), mix.chat_max_tokens
    else:
        stream = True
        words = document(rng, rng.randint(*mix.document_words))
        content, max_tokens = f"Summarize this: {words}", mix.document_max_tokens
    body = {
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": mix.temperature,
    }
    draw = rng.random()
    cut = stream and draw < mix.disconnect_fraction
    disconnect_after = rng.randint(*mix.disconnect_chunks) if cut else None
    early = not cut and draw < (mix.disconnect_fraction if stream else 0.0) + (
        mix.early_disconnect_fraction
    )
    give_up_after_s = rng.uniform(*mix.early_disconnect_s) if early else None
    name = "chat_stream" if kind == "chat" and stream else kind
    if mix.structured_fraction and rng.random() < mix.structured_fraction:
        body["response_format"] = structured_format(rng)
        name += "_json"
    return Spec(name, body, stream, disconnect_after, give_up_after_s)


def invalid_spec(kind: str, rng: random.Random, max_model_len: int) -> Spec:
    """A request of `kind` (one of INVALID_KINDS) that must be refused with a 4xx."""
    chat = [{"role": "user", "content": rng.choice(QUESTIONS)}]
    body: dict[str, Any] = {"messages": chat, "max_tokens": 8}
    if kind == "invalid_role":
        body["messages"] = [{"role": "wizard", "content": chat[0]["content"]}]
    elif kind == "invalid_max_tokens":
        body["max_tokens"] = -1
    elif kind == "invalid_temperature":
        body["temperature"] = 9
    elif kind == "invalid_over_context":
        # Words separated by spaces are at least one token each under a byte-level BPE.
        words = " ".join(rng.choice(WORDS) for _ in range(max_model_len + 64))
        body["messages"] = [{"role": "user", "content": f"Summarize this: {words}"}]
    elif kind == "invalid_json":
        return Spec(kind, body, raw=b'{"model": "x", "messages": [{"role": "user", "content": ')
    else:
        raise ValueError(f"unknown invalid kind {kind!r}; one of {', '.join(INVALID_KINDS)}")
    return Spec(kind, body)


@dataclass(slots=True)
class SoakTraffic:
    """The clients of one run against the OpenAI API at `base_url` (".../v1"). Use as an async
    context manager (it owns one AsyncOpenAI and one httpx client for all clients).

    honor_retry_after_s: after a 429, a client waits its Retry-After, at most this long (0:
        retry at once).
    """

    base_url: str
    max_model_len: int
    mix: Mix = field(default_factory=Mix)
    seed: int = 0
    api_key: str = "none"
    timeout_s: float = 600.0
    honor_retry_after_s: float = 0.0
    clock: Callable[[], float] = time.perf_counter
    records: list[Record] = field(default_factory=list)
    model: str = ""
    started: float = 0.0  # clock() when the clients connected
    _openai: openai.AsyncOpenAI | None = None
    _http: httpx2.AsyncClient | None = None

    async def __aenter__(self) -> SoakTraffic:
        self._openai = openai.AsyncOpenAI(
            base_url=self.base_url, api_key=self.api_key, max_retries=0, timeout=self.timeout_s
        )
        self._http = httpx2.AsyncClient(
            timeout=self.timeout_s, headers={"Authorization": f"Bearer {self.api_key}"}
        )
        self.model = self.model or (await self._openai.models.list()).data[0].id
        self.started = self.clock()
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._openai is not None:
            await self._openai.close()
        if self._http is not None:
            await self._http.aclose()

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    async def run(
        self,
        num_clients: int,
        *,
        duration_s: float | None = None,
        num_requests: int | None = None,
        drain_timeout_s: float = 120.0,
        invalid_sweep: bool = True,
    ) -> list[Record]:
        """Closed-loop clients until `duration_s` has passed (each then finishes the request
        it is in, for at most `drain_timeout_s`) or `num_requests` are sent (split among the
        clients). Returns this run's records, in the order they were sent."""
        if (duration_s is None) == (num_requests is None):
            raise ValueError("give exactly one of duration_s and num_requests")
        first = len(self.records)
        if invalid_sweep:
            rng = random.Random(f"{self.seed}:invalid")
            for kind in INVALID_KINDS:
                await self.send(invalid_spec(kind, rng, self.max_model_len), client=-1)
        stop_at = None if duration_s is None else self.clock() + duration_s
        quotas: list[int | None] = [None] * num_clients
        if num_requests is not None:
            quotas = [
                num_requests // num_clients + (i < num_requests % num_clients)
                for i in range(num_clients)
            ]
        tasks = [
            asyncio.create_task(self._client(i, stop_at, quotas[i])) for i in range(num_clients)
        ]
        timeout = None if duration_s is None else duration_s + drain_timeout_s
        _, pending = await asyncio.wait(tasks, timeout=timeout)
        for task in pending:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for task in tasks:
            exc = None if task.cancelled() else task.exception()
            if exc is not None:
                raise exc
        return self.records[first:]

    async def _client(self, i: int, stop_at: float | None, quota: int | None) -> None:
        rng = random.Random(f"{self.seed}:{i}")
        sent = 0
        while (quota is None or sent < quota) and (stop_at is None or self.clock() < stop_at):
            record = await self.send(make_spec(rng, self.mix, self.max_model_len), client=i)
            sent += 1
            if record.status == 429 and self.honor_retry_after_s > 0:
                await asyncio.sleep(min(self.honor_retry_after_s, _seconds(record.retry_after)))

    async def send(self, spec: Spec, client: int = -1) -> Record:
        """Send one request and wait for its end; the record is in `records` from the start
        (an unfinished one stays "unfinished")."""
        record = Record(spec.kind, spec.valid, client, self.elapsed_s())
        self.records.append(record)
        t0 = self.clock()
        try:
            if spec.valid:
                await self._send_valid(spec, record, t0)
            else:
                await self._send_invalid(spec, record)
        finally:
            record.total_s = self.clock() - t0
        return record

    async def _send_valid(self, spec: Spec, record: Record, t0: float) -> None:
        assert self._openai is not None
        create = self._openai.chat.completions.create
        try:
            if not spec.stream:
                answer = await asyncio.wait_for(
                    create(model=self.model, **spec.body), spec.give_up_after_s
                )
                record.text = answer.choices[0].message.content or ""
                record.outcome = "completed"
                return
            stream = await asyncio.wait_for(
                create(model=self.model, stream=True, **spec.body), spec.give_up_after_s
            )
            finish = None
            async with stream:
                async for chunk in stream:
                    record.chunks += 1
                    if chunk.choices:
                        choice = chunk.choices[0]
                        if record.ttft_s is None and choice.delta.content:
                            record.ttft_s = self.clock() - t0
                        finish = choice.finish_reason or finish
                    if spec.disconnect_after is not None and record.chunks >= spec.disconnect_after:
                        record.outcome = "disconnected"
                        return  # leaving `async with` closes the response: our disconnect
            record.outcome = "completed" if finish else "error"
            if not finish:
                record.detail = f"stream ended after {record.chunks} chunks without finish_reason"
        except TimeoutError:  # our give_up_after_s (the call is cancelled: the connection closed)
            record.outcome = "disconnected"
            record.detail = f"gave up after {spec.give_up_after_s:.3f} s, before any answer"
        except openai.APIStatusError as exc:
            _refused(record, exc.status_code, exc.response.headers.get("retry-after"), exc.message)
        except openai.APIError as exc:  # connection, timeout, an SSE error event mid-stream
            record.outcome = "error"
            record.detail = f"{type(exc).__name__}: {exc}"[:300]

    async def _send_invalid(self, spec: Spec, record: Record) -> None:
        assert self._http is not None
        url = f"{self.base_url}/chat/completions"
        body = (
            spec.raw
            if spec.raw is not None
            else json.dumps({"model": self.model, **spec.body}).encode()
        )
        try:
            response = await self._http.post(
                url, content=body, headers={"Content-Type": "application/json"}
            )
        except httpx2.HTTPError as exc:
            record.outcome = "error"
            record.detail = f"{type(exc).__name__}: {exc}"[:300]
            return
        _refused(
            record, response.status_code, response.headers.get("retry-after"), response.text[:300]
        )

    async def ask(self, question: str = README_QUESTION, max_tokens: int = 64) -> Record:
        """One greedy, non-streamed chat (the README's question): the record has the text."""
        spec = Spec(
            "readme",
            {
                "messages": [{"role": "user", "content": question}],
                "max_tokens": max_tokens,
                "temperature": 0,
            },
        )
        return await self.send(spec)


def _refused(record: Record, status: int, retry_after: str | None, detail: str) -> None:
    record.status = status
    record.outcome = f"http_{status}"
    record.retry_after = retry_after
    record.detail = detail[:300]


def _seconds(retry_after: str | None) -> float:
    try:
        return max(0.0, float(retry_after or 1))
    except ValueError:  # an HTTP date: not what the router sends
        return 1.0


def outcome_counts(records: list[Record]) -> dict[str, dict[str, int]]:
    """kind -> outcome -> number of requests."""
    out: dict[str, dict[str, int]] = {}
    for r in records:
        by_kind = out.setdefault(r.kind, {})
        by_kind[r.outcome] = by_kind.get(r.outcome, 0) + 1
    return out
