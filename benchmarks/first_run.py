"""What a first run's quick measurement moves over the link (issue 20 §4), on a Mixtral-shaped model.

A tiny random checkpoint with Mixtral-8x7B's routing shape (32 MoE layers, 8 experts, top-2) is timed
as a run without a saved profile times it (fmoe_cli/run.py: measure_timings), on an emulated link whose
bandwidth is scaled so that one of its experts takes as long as a Mixtral-8x7B bf16 expert (336 MiB) at
`--gbps` (default 12: PCIe 3.0 x16), on a virtual clock (it moves only while the host waits on the link).
Printed per run: the link's bytes in units of one layer's experts (exact) and the link time (virtual,
emulated: the host's compute does not move the clock). `--gpu-path` takes the branch of a model that does
not fit on the device (one layer's experts stand in for every layer's). The quick rounds stop after 5 s of
wall time, so the bytes vary with the machine's speed (never above 20 layers' worth).

    python benchmarks/first_run.py [--rounds 3] [--gpu-path] [--gbps 12]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from fmoe_cli.models.demo import build_random_moe
from fmoe_cli.models.load import load_model
from fmoe_cli.offload.link import EmulatedLink, VirtualClock
from fmoe_cli.profiling import model as profiling_model
from fmoe_cli.run import measure_timings

MIXTRAL_EXPERT_BYTES = 3 * 14336 * 4096 * 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gbps", type=float, default=12.0)
    parser.add_argument("--gpu-path", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.gpu_path:
        profiling_model._resident_fits = lambda lm: False
    with tempfile.TemporaryDirectory() as tmp:
        path = build_random_moe(Path(tmp) / "m", "mixtral", seed=1, num_hidden_layers=32, num_local_experts=8,
                                num_experts_per_tok=2)
        lm = load_model(str(path), device="cpu", dtype="float32")
        shape = lm.shape
        layer = shape.num_experts * shape.expert_bytes
        for r in range(args.rounds):
            clock = VirtualClock()
            link = EmulatedLink(args.gbps * shape.expert_bytes / MIXTRAL_EXPERT_BYTES, clock=clock)
            measure_timings(lm, link=link)
            print(f"run {r + 1}: {link.bytes_moved / layer:.2f} layers' experts over the link; link time "
                  f"{clock.t:.2f} s (virtual, emulated {args.gbps:g} GB/s for Mixtral-8x7B bf16 experts)")


if __name__ == "__main__":
    main()
