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
    assert list(parts) == ["parity", "throughput", "nixl", "serve"]
    nixl_status = "ok" if importlib.util.find_spec("nixl") else "skipped"
    expected = {"parity": "ok", "throughput": "ok", "nixl": nixl_status, "serve": "ok"}
    assert {name: p["status"] for name, p in parts.items()} == expected, output
    for part in parts.values():
        assert part["duration_s"] >= 0

    sub_checks = parts["parity"]["figures"]["sub_checks"]
    names = {f"{a}/{c}" for a in ("llama", "qwen3") for c in PER_ARCH} | {"llama/sampling"}
    assert set(sub_checks) == names
    assert all(r["passed"] for r in sub_checks.values()), sub_checks

    tp = parts["throughput"]["figures"]
    for side in ("engine", "hf"):
        assert tp[side]["output_tokens"] == tp["workload"]["output_tokens"]
        assert not tp[side]["truncated_by_budget"]
    assert tp["ratio_engine_over_hf"] > 0

    serve = parts["serve"]["figures"]
    assert serve["requests"] and all(r["identical"] for r in serve["requests"])
    assert all(r["disaggregated"] for r in serve["requests"])
    assert serve["kv_pulls_recomputed"] == 0


def test_gpu_check_rejects_unknown_parts(tmp_path: Path) -> None:
    run = [sys.executable, str(SCRIPT), "--cpu", "--out", str(tmp_path), "--parts"]
    bad = subprocess.run([*run, "parity,bogus"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "bogus" in bad.stderr
