"""An engine on `cuda:N` makes device N current where it is built and in the thread that
warms it up (the engine thread): Triton launches and CUDA graph capture go to the current
device, not to the tensors' (CPU run: only `torch.cuda.set_device` is faked)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine.device import use_device
from tandem.engine.engine import LLMEngine


class Stop(Exception):
    """Raised by the fake set_device to end an engine's construction there."""


def test_use_device_sets_the_index_of_a_cuda_device(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    for device in ("cuda:1", torch.device("cuda", 3), "cuda", "cpu"):
        use_device(device)
    assert calls == [1, 3]  # a bare "cuda" is the current device already


def test_engine_sets_its_device_before_anything_else(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[Any] = []

    def set_device(index: Any) -> None:
        calls.append(index)
        raise Stop  # no CUDA here: the engine would fail at its first allocation

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    with pytest.raises(Stop):
        LLMEngine(EngineConfig(model_dir="/nonexistent", device="cuda:1"))
    assert calls == [1]


def test_warm_up_sets_the_device_in_its_thread(
    tiny_model_dir: Path, engine_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = engine_factory(tiny_model_dir, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    # The tensors stay on the CPU; only the device the engine names is cuda:1.
    engine.config = dataclasses.replace(engine.config, device="cuda:1")
    calls: list[Any] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    engine.warm_up()
    assert calls == [1]
