"""fmoe: chat with a Mixture-of-Experts LLM on a GPU that cannot hold it."""

import os
import sys

__version__ = "0.1.0"

# torch's OpenMP threads sleep as soon as an op ends (OMP_WAIT_POLICY=PASSIVE) unless the user chose otherwise. By
# default libgomp's threads spin for a while after each parallel op, on the very cores the expert kernels' own
# threads (kernels/experts.c `parallel_chunks`) need next: two pools fighting for the same cores. Measured on the
# peer models, 2 threads, interleaved rounds (docs/bench.md § Threads): a3b int4 decode 36.5–38.9 → 26.0–28.7 ms,
# big int4 21.0–23.7 → 18.0–21.3 ms, with about a third less CPU time. libgomp reads the variable once, when torch
# loads it, so this must run before torch is imported (fmoe's modules import this package first).
if "torch" not in sys.modules:
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
