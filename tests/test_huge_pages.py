"""The KV pool's allocation: zeros, advised as huge pages over whole 2 MB pages inside it only."""

from __future__ import annotations

import sys

import pytest
import torch

from tokenmill.worker import huge_pages


def test_zeros_are_zeros_of_the_shape_asked() -> None:
    t = huge_pages.zeros((3, 1000, 16, 3, 64), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 1000, 16, 3, 64) and t.dtype == torch.bfloat16
    assert int(t.count_nonzero()) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise(MADV_HUGEPAGE) is Linux's")
def test_advice_covers_whole_huge_pages_inside_the_tensor(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(huge_pages, "_advise", lambda addr, length: calls.append((addr, length)))
    t = huge_pages.zeros((64 << 20,), torch.uint8, torch.device("cpu"))
    assert len(calls) == 1
    addr, length = calls[0]
    assert addr % huge_pages.HUGE == 0 and length % huge_pages.HUGE == 0 and length > 0
    assert t.data_ptr() <= addr and addr + length <= t.data_ptr() + t.numel()
    assert int(t.count_nonzero()) == 0


def test_small_or_other_devices_are_plain(monkeypatch) -> None:
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(huge_pages, "_advise", lambda addr, length: calls.append((addr, length)))
    assert int(huge_pages.zeros((100,), torch.float32, torch.device("cpu")).count_nonzero()) == 0
    assert huge_pages.zeros((4,), torch.float32, torch.device("meta")).device.type == "meta"
    assert calls == []  # 400 bytes hold no whole 2 MB page; meta has no memory


def test_the_real_madvise_call_does_not_fail() -> None:
    huge_pages._advise(0, 0)  # length 0 is accepted (or refused with an errno, logged): never raises
