"""Part 4, serve: 1 prefill + 1 decode worker + router as processes (static addresses, no
Redis), greedy requests through `TandemClient`, token-identical to one `LLMEngine`. Skipped if
the gRPC stack or nixl does not import.

The H200 machine has neither nixl nor grpcio-health-checking / grpcio-reflection, and its
grpcio and protobuf may be older than the generated code requires. `scripts/gpu-check-site`
packs all six (nixl, nixl-cu13, grpcio, grpcio-health-checking, grpcio-reflection, protobuf,
for Python 3.12) into `.whl/gpu-check-site.tar.xz`: 37 MB, which with the tree (~9 MB) fits
the 64 MiB a device command carries (nixl-cu13's wheel alone is 58.8 MB, the other five
7.8 MB: as wheels they do not fit). The second command unpacks it into `.site`, first on
PYTHONPATH, and runs `--parts preflight,nixl,serve`."""

from __future__ import annotations

import importlib
import os
import random
import select
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from .common import (
    REPO_ROOT,
    Context,
    Figures,
    PartFailed,
    PartSkipped,
    make_engine,
    sampling_params,
)

SERVE_IMPORTS = (
    "grpc",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "tandem.v1.router_pb2",
    "tandem.client",
    "nixl",
)


class Service:
    """`python -m module args` with stderr in a log file; `address` from its READY line."""

    def __init__(self, module: str, args: Sequence[str], log_path: Path) -> None:
        self.module, self.log_path = module, log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        with log_path.open("w") as stderr:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
                cwd=REPO_ROOT,
                env=env,
            )
        self.address = ""

    def wait_ready(self, deadline: float) -> str:
        assert self.proc.stdout is not None
        while not self.address:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                state = "exited" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{self.module} {state} before READY:\n{self.tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("READY"):
                    self.address = line.split()[-1]
        return self.address

    def tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {self.module}: {line}" for line in lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_serve(ctx: Context) -> Figures:
    for module in SERVE_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or generated code refusing its runtime
            raise PartSkipped(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    from tandem.client import TandemClient
    from tandem.weights.tiny import make_tiny_model

    s, dev = ctx.sizes, ctx.device
    model_dir = make_tiny_model(ctx.tmp_dir / "serve-tiny", preset="tiny", seed=0)
    engine_flags = ["--model-dir", str(model_dir), "--device", dev, "--dtype", s.serve_dtype]
    engine_flags += ["--num-blocks", str(s.serve_num_blocks), "--redis-url", ""]
    engine_flags += ["--attention-backend", ctx.attention_backend]
    if not ctx.cuda:
        engine_flags += ["--num-threads", "1"]  # three processes share two cores in CI
    services: list[Service] = []
    ok = False
    try:
        for role in ("prefill", "decode"):
            args = [*engine_flags, "--port", "0", "--worker-id", f"gpu-check-{role}"]
            services.append(Service(f"tandem.services.{role}", args, ctx.tmp_dir / f"{role}.log"))
        prefill, decode = services
        # The reference engine loads while the workers start.
        reference = make_engine(
            model_dir,
            dev,
            s.serve_dtype,
            block_size=16,
            num_blocks=s.serve_num_blocks,
            attention_backend=ctx.attention_backend,
        )
        deadline = time.monotonic() + max(30.0, ctx.left_s() - 30)
        p_addr, d_addr = prefill.wait_ready(deadline), decode.wait_ready(deadline)
        router_args = ["--model-dir", str(model_dir), "--port", "0", "--redis-url", ""]
        router_args += ["--prefill-addresses", p_addr, "--decode-addresses", d_addr]
        router_args += ["--disagg-min-uncached-tokens", "0"]
        services.append(Service("tandem.services.router", router_args, ctx.tmp_dir / "router.log"))
        r_addr = services[-1].wait_ready(deadline)
        ctx.log(f"serve: prefill {p_addr}, decode {d_addr}, router {r_addr}")

        rng = random.Random(0)
        prompts = [
            rng.choices(range(5, 512), k=rng.randint(*s.serve_prompt_len))
            for _ in range(s.serve_num_requests)
        ]
        n = s.serve_max_tokens
        greedy = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        results = []
        # One at a time, here and on the reference: each step then has the same batch
        # composition on both sides (bf16 GEMMs may pick shape-dependent kernels).
        with TandemClient(r_addr, timeout_s=120) as client:
            for p in prompts:
                results.append(client.generate(p, max_tokens=n, temperature=0.0, ignore_eos=True))
        expected = [reference.generate([p], greedy)[0].token_ids for p in prompts]
        recomputed = (ctx.tmp_dir / "decode.log").read_text().count("recomputing locally")
        requests = [
            {
                "prompt_tokens": len(p),
                "identical": r.token_ids == want,
                "disaggregated": r.disaggregated,
                "finish_reason": r.finish_reason,
                "first_token_ms": round(r.first_token_ms, 1),
                "total_ms": round(r.total_ms, 1),
            }
            for p, r, want in zip(prompts, results, expected, strict=True)
        ]
        figures: Figures = {
            "dtype": s.serve_dtype,
            "max_tokens": n,
            "requests": requests,
            "kv_pulls_recomputed": recomputed,
        }
        problems = []
        if not all(r["identical"] for r in requests):
            problems.append("tokens differ from the single engine")
        if not all(r["disaggregated"] for r in requests):
            problems.append("not every request was disaggregated")
        if recomputed:
            problems.append(f"{recomputed} KV pulls failed and were recomputed")
        if problems:
            raise PartFailed("; ".join(problems), figures)
        ok = True
        return figures
    finally:
        for service in reversed(services):
            service.stop()
        if not ok:
            for service in services:
                ctx.log(f"serve: last lines of {service.log_path.name}:\n{service.tail()}")
