"""Speculative decoding (issue 45): batch-1 tokens/s per proposer and workload, throughput by
batch size with speculation forced on and off, and acceptance disaggregated vs colocated.

    .venv/bin/python benchmarks/bench_speculative.py batch1 [--model-dir DIR] [--reps N]
    .venv/bin/python benchmarks/bench_speculative.py batch [--sizes 1,4,8,16,32] [--workload W]
    .venv/bin/python benchmarks/bench_speculative.py pd [--model-dir DIR]
    .venv/bin/python benchmarks/bench_speculative.py cost [--model-dir DIR]
    .venv/bin/python benchmarks/bench_speculative.py draft-layers [--layer-sets "0-7;0-3,26-29"]

`cost` measures what a verify step costs against a plain decode step at k = 1..4 (the
constants of `tandem.speculative.speculator.CPU_COST`): one request at a 500-token context,
its drafts always wrong (each verify still yields one token), plain and verify steps
alternated so the box's load moves both alike; medians of --reps rounds.

Every ratio is against speculation off in the same run: the engines run side by side and
each prompt is served by every engine in turn, so the box's load moves all of them alike.
Greedy answers must be token-identical across engines (the script fails otherwise).

Workloads (chat-templated, greedy, up to --max-tokens):
  code-edit   rewrite a given function with one change (the model copies most of it)
  agent       an agent loop whose next turn repeats the tool's output
  quote       summarise a passage, then quote it
  chat        open chat: little to copy (speculation must cost next to nothing there)

Proposers: none, ngram, suffix, and draft: a draft model made of the target's
--draft-layers, written once next to the model: no smaller model shares SmolLM2's tokenizer.
The default, all 30 layers, drafts what the target would say (the ceiling of any draft's
acceptance, at the target's own cost); a layer-skipping draft ("0-7,22-29") is cheaper but
its guesses are rarely accepted (BENCHMARKS.md issue 45). It drafts with the cost rule
(`draft`) and always k tokens (`draft-forced`, --speculative-adaptive false).

Default model: SmolLM2-135M-Instruct (the CLI's default), float32 (--dtype). Writes
benchmarks/results/speculative.json and benchmarks/plots/speculative-batch1.png.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tandem.config import (  # noqa: E402
    CacheConfig,
    EngineConfig,
    EngineRole,
    SchedulerConfig,
    SpeculativeConfig,
)
from tandem.engine.engine import LLMEngine  # noqa: E402
from tandem.engine.request import Resume  # noqa: E402
from tandem.engine.sampling import SamplingParams  # noqa: E402
from tandem.transfer.sections import SectionKind  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"
RESULTS = ROOT / "results" / "speculative.json"
PLOT = ROOT / "plots" / "speculative-batch1.png"
METHODS = ("none", "ngram", "suffix", "draft", "draft-forced")

CODE = """def parse_orders(lines):
    orders = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        order_id, customer, amount = line.split(",")
        orders.append({"id": int(order_id), "customer": customer.strip(),
                       "amount": float(amount)})
    total = sum(order["amount"] for order in orders)
    return orders, total
"""
TOOL = """{"files": ["src/app.py", "src/models/user.py", "src/models/order.py",
"src/routes/orders.py", "tests/test_orders.py", "tests/test_users.py"],
"status": "ok", "elapsed_ms": 41}"""
PASSAGE = (
    "The bicycle was invented in the early nineteenth century. The first machines had no "
    "pedals; riders pushed them along the ground with their feet. Pedals were added to the "
    "front wheel in the 1860s, and the safety bicycle, with two wheels of equal size and a "
    "chain drive, appeared in the 1880s. It made cycling popular across Europe and America."
)


def workloads() -> dict[str, list[list[dict[str, str]]]]:
    """Each workload's chats (one conversation per prompt)."""
    return {
        "code-edit": [
            [{"role": "user", "content": f"Rename the variable `orders` to `records` in this "
              f"function. Reply with the whole function only.\n\n```python\n{CODE}```"}],
            [{"role": "user", "content": f"Add a docstring to this function and change "
              f"nothing else. Reply with the whole function.\n\n```python\n{CODE}```"}],
        ],
        "agent": [
            [
                {"role": "user", "content": "List the project's files, then tell me them."},
                {"role": "assistant", "content": "Calling list_files()."},
                {"role": "user", "content": f"Tool output:\n{TOOL}\nRepeat the tool output "
                 "exactly as JSON, then say which files are tests."},
            ],
        ],
        "quote": [
            [{"role": "user", "content": f"Passage: {PASSAGE}\n\nQuote the passage word for "
              "word, then summarise it in one sentence."}],
        ],
        "chat": [
            [{"role": "user", "content": "What makes a good cup of tea? Give me some tips."}],
            [{"role": "user", "content": "Write a short story about a lighthouse keeper."}],
        ],
    }  # fmt: skip


CPU_MATMUL = "auto"  # --cpu-matmul
DRAFT_LAYERS = "0-29"  # --draft-layers
# --dtype: float32 by default, where a verify step's rows round exactly as a plain step's
# (greedy answers token-identical, which the script checks); bfloat16 through oneDNN (a CPU
# with AMX or AVX512-BF16) rounds a few-row product differently from a one-row one, so
# answers may part after a near-tie (tandem.model.linear.pack)
DTYPE = "float32"


def parse_layers(spec: str) -> list[int]:
    """ "0-3,26-29" -> [0, 1, 2, 3, 26, 27, 28, 29]."""
    out: list[int] = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return out


def layer_draft(model_dir: Path, layers: str) -> Path:
    """The target's layers `layers` (e.g. "0-3,26-29": its first and last four, the middle
    skipped) with its embedding, final norm and head, as a model directory beside it
    (written once): a layer-skipping draft sharing its tokenizer."""
    import shutil

    from safetensors.torch import load_file, save_file

    keep = parse_layers(layers)
    out = model_dir.parent / f"{model_dir.name}-layers{layers.replace(',', '_')}"
    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = len(keep)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy(model_dir / name, out / name)
    renumber = {old: new for new, old in enumerate(keep)}
    kept = {}
    for k, v in load_file(model_dir / "model.safetensors").items():
        if not k.startswith("model.layers."):
            kept[k] = v
            continue
        parts = k.split(".")
        if int(parts[2]) in renumber:
            parts[2] = str(renumber[int(parts[2])])
            kept[".".join(parts)] = v
    save_file(kept, out / "model.safetensors.part")
    (out / "model.safetensors.part").rename(out / "model.safetensors")
    return out


def spec_config(model_dir: Path, method: str, max_batch: int) -> SpeculativeConfig:
    if not method.startswith("draft"):
        return SpeculativeConfig(method=method, max_batch=max_batch)
    draft = layer_draft(model_dir, DRAFT_LAYERS)
    return SpeculativeConfig(method="draft", draft_model=str(draft), max_batch=max_batch,
                             adaptive=method == "draft")  # fmt: skip


def make_engine(model_dir: Path, method: str, max_batch: int = 8, **kw: Any) -> LLMEngine:
    cfg = EngineConfig(
        model_dir=str(model_dir),
        dtype=DTYPE,
        cpu_matmul=CPU_MATMUL,
        cache=CacheConfig(num_blocks=2048),
        scheduler=SchedulerConfig(max_num_seqs=64),
        speculative=spec_config(model_dir, method, max_batch),
        **kw,
    )
    engine = LLMEngine(cfg)
    engine.warm_up()
    return engine


def serve(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    """Serve `prompts` at once, greedy: (seconds from the first token to the end, tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rids = [f"b{engine.num_steps}-{i}" for i in range(len(prompts))]
    reqs = [
        engine.add_request(engine.spec(r, p, params)) for r, p in zip(rids, prompts, strict=True)
    ]
    first = None
    while engine.has_unfinished():
        engine.step()
        if first is None and all(r.output_token_ids for r in reqs):
            first = time.perf_counter()
    assert first is not None
    return time.perf_counter() - first, [list(r.output_token_ids) for r in reqs]


def counts(engine: LLMEngine) -> tuple[int, int, int, int]:
    stats = engine.spec_stats()
    if not stats:
        return (0, 0, 0, 0)
    s = stats[0]
    return (s.proposed_tokens, s.accepted_tokens, s.verify_rows, s.emitted_tokens)


def cmd_batch1(args: argparse.Namespace) -> dict:
    engines = {m: make_engine(args.model_dir, m) for m in METHODS}
    tok = engines["none"].tokenizer
    assert tok is not None
    rows = []
    for name, chats in workloads().items():
        prompts = [tok.encode_chat(chat)[0] for chat in chats]
        secs = dict.fromkeys(METHODS, 0.0)
        toks = dict.fromkeys(METHODS, 0)
        before = {m: counts(e) for m, e in engines.items()}
        for _ in range(args.reps):
            for prompt in prompts:
                answers = {}
                for m, e in engines.items():  # each prompt by every engine in turn
                    s, [out] = serve(e, [prompt], args.max_tokens)
                    secs[m] += s
                    toks[m] += len(out) - 1
                    answers[m] = out
                if len({tuple(a) for a in answers.values()}) != 1:
                    raise SystemExit(f"{name}: greedy answers differ across proposers")
        base = toks["none"] / secs["none"]
        for m, e in engines.items():
            after = counts(e)
            proposed, accepted, verify, emitted = (
                a - b for a, b in zip(after, before[m], strict=True)
            )
            rate = toks[m] / secs[m]
            decode_steps = toks[m] - emitted + verify  # plain steps + verifying steps
            rows.append({
                "workload": name, "method": m, "decode_tokens_per_s": round(rate, 2),
                "vs_off": round(rate / base, 3),
                "acceptance_rate": round(accepted / proposed, 3) if proposed else None,
                "tokens_per_step": round(toks[m] / decode_steps, 3) if decode_steps else None,
                "acceptance_length": round(emitted / verify, 3) if verify else None,
            })  # fmt: skip
            print(json.dumps(rows[-1]), flush=True)
    plot(rows)
    return {"model": args.model_dir.name, "max_tokens": args.max_tokens, "reps": args.reps,
            "rows": rows}  # fmt: skip


def cmd_batch(args: argparse.Namespace) -> dict:
    """Output tokens/s at each batch size, --workload's prompts, speculation forced on (its
    max_batch above every size) against off, each size served by both in turn."""
    sizes = [int(s) for s in args.sizes.split(",")]
    engines = {m: make_engine(args.model_dir, m, max_batch=1024) for m in ("none", args.method)}
    tok = engines["none"].tokenizer
    assert tok is not None
    chats = workloads()[args.workload]
    prompts = [tok.encode_chat(c)[0] for c in chats]
    rows = []
    for n in sizes:
        batch = [prompts[i % len(prompts)] for i in range(n)]
        rates = {}
        for m, e in engines.items():
            s, outs = serve(e, batch, args.max_tokens)
            rates[m] = sum(len(o) - 1 for o in outs) / s
        rows.append({"batch": n, "off_tokens_per_s": round(rates["none"], 1),
                     "on_tokens_per_s": round(rates[args.method], 1),
                     "on_vs_off": round(rates[args.method] / rates["none"], 3)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {"model": args.model_dir.name, "method": args.method, "workload": args.workload,
            "max_tokens": args.max_tokens, "rows": rows}  # fmt: skip


def cmd_pd(args: argparse.Namespace) -> dict:
    """Acceptance colocated (one engine) against disaggregated (a prefill engine hands each
    prompt's KV to a decode engine, copied block by block in process), per proposer."""
    rows = []
    chats = [c for cs in workloads().values() for c in cs]
    for m in args.methods.split(",") if args.methods else METHODS[1:]:
        full = make_engine(args.model_dir, m)
        # a draft model's prefill worker prefills the draft too and hands its KV over
        pre = m if m.startswith("draft") else "none"
        prefill = make_engine(args.model_dir, pre, role=EngineRole.PREFILL)
        decode = make_engine(args.model_dir, m, role=EngineRole.DECODE)
        tok = full.tokenizer
        assert tok is not None
        for i, chat in enumerate(chats):
            prompt = tok.encode_chat(chat)[0]
            _, [colocated] = serve(full, [prompt], args.max_tokens)
            split = handoff(prefill, decode, f"pd{i}", prompt, args.max_tokens)
            if split != colocated:
                raise SystemExit(f"{m}: disaggregated output differs from colocated")
        a, b = full.spec_stats()[0], decode.spec_stats()[0]
        rows.append({"method": m, "colocated_acceptance_length": round(a.acceptance_length, 4),
                     "disaggregated_acceptance_length": round(b.acceptance_length, 4),
                     "ratio": round(b.acceptance_length / a.acceptance_length, 4)
                     if a.verify_rows else None,  # (the cost rule may never draft)
                     "decode_draft_prefill_tokens": b.draft_prefill_tokens,
                     "decode_draft_handoff_tokens": b.draft_handoff_tokens})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
        del full, prefill, decode  # three engines per method: free them before the next
        gc.collect()
    return {"model": args.model_dir.name, "rows": rows}


def cmd_draft_layers(args: argparse.Namespace) -> dict:
    """Acceptance of drafts cut from the target's layers (--layer-sets, ";"-separated
    `--draft-layers` values), always drafting k = 4, on the code-edit prompts."""
    global DRAFT_LAYERS
    rows = []
    for layers in args.layer_sets.split(";"):
        DRAFT_LAYERS = layers
        e = make_engine(args.model_dir, "draft-forced")
        tok = e.tokenizer
        assert tok is not None
        for chat in workloads()["code-edit"]:
            serve(e, [tok.encode_chat(chat)[0]], args.max_tokens)
        s = e.spec_stats()[0]
        rows.append({"layers": layers, "acceptance_rate": round(s.accepted_tokens
                     / max(s.proposed_tokens, 1), 3), "acceptance_length":
                     round(s.acceptance_length, 3)})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {"model": args.model_dir.name, "max_tokens": args.max_tokens, "rows": rows}


class WrongDraft:
    """A proposer whose drafts are never accepted: k copies of a token the model would not
    pick here (it is set to a rejected one after the first step)."""

    name = "wrong"

    def __init__(self) -> None:
        self.k = 1

    def start(self, request_id: str, token_ids: Any, tenant: str = "", n: int = 0) -> None: ...

    def extend(self, request_id: str, token_ids: Any) -> None: ...

    def propose(self, request_id: str, k: int) -> list[int]:
        return [3] * self.k

    def finish(self, request_id: str) -> None: ...

    def num_requests(self) -> int:
        return 0


def cmd_cost(args: argparse.Namespace) -> dict:
    import statistics

    from tandem.speculative.speculator import VerifyCost

    ks = (1, 2, 3, 4)
    engines = {k: make_engine(args.model_dir, "ngram" if k else "none") for k in (0, *ks)}
    params = SamplingParams(max_tokens=4 * args.reps + 8, temperature=0.0, ignore_eos=True)
    prompt = list(range(1000, 1500))
    times: dict[int, list[float]] = {k: [] for k in engines}
    for k, e in engines.items():
        if e.speculator is not None:
            proposer = e.speculator.proposer = WrongDraft()  # type: ignore[assignment]
            proposer.k = k
            e.speculator.cost = VerifyCost(0.0, 0.0)  # always draft: rate never matters
        e.add_request(e.spec("c", prompt, params))
        e.step()  # the prefill
    for _ in range(args.reps):
        for k, e in engines.items():  # each round: a step of every engine in turn
            t = time.perf_counter()
            e.step()
            times[k].append(time.perf_counter() - t)
    base = statistics.median(times[0])
    medians = {k: statistics.median(t) for k, t in times.items()}
    rows = [
        {"k": k, "step_ms": round(1000 * m, 2), "vs_plain": round(m / base, 3)}
        for k, m in medians.items()
    ]
    for row in rows:
        print(json.dumps(row), flush=True)
    return {"model": args.model_dir.name, "context": len(prompt), "cpu_matmul": args.cpu_matmul,
            "rows": rows}  # fmt: skip


def handoff(prefill: LLMEngine, decode: LLMEngine, rid: str, prompt: list[int], n: int) -> list:
    """One request prefilled by `prefill`, its KV copied into `decode`, decoded there."""
    import torch

    params = SamplingParams(max_tokens=n, temperature=0.0)
    prefill.add_request(prefill.spec(rid, prompt, params))
    while not (outs := [o for o in prefill.step() if o.request_id == rid]):
        pass
    [out] = outs
    src = prefill.block_table(rid)
    pages = len(src) - out.draft_blocks
    reserved = decode.reserve_kv(decode.spec(rid, prompt, params), Resume(out.new_token_ids))
    assert reserved is not None
    dst, cached = reserved
    first = cached // decode.kv.block_size
    copies = [(src[first:pages], dst[first:])]
    if out.draft_blocks:  # the draft_kv section, into blocks reserved for it
        copies.append((src[pages:], decode.reserve_section(rid, SectionKind.DRAFT_KV) or []))
    for a, b in copies:
        idx = torch.tensor(b, dtype=torch.long)
        decode.kv_cache[idx] = prefill.kv_cache[torch.tensor(a, dtype=torch.long)]
    decode.commit_kv(rid)
    request = decode.get_request(rid)
    assert request is not None and prefill.release(rid)
    while decode.has_unfinished():
        decode.step()
    return list(request.output_token_ids)


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(METHODS)
    for j, m in enumerate(METHODS):
        vals = [next(r["vs_off"] for r in rows if r["workload"] == n and r["method"] == m)
                for n in names]  # fmt: skip
        ax.bar([i + j * width for i in range(len(names))], vals, width, label=m)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks([i + width * (len(METHODS) - 1) / 2 for i in range(len(names))], names)
    ax.set_ylabel("batch-1 decode tokens/s vs off")
    ax.set_title("Speculative decoding, SmolLM2-135M on 2 CPU cores")
    ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cmd", choices=("batch1", "batch", "pd", "cost", "draft-layers"))
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--sizes", default="1,4,8,16,32")
    parser.add_argument("--method", default="ngram")
    parser.add_argument("--cpu-matmul", default="auto", choices=("auto", "plain", "onednn"))
    parser.add_argument("--draft-layers", default="0-29")
    parser.add_argument("--methods", default="", help="pd: these proposers (default all)")
    parser.add_argument("--layer-sets", default="0-7;0-13;0-3,26-29;0-5,24-29;0-7,22-29")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    parser.add_argument("--workload", default="code-edit", choices=tuple(workloads()))
    args = parser.parse_args()
    global CPU_MATMUL, DRAFT_LAYERS, DTYPE
    CPU_MATMUL, DRAFT_LAYERS, DTYPE = args.cpu_matmul, args.draft_layers, args.dtype
    commands = {"batch1": cmd_batch1, "batch": cmd_batch, "pd": cmd_pd, "cost": cmd_cost,
                "draft-layers": cmd_draft_layers}  # fmt: skip
    result = commands[args.cmd](args)
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    key = f"batch-{args.workload}" if args.cmd == "batch" else args.cmd
    key += "" if args.cpu_matmul == "auto" else f"-{args.cpu_matmul}"
    saved[key] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
