"""Constrained decoding: Constraint validation, the compile cache, the bitmask the sampler
applies (constrained rows masked, the others bit-identical), and the engine's outputs
(json_schema, json_object, regex, choice, grammar) including a resumed grammar."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import torch

from tandem.engine.grammar import (
    MAX_JSON_DIGIT_RUN,
    Constraint,
    ConstraintKind,
    GrammarCompiler,
    token_bitmask,
)
from tandem.engine.request import Resume
from tandem.engine.sampling import (
    Sampler,
    SampleRow,
    SamplingParams,
    apply_token_bitmask,
)
from tests.conftest import make_engine

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}


# -------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("kind", "spec", "says"),
    [
        ("json_schema", '{"type": ', "json_schema: not valid JSON"),
        ("json_schema", "[1, 2]", "json_schema: a schema is a JSON object, got list"),
        ("json_schema", "true", "json_schema: a schema is a JSON object, got bool"),
        ("json_schema", '{"type": "frob"}', "json_schema: Invalid type: frob"),
        ("json_schema", '{"$ref": "#/nope"}', "json_schema: Pointer '/nope' does not exist"),
        ("json_schema", "", "json_schema must not be empty"),
        ("regex", "a(b", "regex: "),
        ("regex", "", "regex must not be empty"),
        ("grammar", "start: foo", 'grammar: at 1(8): unknown name: "foo"'),
        ("grammar", "root ::= other", "grammar: cannot read the grammar (GBNF or Lark): Rule"),
        ("choice", (), "choice must hold at least one non-empty string"),
        ("choice", ("a", ""), "choice must hold at least one non-empty string"),
        ("choice", "ab", "choice must be a list of strings"),
        ("json_object", "{}", "json_object takes no spec"),
        ("xml", "", "constraint kind must be one of json_schema, json_object, regex"),
    ],
)
def test_a_bad_constraint_is_refused_naming_what_is_wrong(kind: str, spec: Any, says: str) -> None:
    with pytest.raises(ValueError) as info:
        Constraint(kind, spec)  # type: ignore[arg-type]
    assert says in str(info.value)
    if kind == "regex" and spec:
        assert "unclosed group" in str(info.value)


def test_good_constraints_are_values() -> None:
    a = Constraint.json_schema(PERSON)
    assert a == Constraint.json_schema(json.dumps(PERSON, separators=(",", ":"), sort_keys=True))
    assert a.kind == ConstraintKind.JSON_SCHEMA and hash(a) == hash(Constraint.json_schema(PERSON))
    choice = Constraint("choice", ["yes", "no"])  # type: ignore[arg-type]
    assert choice.spec == ("yes", "no") and choice.kind is ConstraintKind.CHOICE
    assert Constraint("grammar", 'root ::= "yes" | "no"').grammar  # GBNF (EBNF)
    assert Constraint("grammar", 'start: "yes" | "no"').grammar  # Lark
    assert Constraint(ConstraintKind.JSON_OBJECT).grammar
    with pytest.raises(ValueError, match="constraint must be a Constraint"):
        SamplingParams(constraint="json")  # type: ignore[arg-type]


# ----------------------------------------------------------------------- compile cache


@pytest.fixture(scope="module")
def compiler(tiny_model_dir: Path) -> GrammarCompiler:
    eos = json.loads((tiny_model_dir / "config.json").read_text())["eos_token_id"]
    vocab = json.loads((tiny_model_dir / "config.json").read_text())["vocab_size"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    return GrammarCompiler((tiny_model_dir / "tokenizer.json").read_text(), vocab, eos_ids)


def test_grammars_compile_once_per_content_and_the_cache_is_bounded(tiny_model_dir: Path) -> None:
    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    eos = cfg["eos_token_id"]
    small = GrammarCompiler(
        (tiny_model_dir / "tokenizer.json").read_text(),
        cfg["vocab_size"],
        eos if isinstance(eos, list) else [eos],
        cache_size=2,
    )
    a, b, c = (Constraint(ConstraintKind.REGEX, p) for p in ("a+", "b+", "c+"))
    small.matcher(a)
    small.matcher(Constraint(ConstraintKind.REGEX, "a+"))  # equal content: a hit
    assert (small.num_hits, small.num_misses) == (1, 1)
    small.matcher(b)
    small.matcher(a)  # a is now the most recently used
    small.matcher(c)  # evicts b
    assert small.cached() == [a, c]
    assert (small.num_hits, small.num_misses) == (2, 3)
    with pytest.raises(ValueError, match="cache_size must be >= 1"):
        GrammarCompiler("{}", 8, [0], cache_size=0)


def _allowed(bitmask_row: torch.Tensor, vocab: int) -> set[int]:
    return {t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1}


def test_eos_is_allowed_exactly_when_the_grammar_can_end(compiler: GrammarCompiler) -> None:
    vocab, eos = compiler.vocab_size, set(compiler.eos_token_ids)
    matcher = compiler.matcher(Constraint(ConstraintKind.REGEX, "[0-9]{2}"))
    tokenizer = compiler._tokenizer
    assert tokenizer is not None
    digits = [tokenizer.tokenize_str(d) for d in "0123456789"]
    single = {ids[0] for ids in digits if len(ids) == 1}
    allowed = _allowed(token_bitmask([matcher], vocab)[0], vocab)
    assert single <= allowed and not allowed & eos and not matcher.can_end
    assert matcher.accept(tokenizer.tokenize_str("4")[0])
    assert matcher.accept(tokenizer.tokenize_str("2")[0])
    assert matcher.can_end and matcher.is_finished
    assert _allowed(token_bitmask([matcher], vocab)[0], vocab) == eos
    assert not matcher.accept(tokenizer.tokenize_str("7")[0])  # forbidden: refused


def test_json_numbers_cannot_run_on_but_regex_digits_can(compiler: GrammarCompiler) -> None:
    """A schema bounds a number's value, not its length: after MAX_JSON_DIGIT_RUN digits in
    a row a JSON constraint allows a digit only when nothing else is; a regex that asks for
    more digits gets them."""
    vocab = compiler.vocab_size
    compiler.load()
    tokenizer = compiler._tokenizer
    assert tokenizer is not None
    zero = tokenizer.tokenize_str("0")
    assert len(zero) == 1
    schema = {"type": "object", "properties": {"score": {"type": "number"}}}
    matcher = compiler.matcher(Constraint.json_schema(schema))
    matcher.replay(tokenizer.tokenize_str('{"score": 1.'))
    for n in range(MAX_JSON_DIGIT_RUN):
        assert zero[0] in _allowed(token_bitmask([matcher], vocab)[0], vocab), n
        assert matcher.accept(zero[0])
    assert matcher.digit_run == MAX_JSON_DIGIT_RUN
    allowed = _allowed(token_bitmask([matcher], vocab)[0], vocab)
    texts = {tokenizer.decode_bytes([t]) for t in allowed}
    assert allowed and not any(t[:1].isdigit() for t in texts)
    assert b"}" in texts  # the object can close
    assert matcher.accept(tokenizer.tokenize_str("}")[0]) and matcher.digit_run == 0
    # a run is counted across tokens and reset by any other character
    table = compiler._digit_table()  # the one the JSON matchers share
    assert table.after(5, zero[0]) == 6 and table.after(5, tokenizer.tokenize_str(",")[0]) == 0
    # not for other kinds: a regex may need long runs of digits
    digits = compiler.matcher(Constraint(ConstraintKind.REGEX, "[0-9]{40}"))
    for _ in range(MAX_JSON_DIGIT_RUN + 1):
        assert digits.accept(zero[0])
    assert zero[0] in _allowed(token_bitmask([digits], vocab)[0], vocab)


# ------------------------------------------------------------------- mask application


def test_the_bitmask_masks_constrained_rows_and_copies_the_others() -> None:
    vocab = 40  # two words, the second one partly past the vocabulary
    scores = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 0] = (1 << 3) - (1 << 31)  # tokens 3 and 31 (bit 31 is int32's sign bit)
    bitmask[0, 1] = 1 << 5  # token 37
    out = apply_token_bitmask(scores, [1], bitmask)
    assert torch.equal(out[0], scores[0]) and torch.equal(out[2], scores[2])
    kept = torch.isfinite(out[1]).nonzero().flatten().tolist()
    assert kept == [3, 31, 37]
    assert torch.equal(out[1, kept], scores[1, kept])
    assert torch.isfinite(scores).all()  # the input is left alone
    with pytest.raises(ValueError, match=r"bitmask must be int32 \[1, 2\]"):
        apply_token_bitmask(scores, [1], torch.zeros(1, 3, dtype=torch.int32))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_unconstrained_rows_sample_exactly_as_without_constrained_neighbours(
    compiler: GrammarCompiler, temperature: float
) -> None:
    vocab = compiler.vocab_size
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(1)) * 3
    plain = SamplingParams(temperature=temperature, seed=7)
    constrained = SamplingParams(
        temperature=temperature, seed=7, constraint=Constraint(ConstraintKind.REGEX, "[0-9]+")
    )

    def rows(with_constraint: bool) -> list[SampleRow]:
        out = []
        for i in range(4):
            gen = torch.Generator().manual_seed(100 + i)
            if with_constraint and i % 2:
                matcher = compiler.matcher(constrained.constraint)  # type: ignore[arg-type]
                out.append(SampleRow(constrained, [1], [], gen, matcher))
            else:
                out.append(SampleRow(plain, [1], [], gen))
        return out

    alone = Sampler()(logits, rows(False))
    mixed = Sampler()(logits, rows(True))
    assert [mixed[i] for i in (0, 2)] == [alone[i] for i in (0, 2)]
    tokenizer = compiler._tokenizer
    assert tokenizer is not None
    for i in (1, 3):
        assert re.fullmatch("[0-9]+", tokenizer.decode_str([mixed[i].token_id]))


# ------------------------------------------------------------------------------ engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Any:
    return make_engine(tiny_model_dir)


def _generate(engine: Any, constraint: Constraint, **kwargs: Any) -> Any:
    params = SamplingParams(
        **{"max_tokens": 64, "temperature": 0.0, **kwargs}, constraint=constraint
    )
    [done] = engine.generate(["Tell me about a person:"], params)
    engine.check_integrity()
    return done


def test_json_schema_output_parses_and_validates(engine: Any) -> None:
    done = _generate(engine, Constraint.json_schema(PERSON), max_tokens=128)
    assert done.finish_reason == "stop"
    jsonschema.validate(json.loads(done.text), PERSON)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sampled_json_object_output_is_an_object(engine: Any, seed: int) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
        "required": ["ok", "n"],
        "additionalProperties": False,
    }
    done = _generate(engine, Constraint.json_schema(schema), temperature=1.0, seed=seed)
    jsonschema.validate(json.loads(done.text), schema)


def test_regex_choice_and_grammar_outputs_match(engine: Any) -> None:
    done = _generate(engine, Constraint(ConstraintKind.REGEX, "[a-c]{2}-[0-9]{3}"))
    assert re.fullmatch("[a-c]{2}-[0-9]{3}", done.text) and done.finish_reason == "stop"
    choices = ("red", "green", "blue sky")
    done = _generate(engine, Constraint(ConstraintKind.CHOICE, choices), temperature=1.0, seed=3)
    assert done.text in choices
    done = _generate(engine, Constraint(ConstraintKind.GRAMMAR, 'root ::= "yes" | "no" | "maybe"'))
    assert done.text in ("yes", "no", "maybe")


def test_a_grammar_that_cannot_finish_in_max_tokens_ends_with_length(engine: Any) -> None:
    done = _generate(engine, Constraint(ConstraintKind.REGEX, "x{30}"), max_tokens=5)
    assert done.finish_reason == "length" and len(done.token_ids) == 5
    assert re.fullmatch("x+", done.text)


def test_a_resumed_grammar_continues_exactly_and_refuses_forbidden_tokens(engine: Any) -> None:
    """The decode side of a hand-off or a migration: replaying the tokens emitted elsewhere
    gives the same continuation as one uninterrupted run."""
    constraint = Constraint.json_schema(PERSON)
    params = SamplingParams(max_tokens=128, temperature=0.0, constraint=constraint)
    whole = _generate(engine, constraint, max_tokens=128)
    for cut in (1, 5):
        spec = engine.spec(f"resume-{cut}", "Tell me about a person:", params)
        engine.add_request(spec, Resume(tuple(whole.token_ids[:cut])))
        tokens: list[int] = list(whole.token_ids[:cut])
        while engine.has_unfinished():
            for out in engine.step():
                tokens += out.new_token_ids
        assert tokens == whole.token_ids
    forbidden = engine.tokenize("hello")[0]
    spec = engine.spec("resume-bad", "Tell me about a person:", params)
    with pytest.raises(ValueError, match=r"output_token_ids\[0\] = \d+ does not satisfy"):
        engine.add_request(spec, Resume((forbidden,)))
    assert not engine.has_request("resume-bad")


def test_constrained_requests_keep_their_grammar_through_preemption(
    engine: Any, tiny_model_dir: Path
) -> None:
    """A preempted request recomputes its KV but keeps its output and its matcher: the same
    tokens as with room for everyone, and a chunked prefill changes nothing either."""
    constraint = Constraint.json_schema(PERSON)
    prompts = [f"Person number {i} of the list, with more words to fill blocks:" for i in range(12)]
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=5, constraint=constraint)
    want = [c.token_ids for c in engine.generate(prompts, params)]
    tight = make_engine(tiny_model_dir, num_blocks=40, max_num_batched_tokens=16)
    requests = [tight.add_request(tight.spec(f"p{i}", p, params)) for i, p in enumerate(prompts)]
    while tight.has_unfinished():
        tight.step()
        tight.check_integrity()
    assert sum(r.num_preemptions for r in requests) > 0
    assert [r.output_token_ids for r in requests] == want


def test_a_tokenizer_llguidance_cannot_read_refuses_constraints_only() -> None:
    broken = GrammarCompiler('{"model": "nonsense"}', 16, [0])
    constraint = Constraint(ConstraintKind.REGEX, "a")
    for _ in range(2):  # the reason is kept, not rebuilt per request
        with pytest.raises(ValueError, match="this model's tokenizer is not supported"):
            broken.matcher(constraint)
