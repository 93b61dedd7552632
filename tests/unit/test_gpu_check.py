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

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "gpu-check"
PER_ARCH = ("fp32_greedy", "chunked_prefill", "prefix_cache_hit", "bf16_logits")


def test_gpu_check_cpu_run_passes_every_part(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--cpu", "--parts", "all", "--out", str(tmp_path)],
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
    tree = report["environment"]["tree"]  # the exact tree measured
    assert tree["source"] == "git" and len(tree["git_commit"]) == 40
    assert len(tree["tree_sha256"]) == 64
    parts = report["parts"]
    assert list(parts) == [
        "preflight", "startup", "parity", "throughput", "kernels", "e2e", "quant", "moe", "nixl",
        "serve", "tiles", "hybrid", "mla", "tiers",
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
        "moe": "ok",
        "nixl": nixl_status,
        "serve": "ok",
        "tiles": "ok",
        "hybrid": "ok",
        "mla": "ok",
        "tiers": "ok",
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
    assert tp["engine"]["output_tokens"] == tp["workload"]["output_tokens"]
    assert not tp["engine"]["truncated_by_budget"]
    assert "hf" not in tp  # HF generate is no longer run
    roof = tp["workload_roofline"]
    assert roof["roofline_s"] == pytest.approx(
        roof["weights_s"] + roof["kv_s"] + roof["prefill_flops_s"], abs=1e-3
    )
    assert 0 < roof["fraction"] and roof["met"] is None  # a smoke run is not judged

    # kernels: every kernel checked against tandem.kernels.reference under Triton's interpreter,
    # then every benchmark case run (timed, smoke) and the prefill cases agreeing with SDPA.
    kernels = parts["kernels"]["figures"]
    assert set(kernels["correctness"]) == {"write_kv", "decode", "prefill"}
    assert all(r["passed"] for r in kernels["correctness"].values()), kernels["correctness"]
    assert kernels["copy"]["gb_s"] > 0
    decode_cases = kernels["decode"]["cases"]
    assert decode_cases and all(c["gb_s"] > 0 and "skipped" not in c for c in decode_cases)
    # the FP8 KV cases read half the bytes of the same case over a 16-bit cache
    fp8 = [c for c in decode_cases if c["kv_dtype"] == "fp8"]
    assert [(c["batch"], c["context"]) for c in fp8] == [(2, 256)]
    bf16 = next(c for c in decode_cases if (c["batch"], c["context"]) == (2, 256) and c not in fp8)
    assert fp8[0]["kv_bytes"] * 2 == bf16["kv_bytes"]
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
    profile = e2e["eager"]["profile"]  # where a decode step's time goes, by category
    assert sum(profile["share"].values()) == pytest.approx(1.0, abs=1e-3)
    assert profile["share"]["gemm"] > 0 and profile["top_kernels"]

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
    # every candidate kernel timed beside the production path, the fastest named per row count
    assert all(
        set(c[s]["candidates_ms"]) == {"production", "triton"}
        for shape in shapes for c in shape["cases"] for s in ("fp8", "int8", "int4")
    )  # fmt: skip
    gemms = quant["bf16_gemms"]  # the split-K candidate checked, then timed beside cuBLAS
    assert gemms["passed"] and gemms["large_matrix_gb_s"]["1"] > 0
    assert all(
        c["splitk_correct"] and set(c) >= {"engine_layout", "f_linear", "splitk"}
        for shape in gemms["shapes"] for c in shape["cases"]
    )  # fmt: skip
    fastest = quant["linear_speed"]["fastest_by_rows"]
    assert set(fastest) == {"fp8", "int8", "int4"}
    assert all(row["fastest"] in row["total_ms"] for f in fastest.values() for row in f.values())
    assert all(shape["weight_bytes"]["int4"] < shape["weight_bytes"]["bf16"] for shape in shapes)
    engine = quant["engine"]
    assert engine["weights_from"] == "the throughput part's directory"
    assert engine["fp8"]["linear_path"] == "fp8_decoded" and engine["fp8"]["itl_ms"] > 0
    assert engine["float32"]["linear_path"] == "dense float32"
    assert engine["fp8"]["weight_bytes"] < engine["float32"]["weight_bytes"]
    assert engine["fp8_with_fp8_kv"]["prefill"]["steps_per_prompt"] == [1, 1]
    assert engine["int4"]["weight_bytes"] < engine["fp8"]["weight_bytes"]
    assert all(engine[k]["batch"]["batch"] == 4 for k in ("float32", "fp8", "int4"))
    assert set(engine["speedup_vs_float32"]) == {"fp8", "int4", "fp8_with_fp8_kv"}

    # moe: the fused kernel (interpreter) against grouped torch and the reference, timed
    moe = parts["moe"]["figures"]
    assert [c["tokens"] for c in moe["cases"]] == [1, 5]
    assert all(c["passed"] and c["fused_us"] > 0 and c["grouped_us"] > 0 for c in moe["cases"])
    assert all(0 < c["experts_touched"] <= 8 for c in moe["cases"])

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

    # hybrid: every kernel judged against its reference, MXFP4 experts decoded in the kernel
    hybrid = parts["hybrid"]["figures"]
    assert all(c["passed"] for c in hybrid["correct"].values()), hybrid["correct"]
    assert "fused_moe_mxfp4" in hybrid["correct"]
    assert hybrid["mxfp4"]["2"]["mxfp4_us"] > 0 and hybrid["mxfp4"]["2"]["bf16_us"] > 0
    engines = hybrid["engines"]
    assert set(engines) == {"gpt-oss", "gpt-oss-mxfp4", "gemma3", "qwen3-next"}
    assert all(e["identical"] and e["prefix_hit_tokens"] == 24 for e in engines.values())
    # mla: the MLA decode kernel judged against its reference, timed per case and vs torch
    mla = parts["mla"]["figures"]
    assert mla["correct"]["passed"] and len(mla["decode"]) == 2
    assert all(c["time_us"] > 0 for c in mla["decode"]) and mla["vs_torch"]["torch_us"] > 0
    # tiers: block copies out and back exact, repeats identical and served from the host tier
    tiers = parts["tiers"]["figures"]
    copies = tiers["block_copies"]
    assert copies["offload_copy_gb_s"] > 0 and copies["verify_gb_s"] > 0
    engine = tiers["engine"]
    assert engine["identical"] and engine["tier_pays"] and engine["hit_tokens"] > 0


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
    assert parts["quant"]["figures"]["engine"]["weights_from"] == "the e2e part's directory"


def test_gpu_check_rejects_unknown_parts(tmp_path: Path) -> None:
    run = [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path), "--parts"]
    bad = subprocess.run([*run, "parity,bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bogus" in bad.stderr


def test_default_parts_are_one_command_within_its_timeout() -> None:
    """The default selection is the one prepared command: its CUDA budgets fit `timeout 470`
    with room for start-up and imports."""
    from benchmarks.gpu_check.cli import DEFAULT_PARTS, PARTS
    from benchmarks.gpu_check.sizes import CUDA_SIZES

    assert set(DEFAULT_PARTS) <= set(PARTS)
    assert sum(CUDA_SIZES.budget_s[p] for p in DEFAULT_PARTS) <= 450
    assert all(p in CUDA_SIZES.budget_s for p in PARTS)


def test_the_tree_record_falls_back_to_the_stamp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without git (the device machine's copy), the run reads the stamp written before the
    copy and recomputes its digest over the stamped files: equal for the same tree, not for
    a changed one."""
    from benchmarks.gpu_check import common

    files = ["Makefile", "pyproject.toml"]
    stamp = {"git_commit": "c" * 40, "git_dirty": False, "uncommitted_sha256": None,
             "tree_sha256": common.tree_digest(files), "files": files}  # fmt: skip
    monkeypatch.setattr(common, "STAMP", tmp_path / "stamp.json")
    monkeypatch.setattr(common, "_run", lambda *a, **k: None)  # no git
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    record = common.tree_record()
    assert record["source"] == "stamp" and record["git_commit"] == "c" * 40
    assert record["matches_stamp"] is True
    stamp["tree_sha256"] = common.tree_digest(["Makefile"])  # a different tree
    (tmp_path / "stamp.json").write_text(json.dumps(stamp))
    assert common.tree_record()["matches_stamp"] is False
    assert common.tree_digest(["Makefile", "missing-file"]) != common.tree_digest(["Makefile"])
