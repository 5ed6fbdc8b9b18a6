"""`fmoe bench --replay-routing TRACE`: every MoE layer's router decision taken from a routing trace.

The hook is the router (the MoE block's `.gate`: `MoeLayer.gate`, else `MoeLayer.router`), the one place the top-k ids and weights are
computed: `ReplayedRouting.install` wraps each router's forward. The router still runs (its logits: the same work as
in any run), then the top-k ids and weights it returns are replaced by the trace's for the tokens of this forward,
in the router's dtype and on its device. Whatever reads the routing after it reads the trace's: the engine
(`Engine.experts_forward`: classification, loads, the policy, the cache), the predictor's observations, the
routing statistics, `--trace-out`. Nothing in the engine knows; the C decode token (models/token.py), which computes
its routing itself, stands aside because the router's forward is no longer fmoe's decode forward (`is_ours`).

Which tokens: the trace's sequences one after another, its first L MoE layers (L: the model's; a trace of more
layers replays on a model built with fewer). Every generation starts again at the trace's first token (the bench's
warm-up and its measured run see the same routing, as they see the same prompt in a plain bench); a forward of T
tokens in layer j takes the next T tokens of layer j: the prompt's prefill takes the first P, each decode step one.
The tokens the model computes are meaningless; every policy still computes the same ones (the same routing: every
policy is exact), which the bench checks as usual.

Predictors: the prefetcher's predictions are only as good as what they read. `eam` (MoE-Infinity) reads the routing
alone, so it sees the trace's; `trace` feeds the trace's own recorded rankings (`predicted`, written by
`--trace-out` when the recorded run prefetched) as the speculative predictions they were. `speculative`, `mol`,
`expert-map` and `auto` read the model's hidden states through its routers, which did not make the trace's routing:
their predictions run (same work) but are not the real model's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from fmoe_cli.errors import FmoeError
from fmoe_cli.planning.simulate import Token, predictor_for, stats_from
from fmoe_cli.prediction import TRACE_PREDICTOR
from fmoe_cli.prediction.base import BasePredictor, Iteration, Prediction, ranked_prediction
from fmoe_cli.prediction.make import make_predictor
from fmoe_cli.trace import Trace
from fmoe_cli.types import ExpertShape, MoeLayer

# Predictors whose predictions come from the routing the trace holds (docs/replay-routing.md § Predictors).
ROUTING_ONLY_PREDICTORS = ("eam", TRACE_PREDICTOR)


def check_trace_shape(trace: Trace, shape: ExpertShape) -> None:
    """A trace replays on a model with its expert count and top-k and at most its MoE layers (the first L of them);
    anything else is one line."""
    name = f"--replay-routing {trace.path}"
    layers = len(trace.layers)
    if layers < shape.num_layers:
        raise FmoeError(f"{name}: the trace has {layers} MoE layers, the model {shape.num_layers}; a trace replays on "
                        f"a model with as many MoE layers or fewer (its first ones)")
    if trace.layers[:shape.num_layers] != tuple(range(shape.num_layers)):
        raise FmoeError(f"{name}: the trace's MoE layers are {list(trace.layers[:shape.num_layers + 1])}…, not "
                        f"0…{shape.num_layers - 1}")
    if trace.num_experts != shape.num_experts:
        raise FmoeError(f"{name}: the trace routes over {trace.num_experts} experts a layer, the model has "
                        f"{shape.num_experts}")
    widths = {len(r.experts) for seq in trace.sequences for layer in seq.records for r in layer}
    if widths != {shape.top_k}:
        raise FmoeError(f"{name}: the trace activates {' or '.join(map(str, sorted(widths)))} experts a token, the "
                        f"model {shape.top_k} (top-k)")


def check_replay_length(trace: Trace, prompt_tokens: int, tokens: int, warmup: int) -> None:
    """A generation of `tokens` new tokens after a prompt of `prompt_tokens` routes prompt + tokens − 1 tokens (the
    last one is never fed back): the trace must hold them (the longer of the warm-up and the measured run)."""
    need = prompt_tokens + max(tokens, warmup) - 1
    if need <= trace.num_tokens:
        return
    option = "--tokens" if tokens >= warmup else "--warmup"
    fix = (f"use {option} {trace.num_tokens - prompt_tokens + 1} or less, or a shorter prompt"
           if prompt_tokens <= trace.num_tokens else "use a shorter prompt (--prompt)")
    raise FmoeError(f"--replay-routing {trace.path} holds {trace.num_tokens} tokens; the prompt ({prompt_tokens} "
                    f"tokens) and {option} {max(tokens, warmup)} route {need}: {fix}")


@dataclass
class _Forward:
    """Where the last forward of a layer read the trace: its first token and how many."""

    start: int = 0
    tokens: int = 0


def routing_module(layer: MoeLayer):
    """The module whose forward returns the layer's top-k: the block's router (Hunyuan's gate, around its `wg`), else the
    scoring matrix's module itself (Mixtral's gate, DeepSeek's router)."""
    return layer.gate if layer.gate is not None else layer.router


class ReplayedRouting:
    """The routing-override object: per MoE layer j, the trace's ids [n, K] and weights [n, K] of its n tokens (the
    sequences one after another), and a cursor per layer (`take`). `install` puts it in front of the routers."""

    def __init__(self, trace: Trace, shape: ExpertShape) -> None:
        check_trace_shape(trace, shape)
        self.path = trace.path
        self.num_layers = shape.num_layers
        self.trace_layers = len(trace.layers)
        self.num_experts = shape.num_experts
        self.sequences = [len(seq.tokens) for seq in trace.sequences]
        records = [[r for seq in trace.sequences for r in seq.records[j]] for j in range(shape.num_layers)]
        self.num_tokens = len(records[0])
        self.ids = [torch.tensor([r.experts for r in layer], dtype=torch.long) for layer in records]
        self.weights = [torch.tensor([r.probs for r in layer], dtype=torch.float64) for layer in records]
        self.rankings = [[r.predicted for r in layer] for layer in records]  # [layer][token] or None
        self._next = [0] * shape.num_layers
        self.last = [_Forward() for _ in range(shape.num_layers)]
        self._installed: list[tuple[torch.nn.Module, object]] = []
        # per layer, the trace's ids and weights as its router returns its own (dtype, device), from its first forward
        self._served: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * shape.num_layers

    # --- the tokens ------------------------------------------------------------
    def restart(self) -> None:
        """A new generation: every layer reads from the trace's first token again."""
        self._next = [0] * self.num_layers
        self.last = [_Forward() for _ in range(self.num_layers)]

    def take(self, layer: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The next `tokens` tokens' ids [T, K] and weights [T, K] of MoE layer `layer`: as its router returns them
        (dtype, device) once installed, else long and float64 on the host."""
        start = self._next[layer]
        if start + tokens > self.num_tokens:
            raise FmoeError(f"--replay-routing {self.path}: the run routes more than the trace's {self.num_tokens} "
                            f"tokens (layer {layer})")
        self._next[layer] = start + tokens
        self.last[layer] = _Forward(start, tokens)
        ids, weights = self._served[layer] or (self.ids[layer], self.weights[layer])
        return ids[start:start + tokens].clone(), weights[start:start + tokens].clone()

    def tokens(self, limit: int | None = None) -> list[list[Token]]:
        """The replayed routing as the simulator's token sequences (planning/simulate.py), the model's layers only;
        `limit`: the first `limit` tokens of the stream."""
        out, start = [], 0
        for length in self.sequences:
            end = start + length if limit is None else min(start + length, limit)
            seq = []
            for t in range(start, end):
                predicted = tuple(self.rankings[j][t] for j in range(self.num_layers))
                seq.append(Token(tuple(tuple(self.ids[j][t].tolist()) for j in range(self.num_layers)),
                                 predicted if any(p is not None for p in predicted) else None))
            if seq:
                out.append(seq)
            start += length
        return out

    def statistics(self, shape: ExpertShape, model: str):
        """The routing statistics of the whole replayed trace (planning/stats.py), as `fmoe plan --trace` and the
        simulator plan from: what the configurator plans `moepic` from in a replayed run."""
        sequences = self.tokens()
        stats = stats_from(sequences, shape, predictor_for(sequences, shape)())
        stats.model = model
        return stats

    # --- the hook --------------------------------------------------------------
    def install(self, layers: Sequence[MoeLayer]) -> None:
        """Wrap every MoE layer's router forward: its top-k ids and weights become the trace's. A router whose
        forward does not return (logits, weights [T, K], ids [T, K]) is refused in one line at its first forward
        (`_serving`): only the model's own call has the arguments some routers take beside the hidden state (their
        block's bias: AFMoE, HY-V3, MiniMax-M2, LFM2-MoE; a probe without them was a TypeError's traceback)."""
        for layer in layers:
            router = routing_module(layer)
            original = router.forward
            self._installed.append((router, router.__dict__.get("forward")))
            router.forward = self._replaying(layer, original)

    def uninstall(self) -> None:
        for router, previous in reversed(self._installed):
            if previous is None:
                del router.forward
            else:
                router.forward = previous
        self._installed, self._served = [], [None] * self.num_layers

    def _replaying(self, layer: MoeLayer, original):
        j = layer.index

        def forward(hidden_states, *args, **kwargs):
            out = original(hidden_states, *args, **kwargs)  # the router's work, as always
            if self._served[j] is None:
                self._served[j] = self._serving(layer, out)
            logits, _, index = out
            ids, probs = self.take(j, index.shape[0])
            return logits, probs, ids

        forward.fmoe_replay = True
        return forward

    def _serving(self, layer: MoeLayer, out) -> tuple[torch.Tensor, torch.Tensor]:
        """The trace's ids and weights of `layer` where its router puts its own (a GPU's: no copy a forward), once its
        first output `out` is seen to be (logits, weights [T, K], ids [T, K]); else one line."""
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
                and out[2].dim() == 2 and not out[2].is_floating_point() and out[1].shape == out[2].shape):
            raise FmoeError(f"--replay-routing: the router of {layer.name} ({type(routing_module(layer)).__name__}) does not "
                            f"return its top-k weights and ids; fmoe replays routing on routers that do "
                            f"(Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, Hunyuan, …)")
        _, weights, index = out
        return (self.ids[layer.index].to(device=index.device, dtype=index.dtype),
                self.weights[layer.index].to(weights.dtype).to(weights.device))

    # --- the predictor ---------------------------------------------------------
    def predictor(self, name: str, layers: list[MoeLayer], shape: ExpertShape):
        """A fresh predictor for one run (no run learns from an earlier one's identical routing): `trace`: the
        trace's own rankings; else the table's (fmoe_cli/prediction)."""
        if name == TRACE_PREDICTOR:  # (a trace with rankings: bench/__init__.py, check_replay)
            return TracePredictor(self)
        return make_predictor(name, layers, shape.num_experts, shape.top_k)


class TracePredictor(BasePredictor):
    """The trace's recorded rankings as the prefetcher's predictions, as they were made: after MoE layer j, the
    ranking recorded for layer j + 1 of the forward's last token (the last layer: layer 0 of the next token), as a
    speculative prediction one layer ahead (planning/simulate.py feeds them the same way)."""

    name = TRACE_PREDICTOR

    def __init__(self, replay: ReplayedRouting) -> None:
        self.replay = replay

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        replay = self.replay
        last = replay.last[layer]
        token = last.start + last.tokens - 1
        target = layer + 1
        if target == replay.num_layers:
            target, token = 0, token + 1
        ranking = replay.rankings[target][token] if token < replay.num_tokens else None
        return [] if ranking is None else [ranked_prediction(target, ranking, replay.num_experts)]


def replay_note(replay: ReplayedRouting) -> str:
    """The line every output of a replayed run carries."""
    layers = (f"its first {replay.num_layers} of {replay.trace_layers} MoE layers"
              if replay.trace_layers > replay.num_layers else f"{replay.num_layers} MoE layers")
    return (f"routing: replayed from {Path(replay.path)} ({layers}, {replay.num_tokens} tokens in "
            f"{len(replay.sequences)} sequences; the tokens generated are meaningless)")
