"""A consumer GPU to shape the emulated link by on a machine without one.

Decode reads every weight once, so on a GPU one expert computes in about S_e / memory
bandwidth and loads in S_e / link bandwidth: loading takes memory ÷ link bandwidth
times as long as computing. An emulated link keeps that ratio against this machine's
own expert compute time T_exp:  link = S_e / (ratio · T_exp).

The figures are those of the reference profile `profiles/rtx-3060-12gb.json` (spec
sheets, sources there; tests/test_reference.py checks they agree).
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoe_cli.offload import MIN_EMULATED_GBPS


@dataclass(frozen=True)
class ReferenceCard:
    name: str
    link_bandwidth: float  # bytes/s, host → device, one direction
    memory_bandwidth: float  # bytes/s, device memory
    profile: str  # the reference profile these figures come from

    @property
    def load_over_compute(self) -> float:
        """One expert's load time ÷ its compute time on this card (memory ÷ link bandwidth)."""
        return self.memory_bandwidth / self.link_bandwidth

    def link_gbps(self, expert_bytes: int, t_exp: float) -> float:
        """GB/s of an emulated link that loads one expert in load_over_compute × T_exp, and at least
        MIN_EMULATED_GBPS: a tiny expert timed on a busy machine would otherwise ask for a link the
        options refuse (the user did not choose this one: it is never an error)."""
        return max(MIN_EMULATED_GBPS, expert_bytes / (self.load_over_compute * t_exp) / 1e9)

    def note(self) -> str:
        return (f"shaped like an {self.name}: load ÷ compute = {self.load_over_compute:.1f}, from "
                f"profiles/{self.profile}")


CONSUMER_CARD = ReferenceCard("NVIDIA GeForce RTX 3060 (12 GB) on PCIe 4.0 x16", 16e9 * 16 * 128 / 130 / 8, 360e9,
                              "rtx-3060-12gb.json")
