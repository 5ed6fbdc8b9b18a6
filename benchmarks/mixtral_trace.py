"""The real Mixtral-8x7B routing trace that simulate.py, hybrid.py and routing_report.py replay, and what they run on
without it.

The trace is not shipped with fmoe: it is the public repository Mario928/speculative-moe's
`routing_data_collected/humaneval_2_routing.jsonl` (commit 216e26e; vLLM, Mixtral-8x7B-Instruct on two HumanEval
problems, 333 complete tokens), whose README says "Research project for academic purposes", not an open licence.
Fetch it yourself and give its path with the benchmark's --trace option or the FMOE_MIXTRAL_TRACE environment
variable (docs/traces.md § Real routing). Without it the benchmarks say so in one line and replay the repository's
own traces/demo.jsonl (the demo model's routing) mapped onto the shape they simulate (`map_routing`)."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

ENV = "FMOE_MIXTRAL_TRACE"
DEMO_TRACE = Path(__file__).resolve().parents[1] / "traces" / "demo.jsonl"
WHERE = ("github.com/Mario928/speculative-moe, routing_data_collected/humaneval_2_routing.jsonl at commit 216e26e "
         "(not shipped: no open licence)")


def find(option: str | None = None) -> Path | None:
    """The Mixtral trace: the benchmark's --trace if given, else $FMOE_MIXTRAL_TRACE; None when neither is set. A path
    given that is not a file is bad input: one `error:` line, exit 2."""
    given = option or os.environ.get(ENV)
    if not given:
        return None
    path = Path(given).expanduser()
    if not path.is_file():
        print(f"error: {'--trace' if option else ENV} {given}: no such file", file=sys.stderr)
        raise SystemExit(2)
    return path


def absent_line(instead: str) -> str:
    """The one line a benchmark prints when the trace is not here, and what it does instead."""
    return f"no Mixtral trace (--trace FILE or {ENV}; get it from {WHERE}): {instead}"


def map_routing(sequences, num_layers: int, num_experts: int, top_k: int, tokens: int, source_experts: int,
                source_top_k: int):
    """Traced routing (planning/simulate.py Tokens) onto another shape; at most `tokens` tokens. Layer j plays the
    trace's layer j mod L; with fewer experts, expert e is e mod N (the first K distinct kept); with more, each traced
    expert stands for a block of N/N' experts of which K/K' are activated, chosen afresh every token (a hash of token,
    layer and expert): the block's share keeps the trace's skew and locality, the choice inside it has neither."""
    from fmoe_cli.planning.simulate import Token

    ratio = max(1, num_experts // source_experts)
    per = max(1, min(ratio, top_k // source_top_k))  # experts of a block activated per traced expert
    out, left = [], tokens
    for s, seq in enumerate(sequences):
        mapped = []
        for t, token in enumerate(seq[:left]):
            layers = []
            for j in range(num_layers):
                src = token.experts[j % len(token.experts)]
                if num_experts <= source_experts:
                    chosen = list(dict.fromkeys(e % num_experts for e in src))[:top_k]
                else:  # a block per traced expert, `per` of it chosen afresh every token (seeded: deterministic)
                    chosen = sorted({e * ratio + o for e in src
                                     for o in random.Random(f"{s}/{t}/{j}/{e}").sample(range(ratio), per)})[:top_k]
                layers.append(tuple(sorted(chosen)))
            mapped.append(Token(tuple(layers)))
        out.append(mapped)
        left -= len(mapped)
        if left <= 0:
            break
    return out


def read_routing(path: Path, shape, tokens: int):
    """A trace's routing, rankings dropped (they rank the traced model's experts), mapped onto `shape`."""
    from fmoe_cli.planning.simulate import Token, tokens_of
    from fmoe_cli.trace import read_trace

    trace = read_trace(str(path))
    sequences = [[Token(t.experts) for t in seq] for seq in tokens_of(trace)]
    source_top_k = max(len(layer) for seq in sequences for t in seq for layer in t.experts)
    return map_routing(sequences, shape.num_layers, shape.num_experts, shape.top_k, tokens, trace.num_experts,
                       source_top_k)
