"""Deterministic tiny Llama-style models for tests, benchmarks and the embedded default.

`make_tiny_model` writes a HuggingFace-compatible Llama directory (config, weights, byte-level BPE
tokenizer with a Llama-3-style chat template). Same preset and seed give byte-identical files.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as HFTokenizer

BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
# The trainer assigns special tokens the first ids, in this order.
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)
BOS_ID, EOS_ID, START_HEADER_ID, END_HEADER_ID, EOT_ID = range(len(SPECIAL_TOKENS))
_BYTE_ALPHABET_SIZE = 256
_POSITIVE_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads "
    "num_key_value_heads max_position_embeddings"
).split()

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ('system', 'user', 'assistant', 'tool') -%}"
    "{{- raise_exception('unsupported role ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' -}}"
    "{{- message['content'] | trim -}}"
    "{{- '<|eot_id|>' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}"
    "{%- endif -%}"
)


@dataclass(frozen=True, slots=True)
class TinyPreset:
    """Shape of a generated model."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float

    def __post_init__(self) -> None:
        for name in _POSITIVE_FIELDS:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        min_vocab = _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)
        if self.vocab_size < min_vocab:
            raise ValueError(
                f"vocab_size ({self.vocab_size}) must be at least {min_vocab} "
                "(256 byte tokens + special tokens)"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim ({self.head_dim}) must be even for RoPE")
        if self.rope_theta <= 0:
            raise ValueError(f"rope_theta must be positive, got {self.rope_theta}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


PRESETS: dict[str, TinyPreset] = {
    # Unit/integration tests: builds in well under a second.
    "tiny": TinyPreset(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    # Fault tests of long prompts: ~3M parameters, an 8000-token prompt takes seconds per
    # step on one thread (like a long document on a real model).
    "medium": TinyPreset(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
    # CPU benchmarks: ~46M parameters.
    "small": TinyPreset(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=12,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    ),
}


def get_preset(preset: str | TinyPreset) -> TinyPreset:
    """Resolve a preset name (or pass a `TinyPreset` through)."""
    if isinstance(preset, TinyPreset):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(
            f"unknown tiny-model preset {preset!r}; available: {', '.join(sorted(PRESETS))}"
        ) from None


def weight_shapes(preset: str | TinyPreset) -> dict[str, tuple[int, ...]]:
    """HF Llama tensor names -> shapes, in generation order."""
    p = get_preset(preset)
    kv_dim = p.num_key_value_heads * p.head_dim
    h, inter = p.hidden_size, p.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (p.vocab_size, h)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}"
        shapes[f"{pre}.input_layernorm.weight"] = (h,)
        shapes[f"{pre}.self_attn.q_proj.weight"] = (h, h)
        shapes[f"{pre}.self_attn.k_proj.weight"] = (kv_dim, h)
        shapes[f"{pre}.self_attn.v_proj.weight"] = (kv_dim, h)
        shapes[f"{pre}.self_attn.o_proj.weight"] = (h, h)
        shapes[f"{pre}.post_attention_layernorm.weight"] = (h,)
        shapes[f"{pre}.mlp.gate_proj.weight"] = (inter, h)
        shapes[f"{pre}.mlp.up_proj.weight"] = (inter, h)
        shapes[f"{pre}.mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not p.tie_word_embeddings:
        shapes["lm_head.weight"] = (p.vocab_size, h)
    return shapes


def num_params(preset: str | TinyPreset) -> int:
    """Parameter count of a preset (tied lm_head counted once), without building it."""
    return sum(math.prod(shape) for shape in weight_shapes(preset).values())


def make_tiny_model(
    out_dir: str | Path,
    preset: str | TinyPreset = "tiny",
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> Path:
    """Write a deterministic random Llama model directory into `out_dir` and return its path."""
    p = get_preset(preset)
    report = progress or (lambda _msg: None)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    report(f"training tokenizer (vocab {p.vocab_size})")
    tokenizer_json = build_tokenizer_json(p.vocab_size)
    report("writing config and tokenizer")
    _write_text(out / "tokenizer.json", tokenizer_json)
    _write_json(out / "tokenizer_config.json", _tokenizer_config(p))
    _write_json(out / "config.json", _model_config(p))
    generation = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, EOT_ID]}
    _write_json(out / "generation_config.json", generation)

    report(f"generating {num_params(p) / 1e6:.1f}M weights (seed {seed})")
    tensors = _make_weights(p, seed)
    report("writing weights")
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    report(f"wrote tiny model to {out}")
    return out


def _make_weights(p: TinyPreset, seed: int) -> dict[str, torch.Tensor]:
    # Drawn on the CPU whatever device later serves the model: CPU and CUDA generators give
    # different streams, and a seed must write the same safetensors file on every machine.
    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in weight_shapes(p).items():
        if name.endswith("norm.weight"):
            # Not exactly 1.0 so that a kernel ignoring the norm weight fails the HF comparison.
            noise = torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu")
            tensors[name] = 1.0 + 0.1 * noise
            continue
        if name == "model.embed_tokens.weight":
            std = 1.0
        elif name == "lm_head.weight":
            # Logit std ~3: greedy argmax then has clear margins, so float rounding
            # differences between implementations do not flip tokens.
            std = 3.0 / p.hidden_size**0.5
        else:
            # 1/sqrt(fan_in) keeps each layer's update comparable to the residual stream,
            # so attention and MLP bugs change the output (std 0.02 would make them invisible).
            std = 1.0 / shape[1] ** 0.5
        tensors[name] = torch.randn(shape, generator=gen, dtype=torch.float32, device="cpu") * std
    return tensors


def _model_config(p: TinyPreset) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": p.tie_word_embeddings,
        "use_cache": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
    }


def _tokenizer_config(p: TinyPreset) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": p.max_position_embeddings,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }


@lru_cache(maxsize=4)
def build_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE tokenizer for `vocab_size` and serialize it."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    # The corpus may not support enough merges for a large vocab: fill the rest with
    # reserved special tokens (as Llama 3 does) so the tokenizer size equals vocab_size.
    missing = vocab_size - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        reserved = [f"<|reserved_special_token_{i}|>" for i in range(missing)]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in reserved])
    # Invariants the rest of the file (and callers) rely on.
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    # Mirror Llama 3: the post-processor prepends BOS, so plain HF tokenizers add it too.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tok.to_str()


_WORDS = (
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by hot word but what some we can out other were all there when up use your "
    "how said an each she which do their time if will way about many then them write would "
    "like so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell does "
    "set three want air well also play small end put home read hand port large spell add even "
    "land here must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head stand own "
    "page should country found answer school grow study still learn plant cover food sun four "
    "between state keep eye never last let thought city tree cross farm hard start might story "
    "saw far sea draw left late run while press close night real life few north open seem"
).split()
_PUNCT = (".", ".", ".", "!", "?", ";", ":")
_ONSETS = "b c d f g h j k l m n p r s t v w z br cr dr fl gr pl st tr sh ch th".split()
_VOWELS = "a e i o u ai ea ou oo".split()
_CODAS = ("", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck")


def _corpus() -> list[str]:
    """A fixed pseudo-English corpus (~280 KB) from a seeded RNG, independent of the model seed.

    Real words alone support only ~2k merges; invented syllable words give the 8k-vocab preset
    real merges instead of thousands of never-seen reserved tokens.
    """
    rng = random.Random(1234)
    invented: set[str] = set()
    while len(invented) < 4000:
        syllables = rng.randint(1, 3)
        invented.add(
            "".join(
                rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS)
                for _ in range(syllables)
            )
        )
    pool = list(_WORDS) + sorted(invented)
    # Zipf-like weights: common words dominate, as in real text.
    cum_weights = list(itertools.accumulate(1.0 / (rank + 10) for rank in range(len(pool))))
    paragraphs = []
    for _ in range(1200):
        sentences = []
        for _ in range(rng.randint(2, 6)):
            words = rng.choices(pool, cum_weights=cum_weights, k=rng.randint(4, 14))
            if rng.random() < 0.3:
                words.insert(rng.randrange(len(words)), str(rng.randint(0, 2025)))
            if rng.random() < 0.3:
                pos = rng.randrange(1, len(words))
                words[pos - 1] += ","
            if rng.random() < 0.1:
                words.insert(rng.randrange(len(words)), f'"{rng.choice(pool[:200])}"')
            words[0] = words[0].capitalize()
            sentences.append(" ".join(words) + rng.choice(_PUNCT))
        paragraphs.append(" ".join(sentences) + "\n")
    return paragraphs


def _write_text(path: Path, text: str) -> None:
    # Write-then-rename so an interrupted run never leaves a truncated file behind.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text.encode("utf-8"))
    os.replace(tmp, path)


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    _write_text(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n")
