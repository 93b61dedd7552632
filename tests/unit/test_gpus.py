"""tandem.gpus: local workers placed over the visible GPUs with budgets that fit, the free
memory check, and the fail-fast reasons when CUDA is not there (exact messages)."""

from __future__ import annotations

import pytest
import torch

from tandem.gpus import (
    WorkerGpu,
    check_device,
    cuda_unavailable_reason,
    memory_shortfall,
    place_workers,
)

GIB = 2**30


def test_two_workers_on_one_gpu_split_its_budget() -> None:
    assert place_workers(2, ["cuda:0"], 0.9) == [WorkerGpu("cuda:0", 0.45)] * 2


def test_four_workers_on_two_gpus_round_robin() -> None:
    assert place_workers(4, ["cuda:0", "cuda:1"], 0.9) == [
        WorkerGpu("cuda:0", 0.45),
        WorkerGpu("cuda:1", 0.45),
        WorkerGpu("cuda:0", 0.45),
        WorkerGpu("cuda:1", 0.45),
    ]


def test_uneven_counts_split_per_device_and_never_add_up_to_more() -> None:
    placed = place_workers(3, ["cuda:0", "cuda:1"], 0.9)
    assert placed == [
        WorkerGpu("cuda:0", 0.45),
        WorkerGpu("cuda:1", 0.9),
        WorkerGpu("cuda:0", 0.45),
    ]
    assert place_workers(1, ["cuda:0", "cuda:1"], 0.9) == [WorkerGpu("cuda:0", 0.9)]
    for n in range(1, 12):
        shares = [w.gpu_memory_utilization for w in place_workers(n, ["cuda:0"], 0.9)]
        assert sum(shares) <= 0.9 and min(shares) > 0.9 / n - 0.001


def test_placement_refusals() -> None:
    with pytest.raises(ValueError, match="no CUDA device"):
        place_workers(2, [], 0.9)
    with pytest.raises(ValueError, match="2000 workers share cuda:0"):
        place_workers(2000, ["cuda:0"], 0.9)


def test_memory_shortfall_names_the_figures() -> None:
    assert memory_shortfall("cuda:0", 0.45, 80 * GIB, 140 * GIB) is None
    assert memory_shortfall("cuda:0", 0.9, 70 * GIB, 140 * GIB) == (
        "cuda:0 has 70.00 GiB free of 140.00 GiB (70.00 GiB held by other processes), but "
        "gpu_memory_utilization 0.9 needs 126.00 GiB: lower it (workers sharing a GPU split "
        "one budget) or give this worker its own GPU"
    )


def test_cuda_unavailable_reasons() -> None:
    assert cuda_unavailable_reason("cpu", "2.13.0+cpu", None, None, 0) is None
    assert cuda_unavailable_reason("cuda:1", "2.13.0", "13.0", "580.65.06", 2) is None
    assert cuda_unavailable_reason("cuda", "2.13.0+cpu", None, None, 0) == (
        "device 'cuda' asked for, but torch 2.13.0+cpu is a CPU build (torch.version.cuda is None)"
    )
    assert cuda_unavailable_reason("cuda", "2.13.0", "13.0", None, 0) == (
        "device 'cuda' asked for, but CUDA is unavailable: torch 2.13.0 is built for CUDA "
        "13.0, which needs an NVIDIA driver R580 or newer; no NVIDIA driver was found"
    )
    assert cuda_unavailable_reason("cuda:0", "2.13.0", "13.0", "550.54.15", 0) == (
        "device 'cuda:0' asked for, but CUDA is unavailable: torch 2.13.0 is built for CUDA "
        "13.0, which needs an NVIDIA driver R580 or newer; NVIDIA driver 550.54.15 shows no "
        "CUDA device (too old, or none visible)"
    )
    assert cuda_unavailable_reason("cuda:2", "2.13.0", "13.0", "580.65.06", 2) == (
        "device 'cuda:2' asked for, but only 2 CUDA device(s) are visible (cuda:0..1)"
    )


def test_check_device_fails_fast_on_this_machine_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    check_device("cpu", 0.9)  # nothing to check
    with pytest.raises(ValueError) as err:
        check_device("cuda", 0.9)
    message = str(err.value)
    assert f"torch {torch.__version__}" in message
    if torch.version.cuda is None:
        assert "CPU build" in message
    else:
        assert f"CUDA {torch.version.cuda}" in message and "driver" in message


def test_tandem_up_gives_each_worker_its_place_in_start_order() -> None:
    from tandem.services.up import Cluster, UpConfig

    cluster = Cluster(UpConfig(model_dir="m", device="cuda", num_prefill=1, num_decode=1))
    cluster._gpus = place_workers(2, ["cuda:0", "cuda:1"], 0.9)
    assert [cluster._device_args() for _ in range(3)] == [
        ["--device", "cuda:0", "--gpu-memory-utilization", "0.9"],  # prefill-0
        ["--device", "cuda:1", "--gpu-memory-utilization", "0.9"],  # decode-0
        ["--device", "cuda:0", "--gpu-memory-utilization", "0.9"],  # one added later
    ]
    cpu = Cluster(UpConfig(model_dir="m"))
    assert cpu._device_args() == ["--device", "cpu"]
