"""SentencePiece ("llama") GGUF tokenizers: a vocabulary trained here, written with gguf's writer,
checked against a plain SentencePiece BPE encoder, transformers' GGUF loader, the chat and
streaming paths of our Tokenizer, and a tiny model converted end to end."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import pytest
from tokenizers import Regex, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.tokenizer.detokenize import IncrementalDetokenizer
from tandem.tokenizer.gguf import _merges_from_scores, build_tokenizer
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.weights.gguf import convert_gguf

SPACE = "\u2581"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
USER_TOKEN = "<sep>"
TINY_HIDDEN, TINY_HEADS, TINY_FFN = 32, 2, 64  # the converted model's shape
CHAT_TEMPLATE = (  # Llama 2's shape: BOS, then "[INST] ... [/INST]" as plain text
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}[INST] {{ m.content }} [/INST]"
    "{% else %} {{ m.content }} {{ eos_token }}{% endif %}{% endfor %}"
)
# Training text: no emoji, tabs or newlines (they fall back to bytes, as in Llama 2), few CJK.
CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun all day long.
Hello, world! Hello there, how are you doing today? I am doing well, thank you.
A tokenizer splits text into pieces; the model reads the pieces as numbers.
Serving large language models needs memory for the key and value cache of every request.
Prefill computes the prompt, decode writes one token at a time, and the router picks a worker.
We'll see; they've said it's fine, but I'm not sure that you'd agree with them.
Numbers like 1234567, 3.14159 and 2025-01-31 are split into single digits by the tokenizer.
Le café est très bon, mais la crème brûlée est meilleure. Où est la gare? Voilà!
Der Müller fährt über die Brücke nach München; schöne Grüße aus Köln und Zürich.
São Paulo é uma cidade enorme, e a façade do edifício é muito bonita. Ångström, naïve.
El niño comió una manzana en la mañana. ¿Dónde está la biblioteca? ¡Qué bueno!
def main(args):
    for item in range(10):
        if item % 2 == 0:
            print(f"even {item}")
    return {'a': [x ** 2 for x in args], "b": None}
class Scheduler:
    def schedule(self, requests: list[int]) -> dict[str, int]:
        return {str(r): r * 2 for r in requests if r > 0}
日本語のテキストはとても面白いです。東京は日本の首都です。
中文是一种语言，我们学习中文和日本語。今天天气很好。
Ελληνικά είναι μια όμορφη γλώσσα. Καλημέρα κόσμε.
Русский текст тоже бывает: привет, мир! Как дела?
The scheduler admits requests while free blocks remain, then runs prefill and decode steps.
Each block holds the keys and values of sixteen tokens; blocks are freed when requests finish.
if x > 0 and y < 10: z = x + y  # a comment about the sum of x and y
while True: break
"""
# No added-token text in these: for plain text every tokenizer here should agree.
TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces\tand tabs\n\nnew lines   ",
    " one leading space",
    "trailing spaces   ",
    "multiple   inner    spaces and a  double",
    "Numbers 1234567 and 3.14159, dates 2025-01-31.",
    "Accents: café, naïve, façade, Ångström, São Paulo, Müller, crème brûlée.",
    "Emoji: 🙂🚀👩‍💻 and flags 🇫🇷 mixed with text 🤖!",
    "🙂",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code\n",
    "\tclass Scheduler:\r\n\t\tpass",
    "日本語のテキスト と 中文 and Ελληνικά, 你好世界！",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "don't won't it's I'm we'll they've",
    "aaaaaaaa        bbbb",
    "",
)


class SpmVocab(NamedTuple):
    tokens: list[str]
    scores: list[float]
    types: list[int]

    def id(self, token: str) -> int:
        return self.tokens.index(token)


def _train_vocab() -> SpmVocab:
    """A SentencePiece-shaped BPE vocabulary, learned by `tokenizers` with SentencePiece's word
    split and single digits: Llama 2's layout (<unk>, <s>, </s>, 256 byte pieces, then the normal
    pieces, here shuffled) and scores (-i for the i-th merge, lower still for characters)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="always", split=False),
            # words start with "▁"; a run of spaces is a word of its own, as with
            # SentencePiece's allow_whitespace_only_pieces
            pre_tokenizers.Split(
                Regex(f"{SPACE}?[^{SPACE}]+|{SPACE}+?(?={SPACE}[^{SPACE}])|{SPACE}+"),
                behavior="isolated",
            ),
            pre_tokenizers.Digits(individual_digits=True),
        ]
    )
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(), trainer)
    model = json.loads(tok.to_str())["model"]
    merged = ["".join(m) if isinstance(m, list) else m.replace(" ", "") for m in model["merges"]]
    chars = [t for t in sorted(model["vocab"], key=model["vocab"].get) if t not in set(merged)]
    assert all(len(c) == 1 for c in chars) and "\n" not in chars and "🙂" not in chars
    scored = [(piece, -float(i)) for i, piece in enumerate(merged + chars)]
    random.Random(0).shuffle(scored)  # so that only the scores, not the file order, give merges
    pieces = [piece for piece, _ in scored]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [UNKNOWN, CONTROL, CONTROL] + [BYTE] * 256 + [NORMAL] * len(pieces)
    scores = [0.0] * 259 + [score for _, score in scored]
    assert len(set(tokens)) == len(tokens)
    return SpmVocab(tokens + [USER_TOKEN], scores + [0.0], types + [USER_DEFINED])


def _spm_encode(text: str, vocab: SpmVocab, add_space_prefix: bool = True) -> list[int]:
    """SentencePiece BPE encoding written out plainly, as the reference: join the adjacent pair
    that makes the best-scoring normal piece (the leftmost on a tie) until no pair does, then
    spell what is left outside the vocabulary as UTF-8 byte pieces."""
    ids = {t: i for i, t in enumerate(vocab.tokens)}
    normal = {t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == NORMAL}
    escaped = text.replace(" ", SPACE)
    symbols = list(SPACE + escaped if add_space_prefix and text else escaped)
    while True:
        best: tuple[float, int] | None = None
        for i in range(len(symbols) - 1):
            piece = symbols[i] + symbols[i + 1]
            if piece in normal and (best is None or vocab.scores[ids[piece]] > best[0]):
                best = (vocab.scores[ids[piece]], i)
        if best is None:
            break
        i = best[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for s in symbols:
        out.extend([ids[s]] if s in normal else [ids[f"<0x{b:02X}>"] for b in s.encode()])
    return out


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_spm_gguf(
    path: Path,
    vocab: SpmVocab,
    *,
    model: str = "llama",
    special_ids: bool = True,
    add_bos: bool | None = True,
    add_eos: bool = False,
    add_space_prefix: bool | None = None,
    chat_template: str | None = None,
    tensors: dict[str, np.ndarray[Any, Any]] | None = None,
) -> Path:
    """A GGUF holding a "llama" tokenizer as convert_hf_to_gguf.py writes one (no merges), and
    with `tensors` a tiny model's metadata; `None` leaves a flag out (llama.cpp's default)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.types)
    if special_ids:
        writer.add_unk_token_id(vocab.id("<unk>"))
        writer.add_bos_token_id(vocab.id("<s>"))
        writer.add_eos_token_id(vocab.id("</s>"))
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_add_eos_token(add_eos)
    if add_space_prefix is not None:
        writer.add_add_space_prefix(add_space_prefix)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    if tensors is not None:
        writer.add_context_length(128)
        writer.add_embedding_length(TINY_HIDDEN)
        writer.add_block_count(1)
        writer.add_feed_forward_length(TINY_FFN)
        writer.add_head_count(TINY_HEADS)
        writer.add_head_count_kv(1)
        writer.add_layer_norm_rms_eps(1e-5)
        for name, array in tensors.items():
            writer.add_tensor(name, array)
    _finish(writer)
    return path


def _build(path: Path) -> tuple[HFTokenizer, dict[str, Any]]:
    return build_tokenizer(gguf.GGUFReader(str(path)))


@pytest.fixture(scope="module")
def vocab() -> SpmVocab:
    return _train_vocab()


@pytest.fixture(scope="module")
def spm_gguf(vocab: SpmVocab, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_spm_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", vocab)


# -- merges ----------------------------------------------------------------------------------


def test_merges_rank_pieces_by_score() -> None:
    """Every split of a normal piece into two normal pieces is a merge, best score first, longer
    left part first within a piece; control and byte pieces make and take part in none."""
    tokens = ["<s>", "<0x61>", "a", "b", "c", "ab", "bc", "abc", "ca", "ac", "a<0x61>"]
    types = [CONTROL, BYTE, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, NORMAL, CONTROL, NORMAL]
    scores = [0.0, 0.0, -10, -11, -12, -1, -0.5, -2, -3, 0.0, -0.1]
    assert _merges_from_scores(tokens, types, scores) == [
        ("b", "c"),  # -0.5: later in the file than "ab" but better scored
        ("a", "b"),
        ("ab", "c"),
        ("a", "bc"),
        ("c", "a"),
    ]


# -- against SentencePiece semantics and transformers ----------------------------------------


def test_encode_matches_sentencepiece(spm_gguf: Path, vocab: SpmVocab) -> None:
    tok, _ = _build(spm_gguf)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == _spm_encode(text, vocab), text
    # the vocabulary is realistic: words merge, and what it lacks falls back to bytes
    assert tok.encode("the", add_special_tokens=False).tokens == [f"{SPACE}the"]
    emoji = [f"<0x{b:02X}>" for b in "🙂".encode()]
    assert tok.encode("🙂", add_special_tokens=False).tokens == [SPACE, *emoji]
    assert tok.encode("a\tb", add_special_tokens=False).tokens == [f"{SPACE}a", "<0x09>", "b"]
    # a leading space gets the prefix on top ("▁▁a"), where Metaspace would give "▁a"
    assert tok.encode(" a", add_special_tokens=False).tokens[0] == SPACE * 2


def test_decode_round_trips(spm_gguf: Path, vocab: SpmVocab) -> None:
    tok, _ = _build(spm_gguf)
    for text in TEXTS:
        ids = tok.encode(text).ids
        assert ids[:1] == [vocab.id("<s>")]
        assert tok.decode(ids) == text, text
        assert tok.decode(ids, skip_special_tokens=False) == "<s>" + (" " + text if text else "")


def test_matches_transformers_gguf_loader(spm_gguf: Path) -> None:
    """transformers (5.x) builds Llama's Metaspace pre-tokenizer, which adds no "▁" in front of
    text that starts with a space: there it differs from SentencePiece and llama.cpp (and us,
    see test_encode_matches_sentencepiece), so those texts are compared on decoding only."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(spm_gguf.parent), gguf_file=spm_gguf.name)
    tok, _ = _build(spm_gguf)
    for text in TEXTS:
        ours = tok.encode(text).ids
        if not text.startswith(" "):
            assert hf(text, add_special_tokens=False)["input_ids"] == ours[1:], text
            assert hf(text)["input_ids"] == ours, text
        assert hf.decode(ours, skip_special_tokens=True) == text, text


# -- added tokens, flags and defaults --------------------------------------------------------


def test_added_tokens_and_bos(spm_gguf: Path, vocab: SpmVocab) -> None:
    """Control and user-defined tokens match whole; the text after one gets its own "▁"
    prefix, as llama.cpp does (SentencePiece alone, which keeps a user-defined piece inside one
    string, would give "b" and not "▁b" after it; llama.cpp is what these files are run with)."""
    tok, config = _build(spm_gguf)
    bos, eos, sep = vocab.id("<s>"), vocab.id("</s>"), vocab.id(USER_TOKEN)

    def spm(text: str) -> list[int]:
        return _spm_encode(text, vocab)

    plain = tok.encode("a<sep>b", add_special_tokens=False).ids
    assert plain == spm("a") + [sep] + spm("b")
    assert tok.encode("hi</s><s>there", add_special_tokens=False).ids == (
        spm("hi") + [eos, bos] + spm("there")
    )
    assert config == {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    ours = Tokenizer(tok, bos_token="<s>", eos_token="</s>", add_bos_token=True)
    assert ours.encode("hello world") == [bos] + spm("hello world")
    # BOS written in the text is not doubled, and the text after it is SentencePiece's
    assert ours.encode("<s>hello world") == [bos] + spm("hello world")
    assert ours.decode([bos, *spm("hello"), eos]) == "hello"
    assert ours.decode([sep, *spm("hello")], skip_special_tokens=False) == "<sep> hello"


def test_flags_and_defaults(tmp_path: Path, vocab: SpmVocab) -> None:
    """add_space_prefix off, add_eos on; and a file naming no special tokens gets llama.cpp's
    SentencePiece defaults (unk 0, BOS 1 added, EOS 2)."""
    path = _write_spm_gguf(tmp_path / "flags.gguf", vocab, add_eos=True, add_space_prefix=False)
    tok, config = _build(path)
    bos, eos = vocab.id("<s>"), vocab.id("</s>")
    for text in ("hello world", " hello", "  x 🙂 y  "):
        body = _spm_encode(text, vocab, add_space_prefix=False)
        assert tok.encode(text, add_special_tokens=False).ids == body, text
        assert tok.encode(text).ids == [bos, *body, eos], text
        assert tok.decode(tok.encode(text).ids) == text, text
    assert not tok.encode("hello").tokens[1].startswith(SPACE)  # no prefix
    assert config["add_bos_token"] and config["add_eos_token"]

    bare = _write_spm_gguf(tmp_path / "bare.gguf", vocab, special_ids=False, add_bos=None)
    tok, config = _build(bare)
    names = {key: config[f"{key}_token"] for key in ("unk", "bos", "eos")}
    assert names == {"unk": "<unk>", "bos": "<s>", "eos": "</s>"}
    assert config["add_bos_token"] is True
    assert tok.encode("hi").ids == [bos, *_spm_encode("hi", vocab)]


def test_bad_tokenizer_metadata(tmp_path: Path, vocab: SpmVocab) -> None:
    bert = _write_spm_gguf(tmp_path / "bert.gguf", vocab, model="bert")
    with pytest.raises(ValueError, match=r"tokenizer model 'bert'; supported: gpt2, llama"):
        _build(bert)
    short = vocab._replace(scores=vocab.scores[:-1])
    with pytest.raises(ValueError, match=r"llama tokenizer needs .* one \.scores each"):
        _build(_write_spm_gguf(tmp_path / "short.gguf", short))
    untyped = vocab._replace(types=vocab.types[:-1])
    with pytest.raises(ValueError, match=r"GGUF has \d+ token types for \d+ tokens"):
        _build(_write_spm_gguf(tmp_path / "untyped.gguf", untyped))
    writer = gguf.GGUFWriter(str(tmp_path / "far.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_bos_token_id(len(vocab.tokens))
    _finish(writer)
    with pytest.raises(ValueError, match=r"bos_token_id is \d+, outside the \d+-token vocab"):
        _build(tmp_path / "far.gguf")


# -- a converted model directory -------------------------------------------------------------


def _tiny_llama_tensors(vocab_size: int, seed: int = 0) -> dict[str, np.ndarray[Any, Any]]:
    """Random weights of a one-layer llama with one KV head, in HF layout."""
    rng = np.random.default_rng(seed)
    hidden, kv, ffn = TINY_HIDDEN, TINY_HIDDEN // TINY_HEADS, TINY_FFN

    def w(*shape: int) -> np.ndarray[Any, Any]:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    return {
        "token_embd.weight": w(vocab_size, hidden),
        "blk.0.attn_norm.weight": np.ones(hidden, np.float32),
        "blk.0.attn_q.weight": w(hidden, hidden),
        "blk.0.attn_k.weight": w(kv, hidden),
        "blk.0.attn_v.weight": w(kv, hidden),
        "blk.0.attn_output.weight": w(hidden, hidden),
        "blk.0.ffn_norm.weight": np.ones(hidden, np.float32),
        "blk.0.ffn_gate.weight": w(ffn, hidden),
        "blk.0.ffn_up.weight": w(ffn, hidden),
        "blk.0.ffn_down.weight": w(hidden, ffn),
        "output_norm.weight": np.ones(hidden, np.float32),
        "output.weight": w(vocab_size, hidden),
    }


@pytest.fixture(scope="module")
def converted(vocab: SpmVocab, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("spm-model")
    tensors = _tiny_llama_tensors(len(vocab.tokens))
    path = _write_spm_gguf(root / "tiny.gguf", vocab, chat_template=CHAT_TEMPLATE, tensors=tensors)
    return convert_gguf(path, root / "converted")


def test_converted_directory_loads_and_serves(
    converted: Path, vocab: SpmVocab, engine_factory: Any
) -> None:
    config = ModelConfig.from_dir(converted)
    tok = Tokenizer.from_dir(converted)
    assert config.vocab_size == tok.vocab_size == len(vocab.tokens)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.add_bos_token) == (1, (2,), True)
    assert tok.chat_template == CHAT_TEMPLATE
    bos = [vocab.id("<s>")]
    assert tok.encode("Hello world") == bos + _spm_encode("Hello world", vocab)

    # Chat: BOS then "[INST] ..." with its own "▁" prefix, as Llama 2's reference code encodes
    # each turn; a client's "</s>" is text, not EOS.
    messages = [{"role": "user", "content": "say </s> now"}]
    ids, text = tok.encode_chat(messages)
    assert text == "<s>[INST] say </s> now [/INST]"
    assert ids == bos + _spm_encode("[INST] say </s> now [/INST]", vocab)
    assert tok.encode(text, add_special_tokens=False) != ids  # plain encode reads "</s>" as EOS

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [out] = engine_factory(converted).generate(["Hello world"], params)
    assert out.prompt_token_ids == bos + _spm_encode("Hello world", vocab)
    assert len(out.token_ids) == 8 and all(0 <= i < config.vocab_size for i in out.token_ids)


def test_streaming_decode(converted: Path, vocab: SpmVocab) -> None:
    """Deltas join to the text; an emoji spelled as four byte pieces comes out whole, on its last
    byte; a stream with no prompt drops the prefix space as `decode` does."""
    tok = Tokenizer.from_dir(converted)
    ids = tok.encode("Say: Hi 🙂 café 日本", add_special_tokens=False)
    emoji = [vocab.id(f"<0x{b:02X}>") for b in "🙂".encode()]
    at = next(i for i in range(len(ids)) if ids[i : i + 4] == emoji)
    for num_prompt in (0, 2):
        prompt, generated = [vocab.id("<s>"), *ids[:num_prompt]], ids[num_prompt:]
        detok = IncrementalDetokenizer(tok, prompt)
        deltas = [detok.add([i]) for i in generated]
        assert detok.flush() == ""
        text = "Say: Hi 🙂 café 日本"[len(tok.decode(prompt)) :]
        assert "".join(deltas) == detok.text == text
        first = at - num_prompt
        assert deltas[first : first + 4] == ["", "", "", "🙂"]
