"""kernels/lora.py's choice of LoRA kernel (``kernel_for``, called once when an engine's
LoRA store is built), and its switch ``KVROUTE_LORA_KERNEL``."""

from __future__ import annotations

import pytest
import torch

from kvroute.kernels.lora import KERNELS, kernel_for


def test_by_device_without_the_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVROUTE_LORA_KERNEL", raising=False)
    assert kernel_for(torch.device("cpu")) == "grouped"
    assert kernel_for(torch.device("meta")) == "dense"


@pytest.mark.parametrize("choice", KERNELS)
def test_kvroute_lora_kernel_picks_one(monkeypatch: pytest.MonkeyPatch, choice: str) -> None:
    monkeypatch.setenv("KVROUTE_LORA_KERNEL", f" {choice.upper()} ")  # trimmed, any case
    assert kernel_for(torch.device("cpu")) == choice


def test_kvroute_lora_kernel_refuses_an_unknown_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVROUTE_LORA_KERNEL", "fast")
    with pytest.raises(ValueError, match="KVROUTE_LORA_KERNEL must be one of"):
        kernel_for(torch.device("cpu"))
