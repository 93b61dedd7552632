"""Tokenizer wrapper (HF `tokenizer.json` + config files), with chat encoding that keeps client
text out of control tokens. Rendering chat templates is tandem.tokenizer.templates; streaming
decode is tandem.tokenizer.detokenize."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from tokenizers import AddedToken, Encoding
from tokenizers import Tokenizer as HFTokenizer

from tandem.tokenizer.templates import (
    ChatTemplate,
    check_messages,
    free_chars,
    iter_strings,
    map_strings,
)

# An added token of the plain-text copy of the tokenizer: a stretch encoded right after it is
# tokenized as a stretch after a control token is (see `_encode_plain`).
_LEAD_TOKEN = "\U0010fffd\U0010fffctandem-stretch\U0010fffc\U0010fffd"


class _Controls(NamedTuple):
    """The added tokens that only the chat template may write."""

    tokens: dict[int, AddedToken]
    ids: frozenset[int]
    pattern: re.Pattern[str] | None  # their texts, longest first; None when there are none
    normalized: bool  # some match on normalized text, so only the tokenizer can find them
    added_chars: frozenset[str]  # the characters of every added token


class Tokenizer:
    """Encode/decode text and render chat templates for one model."""

    def __init__(
        self,
        tokenizer: HFTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        self._tok = tokenizer
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.bos_token_id: int | None = self._require_id(bos_token, "bos_token")
        eos_ids: list[int] = []
        eos_id = self._require_id(eos_token, "eos_token")
        for tid in ([] if eos_id is None else [eos_id]) + [int(i) for i in extra_eos_token_ids]:
            if tid not in eos_ids:
                eos_ids.append(tid)
        self.eos_token_ids: tuple[int, ...] = tuple(eos_ids)
        self.chat_template = chat_template
        if add_bos_token is None:
            add_bos_token = self._post_processor_adds_bos()
        if add_bos_token and self.bos_token_id is None:
            raise ValueError("add_bos_token is true but the tokenizer has no bos_token")
        self.add_bos_token = add_bos_token
        self._template: ChatTemplate | None = None
        # Built on first use; threads racing there build equal values, and either one wins.
        self._controls: _Controls | None = None
        self._plain: tuple[HFTokenizer, int] | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` plus the optional config files of a HF model directory."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer.json not found in model directory {root}: {path}")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust side raises a bare Exception
            raise ValueError(f"failed to parse {path}: {exc}") from None

        tok_cfg = _read_json(root / "tokenizer_config.json")
        gen_cfg = _read_json(root / "generation_config.json")
        model_cfg = _read_json(root / "config.json")
        bos_token = _token_content(tok_cfg.get("bos_token"), "bos_token")
        eos_token = _token_content(tok_cfg.get("eos_token"), "eos_token")
        if bos_token is None:
            # No tokenizer_config entry: fall back to the id the model configs declare.
            bos_id = gen_cfg.get("bos_token_id")
            if bos_id is None:
                bos_id = model_cfg.get("bos_token_id")
            if isinstance(bos_id, int) and not isinstance(bos_id, bool):
                bos_token = tok.id_to_token(bos_id)
        extra_eos: list[int] = []
        for cfg in (gen_cfg, model_cfg):
            value = cfg.get("eos_token_id")
            ids = value if isinstance(value, list) else [] if value is None else [value]
            for tid in ids:
                if not isinstance(tid, int) or isinstance(tid, bool):
                    raise ValueError(
                        f"eos_token_id must be an int or a list of ints, got {value!r}"
                    )
                extra_eos.append(tid)
        if eos_token is None and extra_eos:
            eos_token = tok.id_to_token(extra_eos[0])

        template_file = root / "chat_template.jinja"
        if template_file.is_file():
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        else:
            chat_template = _pick_chat_template(tok_cfg.get("chat_template"))
        add_bos = tok_cfg.get("add_bos_token")
        if add_bos is not None and not isinstance(add_bos, bool):
            raise ValueError(
                f"add_bos_token in tokenizer_config.json must be a bool, got {add_bos!r}"
            )
        return cls(
            tok,
            bos_token=bos_token,
            eos_token=eos_token,
            extra_eos_token_ids=extra_eos,
            chat_template=chat_template,
            add_bos_token=add_bos,
        )

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token covers (the longest vocabulary
        entry; byte-level and byte-fallback spellings only overstate it). A text of n
        characters so needs at least about n / this many tokens: a cheap early length check."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special-token strings in `text` map to their ids.

        With `add_special_tokens`, BOS is prepended when the tokenizer config asks for it, unless
        the text already starts with BOS (e.g. a rendered chat template), to avoid a double BOS.
        """
        # The post-processor is bypassed so BOS handling depends only on `add_bos_token`.
        ids = _ids(self._tok, text)
        if add_special_tokens and self.add_bos_token and ids[:1] != [self.bos_token_id]:
            assert self.bos_token_id is not None  # checked in __init__
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids outside the vocabulary (padded model vocab) are dropped."""
        try:
            return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))
        except OverflowError:
            bad = [i for i in ids if not 0 <= i < 2**32]
            raise ValueError(f"token ids must be non-negative 32-bit ints, got {bad[:5]}") from None

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        """Render `messages` ({role, content} mappings, and OpenAI's name, tool_call_id and
        tool_calls) with the model's chat template.

        Encoding this text reads special-token text inside the messages as special tokens;
        `encode_chat` encodes client messages safely."""
        return self._render(self._checked_messages(messages), add_generation_prompt)

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> tuple[list[int], str]:
        """Render and encode `messages` so that the strings in them (content, role, any other
        field, nested ones such as tool-call arguments) never become control tokens; only the
        template's own markers do.

        Control tokens are the special added tokens plus the non-special added tokens that the
        template's literal text contains (e.g. `<think>`, `<tool_call>`), as in transformers'
        `sanitize_control_tokens`. Other added tokens match everywhere, as in the tokenizer.
        The ids are those of the rendered text with control tokens matched only where the
        template wrote them; so a chat without control-token text in its strings gets exactly
        `encode(apply_chat_template(...), add_special_tokens=False)`. No BOS is added: the
        template writes it.

        How: each control-token text in a message is wrapped in two private marker characters
        before rendering, so templates that look for it (e.g. `split('</think>')`) still work.
        The rendered text is encoded; a control token next to a marker is the client's. Every
        stretch between two template control tokens that holds a marker is encoded again,
        markers removed and control tokens not matched:

            rendered:  <|start_header_id|>user<|end_header_id|>\n\nhi [<|eot_id|>]<|eot_id|>
            stretches:                    [ 0 ]                [  1: re-encoded  ]

        A template that splits a message at a control token (`content.split('</think>')`) leaves
        a lone marker next to the pieces, which `trim` does not remove: whitespace there stays
        (as in transformers). Templates that build control-token text out of message text
        (e.g. with `lower`) defeat the marking; no known chat template does.

        `tools`: the template's `tools` variable (transformers' function definitions; None:
        not passed), whose strings are the client's too.

        Returns (ids, rendered text without markers). Raises ValueError as `apply_chat_template`
        does, or when the vocabulary spells such text with a control token (fail closed)."""
        checked = self._checked_messages(messages)
        controls = self._chat_controls()
        # every string, nested ones (tool calls, tool definitions) too
        strings = list(iter_strings(checked)) + list(iter_strings(tools or []))
        spans = {
            value: found for value in strings if (found := self._control_spans(value, controls))
        }
        if not spans:
            text = self._render(checked, add_generation_prompt, tools)
            return _ids(self._tok, text), text
        in_use = [*strings, self.chat_template or "", self.bos_token or "", self.eos_token or ""]
        start, end = free_chars(2, in_use, controls.added_chars | set(_LEAD_TOKEN))

        def mark(value: str) -> str:
            found = spans.get(value)
            if not found:
                return value
            bounds = [0, *(i for span in found for i in span), len(value)]
            pieces = [value[a:b] for a, b in itertools.pairwise(bounds)]
            pieces[1::2] = [start + piece + end for piece in pieces[1::2]]  # the control texts
            return "".join(pieces)

        checked = [map_strings(message, mark) for message in checked]
        tools = None if tools is None else [map_strings(tool, mark) for tool in tools]
        rendered = self._render(checked, add_generation_prompt, tools)
        ids = self._encode_marked(rendered, (start, end), controls)
        return ids, rendered.replace(start, "").replace(end, "")

    def _encode_marked(
        self,
        rendered: str,
        marks: tuple[str, str],
        controls: _Controls,
        reencode_all: bool = False,
    ) -> list[int]:
        """Ids of `rendered`, whose client control-token texts are wrapped in `marks`. With
        `reencode_all` every stretch is encoded again (a parity check for tests)."""
        start_mark, end_mark = marks
        encoding = _encoding(self._tok, rendered)
        ids: list[int] = []
        stretch_ids: list[int] = []
        start = 0  # where the current stretch starts in `rendered`

        def end_stretch(end: int) -> None:
            stretch = rendered[start:end]
            if reencode_all or start_mark in stretch or end_mark in stretch:
                plain = stretch.replace(start_mark, "").replace(end_mark, "")
                stretch_ids[:] = self._encode_plain(plain, start > 0, controls)
            ids.extend(stretch_ids)
            stretch_ids.clear()

        for tid, (a, b) in zip(encoding.ids, encoding.offsets, strict=True):
            # Either mark next to it makes it the client's: a template may slice one off.
            clients = rendered[a - 1 : a] == start_mark or rendered[b : b + 1] == end_mark
            if (
                tid in controls.ids
                and not clients
                and _is_match(self._tok, controls.tokens[tid], rendered[a:b])
            ):
                end_stretch(a)
                ids.append(tid)
                start = b
            else:
                stretch_ids.append(tid)
        end_stretch(len(rendered))
        return ids

    def _control_spans(self, text: str, controls: _Controls) -> list[tuple[int, int]]:
        """Where `text` holds control-token text, as the tokenizer would match it."""
        if controls.normalized:
            encoding = _encoding(self._tok, text)
            return [
                (a, b)
                for tid, (a, b) in zip(encoding.ids, encoding.offsets, strict=True)
                if tid in controls.ids and _is_match(self._tok, controls.tokens[tid], text[a:b])
            ]
        if controls.pattern is None:
            return []
        return [m.span() for m in controls.pattern.finditer(text)]

    def _encode_plain(self, text: str, after_control: bool, controls: _Controls) -> list[int]:
        """Ids of `text` with no control token matched, tokenized as a stretch that follows a
        control token (`after_control`) or starts the input. Tokenizers treat a stretch by its
        offset in the input (SentencePiece's Metaspace adds "▁" only at offset 0), so a stretch
        after a control token is encoded after `_LEAD_TOKEN`, whose id is then dropped."""
        if self._plain is None:
            # A copy, so that no setting of the shared tokenizer changes under another thread.
            config = json.loads(self._tok.to_str())
            for entry in config.get("added_tokens", []):
                if entry.get("id") in controls.ids:
                    entry["special"] = True  # so that `encode_special_tokens` skips it
            plain = HFTokenizer.from_str(json.dumps(config))
            plain.encode_special_tokens = True
            plain.add_tokens([AddedToken(_LEAD_TOKEN, special=False, normalized=False)])
            lead_id = plain.token_to_id(_LEAD_TOKEN)
            assert lead_id is not None
            self._plain = (plain, lead_id)
        plain, lead_id = self._plain
        lead = _LEAD_TOKEN if after_control else ""
        encoding = _encoding(plain, lead + text)
        ids: list[int] = encoding.ids
        num_lead = int(after_control)
        assert ids[:num_lead] == [lead_id] * num_lead
        for tid, (a, b) in itertools.islice(
            zip(ids, encoding.offsets, strict=True), num_lead, None
        ):
            if tid == lead_id or (
                tid in controls.ids
                and _is_match(self._tok, controls.tokens[tid], (lead + text)[a:b])
            ):
                raise ValueError(
                    "chat messages hold text that this tokenizer cannot encode without "
                    "control tokens"
                )
        return ids[num_lead:]

    def _chat_controls(self) -> _Controls:
        if self._controls is None:
            template_text = self._compiled_template().literal_text()
            added = self._tok.get_added_tokens_decoder()
            tokens = {
                tid: token
                for tid, token in added.items()
                # Whitespace tokens (Gemma's "\n") are ordinary text in templates.
                if token.special or (token.content in template_text and not token.content.isspace())
            }
            texts = sorted({token.content for token in tokens.values()}, key=len, reverse=True)
            self._controls = _Controls(
                tokens=tokens,
                ids=frozenset(tokens),
                pattern=re.compile("|".join(map(re.escape, texts))) if texts else None,
                normalized=any(token.normalized for token in tokens.values()),
                added_chars=frozenset("".join(token.content for token in added.values())),
            )
        return self._controls

    def _checked_messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        if self.chat_template is None:
            raise ValueError(
                "model has no chat template (no chat_template.jinja and no chat_template in "
                "tokenizer_config.json); send a plain prompt instead"
            )
        return check_messages(messages)

    def _render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        return self._compiled_template().render(
            messages,
            add_generation_prompt,
            tools,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )

    def _compiled_template(self) -> ChatTemplate:
        if self._template is None:
            assert self.chat_template is not None
            self._template = ChatTemplate(self.chat_template)
        return self._template

    def _require_id(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer's vocabulary")
        return int(tid)

    def _post_processor_adds_bos(self) -> bool:
        # Llama-3-style tokenizers declare BOS only through the post-processor.
        if self.bos_token_id is None:
            return False
        with_special = self._tok.encode("a", add_special_tokens=True).ids
        plain = self._tok.encode("a", add_special_tokens=False).ids
        return len(with_special) > len(plain) and with_special[0] == self.bos_token_id


def _ids(tok: HFTokenizer, text: str) -> list[int]:
    """Ids of `text`, no special tokens added. The batch call releases the GIL while it
    encodes (a router tokenizing a long prompt on a thread keeps serving its event loop; a
    single `encode` holds the GIL throughout) and skips the offsets: half the time."""
    ids: list[int] = tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
    return ids


def _encoding(tok: HFTokenizer, text: str) -> Encoding:
    """`text`'s encoding with offsets, no special tokens added, the GIL released (`_ids`)."""
    encoding: Encoding = tok.encode_batch([text], add_special_tokens=False)[0]
    return encoding


def _is_match(tok: HFTokenizer, token: AddedToken, text: str) -> bool:
    """Whether `token` was matched on `text` (the text under its offsets), rather than being
    what the model gives for text it does not know (an unknown token is often special)."""
    if token.normalized and tok.normalizer is not None:
        text = tok.normalizer.normalize_str(text)
    return (text.strip() if token.lstrip or token.rstrip else text) == token.content


def _read_json(path: Path) -> dict[str, Any]:
    """Contents of an optional JSON object file; {} if absent."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any, field: str) -> str | None:
    """A special token given as a string or as an AddedToken dict {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("content")
    if not isinstance(value, str):
        raise ValueError(f"{field} in tokenizer_config.json must be a string, got {value!r}")
    return value


def _pick_chat_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of named ones (use "default")."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        for entry in value:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                if not isinstance(template, str):
                    raise ValueError(f"default chat_template must be a string, got {template!r}")
                return template
        return None
    raise ValueError(f"chat_template must be a string or a list, got {type(value).__name__}")
