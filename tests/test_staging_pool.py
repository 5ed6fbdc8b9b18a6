"""The staging pool (offload/pool.py) under asynchronous link semantics.

A property test drives random interleavings of demand loads, prefetches, time,
cancels and releases on the emulated link with a virtual clock: the pool stays
consistent (`find` sees exactly the live entries), a demand load always gets a slot unless the layer itself holds them all,
and no copy into a slot starts before the previous copy into it has finished or
before the compute that read it has (fences). Then the crash of issue 10: a prompt of
more tokens than the pool has slots, on a link whose wait() does not block.
"""

from __future__ import annotations

import torch
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.generate import stream_generate
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.engine import Engine
from fmoe_cli.offload.link import DEMAND, PREFETCH, EmulatedLink, Fence, TransferState, VirtualClock
from fmoe_cli.offload.pool import Staged, StagingPool
from fmoe_cli.planning.presets import PRESETS, make_settings
from fmoe_cli.types import Timings

ROW = (3, 4)
NEURONS, LAYERS, EXPERTS = 4, 3, 6
OPS = st.lists(
    st.tuples(st.sampled_from(["demand", "prefetch", "time", "release", "done_using", "read_lag", "clear"]),
              st.integers(0, LAYERS - 1), st.integers(0, EXPERTS - 1), st.integers(0, 50)),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(slots=st.integers(1, 5), ops=OPS)
def test_staging_pool_stays_consistent(slots: int, ops: list) -> None:
    clock = VirtualClock()
    link = EmulatedLink(gbps=1e-6, latency_s=0.0, clock=clock, copy=True)  # 48 bytes: 48 µs
    pool = StagingPool(slots, NEURONS, ROW, torch.float32, torch.device("cpu"))
    src = torch.ones(NEURONS, *ROW)
    into: dict[int, list] = {s: [] for s in range(slots)}  # slot -> (transfer, fences it must follow)
    lagging: list[Fence] = []  # reads the "compute stream" has not finished yet

    def stage(slot: int | None, layer: int, expert: int, demand: bool) -> None:
        if slot is None or pool.find(layer, expert) is not None:  # as the engine: an expert is staged once
            return
        assert pool.entries[slot] is None  # a slot holds one entry
        after = pool.after(slot)
        t = link.submit(pool.buffer[slot], src, DEMAND if demand else PREFETCH, after=after)
        into[slot].append((t, [d for d in after if isinstance(d, Fence)]))
        pool.put(Staged(layer, expert, 0, slot, t, prefetched=not demand, in_use=demand))

    for op, layer, expert, pick in ops:
        before = pool.live()
        if op == "demand":
            slot = pool.reclaim(keep_layer=layer)
            for entry in before:  # nothing in use and nothing of the demanding layer was taken for it
                if entry.in_use or entry.layer == layer:
                    assert pool.entries[entry.slot] is entry
            if slot is None:  # only when the layer's own loads fill the pool
                assert all(e.in_use or e.layer == layer for e in before) and len(before) == slots
            stage(slot, layer, expert, demand=True)
        elif op == "prefetch":
            slot = pool.free_slot()
            assert before == pool.live()  # looking for a free slot evicts nothing
            stage(slot, layer, expert, demand=False)
        elif op == "time":
            clock.advance(pick * 1e-5)
        elif op == "release" and before:
            entry = before[pick % len(before)]
            if not entry.in_use:
                pool.release(entry)
        elif op in ("done_using", "read_lag") and before:
            entry = before[pick % len(before)]
            if entry.in_use:
                while lagging:  # the compute stream runs what was queued before this compute
                    lagging.pop(0).ready_at = clock.now()
                link.acquire(entry.transfer)  # the engine computes with it, then lets it go
                fence = link.record_reads()
                if op == "read_lag":  # the compute stream still reads the slot
                    fence = Fence(float("inf"))
                    lagging.append(fence)
                pool.release(entry, fence)
        elif op == "clear":
            pool.clear()
            assert not pool.live()
        if lagging and pick % 3 == 0:  # the compute stream catches up
            lagging.pop(0).ready_at = clock.now()

        entries = pool.live()
        assert len({e.slot for e in entries}) == len(entries) <= slots
        live = {(e.layer, e.expert): e for e in entries}  # `find` sees exactly the live entries
        assert all(pool.find(j, e) is live.get((j, e)) for j in range(LAYERS) for e in range(EXPERTS))
        assert all(e.transfer.state is not TransferState.CANCELLED for e in entries)
        assert pool.nbytes == slots * NEURONS * 12 * 4
        link.poll(entries[0].transfer) if entries else None
        for slot, copies in into.items():  # every copy into a slot follows the previous one and its readers
            started = [(t, fences) for t, fences in copies if t.started_at is not None]
            for (a, _), (b, fences) in zip(started, started[1:]):
                assert a.state is TransferState.DONE and b.started_at >= a.done_at
                assert all(b.started_at >= f.ready_at for f in fences)


def test_a_prompt_longer_than_the_pool_on_an_asynchronous_link(checkpoints):
    """Issue 10: with a link whose wait() does not block, a 12-token prompt through 2·K slots
    crashed every policy (IndexError: loading[0] on an empty list). It must run, exactly."""
    path = checkpoints["mixtral"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None
    prompt = torch.arange(3, 15).reshape(1, -1)
    want = reference.generate(prompt, max_new_tokens=4, do_sample=False)[0, prompt.shape[1]:].tolist()
    lm = load_model(str(path), device="cpu", dtype="float32")
    shape = lm.shape
    assert prompt.shape[1] * shape.top_k > 2 * shape.top_k  # more activations than slots: waves
    link = EmulatedLink(1.0, clock=VirtualClock(), copy=True, chunk_bytes=4096)  # pre-empted between small chunks
    engine = Engine(lm.layers, lm.store, shape, link, lm.device,
                    lm.dtype)
    engine.install(lm.model)
    try:
        for policy in PRESETS:
            if policy == "resident":
                continue
            settings_ = make_settings(policy, shape, 2 * shape.top_k * shape.expert_bytes + shape.expert_bytes,
                                      timings=Timings(1e-4, 2e-4, 1e-4, 3e-4, shape.top_k))
            assert settings_.plan.staging_slots == 2 * shape.top_k or policy in ("prefetch-only", "ondemand")
            engine.configure(settings_)
            got = [e.token_id for e in stream_generate(lm.model, prompt, engine=engine, max_new_tokens=4,
                                                       stop_on_eos=False)]
            assert got == want, policy
    finally:
        engine.close()


class LaggingComputeLink(EmulatedLink):
    """The emulated link with a compute stream that finishes its reads `lag` seconds after the
    host issued them (as a GPU's does); records every copy into a buffer with its fences."""

    def __init__(self, lag: float) -> None:
        super().__init__(1.0, clock=VirtualClock(), copy=True)
        self.lag = lag
        self.copies: list[tuple[int, object]] = []  # (address written, transfer)

    def record_reads(self) -> Fence:
        return Fence(self.clock.now() + self.lag)

    def submit(self, dst, src, priority, after=()):
        t = super().submit(dst, src, priority, after)
        self.copies.append((dst.data_ptr(), t))
        return t


def test_no_copy_into_a_slot_starts_before_the_compute_that_read_it(checkpoints):
    """No write-after-read in the engine: a refill of a staging slot starts only after the fence
    recorded when compute last read the slot (a lagging compute stream makes the difference)."""
    lm = load_model(str(checkpoints["mixtral"]), device="cpu", dtype="float32")
    shape = lm.shape
    link = LaggingComputeLink(lag=0.5)
    engine = Engine(lm.layers, lm.store, shape, link, lm.device, lm.dtype)
    engine.install(lm.model)
    engine.configure(make_settings("lru", shape, 2 * shape.top_k * shape.expert_bytes + shape.expert_bytes))
    reads: dict[int, list[Fence]] = {}
    release = engine.pool.release

    def recording_release(entry, fence=None):
        if fence is not None:
            reads.setdefault(entry.slot, []).append((fence, entry.transfer))
        release(entry, fence)

    engine.pool.release = recording_release
    prompt = torch.arange(3, 15).reshape(1, -1)
    list(stream_generate(lm.model, prompt, engine=engine, max_new_tokens=3, stop_on_eos=False))
    checked = 0
    for slot, fences in reads.items():
        first = engine.pool.buffer[slot].data_ptr()
        end = first + engine.pool.buffer[slot].numel() * engine.pool.buffer.element_size()
        copies = [t for ptr, t in link.copies if first <= ptr < end]
        for fence, reader in fences:
            later = [t for t in copies if t.seq > reader.seq and t.started_at is not None]
            for t in later:
                assert t.started_at >= fence.ready_at, "a refill started while compute still read the slot"
                checked += 1
    engine.close()
    assert checked > 0


def test_the_fake_gpu_leaves_garbage_in_a_released_slot():
    """tests/fake_gpu.py: on the fake GPU a staging slot is the copy engine's once released (the next load into it
    waits only for the fence of the reads issued before), so it is poisoned then: a compute or an admission that read it
    after its release would see NaN, where a GPU might see the next load's bytes. The other slots keep theirs."""
    import fake_gpu  # tests/fake_gpu.py

    link = EmulatedLink(gbps=1e-6, latency_s=0.0, clock=VirtualClock(), copy=True)
    with fake_gpu.installed():
        pool = StagingPool(2, NEURONS, ROW, torch.float32, torch.device("cpu"))
        pool.buffer.fill_(1.0)
        entries = []
        for slot in range(2):
            t = link.submit(pool.buffer[slot], torch.ones(NEURONS, *ROW), DEMAND)
            entries.append(Staged(0, slot, 0, slot, t, prefetched=False, in_use=True))
            pool.put(entries[-1])
        pool.release(entries[0], link.record_reads())
        assert torch.isnan(pool.buffer[0]).all() and torch.equal(pool.buffer[1], torch.ones(NEURONS, *ROW))
    pool.release(entries[1])  # not on the fake GPU: as it was
    assert torch.equal(pool.buffer[1], torch.ones(NEURONS, *ROW))


def test_a_copy_into_a_slot_follows_its_unfinished_writer_and_its_last_reads():
    """`after(slot)`: the slot's last copy while it has not finished (queued or running, not done or dropped), then
    the fence of the compute that last read it, if any; nothing for a slot never written or read."""
    clock = VirtualClock()
    link = EmulatedLink(gbps=1e-6, latency_s=0.0, clock=clock)  # 48 bytes: 48 s, nothing finishes by itself
    pool = StagingPool(1, NEURONS, ROW, torch.float32, torch.device("cpu"))
    src = torch.ones(NEURONS, *ROW)
    assert pool.after(0) == ()
    for state in TransferState:
        for read in (False, True):
            pool._reads[0] = fence = Fence(clock.now()) if read else None
            writer = link.submit(pool.buffer[0], src, PREFETCH)
            writer.state = state  # (the states the link gives it; set by hand to cover each)
            pool._writer[0] = writer
            expected = ((writer,) if state in (TransferState.QUEUED, TransferState.RUNNING) else ()) + (
                (fence,) if read else ())
            assert pool.after(0) == expected, (state, read)
            assert all(a is b for a, b in zip(pool.after(0), expected))
            writer.state = TransferState.CANCELLED
            link._queue.clear()
            link._current = None
