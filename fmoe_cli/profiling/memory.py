"""Peak resident memory of this process, for measuring a load (Linux /proc; the benchmark and a test use it).

`ru_maxrss` is no use here: a child process starts with its parent's peak. VmHWM is
the peak of this process's own address space, and writing 5 to clear_refs resets it.
"""

from __future__ import annotations

from pathlib import Path


def _status_kib(field: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/{pid}/status")


def rss() -> int:
    """Resident bytes now."""
    return _status_kib("VmRSS") * 1024


def anon_rss(pid: int | str = "self") -> int:
    """Anonymous resident bytes of a process now: its own memory, without mapped files (a converted store, the
    libraries), which VmRSS and VmHWM count. Linux keeps no peak of it: benchmarks/host_memory.py polls."""
    return _status_kib("RssAnon", pid) * 1024


def reset_peak_rss() -> int:
    """Start a new peak at the current resident size; returns it (bytes)."""
    Path("/proc/self/clear_refs").write_text("5")
    return rss()


def peak_rss() -> int:
    """Peak resident bytes since the last reset (or since the process started)."""
    return _status_kib("VmHWM") * 1024
