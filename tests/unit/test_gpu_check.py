"""`scripts/gpu-check --cpu` (the GPU check's CPU smoke run) passes every part end to end.

The script is what runs on the lent H200; this keeps each of its parts working between the
rare runs there. Its figures are not asserted (tests never assert a timing).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu-check"
PER_ARCH = ("fp32_greedy", "chunked_prefill", "prefix_cache_hit", "bf16_logits")


def test_gpu_check_cpu_run_passes_every_part(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert (tmp_path / "gpu-check.log").read_text().strip()
    assert report["mode"] == "cpu" and report["ok"] is True
    assert report["environment"]["torch"]
    parts = report["parts"]
    assert list(parts) == [
        "preflight", "startup", "parity", "throughput", "kernels", "e2e", "quant", "nixl", "serve",
        "tiles",
    ]  # fmt: skip
    nixl_status = "ok" if importlib.util.find_spec("nixl") else "skipped"
    expected = {
        "preflight": "ok",
        "startup": "ok",
        "parity": "ok",
        "throughput": "ok",
        "kernels": "ok",
        "e2e": "ok",
        "quant": "ok",
        "nixl": nixl_status,
        "serve": "ok",
        "tiles": "ok",
    }
    assert {name: p["status"] for name, p in parts.items()} == expected, output
    for part in parts.values():
        assert part["duration_s"] >= 0

    # preflight: what Triton's launcher needs, and one kernel launched (the interpreter here).
    pre = parts["preflight"]["figures"]
    assert pre["triton_launch"] == "ok" and pre["triton_interpreter"] is True
    assert pre["c_compiler"] and pre["python_h"] and pre["python_h"].endswith("Python.h")
    assert pre["torch_cuda"] == torch.version.cuda
    assert pre["attention_backend_for_later_parts"] == "auto"

    # startup: the values-gpu.yaml decode worker's engine (sized, not given a block count),
    # warmed up, serving tokens identical to one engine.
    startup = parts["startup"]["figures"]
    assert startup["config"]["gpu_memory_utilization"] == 0.9
    assert startup["config"]["max_num_seqs"] == 256  # the chart's decode value
    assert startup["num_blocks"] > 0 and startup["warm_up_s"] >= 0
    assert startup["requests"] and all(r["identical"] for r in startup["requests"])

    sub_checks = parts["parity"]["figures"]["sub_checks"]
    names = {f"{a}/{c}" for a in ("llama", "qwen3") for c in PER_ARCH} | {"llama/sampling"}
    assert set(sub_checks) == names
    assert all(r["passed"] for r in sub_checks.values()), sub_checks

    tp = parts["throughput"]["figures"]
    for side in ("engine", "hf"):
        assert tp[side]["output_tokens"] == tp["workload"]["output_tokens"]
        assert not tp[side]["truncated_by_budget"]
    assert tp["ratio_engine_over_hf"] > 0

    # kernels: every kernel checked against tandem.kernels.reference under Triton's interpreter,
    # then every benchmark case run (timed, smoke) and the prefill cases agreeing with SDPA.
    kernels = parts["kernels"]["figures"]
    assert set(kernels["correctness"]) == {"write_kv", "decode", "prefill"}
    assert all(r["passed"] for r in kernels["correctness"].values()), kernels["correctness"]
    assert kernels["copy"]["gb_s"] > 0
    decode_cases = kernels["decode"]["cases"]
    assert decode_cases and all(c["gb_s"] > 0 and "skipped" not in c for c in decode_cases)
    # The serving table width (the longest context) for every case, splits by the context.
    assert {c["table_width"] for c in decode_cases} == {
        max(c["context"] for c in decode_cases) // 16
    }
    prefill_cases = kernels["prefill"]["cases"]
    assert prefill_cases and all(c["agrees_with_sdpa"] and c["tflop_s"] > 0 for c in prefill_cases)
    assert any(c["prefix"] > 0 for c in prefill_cases)  # the lower-right causal baseline

    # e2e: one engine on the CPU (no CUDA graphs there), on throughput's weights.
    e2e = parts["e2e"]["figures"]
    assert e2e["weights_from"] == "the throughput part's directory"
    assert e2e["graphs"]["status"] == "skipped"
    assert e2e["eager"]["timed_steps"] > 0 and e2e["eager"]["itl_ms"] > 0
    assert 0 < e2e["roofline"]["weight_bytes_read_per_step"] < e2e["roofline"]["weight_bytes"]
    assert e2e["throughput_target"]["measured"] == tp["ratio_engine_over_hf"]

    # quant: each scheme's CPU path and the Triton kernels (interpreter) against the float32
    # reference, the FP8 KV kernels, every linear case timed, the engines on throughput's
    # weights (left by e2e).
    quant = parts["quant"]["figures"]
    linears = quant["linear_correctness"]
    assert {s: r["production_path"] for s, r in linears.items()} == {
        "fp8": "fp8_decoded",
        "int8": "int8_packed",
        "int4": "int4_packed",
    }
    for record in linears.values():
        assert record["passed"] and set(record["paths"]) == {record["production_path"], "triton"}
        cases = [c for p in record["paths"].values() for c in p["cases"]]
        assert cases and all(c["passed"] and c["max_abs_diff"] < 0.04 for c in cases)
    fp8_cases = linears["fp8"]["paths"]["triton"]["cases"]
    assert all("vs_unquantized_activations" in c for c in fp8_cases)
    kv = quant["fp8_kv_correctness"]
    assert all(kv[name]["passed"] for name in ("write_kv", "decode", "prefill")), kv
    shapes = quant["linear_speed"]["shapes"]
    assert shapes and all(
        c[s]["ms"] > 0 for shape in shapes for c in shape["cases"] for s in ("fp8", "int8", "int4")
    )
    assert all(shape["weight_bytes"]["int4"] < shape["weight_bytes"]["bf16"] for shape in shapes)
    engine = quant["engine"]
    assert engine["weights_from"] == "the throughput part's directory"
    assert engine["fp8"]["linear_path"] == "fp8_decoded" and engine["fp8"]["itl_ms"] > 0
    assert engine["float32"]["linear_path"] == "dense float32"
    assert engine["fp8"]["weight_bytes"] < engine["float32"]["weight_bytes"]
    assert engine["fp8_with_fp8_kv"]["prefill"]["steps_per_prompt"] == [1, 1]
    assert set(engine["speedup_vs_float32"]) == {"fp8", "fp8_with_fp8_kv"}

    serve = parts["serve"]["figures"]
    assert serve["requests"] and all(r["identical"] for r in serve["requests"])
    assert all(r["disaggregated"] for r in serve["requests"])
    assert serve["kv_pulls_recomputed"] == 0

    # tiles: every candidate checked against the reference before it is timed
    tiles = parts["tiles"]["figures"]
    for kind, case in (("decode", "b2_c256"), ("prefill", "b2_n32_p40")):
        candidates = tiles[kind]["candidates"]
        assert candidates and all(c["correct"] for c in candidates), candidates
        assert all(c[case]["time_us" if kind == "decode" else "time_ms"] > 0 for c in candidates)
        assert tiles[kind]["best"]["tiles"] in [c["tiles"] for c in candidates]


def test_gpu_check_new_parts_alone_build_what_they_need(tmp_path: Path) -> None:
    """kernels as the first part (its interpreter set-up), e2e without throughput's weights,
    quant on the weights e2e wrote."""
    proc = subprocess.run(
        [
            *(sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path)),
            *("--parts", "kernels,e2e,quant"),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, output
    parts = json.loads((tmp_path / "gpu-check.json").read_text())["parts"]
    assert {name: p["status"] for name, p in parts.items() if p["status"] != "skipped"} == {
        "kernels": "ok",
        "e2e": "ok",
        "quant": "ok",
    }
    e2e = parts["e2e"]["figures"]
    assert e2e["weights_from"] == "built by this part"
    assert e2e["throughput_target"]["measured"] is None
    assert parts["quant"]["figures"]["engine"]["weights_from"] == "the e2e part's directory"


def test_gpu_check_rejects_unknown_parts(tmp_path: Path) -> None:
    run = [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path), "--parts"]
    bad = subprocess.run([*run, "parity,bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bogus" in bad.stderr
