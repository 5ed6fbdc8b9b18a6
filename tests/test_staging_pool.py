"""Property test of the staging pool: random interleavings of demand loads,
prefetches, transfer progress, cancels and releases leave it consistent.

A scripted link lets the test decide when each transfer starts and finishes, so
every interleaving the engine can meet (a slot released while its copy is still
running, a demand load needing a slot held by another layer's prefetch, …) is
reachable and reproducible.
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.offload.engine import Staged, StagingPool
from fmoe_cli.offload.link import DEMAND, PREFETCH, Transfer
from fmoe_cli.types import ExpertShape


class ScriptedLink:
    """Transfers start and finish only when the test says so (`wait` finishes one)."""

    def __init__(self) -> None:
        self.transfers: list[Transfer] = []

    def submit(self, dst, src, priority: int) -> Transfer:
        t = Transfer(dst, src, priority, src.numel() * src.element_size(), _link=self)
        self.transfers.append(t)
        return t

    def poll(self, t: Transfer) -> bool:
        return t.state == "done"

    def wait(self, t: Transfer) -> None:
        if t.state == "cancelled":
            raise RuntimeError("waiting on a cancelled transfer")
        t.state = "done"

    def cancel(self, t: Transfer) -> bool:
        if t.state == "queued":
            t.state = "cancelled"
            return True
        return False


SHAPE = ExpertShape(num_layers=3, num_experts=6, top_k=2, hidden=4, intermediate=4, dtype_bytes=4)
OPS = st.lists(
    st.tuples(st.sampled_from(["demand", "prefetch", "start", "finish", "release", "done_using", "clear"]),
              st.integers(0, SHAPE.num_layers - 1), st.integers(0, SHAPE.num_experts - 1), st.integers(0, 50)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 5), ops=OPS)
def test_staging_pool_stays_consistent(slots: int, ops: list) -> None:
    pool = StagingPool(slots, SHAPE, torch.device("cpu"), torch.float32)
    link = ScriptedLink()
    src = torch.zeros(SHAPE.intermediate, 3, SHAPE.hidden)

    def live() -> list[Staged]:
        return [e for e in pool.entries if e is not None]

    def writing(slot: int) -> bool:
        """Is a copy still (or about to be) writing into `slot`?"""
        return any(t.dst.data_ptr() == pool.buffer[slot].data_ptr() and t.state in ("queued", "running")
                   for t in link.transfers)

    def stage(slot: int | None, layer: int, expert: int, demand: bool) -> None:
        if slot is None:
            return
        # a new copy never goes into a slot that a live entry holds or an old copy still writes
        assert pool.entries[slot] is None and not writing(slot)
        transfer = link.submit(pool.buffer[slot], src, DEMAND if demand else PREFETCH)
        pool.put(Staged(layer, expert, 0, slot, transfer, prefetched=not demand, in_use=demand))

    for op, layer, expert, pick in ops:
        before = live()
        if op == "demand":
            slot = pool.reclaim(keep_layer=layer)
            # nothing in use and nothing of the demanding layer was taken away for it
            for entry in before:
                if entry.in_use or entry.layer == layer:
                    assert pool.entries[entry.slot] is entry
            stage(slot, layer, expert, demand=True)
        elif op == "prefetch":
            slot = pool.free_slot()
            assert before == live()  # looking for a free slot evicts nothing
            stage(slot, layer, expert, demand=False)
        elif op in ("start", "finish"):
            pending = [t for t in link.transfers if t.state in ("queued", "running")]
            if pending:
                t = pending[pick % len(pending)]
                t.state = "running" if op == "start" else "done"
        elif op == "release" and before:
            entry = before[pick % len(before)]
            if not entry.in_use:
                pool.release(entry)
                assert pool.entries[entry.slot] is None
        elif op == "done_using" and before:
            entry = before[pick % len(before)]
            if entry.in_use:
                entry.transfer.wait()  # the engine computes with it, then lets it go
                pool.release(entry)
        elif op == "clear":
            pool.clear()
            assert not live() and not any(t.state in ("queued", "running") for t in link.transfers)

        entries = live()
        assert len(entries) <= slots
        assert len({e.slot for e in entries}) == len(entries)
        assert all(pool.entries[e.slot] is e for e in entries)
        assert all(e.transfer.state != "cancelled" for e in entries)
        assert pool.nbytes == slots * SHAPE.expert_bytes
