"""The emulated link has CudaLink's host-side semantics, on a virtual clock (no sleeps):
timing, wait() that never blocks, completion seen only by polling, priorities and
chunks, cancel-before-start, fences (no write-after-read), zero-copy and copy modes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoe_cli.errors import FmoeError
from fmoe_cli.offload.link import (
    DEMAND,
    PREFETCH,
    EmulatedLink,
    Fence,
    MonotonicClock,
    Transfer,
    TransferState,
    VirtualClock,
    make_link,
)
from fmoe_cli.offload import link as link_module

MiB = 1024**2


def tensors(mib: float, value: float = 1.0):
    n = int(mib * MiB / 4)
    return torch.zeros(n), torch.full((n,), value)


def link_on(clock, **kw):
    return EmulatedLink(gbps=1.0, latency_s=1e-3, clock=clock, **kw)


def test_duration_is_bytes_over_bandwidth_plus_latency_and_acquire_is_the_only_wait():
    clock = VirtualClock()
    link = link_on(clock, copy=True)
    dst, src = tensors(8)
    expected = 8 * MiB / 1e9 + 1e-3
    t = link.submit(dst, src, DEMAND)
    assert t.state is TransferState.RUNNING and not t.ready()
    t.wait()  # orders the compute; the host does not block
    assert clock.now() == 0.0 and clock.slept == 0.0 and t.state is TransferState.RUNNING
    clock.advance(expected / 2)
    got = link.acquire(t, tag="layer 3")  # the data is read here: the host waits the rest
    assert clock.now() == pytest.approx(expected) and clock.slept == pytest.approx(expected / 2)
    assert got is dst and torch.equal(dst, src) and t.state is TransferState.DONE
    assert link.stalls() == [("layer 3", pytest.approx(expected / 2))] and link.stalls() == []
    assert link.bytes_moved == 8 * MiB


def test_completion_is_seen_only_by_polling():
    clock = VirtualClock()
    link = link_on(clock)
    t = link.submit(*tensors(1), DEMAND)
    clock.advance(1.0)  # long done by the model ...
    assert t.state is TransferState.RUNNING  # ... but nobody has looked yet
    assert t.ready() and t.state is TransferState.DONE
    before = clock.now()
    link.acquire(t)
    assert clock.now() == before and link.stalls() == []  # finished: nothing exposed


def test_zero_copy_reads_the_host_store_and_moves_no_bytes():
    clock = VirtualClock()
    link = link_on(clock)  # copy=False: the CPU is the device
    dst, src = tensors(1)
    t = link.submit(dst, src, DEMAND)
    got = link.acquire(t)
    assert got is src and torch.count_nonzero(dst) == 0
    assert clock.now() == pytest.approx(link.duration(MiB))


def test_copy_mode_bytes_land_only_when_the_copy_completes():
    clock = VirtualClock()
    link = link_on(clock, copy=True)
    dst, src = tensors(2)
    t = link.submit(dst, src, DEMAND)
    clock.advance(link.duration(2 * MiB) * 0.9)
    assert not t.ready() and torch.count_nonzero(dst) == 0
    clock.advance(link.duration(2 * MiB) * 0.2)
    assert t.ready() and torch.equal(dst, src)


def test_demand_overtakes_queued_prefetches_and_cancel_before_start():
    clock = VirtualClock()
    link = link_on(clock, copy=True)
    blocker = link.submit(*tensors(8), PREFETCH)  # on the link first
    prefetch = link.submit(*tensors(4), PREFETCH + 3)
    demand = link.submit(*tensors(1), DEMAND)
    doomed_dst, doomed_src = tensors(1)
    doomed = link.submit(doomed_dst, doomed_src, PREFETCH + 5)
    assert doomed.cancel() and doomed.state is TransferState.CANCELLED
    assert not blocker.cancel()  # running: too late to cancel
    link.acquire(demand)
    assert blocker.state is TransferState.DONE and prefetch.state is TransferState.QUEUED
    assert demand.started_at == pytest.approx(blocker.done_at)  # submitted after the prefetch, went first
    link.acquire(prefetch)
    assert prefetch.started_at == pytest.approx(demand.done_at)
    clock.advance(1.0)
    assert not doomed.ready() and torch.count_nonzero(doomed_dst) == 0
    with pytest.raises(RuntimeError):
        doomed.wait()


def test_a_demand_load_overtakes_a_long_prefetch_after_one_chunk():
    clock = VirtualClock()
    link = EmulatedLink(gbps=1.0, latency_s=0.0, clock=clock, chunk_bytes=4 * MiB)
    prefetch = link.submit(*tensors(32), PREFETCH)  # 8 chunks
    clock.advance(1e-3)
    demand = link.submit(*tensors(1), DEMAND)
    link.acquire(demand)
    chunk = 4 * MiB / 1e9
    assert demand.started_at == pytest.approx(chunk)  # after the chunk in progress, not the whole prefetch
    assert prefetch.state is TransferState.RUNNING
    link.acquire(prefetch)
    assert prefetch.done_at == pytest.approx((32 + 1) * MiB / 1e9)


def test_wait_on_a_queued_transfer_puts_it_next_without_blocking():
    clock = VirtualClock()
    link = link_on(clock)
    first = link.submit(*tensors(4), PREFETCH)
    low = link.submit(*tensors(4), PREFETCH + 1)
    lower = link.submit(*tensors(4), PREFETCH + 2)
    lower.wait()
    assert clock.slept == 0.0
    link.acquire(lower)
    assert lower.started_at == pytest.approx(first.done_at) and low.state is TransferState.QUEUED


def test_a_copy_after_a_fence_waits_for_the_readers_no_write_after_read():
    """A refill of a buffer that compute queued earlier still reads must not land before that
    compute has finished. Without the fence the refill is visible to the earlier reader."""
    for with_fence in (True, False):
        clock = VirtualClock()
        link = link_on(clock, copy=True)
        slot = torch.zeros(MiB // 4)
        first = link.submit(slot, torch.full_like(slot, 1.0), DEMAND)
        reader_sees = link.acquire(first)  # compute on the GPU queued with this view of the slot ...
        reads = Fence(ready_at=float("inf"))  # ... and not run yet (a scripted compute stream)
        refill = link.submit(slot, torch.full_like(slot, 2.0), DEMAND, after=(reads,) if with_fence else ())
        clock.advance(1.0)
        refill.ready()
        if with_fence:
            assert refill.state is TransferState.QUEUED and torch.all(reader_sees == 1.0)
            reads.ready_at = clock.now()  # the compute stream reaches the fence
            clock.advance(1.0)
            assert refill.ready() and torch.all(slot == 2.0)
            assert refill.started_at == pytest.approx(reads.ready_at)
        else:
            assert torch.all(reader_sees == 2.0)  # the earlier reader would read the refill


def test_a_copy_after_a_transfer_follows_it_and_lifts_its_priority():
    clock = VirtualClock()
    link = link_on(clock)
    other = link.submit(*tensors(4), PREFETCH)
    old = link.submit(*tensors(4), PREFETCH + 9)  # an old prefetch still headed for the slot
    new = link.submit(*tensors(1), DEMAND, after=(old,))
    link.acquire(new)
    assert old.state is TransferState.DONE and new.started_at == pytest.approx(old.done_at)
    assert old.started_at == pytest.approx(other.done_at)


def test_instant_host_link_and_labels():
    link = make_link(torch.device("cpu"), None)
    dst, src = tensors(1)
    t = link.submit(dst, src, DEMAND)
    assert t.ready() and link.acquire(t) is src
    assert link.kind == "host" and "emulated" not in link.label()
    emulated = make_link(torch.device("cpu"), 1.0)
    assert emulated.kind == "emulated" and "emulated 1 GB/s" in emulated.label()
    with pytest.raises(FmoeError):
        make_link(torch.device("cpu"), 0.0)


class ScriptedWallTime:
    """A fake perf_counter / time.sleep pair: each read of the time moves it by `tick`;
    a sleep moves it by its duration plus the kernel's late wake-up."""

    def __init__(self, tick: float = 1e-6, late_wake: float = 80e-6) -> None:
        self.t, self.tick, self.late_wake = 0.0, tick, late_wake
        self.sleeps: list[float] = []
        self.reads = 0

    def now(self) -> float:
        self.reads += 1
        self.t += self.tick
        return self.t

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.t += seconds + self.late_wake


def test_an_emulated_wait_sleeps_then_polls_the_last_stretch_so_it_wakes_on_time():
    """time.sleep wakes ~80 µs late; a CUDA event wait does not. The emulated link's clock sleeps
    only up to `spin` before the deadline and polls the rest, so a stall costs what it models."""
    wall = ScriptedWallTime()
    clock = MonotonicClock(spin=200e-6, now=wall.now, sleep=wall.sleep)
    clock.sleep_until(1e-3)
    assert len(wall.sleeps) == 1 and wall.sleeps[0] == pytest.approx(1e-3 - 200e-6 - 1e-6)
    assert 1e-3 <= wall.t < 1e-3 + 5e-6  # late by a poll, not by a wake-up
    wall.sleeps.clear()
    clock.sleep_until(wall.t + 50e-6)  # shorter than the spin: no sleep at all
    assert wall.sleeps == []

    plain = ScriptedWallTime()
    MonotonicClock(spin=0.0, now=plain.now, sleep=plain.sleep).sleep_until(1e-3)
    assert plain.t > 1e-3 + 70e-6  # what sleeping all the way costs


def test_the_emulated_link_waits_with_a_spin():
    link = EmulatedLink(gbps=1.0)
    assert isinstance(link.clock, MonotonicClock) and link.clock.spin == link_module.WAKE_SPIN_S > 100e-6


def test_a_promotion_changes_only_the_choices_made_after_it():
    """As on CudaLink, where the chunks already handed to the copy stream stay where they are: raising a
    queued copy's priority at time T does not rewrite a choice the copy engine made before T, even when
    nobody looked at the link in between."""
    clock = VirtualClock()
    link = EmulatedLink(gbps=1.0, latency_s=0.0, clock=clock, chunk_bytes=1 * MiB)
    long = link.submit(*tensors(2), PREFETCH)  # two chunks: [0, c) and [c, 2c)
    short = link.submit(*tensors(1), PREFETCH + 1)
    chunk = MiB / 1e9
    clock.advance(1.5 * chunk)  # at c the engine chose the long copy's second chunk (nobody polled)
    link.reprioritise(short, DEMAND)
    link.acquire(short)
    assert long.done_at == pytest.approx(2 * chunk) and short.started_at == pytest.approx(2 * chunk)


class CountingClock(VirtualClock):
    """A virtual clock that counts how often the link looks at it (each look plays the model forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def now(self) -> float:
        self.reads += 1
        return super().now()


def test_a_transfer_seen_settled_is_polled_acquired_and_cancelled_without_playing_the_model():
    """Once a poll has seen a copy done (or it was cancelled), the engine's further polls, its acquire and
    the pool's release (cancel) answer from its state: no clock read, no model step. Before that, a poll
    looks (completion is seen only by polling)."""
    clock = CountingClock()
    link = link_on(clock)
    t = link.submit(*tensors(1), DEMAND)
    clock.advance(1.0)
    reads = clock.reads
    assert t.state is TransferState.RUNNING and t.ready() and clock.reads > reads  # the first poll looks
    reads = clock.reads
    assert t.ready() and link.acquire(t) is t.src and not t.cancel() and link.stalls() == []
    assert clock.reads == reads
    busy = link.submit(*tensors(4), DEMAND)
    queued = link.submit(*tensors(1), PREFETCH)  # behind `busy`
    reads = clock.reads
    assert queued.state is TransferState.QUEUED and queued.cancel() and clock.reads > reads  # it looks
    assert busy.state is TransferState.RUNNING
    reads = clock.reads
    assert not queued.ready() and not queued.cancel() and clock.reads == reads


class ScriptedCpuTime:
    """The process's CPU time, moved only by the test (the compute the host did)."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_on_the_cpu_clock_the_link_runs_only_while_the_process_does():
    """FMOE_EMULATED_CLOCK=cpu: the emulated link's time is the process's CPU time plus its waits on the
    link. Time the OS gives to other processes moves neither the host's compute nor the copies, so a
    load's exposed wait is its modelled time less the host's own compute since it was submitted, however
    busy the machine is; the wait costs no real time (nothing sleeps)."""
    cpu = ScriptedCpuTime()
    clock = link_module.CpuClock(cpu)
    link = EmulatedLink(gbps=1.0, latency_s=0.0, clock=clock)
    load = 1 * MiB / 1e9
    t = link.submit(*tensors(1), DEMAND)
    cpu.t += 0.25 * load  # the host computes a quarter of the load's time (other processes: not counted)
    assert not link.poll(t)
    link.acquire(t)
    assert clock.slept == pytest.approx(0.75 * load)  # exposed: the rest of the modelled time
    assert link.stalls()[-1][1] == pytest.approx(0.75 * load)
    assert clock.now() == pytest.approx(load)
    u = link.submit(*tensors(1), DEMAND)
    cpu.t += 2 * load  # the host was busy longer than the copy: no wait
    link.acquire(u)
    assert clock.slept == pytest.approx(0.75 * load)


def test_the_clock_kind_comes_from_the_environment(monkeypatch):
    monkeypatch.setattr(link_module, "_host_clocks", {})
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv(link_module.CLOCK_ENV, "cpu")
        clock = link_module.host_clock()
        assert isinstance(clock, link_module.CpuClock) and link_module.host_clock() is clock
        assert torch.get_num_threads() == 1  # CPU time is one core's time
        link = make_link(torch.device("cpu"), 4.0)
        assert link.clock is clock  # the link and fmoe's timings: one clock
        assert link.label() == "link: emulated 4 GB/s, on the process's CPU-time clock"  # bench, chat: labelled
        with pytest.raises(FmoeError, match="GPU"):
            make_link(torch.device("cuda"), 4.0)  # a GPU's copies are real: no CPU-time emulation
        monkeypatch.setenv(link_module.CLOCK_ENV, "wall")
        assert isinstance(link_module.host_clock(), MonotonicClock)
        monkeypatch.setenv(link_module.CLOCK_ENV, "bogus")
        with pytest.raises(FmoeError, match="FMOE_EMULATED_CLOCK"):
            link_module.host_now()
    finally:
        torch.set_num_threads(threads)


def test_token_latencies_are_read_on_the_links_clock(monkeypatch):
    """stream_generate times each token on host_now (the emulated link's clock), not on wall time."""
    from fmoe_cli import generate
    ticks = iter(range(100))
    monkeypatch.setattr(generate, "host_now", lambda: float(next(ticks)))
    monkeypatch.setattr(generate, "next_logits", lambda model, ids, cache: torch.zeros(1, 8))

    class Model(torch.nn.Module):
        config = None

        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

    monkeypatch.setattr(generate, "new_cache", lambda model: None)  # (the cache a generation starts from: none here)
    events = list(generate.stream_generate(Model(), torch.tensor([1, 2]), max_new_tokens=3, stop_on_eos=False))
    assert [e.latency_s for e in events] == [1.0, 1.0, 1.0]


# --- the emulated link's fast paths give what its general steps give ---------------------------------------------
class GeneralLink(EmulatedLink):
    """The emulated link without its shortcuts: `submit` plays the model to now before and after queueing the copy
    (also on an idle or busy link), `acquire` is `wait` (its own look at the clock) then a second look; the test asks
    the link itself (`poll`, `cancel`) where the emulated link's transfers answer from a settled state."""

    def submit(self, dst, src, priority, after=()):
        now = self.clock.now()
        self._advance(now)
        t = Transfer(dst, src, priority, src.nbytes, link=self, after=tuple(after), submitted_at=now)
        self._queue.append(t)
        self._advance(now)
        return t

    def acquire(self, t, tag=None):
        if t.state is TransferState.DONE:
            return t.dst if self.copy else t.src
        self.wait(t)
        now = self.clock.now()
        self._advance(now)
        if t.state is not TransferState.DONE:
            self._advance(float("inf"), until=t)
            if t.state is not TransferState.DONE:
                raise RuntimeError("a transfer waits on a fence that never completes")
            self.clock.sleep_until(t.done_at)
            self._stalls.append((tag, t.done_at - now))
        return t.dst if self.copy else t.src


LINK_OPS = st.lists(st.tuples(st.sampled_from(["submit", "after", "time", "tie", "poll", "acquire", "cancel", "promote",
                                               "reads", "fence"]),
                              st.integers(0, 40), st.integers(0, 3)), max_size=50)


@settings(max_examples=300, deadline=None)
@given(ops=LINK_OPS, chunked=st.booleans())
def test_the_emulated_links_shortcuts_give_its_general_steps_results(ops, chunked):
    """Random copies (sizes, priorities, copies and fences to follow), time moved or not (ties: a copy submitted
    when another may start at the same instant), polls, acquires, cancels, promotions, on the emulated link and on
    GeneralLink: every transfer's state, start, end and bytes, the link's bytes, stalls and clock, and every answer
    are the same after each step."""
    links = []
    for cls in (EmulatedLink, GeneralLink):
        clock = VirtualClock()
        links.append((cls(gbps=1.0, latency_s=1e-4, clock=clock, chunk_bytes=256 if chunked else 1 << 20), clock,
                      [], []))  # (link, clock, transfers, fences)
    src = torch.ones(256)
    for op, pick, priority in ops:
        answers = []
        for link, clock, transfers, fences in links:
            live = [t for t in transfers if t.state is not TransferState.CANCELLED]
            if op in ("submit", "after"):
                after = ()
                if op == "after" and transfers:
                    after = (transfers[pick % len(transfers)],) + ((fences[pick % len(fences)],) if fences else ())
                transfers.append(link.submit(torch.zeros(8 * (1 + pick)), src[:8 * (1 + pick)], DEMAND + priority,
                                             after=after))
            elif op in ("time", "tie"):
                clock.advance(pick * 1e-6 if op == "time" else 0.0)
            elif op == "poll" and transfers:
                t = transfers[pick % len(transfers)]
                answers.append(t.ready() if type(link) is EmulatedLink else link.poll(t))
            elif op == "acquire" and live:
                try:
                    link.acquire(live[pick % len(live)], tag=pick)
                    answers.append("ok")
                except RuntimeError as exc:  # it follows a fence the compute has not reached
                    answers.append(str(exc))
            elif op == "cancel" and transfers:
                t = transfers[pick % len(transfers)]
                answers.append(t.cancel() if type(link) is EmulatedLink else link.cancel(t))
            elif op == "promote" and transfers:
                link.reprioritise(transfers[pick % len(transfers)], priority - 1)
            elif op == "reads":
                fences.append(link.record_reads() if pick % 2 else Fence(float("inf")))  # done, or not yet
            elif op == "fence" and fences:
                fence = fences[pick % len(fences)]
                if fence.ready_at == float("inf"):
                    fence.ready_at = clock.now()  # the compute stream reaches it
            answers.append([(t.state, t.started_at, t.done_at, t.sent, t.priority) for t in transfers])
            answers.append((link.bytes_moved, link._free_at, link.stalls(), clock.t, clock.slept))
        half = len(answers) // 2
        assert answers[:half] == answers[half:], op


def test_acquire_looks_at_the_clock_once():
    """acquire of a copy still on the link: one look at the clock (wait's promotion and the model's step to now on
    it), and the stall runs from that look to the copy's end."""
    clock = CountingClock()
    link = link_on(clock)
    t = link.submit(*tensors(1), PREFETCH + 1)
    reads = clock.reads
    link.acquire(t, tag="x")
    assert clock.reads == reads + 1
    assert link.stalls() == [("x", pytest.approx(link.duration(MiB)))] and t.priority < DEMAND


def test_host_now_reads_the_clock_the_variable_names_as_it_changes(monkeypatch):
    """host_now's own look-up of FMOE_EMULATED_CLOCK finds the clock host_clock finds, for every value the variable
    takes during a run (monkeypatch.setenv, delenv, a value written differently)."""

    class Fixed:
        def __init__(self, t: float) -> None:
            self.t = t

        def now(self) -> float:
            return self.t

    cpu, wall = Fixed(1.0), Fixed(2.0)
    monkeypatch.setattr(link_module, "_host_clocks", {"cpu": cpu, "wall": wall})
    for value, clock in (("cpu", cpu), ("wall", wall), (None, wall), (" CPU ", cpu), ("", wall), ("cpu", cpu)):
        if value is None:
            monkeypatch.delenv(link_module.CLOCK_ENV, raising=False)
        else:
            monkeypatch.setenv(link_module.CLOCK_ENV, value)
        assert link_module.host_clock() is clock and link_module.host_now() == clock.t, value
