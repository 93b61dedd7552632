"""proto <-> core conversions round-trip, and bad values name their field."""

from __future__ import annotations

import pytest

from tandem import wire
from tandem.engine.engine import RequestOutput
from tandem.engine.grammar import Constraint, ConstraintKind
from tandem.engine.request import RequestSpec, Resume
from tandem.engine.sampling import SamplingParams
from tandem.services.common.rpc import convert
from tandem.services.common.runtime.flags import parse_config
from tandem.services.common.worker.config import WorkerConfig
from tandem.transfer import KVHandoff, KVLayout, RemoteKV
from tandem.v1 import router_pb2 as rpb


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(
            max_tokens=7,
            temperature=0.5,
            top_k=3,
            top_p=0.75,
            min_p=0.125,
            repetition_penalty=1.25,
            presence_penalty=0.5,
            frequency_penalty=-0.5,
            seed=42,
            stop_token_ids=(1, 2),
            stop=("a", "bc"),
            ignore_eos=True,
            logprobs=2,
            logit_bias={5: -100.0, 3: 2.5},  # type: ignore[arg-type]
        ),
        SamplingParams(temperature=0.0, logprobs=0),
    ],
)
def test_sampling_round_trip(params) -> None:
    assert convert.sampling_from_proto(convert.sampling_to_proto(params)) == params


def test_unset_fields_take_defaults_and_bad_values_name_the_field() -> None:
    assert convert.sampling_from_proto(rpb.SamplingParams()) == SamplingParams()
    with pytest.raises(ValueError, match="^top_p"):
        convert.sampling_from_proto(rpb.SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="^max_tokens"):
        convert.sampling_from_proto(rpb.SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match=r"^logit_bias\[7\] must be a finite float"):
        convert.sampling_from_proto(rpb.SamplingParams(logit_bias={7: 101.0}))


def test_finish_reason_round_trip() -> None:
    for reason in ("stop", "length", "abort", None):
        assert wire.finish_reason_from_proto(wire.finish_reason_to_proto(reason)) == reason


def test_logprobs_to_proto() -> None:
    entries = [(-0.5, ((3, -0.5), (4, -1.5))), (None, ())]
    msgs = convert.logprobs_to_proto([3, 9], entries)
    assert [(m.token_id, m.logprob, [(t.token_id, t.logprob) for t in m.top]) for m in msgs] == [
        (3, -0.5, [(3, -0.5), (4, -1.5)]),
        (9, 0.0, []),
    ]


# 2 layers x K,V x 16 tokens x 2 KV heads x 8 dims x 2 bytes = 2048 bytes per block
LAYOUT = KVLayout("VRAM", 3, "bfloat16", num_layers=2, block_size=16, num_kv_heads=2, head_dim=8)


def test_kv_layout_round_trip() -> None:
    for layout in (LAYOUT, KVLayout("DRAM", 0, "float32", 1, 4, 1, 2, order="[custom]")):
        msg = convert.kv_layout_to_proto(layout)
        assert convert.kv_layout_from_proto(msg) == layout
    msg = convert.kv_layout_to_proto(LAYOUT)
    assert (msg.memory_type, msg.device_id, msg.dtype) == ("VRAM", 3, "bfloat16")
    assert (msg.num_layers, msg.block_size, msg.num_kv_heads, msg.head_dim) == (2, 16, 2, 8)
    assert msg.order == LAYOUT.order


def test_remote_kv_round_trip() -> None:
    remote = RemoteKV("nixl", "prefill-0", b"\x00md", 4096, 2048, (3, 4, 9), LAYOUT)
    msg = convert.remote_kv_to_proto(remote, num_tokens=40, block_size=16)
    assert convert.remote_kv_from_proto(msg) == remote
    assert msg.num_tokens == 40 and msg.block_size == 16
    assert msg.layout == convert.kv_layout_to_proto(LAYOUT)


def test_remote_kv_without_or_with_a_bad_layout_is_refused() -> None:
    remote = RemoteKV("nixl", "prefill-0", b"md", 4096, 2048, (3,), LAYOUT)
    msg = convert.remote_kv_to_proto(remote)
    msg.ClearField("layout")  # what a prefill worker from before layouts sends
    with pytest.raises(ValueError, match="^layout: the KV handle does not say"):
        convert.remote_kv_from_proto(msg)
    msg = convert.remote_kv_to_proto(remote)
    msg.layout.dtype = "bf16"
    with pytest.raises(ValueError, match="^layout.dtype must name a torch dtype"):
        convert.remote_kv_from_proto(msg)
    msg = convert.remote_kv_to_proto(remote)
    msg.layout.head_dim = 16  # the layout no longer explains block_bytes
    with pytest.raises(ValueError, match="^block_bytes 2048 does not match .* 4096 bytes"):
        convert.remote_kv_from_proto(msg)


def test_flags_and_env_map_to_fields(monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_LEASE_TTL_S", "2.5")
    cfg = parse_config(
        WorkerConfig, ["--model-dir", "/m", "--transport", "local", "--num-threads", "1"]
    )
    assert cfg.engine.model_dir == "/m" and cfg.transport == "local"
    assert cfg.lease_ttl_s == 2.5 and cfg.engine.num_threads == 1
    with pytest.raises(SystemExit):
        parse_config(WorkerConfig, ["--model-dir", "/m", "--transport", "carrier-pigeon"])


def _spec() -> RequestSpec:
    params = SamplingParams(max_tokens=9, temperature=0.5, seed=3, stop=("x",), logprobs=2)
    return RequestSpec("r1", (5, 6, 7), params)


def test_worker_requests_carry_the_spec_unchanged() -> None:
    spec = _spec()
    prefill = convert.prefill_request_to_proto(spec, "decode-3")
    assert prefill.decode_worker == "decode-3"
    assert convert.spec_from_proto(prefill, "r1", None) == spec
    decode = convert.decode_request_to_proto(convert.DecodeInput(spec))
    assert not decode.HasField("kv") and list(decode.output_token_ids) == []
    assert not decode.report_kv_failure and decode.num_emitted_chars == 0
    worker_spec = convert.spec_from_proto(decode, "r1", 4.5)
    assert worker_spec == RequestSpec("r1", (5, 6, 7), spec.params, timeout_s=4.5)
    assert convert.decode_from_proto(decode, worker_spec) == convert.DecodeInput(worker_spec)


def _handoff() -> KVHandoff:
    return KVHandoff(
        RemoteKV("nixl", "prefill-0", b"md", 4096, 2048, (3, 4), LAYOUT),
        16, 20, "h:1", "L1", 9, 1e9, signature=b"sig",
    )  # fmt: skip


def test_decode_request_after_prefill_carries_token_1_and_the_handoff() -> None:
    handoff = _handoff()
    sent = convert.DecodeInput(_spec(), (42,), 2, handoff, report_kv_failure=True)
    msg = convert.decode_request_to_proto(sent)
    assert msg.request_id == "r1" and list(msg.prompt_token_ids) == [5, 6, 7]
    assert list(msg.output_token_ids) == [42] and msg.num_emitted_chars == 2
    assert msg.report_kv_failure and msg.cache_salt == ""
    assert convert.handoff_from_proto(msg.kv) == handoff
    assert convert.handoff_from_proto(msg.kv).remote.layout == LAYOUT
    # The worker gets back exactly what the router sent.
    spec = convert.spec_from_proto(msg, msg.request_id, None)
    assert convert.decode_from_proto(msg, spec) == sent
    # The handle's block size and its layout's must agree.
    msg.kv.block_size = 8
    with pytest.raises(ValueError, match="^block_size 8 differs from the handle's layout"):
        convert.handoff_from_proto(msg.kv)
    with pytest.raises(convert.BadHandoff, match="^block_size 8 differs"):
        convert.decode_from_proto(msg, spec)


def test_decode_request_of_a_migration_carries_every_streamed_token() -> None:
    spec = RequestSpec("r1~ab12", (5, 6, 7), _spec().params, cache_salt="tenant:t")
    streamed = tuple(range(100, 400))
    sent = convert.DecodeInput(spec, streamed, 1234, None, report_kv_failure=True)
    msg = convert.decode_request_to_proto(sent)
    assert tuple(msg.output_token_ids) == streamed and msg.num_emitted_chars == 1234
    # Without a hand-off there is no KV failure to report: the worker prefills.
    assert not msg.HasField("kv") and not msg.report_kv_failure
    assert msg.cache_salt == "tenant:t"
    got = convert.decode_from_proto(msg, convert.spec_from_proto(msg, msg.request_id, None))
    assert got == convert.DecodeInput(spec, streamed, 1234, None, report_kv_failure=False)


def test_decode_request_refuses_a_handoff_without_token_1_or_with_a_bad_handle() -> None:
    spec = _spec()
    msg = convert.decode_request_to_proto(convert.DecodeInput(spec, (), 0, _handoff()))
    with pytest.raises(ValueError, match="^output_token_ids must hold token 1$") as info:
        convert.decode_from_proto(msg, spec)
    assert not isinstance(info.value, convert.BadHandoff)
    msg.output_token_ids.append(42)
    msg.kv.ClearField("layout")
    with pytest.raises(convert.BadHandoff, match="^layout: the KV handle does not say"):
        convert.decode_from_proto(msg, spec)


def test_chunk_merges_consecutive_outputs() -> None:
    outs = [
        RequestOutput("r", [4], "a", False, None, logprobs=[(-0.5, ())]),
        RequestOutput("r", [5, 6], "bc", True, "stop", logprobs=[(-1.0, ()), (-2.0, ())]),
    ]
    chunk = convert.chunk_to_proto(outs)
    assert list(chunk.token_ids) == [4, 5, 6] and chunk.text == "abc"
    assert [lp.logprob for lp in chunk.logprobs] == [-0.5, -1.0, -2.0]


def test_decode_input_resume_says_how_much_text_the_client_has() -> None:
    spec = _spec()
    # A plain request on a decode worker continues nothing.
    assert convert.DecodeInput(spec).resume == Resume(())
    # After a hand-off the count is exact, even 0 (token 1's text held back).
    assert convert.DecodeInput(spec, (42,), 0, _handoff()).resume == Resume((42,), 0)
    assert convert.DecodeInput(spec, (42,), 2, _handoff()).resume == Resume((42,), 2)
    # A migration: a count is exact; 0 is the wire's unset value, every token's text was sent.
    assert convert.DecodeInput(spec, (7, 8), 5).resume == Resume((7, 8), 5)
    assert convert.DecodeInput(spec, (7, 8), 0).resume == Resume((7, 8), None)


CONSTRAINTS = [
    Constraint.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
    Constraint(ConstraintKind.JSON_OBJECT),
    Constraint(ConstraintKind.REGEX, "[0-9]{3}"),
    Constraint(ConstraintKind.CHOICE, ("yes", "no", "caf\u00e9")),
    Constraint(ConstraintKind.GRAMMAR, 'root ::= "a" | "b"'),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: c.kind)
def test_constraints_round_trip_and_travel_to_both_workers(constraint: Constraint) -> None:
    params = SamplingParams(max_tokens=9, temperature=0.0, constraint=constraint)
    msg = convert.sampling_to_proto(params)
    assert msg.constraint.WhichOneof("kind") == constraint.kind.value
    assert convert.sampling_from_proto(msg) == params
    spec = RequestSpec("r1", (5, 6, 7), params)
    prefill = convert.prefill_request_to_proto(spec, "decode-0")
    assert convert.spec_from_proto(prefill, "r1", None).params.constraint == constraint
    decode = convert.decode_request_to_proto(convert.DecodeInput(spec, (4,)))
    assert convert.spec_from_proto(decode, "r1", None).params.constraint == constraint


def test_a_bad_constraint_names_its_field() -> None:
    assert convert.constraint_from_proto(rpb.Constraint()) is None  # no kind: free text
    cases = {
        "^constraint.regex: ": rpb.Constraint(regex="a(b"),
        "^constraint.json_schema: not valid JSON": rpb.Constraint(json_schema="{"),
        "^constraint.json_object must be true": rpb.Constraint(json_object=False),
        "^constraint.choice must hold": rpb.Constraint(choice=rpb.Choices()),
        "^constraint.grammar: ": rpb.Constraint(grammar="start: nowhere"),
    }
    for says, msg in cases.items():
        with pytest.raises(ValueError, match=says):
            convert.sampling_from_proto(rpb.SamplingParams(constraint=msg))
