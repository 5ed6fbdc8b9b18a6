"""The offloading engine. What its options need checked without torch lives here (the command
line checks it before anything heavy is imported)."""

from __future__ import annotations

from fmoe_cli.errors import FmoeError

MIN_EMULATED_GBPS = 0.01  # 10 MB/s: below any real host→device link (a slower one only looks hung)


def check_bandwidth(emulate_gbps: float) -> None:
    """Refuse an emulated link (--emulate-link) that is not a finite bandwidth ≥ MIN_EMULATED_GBPS, in one line."""
    if not emulate_gbps > 0 or emulate_gbps == float("inf"):
        raise FmoeError(f"--emulate-link needs a finite bandwidth > 0 GB/s, got {emulate_gbps:g}")
    if emulate_gbps < MIN_EMULATED_GBPS:
        raise FmoeError(f"--emulate-link {emulate_gbps:g} GB/s is slower than any host→device link "
                        f"(at least {MIN_EMULATED_GBPS:g} GB/s): one expert would take hours")
