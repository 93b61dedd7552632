"""Constrained decoding (structured outputs) on llguidance: a request's `Constraint`, the
grammars compiled from it (once per content, per tokenizer) and the per-request matcher that
gives the sampler each step's allowed tokens and follows the tokens sampled.

    Constraint(kind, spec)            validated on construction (ValueError naming the kind)
      -> GrammarCompiler.matcher()    compiled once per content (LRU), then a cheap copy
      -> GrammarMatcher               fill(bitmask row) before a step, accept(token) after;
                                      replay(tokens) resumes it after a hand-off/migration

The mask is one bit per vocabulary entry (int32 words, bit i of word w = token 32 w + i);
`token_bitmask` packs a batch's rows and `sampling.apply_token_bitmask` applies them.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

import llguidance
import torch
from llguidance.gbnf_to_lark import any_to_lark

log = logging.getLogger(__name__)

# JSON is generated the way json.dumps writes it (", " and ": ", no other whitespace): what
# models have seen most, and whitespace cannot run on forever. A schema's own "x-guidance"
# options override these.
JSON_DEFAULTS: llguidance._lib.JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
# A JSON schema bounds a number's value, not its length: a model can write "1.000..." until
# max_tokens (a small model does). No float64 needs more than 17 significant digits, so in
# JSON output, after this many digits in a row a digit is allowed only when nothing else is.
MAX_JSON_DIGIT_RUN = 32
DEFAULT_CACHE_SIZE = 128  # compiled grammars kept per engine
_VALIDATION_CACHE_SIZE = 256  # validated constraints kept per process


class ConstraintKind(StrEnum):
    JSON_SCHEMA = "json_schema"  # spec: the schema as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; spec: ""
    REGEX = "regex"  # spec: the pattern (Rust regex syntax), matched in full
    CHOICE = "choice"  # spec: the strings, one of which is the whole output
    GRAMMAR = "grammar"  # spec: a GBNF (llama.cpp EBNF) or Lark grammar


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a constrained request's output must match. Validated on construction: a bad
    schema, regex or grammar raises ValueError naming the kind and the problem.

    Attributes:
        kind: the constraint's form.
        spec: a str for every kind but CHOICE (a tuple of strings); "" for JSON_OBJECT.
    """

    kind: ConstraintKind
    spec: str | tuple[str, ...] = ""

    def __post_init__(self) -> None:
        try:
            kind = ConstraintKind(self.kind)
        except ValueError:
            kinds = ", ".join(k.value for k in ConstraintKind)
            raise ValueError(f"constraint kind must be one of {kinds}, got {self.kind!r}") from None
        object.__setattr__(self, "kind", kind)
        spec = self.spec
        if kind == ConstraintKind.CHOICE:
            if isinstance(spec, str | bytes) or not isinstance(spec, tuple | list):
                raise ValueError(f"choice must be a list of strings, got {spec!r}")
            spec = tuple(spec)
            if not spec or not all(isinstance(s, str) and s for s in spec):
                raise ValueError(f"choice must hold at least one non-empty string, got {spec!r}")
            object.__setattr__(self, "spec", spec)
        elif not isinstance(spec, str):
            raise ValueError(f"{kind} must be a string, got {spec!r}")
        elif kind == ConstraintKind.JSON_OBJECT:
            if spec:
                raise ValueError(f"json_object takes no spec, got {spec!r}")
        elif not spec:
            raise ValueError(f"{kind} must not be empty")
        error = _grammar_and_error(kind, spec)[1]
        if error:
            raise ValueError(f"{kind}: {error}")

    @classmethod
    def json_schema(cls, schema: object) -> Constraint:
        """From a schema as parsed JSON (a dict) or as JSON text."""
        return cls(ConstraintKind.JSON_SCHEMA, schema if isinstance(schema, str) else _dump(schema))

    @property
    def grammar(self) -> str:
        """The llguidance grammar this constraint compiles to (validated, cached)."""
        return _grammar_and_error(self.kind, self.spec)[0]


def _dump(value: object) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema is not JSON-serializable: {exc}") from None


@functools.lru_cache(maxsize=_VALIDATION_CACHE_SIZE)
def _grammar_and_error(kind: ConstraintKind, spec: str | tuple[str, ...]) -> tuple[str, str]:
    """(llguidance grammar, "" or what is wrong with it), checked without a tokenizer:
    milliseconds for a large schema, so a router and every worker check a spec once."""
    if kind == ConstraintKind.JSON_SCHEMA:
        assert isinstance(spec, str)
        try:
            schema = json.loads(spec)
        except json.JSONDecodeError as exc:
            return "", f"not valid JSON: {exc}"
        if not isinstance(schema, dict):  # (llguidance also reads only objects)
            return "", f"a schema is a JSON object, got {type(schema).__name__}"
        grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, defaults=JSON_DEFAULTS)
    elif kind == ConstraintKind.JSON_OBJECT:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            '{"type": "object"}', defaults=JSON_DEFAULTS
        )
    elif kind == ConstraintKind.REGEX:
        assert isinstance(spec, str)
        grammar = llguidance.LLMatcher.grammar_from_regex(spec)
    elif kind == ConstraintKind.CHOICE:
        # Lark string literals take JSON's escapes; each alternative is matched literally.
        lark = "start: " + " | ".join(json.dumps(s) for s in spec)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    else:
        assert isinstance(spec, str)
        try:
            lark = any_to_lark(spec)  # GBNF is converted; Lark passes through
        except Exception as exc:  # the converter raises plain Exceptions on bad input
            return "", f"cannot read the grammar (GBNF or Lark): {exc}"
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        return "", messages[0].strip()
    return grammar, ""


@dataclass(frozen=True, slots=True)
class DigitTable:
    """Per token of a vocabulary, what bounding runs of digits needs (`MAX_JSON_DIGIT_RUN`).

    Attributes:
        starts: [ceil(vocab / 32)] int32 bitmask of the tokens whose text starts with a digit.
        trailing: per token, the digits its text ends with.
        all_digits: per token, whether its text is digits only (the run before it goes on).
    """

    starts: torch.Tensor
    trailing: tuple[int, ...]
    all_digits: tuple[bool, ...]

    @classmethod
    def build(cls, tokenizer: llguidance.LLTokenizer, vocab_size: int) -> DigitTable:
        words = [0] * -(-vocab_size // 32)
        trailing, all_digits = [], []
        for token in range(vocab_size):
            text = tokenizer.decode_bytes([token]) if token < tokenizer.vocab_size else b""
            digits = len(text) - len(text.rstrip(b"0123456789"))
            trailing.append(digits)
            all_digits.append(bool(text) and digits == len(text))
            if text[:1].isdigit():
                words[token // 32] |= 1 << (token % 32)
        signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # the bits as int32
        starts = torch.tensor(signed, dtype=torch.int32, device="cpu")  # masks are CPU
        return cls(starts, tuple(trailing), tuple(all_digits))

    def after(self, run: int, token_id: int) -> int:
        """The digits ending the output once `token_id` follows an output ending in `run`."""
        if token_id >= len(self.trailing):
            return 0
        own = self.trailing[token_id]
        return run + own if self.all_digits[token_id] else own


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe: the engine thread owns it.

    `digits` (JSON constraints): once the output ends in `MAX_JSON_DIGIT_RUN` digits, tokens
    starting with a digit are masked out whenever the grammar allows anything else."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        constraint: Constraint,
        digits: DigitTable | None = None,
    ) -> None:
        self._matcher = matcher
        self.constraint = constraint
        self.num_accepted = 0
        self._digits = digits
        self.digit_run = 0  # digits at the end of the output so far

    def fill(self, row: torch.Tensor) -> None:
        """Write the allowed next tokens into `row`: [num_words] int32, contiguous, CPU.
        A matcher in an error state allows only EOS (it ends the request)."""
        assert row.dtype == torch.int32 and row.is_contiguous() and row.device.type == "cpu"
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if self._digits is not None and self.digit_run >= MAX_JSON_DIGIT_RUN:
            rest = row & ~self._digits.starts
            if bool(rest.any()):
                row.copy_(rest)

    def _advance(self, token_id: int) -> None:
        self.num_accepted += 1
        if self._digits is not None:
            self.digit_run = self._digits.after(self.digit_run, token_id)

    def accept(self, token_id: int) -> bool:
        """Advance past a sampled token. False: the grammar forbids it (the matcher is then
        finished, in an error state)."""
        ok = self._matcher.consume_token(token_id)
        if ok:
            self._advance(token_id)
        else:
            log.warning(
                "constrained request: token %d refused after %d tokens: %s",
                token_id, self.num_accepted, self._matcher.get_error(),
            )  # fmt: skip
        return ok

    def replay(self, token_ids: Sequence[int]) -> None:
        """Resume the grammar after tokens generated elsewhere (a prefill worker's token 1,
        every token streamed before a migration).

        Raises:
            ValueError: a token the grammar forbids, naming its index and id.
        """
        for i, token_id in enumerate(token_ids):
            if not self._matcher.consume_token(token_id):
                raise ValueError(
                    f"output_token_ids[{i}] = {token_id} does not satisfy the request's "
                    f"{self.constraint.kind} constraint: {self._matcher.get_error()}"
                )
            self._advance(token_id)

    def valid_prefix(self, token_ids: Sequence[int]) -> int:
        """How many of `token_ids` (a speculative draft) the grammar accepts in a row from
        here; the matcher does not move."""
        if not token_ids or self._matcher.is_stopped():
            return 0
        return int(self._matcher.validate_tokens(list(token_ids)))

    def masks_along(self, draft: Sequence[int], vocab_size: int) -> torch.Tensor:
        """The allowed tokens here and after each token of `draft` (which the grammar must
        accept: `valid_prefix`): [len(draft) + 1, ceil(vocab_size / 32)] int32 CPU, for
        verifying the draft in one step. The matcher ends where it started."""
        rows = torch.zeros(len(draft) + 1, -(-vocab_size // 32), dtype=torch.int32, device="cpu")
        saved, consumed = (self.num_accepted, self.digit_run), 0
        for j, row in enumerate(rows):
            self.fill(row)
            if j == len(draft):
                break
            if not self._matcher.consume_token(draft[j]):
                raise ValueError(f"draft token {draft[j]} at {j} is not in the grammar")
            self._advance(draft[j])
            consumed += 1
        self._matcher.rollback(consumed)
        self.num_accepted, self.digit_run = saved
        return rows

    @property
    def is_finished(self) -> bool:
        """Nothing but EOS can follow (the output is complete), or the matcher failed."""
        return self._matcher.is_stopped()

    @property
    def can_end(self) -> bool:
        """The output so far is a complete match (EOS is allowed)."""
        return self._matcher.is_accepting()

    @property
    def error(self) -> str:
        return self._matcher.get_error()


class FixedMask:
    """A mask computed ahead (`GrammarMatcher.masks_along`), in a matcher's place for one
    sampling row: `token_bitmask` copies it."""

    def __init__(self, row: torch.Tensor) -> None:
        self.row = row

    def fill(self, row: torch.Tensor) -> None:
        row.copy_(self.row)


def token_bitmask(matchers: Sequence[GrammarMatcher | FixedMask], vocab_size: int) -> torch.Tensor:
    """The allowed tokens of each matcher: [len(matchers), ceil(vocab_size / 32)] int32 CPU."""
    bitmask = torch.zeros(len(matchers), -(-vocab_size // 32), dtype=torch.int32, device="cpu")
    for row, matcher in zip(bitmask, matchers, strict=True):
        matcher.fill(row)
    return bitmask


class GrammarCompiler:
    """Compiles constraints for one tokenizer: each content once (an LRU of
    `cache_size`), every request a copy of the compiled matcher.

    Args:
        tokenizer_json: the model's `tokenizer.json` text.
        vocab_size: the model's logits width (may exceed the tokenizer's vocabulary).
        eos_token_ids: what ends a request; allowed exactly when the grammar can end.
    """

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        if not eos_token_ids:
            raise ValueError("eos_token_ids must not be empty: a grammar could never end")
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._load_error = ""
        self._compiled: OrderedDict[Constraint, llguidance.LLMatcher] = OrderedDict()
        self._digits: DigitTable | None = None  # built with the first JSON constraint
        self.num_hits = 0
        self.num_misses = 0

    def load(self) -> None:
        """Build the token trie (0.2-0.6 s for a 49k vocabulary); the first constrained
        request does it otherwise.

        Raises:
            ValueError: llguidance cannot read this tokenizer (constraints are then refused,
                naming why; unconstrained requests are unaffected).
        """
        if self._tokenizer is not None:
            return
        if self._load_error:
            raise ValueError(self._load_error)
        try:
            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
            )
        except Exception as exc:  # the Rust side raises plain Exceptions
            self._load_error = f"constraint: this model's tokenizer is not supported: {exc}"
            raise ValueError(self._load_error) from None
        finally:
            self._tokenizer_json = ""  # megabytes, needed once

    def matcher(self, constraint: Constraint) -> GrammarMatcher:
        """A fresh matcher at the grammar's start.

        Raises:
            ValueError: the grammar does not compile against this vocabulary.
        """
        compiled = self._compiled.get(constraint)
        if compiled is not None:
            self._compiled.move_to_end(constraint)
            self.num_hits += 1
        else:
            self.load()
            assert self._tokenizer is not None
            compiled = llguidance.LLMatcher(self._tokenizer, constraint.grammar, log_level=0)
            if compiled.is_error():
                raise ValueError(f"{constraint.kind}: {compiled.get_error()}")
            self.num_misses += 1
            self._compiled[constraint] = compiled
            if len(self._compiled) > self.cache_size:
                self._compiled.popitem(last=False)
        json_kinds = (ConstraintKind.JSON_SCHEMA, ConstraintKind.JSON_OBJECT)
        digits = self._digit_table() if constraint.kind in json_kinds else None
        return GrammarMatcher(compiled.deep_copy(), constraint, digits)

    def _digit_table(self) -> DigitTable:
        if self._digits is None:
            assert self._tokenizer is not None
            self._digits = DigitTable.build(self._tokenizer, self.vocab_size)
        return self._digits

    def cached(self) -> list[Constraint]:
        """The compiled constraints, least recently used first."""
        return list(self._compiled)
