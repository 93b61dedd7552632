"""`tandem up --tp 2` against `tandem up` on the default model (issue 29): the same greedy
answers through the OpenAI API, the prefill worker of each handing off to its decode worker.

    python benchmarks/check_tp_up.py [--dtype float32,auto] [--max-tokens 48]
        [--model-dir DIR] [--results-dir DIR]

For each dtype, both clusters are started in turn (`tandem up --dtype D`, then with
`--tp 2`: 2 ranks a worker), each asked the same chat prompts (the README's question first)
at temperature 0 through the real `openai` client, whole and streamed. Reports, per dtype,
how many answers are identical and, where one is not, the first differing character.
Every answer must agree in every dtype: on a CPU the ranks split o and down by their
outputs (`EngineConfig.tp_exact_sums`), so two ranks compute one rank's logits bit for bit.
Writes <results-dir>/tp_up.json; exit status 1 when an answer differs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from bench_vllm_cpu import default_model_dir, log, serving
from report import RESULTS_DIR, machine_info, write_json

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
    "Explain in two sentences why the sky is blue.",
    "What is 17 times 23?",
    "Name the planets of the solar system in order.",
    "Give a short definition of photosynthesis.",
    "Translate 'good morning' into Spanish and German.",
]


def answers(port: int, name: str, max_tokens: int) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
    out = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        ask = {"model": name, "messages": messages, "temperature": 0, "max_tokens": max_tokens}
        whole = client.chat.completions.create(**ask)  # type: ignore[call-overload]
        stream = client.chat.completions.create(**ask, stream=True)  # type: ignore[call-overload]
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        text = whole.choices[0].message.content or ""
        if streamed != text:
            raise RuntimeError(f"streamed and whole answers differ for {prompt!r}")
        out.append(text)
    return out


def first_difference(a: str, b: str) -> int:
    pairs = enumerate(zip(a, b, strict=False))
    return next((i for i, (x, y) in pairs if x != y), min(len(a), len(b)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtype", default="float32,auto")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    model_dir = args.model_dir or default_model_dir()
    log_dir = Path(tempfile.mkdtemp(prefix="check-tp-up-logs-"))
    rows: list[dict[str, Any]] = []
    failed = False
    for dtype in args.dtype.split(","):
        got: dict[int, list[str]] = {}
        for tp in (1, 2):
            extra = ("--dtype", dtype, *(("--tp", "2") if tp == 2 else ()))
            with serving("tandem-up", model_dir, "", log_dir, {}, extra) as (port, name):
                got[tp] = answers(port, name, args.max_tokens)
        same = [a == b for a, b in zip(got[1], got[2], strict=True)]
        row = {
            "dtype": dtype,
            "identical": sum(same),
            "prompts": len(PROMPTS),
            "first_difference": [
                None if s else first_difference(a, b)
                for s, a, b in zip(same, got[1], got[2], strict=True)
            ],
            "tp1": got[1],
            "tp2": got[2],
        }
        rows.append(row)
        log(f"{dtype}: {sum(same)} of {len(PROMPTS)} answers identical; README: {got[2][0]!r}")
        failed |= not all(same)
    write_json(
        args.results_dir / "tp_up.json",
        {
            "command": "python benchmarks/check_tp_up.py " + " ".join(sys.argv[1:]),
            "machine": machine_info(model_dir=str(model_dir)),
            "rows": rows,
        },
        indent=1,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
