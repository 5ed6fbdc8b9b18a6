"""Expert predictors for the prefetcher (docs/predictors.md): `speculative` (MoEpic, the
default), `expert-map` (fMoE), `eam` (MoE-Infinity), `mol` (FIRM-MoE) and `auto` (per layer,
the most accurate of them). `prediction.make.make_predictor` builds one by name.

This module is only the table of names: it imports no torch, so the command line can list
the predictors in its help and check a name before anything slow.
"""

from __future__ import annotations

from fmoe_cli.errors import FmoeError

DEFAULT_PREDICTOR = "speculative"
PREDICTORS = {
    "speculative": "MoEpic/AdapMoE: the next layer's router on this layer's hidden state (default)",
    "expert-map": "fMoE: iteration expert maps, semantic + trajectory matching, distance d = 3",
    "eam": "MoE-Infinity: request-level expert activation matrices, multi-layer prefetch",
    "mol": "FIRM-MoE: intersection of the top-3 that 3 earlier layers give through the target router",
    "auto": "per layer, the predictor with the best measured accuracy (re-chosen when re-planning)",
}


# Only where routing is replayed from a trace (fmoe bench --replay-routing): the trace's own recorded rankings.
TRACE_PREDICTOR = "trace"
TRACE_PREDICTOR_HELP = "with --replay-routing: the trace's own recorded rankings (`predicted`)"


def check_predictor(name: str, replay: bool = False) -> None:
    """Refuse an unknown predictor name (before a long model load); `trace` only where routing is replayed."""
    if name == TRACE_PREDICTOR and not replay:
        raise FmoeError(f"--predictor {TRACE_PREDICTOR} replays a routing trace's own rankings: it needs "
                        f"fmoe bench --replay-routing TRACE")
    if name not in PREDICTORS and name != TRACE_PREDICTOR:
        raise FmoeError(f"unknown predictor {name!r}; choose from {', '.join(PREDICTORS)}")
