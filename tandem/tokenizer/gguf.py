"""GGUF (llama.cpp) tokenizers: an HF `tokenizers` Tokenizer and its tokenizer_config fields
built from a GGUF file's metadata, for `tandem.weights.gguf.convert_gguf`.

Supported tokenizer models: `gpt2` (byte-level BPE) with the gpt-2, llama-bpe, smollm and qwen2
pre-tokenizers, and `llama` (SentencePiece BPE with byte fallback, merges ranked by piece
score as llama.cpp does).
"""

from __future__ import annotations

from typing import Any

from gguf import GGUFReader
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# llama.cpp token types (llama-vocab.h)
_TOKEN_NORMAL = 1
_TOKEN_UNKNOWN = 2
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4
_SPM_SPACE = "\u2581"  # SentencePiece writes a space as "▁" inside pieces


def metadata(reader: GGUFReader, key: str, default: Any = None) -> Any:
    """A metadata field's value, or `default` when the file lacks it."""
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in ("gpt-2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre)
    if split is None:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}; supported: default, gpt-2, llama-bpe, "
            "qwen2, smollm"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def build_tokenizer(reader: GGUFReader) -> tuple[HFTokenizer, dict[str, Any]]:
    """The `tokenizers` Tokenizer and a `tokenizer_config.json` dict from GGUF metadata.

    Raises:
        ValueError: a tokenizer model other than `gpt2` and `llama`, or missing vocabulary.
    """
    model = metadata(reader, "tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise ValueError(f"unsupported GGUF tokenizer model {model!r}; supported: gpt2, llama")
    tokens: list[str] | None = metadata(reader, "tokenizer.ggml.tokens")
    spm = model == "llama"  # SentencePiece BPE; gpt2 is byte-level BPE
    needs = "one .scores each" if spm else ".merges"
    merges: list[str] | None = metadata(reader, "tokenizer.ggml.merges")
    scores: list[float] | None = metadata(reader, "tokenizer.ggml.scores")
    if not tokens or (spm and len(scores or ()) != len(tokens)) or (not spm and merges is None):
        raise ValueError(f"GGUF {model} tokenizer needs tokenizer.ggml.tokens and {needs}")
    types: list[int] = metadata(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise ValueError(f"GGUF has {len(types)} token types for {len(tokens)} tokens")
    # llama.cpp's defaults where a SentencePiece vocabulary does not name its special tokens
    unk_id = _token_id(reader, "unknown", len(tokens), 0 if spm else None)
    bos_id = _token_id(reader, "bos", len(tokens), 1 if spm else None)
    eos_id = _token_id(reader, "eos", len(tokens), 2 if spm else None)
    if spm:
        assert scores is not None
        add_space_prefix = bool(metadata(reader, "tokenizer.ggml.add_space_prefix", True))
        tok = _sentencepiece_tokenizer(tokens, types, scores, unk_id, add_space_prefix)
    else:
        assert merges is not None
        pre = str(metadata(reader, "tokenizer.ggml.pre", "default"))
        tok = _byte_level_tokenizer(tokens, merges, pre)

    specials = [
        AddedToken(tokens[i], special=True, normalized=False)
        for i, t in enumerate(types)
        # SentencePiece's <unk> is special too, as in transformers' Llama tokenizers
        if t == _TOKEN_CONTROL or (spm and t == _TOKEN_UNKNOWN)
    ]
    user = [
        AddedToken(tokens[i], special=False, normalized=False)
        for i, t in enumerate(types)
        if t == _TOKEN_USER_DEFINED
    ]
    tok.add_special_tokens(specials)
    tok.add_tokens(user)

    bos = None if bos_id is None else tokens[bos_id]
    eos = None if eos_id is None else tokens[eos_id]
    # llama.cpp adds BOS to a SentencePiece vocabulary that does not say otherwise
    add_bos = bool(metadata(reader, "tokenizer.ggml.add_bos_token", spm))
    add_eos = bool(metadata(reader, "tokenizer.ggml.add_eos_token", False))
    lead = [(bos, bos_id)] if add_bos and bos is not None else []
    tail = [(eos, eos_id)] if add_eos and eos is not None else []
    if lead or tail:
        first, last = [t for t, _ in lead], [t for t, _ in tail]
        tok.post_processor = processors.TemplateProcessing(
            single=" ".join(first + ["$A"] + last),
            pair=" ".join(first + ["$A"] + first + ["$B"] + last),
            special_tokens=list(dict.fromkeys(lead + tail)),
        )
    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": bool(lead),
        "add_eos_token": bool(tail),
        "clean_up_tokenization_spaces": False,
    }
    if spm and unk_id is not None:
        tok_config["unk_token"] = tokens[unk_id]
    template = metadata(reader, "tokenizer.chat_template")
    if template is not None:
        tok_config["chat_template"] = str(template)
    return tok, tok_config


def _token_id(reader: GGUFReader, name: str, num_tokens: int, default: int | None) -> int | None:
    """`tokenizer.ggml.<name>_token_id`, or `default` when absent; ValueError if out of range."""
    key = f"tokenizer.ggml.{name}_token_id"
    value = metadata(reader, key)
    token_id = default if value is None else int(value)
    if token_id is not None and not 0 <= token_id < num_tokens:
        raise ValueError(f"GGUF {key} is {token_id}, outside the {num_tokens}-token vocabulary")
    return token_id


def _byte_level_tokenizer(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=pairs,  # type: ignore[arg-type]
            ignore_merges=pre in ("llama-bpe", "llama3"),
        )
    )
    tok.pre_tokenizer = _byte_level_pre_tokenizer(pre)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece_tokenizer(
    tokens: list[str],
    types: list[int],
    scores: list[float],
    unk_id: int | None,
    add_space_prefix: bool,
) -> HFTokenizer:
    """SentencePiece BPE (llama.cpp's "llama" vocabulary: Llama 2, Mistral v0.1) as a BPE.

    Each stretch of text between added tokens has its spaces written as "▁" and, with
    `add_space_prefix`, one "▁" put in front, always: "  hi" -> "▁▁▁hi", as SentencePiece and
    llama.cpp do. The Metaspace pre-tokenizer (transformers' choice) gives "▁▁hi" there, and no
    "▁" after an added token, where llama.cpp adds one (so "<s>hi" is BOS + "▁hi", as
    SentencePiece's BOS + encode("hi")). Characters outside the vocabulary fall back to
    `<0xXX>` byte pieces.
    """
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = HFTokenizer(
        models.BPE(
            vocab=vocab,
            merges=_merges_from_scores(tokens, types, scores),
            unk_token=None if unk_id is None else tokens[unk_id],
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    escape = normalizers.Replace(" ", _SPM_SPACE)
    tok.normalizer = (
        normalizers.Sequence([normalizers.Prepend(_SPM_SPACE), escape])
        if add_space_prefix
        else escape
    )
    steps: list[decoders.Decoder] = [
        decoders.Replace(_SPM_SPACE, " "),
        decoders.ByteFallback(),
        decoders.Fuse(),
    ]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))  # the prefix added above
    tok.decoder = decoders.Sequence(steps)
    return tok


def _merges_from_scores(
    tokens: list[str], types: list[int], scores: list[float]
) -> list[tuple[str, str]]:
    """BPE merges that make a `tokenizers` BPE encode as SentencePiece BPE does.

    SentencePiece (and llama.cpp's SPM tokenizer) stores no merges: it joins, again and again,
    the adjacent pair whose concatenation is the highest-scoring piece, leftmost on a tie. A
    `tokenizers` BPE joins the adjacent pair of lowest merge rank. So every split of a normal
    piece into two normal pieces is a merge, ranked by the piece's score, highest first (equal
    scores in file order); the merges of one piece rank by longer left part first. The two agree
    except where two different overlapping pairs make the same piece (x + y == y + z), or two
    pieces score the same: SentencePiece takes the leftmost pair, `tokenizers` the lower rank.
    Merges in the file, if any, are ignored, as llama.cpp does.
    """
    normal = {token for token, kind in zip(tokens, types, strict=True) if kind == _TOKEN_NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token_id, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != _TOKEN_NORMAL:
            continue
        for cut in range(len(piece) - 1, 0, -1):
            left, right = piece[:cut], piece[cut:]
            if left in normal and right in normal:
                ranked.append((-scores[token_id], token_id, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


# -- conversion --------------------------------------------------------------------------------
