"""The emulated link: timing, overlap with compute, priorities, cancel-before-start."""

from __future__ import annotations

import time

import pytest
import torch

from fmoe_cli.offload.link import DEMAND, PREFETCH, EmulatedLink, ThreadLink


def tensors(mib: float):
    n = int(mib * 1024**2 / 4)
    return torch.zeros(n), torch.randn(n)


@pytest.fixture
def link():
    link = EmulatedLink(gbps=1.0, latency_s=1e-3)
    yield link
    link.close()


def test_duration_is_bytes_over_bandwidth_plus_latency(link):
    dst, src = tensors(8)  # 8 MiB at 1 GB/s ≈ 8.4 ms + 1 ms latency
    expected = src.numel() * 4 / 1e9 + 1e-3
    start = time.perf_counter()
    t = link.submit(dst, src, DEMAND)
    t.wait()
    took = time.perf_counter() - start
    assert expected * 0.95 <= took <= expected + 0.05
    assert torch.equal(dst, src)
    assert link.bytes_moved == src.numel() * 4


def test_compute_proceeds_while_a_transfer_is_in_flight(link):
    dst, src = tensors(48)  # ≈ 50 ms on the link
    t = link.submit(dst, src, DEMAND)
    start = time.perf_counter()
    assert not t.ready()
    a = torch.randn(64, 64)
    for _ in range(10):
        a = a @ a / 64  # the caller's thread keeps computing
    computed_at = time.perf_counter() - start
    assert not t.ready() and computed_at < 0.04
    t.wait()
    assert t.ready() and time.perf_counter() - start >= 0.045


def test_demand_overtakes_queued_prefetches_and_cancel_before_start(link):
    blocker_pair, prefetch_pair, demand_pair = tensors(16), tensors(4), tensors(1)
    doomed_dst, doomed_src = tensors(1)  # all tensors exist before the link gets busy
    blocker = link.submit(*blocker_pair, PREFETCH)  # occupies the link ≈ 18 ms
    time.sleep(0.002)
    prefetch = link.submit(*prefetch_pair, PREFETCH + 3)  # ≈ 5 ms once started
    demand = link.submit(*demand_pair, DEMAND)
    doomed = link.submit(doomed_dst, doomed_src, PREFETCH + 5)
    assert doomed.cancel() and doomed.state == "cancelled"
    assert not blocker.cancel()  # running: too late to cancel
    demand.wait()
    # submitted after the prefetch, the demand load still went first
    assert prefetch.state in ("queued", "running")
    prefetch.wait()
    assert demand.state == prefetch.state == "done"
    time.sleep(0.01)
    assert doomed.state == "cancelled" and torch.count_nonzero(doomed_dst) == 0
    with pytest.raises(RuntimeError):
        doomed.wait()


def test_host_copy_link_is_labelled_and_instant():
    link = ThreadLink()
    try:
        dst, src = tensors(1)
        link.submit(dst, src, DEMAND).wait()
        assert torch.equal(dst, src)
        assert "emulated" not in link.label() and link.kind == "host-copy"
    finally:
        link.close()
    assert "emulated 1 GB/s" in EmulatedLink(1.0).label()
