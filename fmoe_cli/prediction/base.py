"""The predictor interface: what a predictor sees, and what it returns to the prefetcher.

One *iteration* is one forward pass of the model (the prompt in a prefill, one
token in a decode step). The engine fills an `Iteration` as the pass goes:

- `begin(embedding)` when the embedding layer has run (its output is the
  semantic hint fMoE matches on);
- `observe(layer, hidden, routed)` when MoE layer `layer` has routed (its router
  input and the experts it chose).

A predictor is asked at both moments (`begin`, `after_layer`) and returns any
number of `Prediction`s (scores on the host): for a target layer, a score per expert, how far ahead
the prediction is issued, how many of its best experts are worth loading, and
the priority weight the prefetcher gives it.

Device work: before MoE layer l's routing is copied to the host, the engine asks
`device_part(it, l, hidden)` for the tensors a predictor computes on the device from
h_l (the next router's scores, this layer's routing distribution, …). They travel to
the host in the same single copy as the routing ids and weights, and `after_layer`
finds them in `it.host` under the keys the predictor chose. A predictor run without
the engine (tests, benchmarks) computes them itself (`Iteration.host_part`). So
predictors and statistics only ever see host tensors and keep their state there.

A *request* is what a user sends: its first iteration is a prefill (more than
one token); the decode steps that follow (one token each) belong to it. A new
multi-token forward (the next chat turn, a new prompt) starts a new request.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fmoe_cli.types import RouterChoice


def router_scores(choice: RouterChoice | nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A MoE layer's per-expert scores for hidden states [T, H] -> [T, N] (higher = more likely), ranked as its router
    chooses its top-k (`RouterChoice`: softmax or sigmoid of its logits, a bias for choosing only, its group limits,
    its own norm and scale of h; models/families.py resolves each layer's once, `ROUTER_FORMS`).

    Used for speculative prediction (MoEpic Eq. 3: softmax(R_{i+1}(h_i))) on every layer of every decode step: a few
    attribute reads beside the ops. A bare router module is read as `plain_router_choice` reads it."""
    if type(choice) is not RouterChoice:
        choice = plain_router_choice(choice)
    x = as_float32(hidden)
    if choice.input_scale is not None:  # Gemma 4: x = h · (mean(h²) + ε)^-½ · s · H^-½
        scale = as_float32(module_attribute(*choice.input_scale)) * choice.input_root
        x = x * (x.pow(2).mean(dim=-1, keepdim=True) + choice.input_eps).rsqrt() * scale
    logits = F.linear(x, as_float32(module_attribute(choice.matrix, "weight")))
    if choice.experts:  # Inkling: the rows after its N routed experts gate its shared experts
        logits = logits[..., :choice.experts]
    if choice.softcap:  # Laguna: z = c · tanh(z / c)
        logits = torch.tanh(logits / choice.softcap) * choice.softcap
    bias = None if choice.bias is None else as_float32(module_attribute(*choice.bias))
    if bias is not None and choice.bias_on_logits:  # Kolibri1: the top-k of z + b; sigmoid keeps that order
        scores = (logits + bias).sigmoid()
    else:
        scores = logits.sigmoid() if choice.sigmoid else logits.softmax(dim=-1)
        if bias is not None:
            scores = scores + bias
    if choice.groups:
        # group-limited routing (DeepSeek-V3, GLM-4.5: a group's score is its two best experts' summed; DeepSeek-V2's
        # group_limited_greedy: its best one's): experts only from the chosen_groups best groups; the other groups'
        # experts rank after every one of those
        grouped = scores.view(*scores.shape[:-1], choice.groups, -1)
        group_score = grouped.amax(dim=-1) if choice.group_by_best else grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_score.topk(choice.chosen_groups, dim=-1).indices
        kept = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter(-1, best, True)
        masked = 0.0 if choice.masked_to_zero else grouped - 1e4
        scores = torch.where(kept.unsqueeze(-1), grouped, masked).view(scores.shape)
    return scores


def plain_router_choice(router: nn.Module, experts: int = 0) -> RouterChoice:
    """How a router module chooses, read from it alone (what models/families.py `router_choice` falls back to for a
    family `ROUTER_FORMS` does not name): softmax of its logits, or, beside its own `e_score_correction_bias`, sigmoid
    plus that bias (DeepSeek-V3's form, for choosing only) within its `num_group` / `topk_group` limits.
    experts: N (0: the bias's length, else the matrix's rows)."""
    bias = module_attribute(router, "e_score_correction_bias")
    rows = module_attribute(router, "weight").shape[0]
    experts = experts or (bias.shape[-1] if bias is not None else rows)
    cut = experts if experts < rows else 0
    if bias is None:
        return RouterChoice(router, experts=cut)
    groups, chosen = group_limits(router, experts)
    return RouterChoice(router, experts=cut, sigmoid=True, bias=(router, "e_score_correction_bias"), groups=groups,
                        chosen_groups=chosen)


def group_limits(router: nn.Module, experts: int) -> tuple[int, int]:
    """(num_group, topk_group) where a router chooses its experts from its topk_group best of num_group groups of
    them, else (0, 0)."""
    groups, chosen = module_attribute(router, "num_group"), module_attribute(router, "topk_group")
    if type(groups) is int and type(chosen) is int and 0 < chosen < groups and experts % groups == 0:
        return groups, chosen
    return 0, 0


def router_choices(routers: Sequence[RouterChoice | nn.Module]) -> list[RouterChoice]:
    """Each layer's `RouterChoice` (a bare router module read by `plain_router_choice`): resolved once, by the
    predictors and the `Iteration` that are given them."""
    return [r if type(r) is RouterChoice else plain_router_choice(r) for r in routers]


def module_attribute(module: nn.Module, name: str):
    """getattr(module, name, None), read from the module's parameters, buffers, submodules and own dict first: through
    nn.Module's __getattr__ a name costs about 1 µs, a missing one 2 µs with its AttributeError (router_scores reads a
    router's weight and biases each layer of a decode step)."""
    if not isinstance(module, nn.Module):
        return getattr(module, name, None)
    for table in (module._parameters, module._buffers, module._modules, module.__dict__):
        if name in table:
            return table[name]
    return getattr(module, name, None) if hasattr(type(module), name) else None  # a property or a class attribute


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """t.float() without its dispatch where t is float32 already (then it is t itself: microseconds an op a layer)."""
    return t if t.dtype == torch.float32 else t.float()


@dataclass
class Prediction:
    target: int  # MoE layer the experts are for (when target <= the issuing layer: that layer of the next iteration)
    scores: torch.Tensor  # [N], higher = more likely; map/EAM predictors give a distribution (sums to 1)
    distance: int  # layers ahead of the issuing point (1 = the next MoE layer; from the embedding: target + 1)
    count: int | None = None  # how many of the best experts to prefetch (None: the prefetcher's default)
    weight: float | None = None  # prefetch priority = score · weight (None: 1 / distance, fMoE's p / (l − l_now))

    def ranking(self) -> list[int]:
        """Experts by descending score; ties by expert id (deterministic)."""
        return torch.argsort(self.scores, descending=True, stable=True).tolist()

    @property
    def priority_weight(self) -> float:
        return self.weight if self.weight is not None else 1.0 / self.distance


def ranked_prediction(target: int, ranking: Sequence[int], num_experts: int) -> Prediction:
    """A recorded ranking (a trace's `predicted`) as the speculative prediction it came from: scores by rank, best
    first, distance 1."""
    scores = torch.zeros(num_experts)
    for rank, e in enumerate(ranking):
        scores[e] = float(num_experts - rank)
    return Prediction(target, scores, distance=1)


@dataclass
class Iteration:
    """What has been observed so far in the current forward pass (and which request it belongs to)."""

    num_layers: int  # L
    num_experts: int  # N
    routers: list[RouterChoice] | None = None  # to compute full routing distributions; None in synthetic tests
    # Router inputs are kept for the last `keep_hidden` layers only (a long prompt's [T, H] per layer
    # would add up); 3 = FIRM-MoE's P, the most any predictor here looks back.
    keep_hidden: int = 3
    request: int = -1  # counts requests (-1: none yet)
    index: int = 0  # iteration number within the request (0: its prefill)
    tokens: int = 0  # tokens in this forward pass
    embedding: torch.Tensor | None = None  # [T, H] output of the embedding layer
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> router input [T, H] (recent layers)
    routed: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> top_k_index [T, K] (host)
    host: dict = field(default_factory=dict)  # key -> host copy of a predictor's device part (this pass)
    _distribution: dict[int, torch.Tensor] = field(default_factory=dict)
    _semantic: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.routers is not None:  # bare router modules (tests) read once
            self.routers = router_choices(self.routers)

    def begin(self, embedding: torch.Tensor | None, tokens: int | None = None) -> None:
        """A new forward pass. More than one token starts a new request (a prefill)."""
        tokens = tokens if tokens is not None else (embedding.shape[-2] if embedding is not None else 1)
        if tokens > 1 or self.request < 0:
            self.request += 1
            self.index = 0
        else:
            self.index += 1
        self.tokens = tokens
        self.embedding = embedding.reshape(-1, embedding.shape[-1]) if embedding is not None else None
        self._semantic = None
        self.hidden.clear()
        self.routed.clear()
        self.host.clear()
        self._distribution.clear()

    def semantic(self) -> torch.Tensor | None:
        """The pass's semantic vector on the host: the embedding output averaged over its tokens [H]."""
        if self._semantic is None and self.embedding is not None:
            self._semantic = self.embedding.float().mean(dim=0).cpu()
        return self._semantic

    def host_part(self, key, compute) -> torch.Tensor:
        """The host copy of a device part (the engine's single copy), else `compute()` brought to the host."""
        if key not in self.host:
            self.host[key] = compute().cpu()
        return self.host[key]

    def observe(self, layer: int, hidden: torch.Tensor | None, routed: torch.Tensor,
                distribution: torch.Tensor | None = None, host: dict | None = None) -> None:
        """MoE layer `layer` has routed (`routed` on the host). `distribution` ([N]) may be given
        directly (synthetic routing); `host`: the predictors' device parts, copied with the routing."""
        if layer in self.routed:  # no embedding hook ran (engine used without `install`): a new pass
            self.begin(None, tokens=routed.shape[0])
        self.host.update(host or {})
        self.hidden[layer] = hidden
        for old in [h for h in self.hidden if h <= layer - self.keep_hidden]:
            del self.hidden[old]
        self.routed[layer] = routed
        if distribution is not None:
            self._distribution[layer] = distribution.float()

    @property
    def observed(self) -> list[int]:
        return sorted(self.routed)

    def activated(self, layer: int) -> set[int]:
        return set(self.routed[layer].reshape(-1).tolist())

    def distribution(self, layer: int) -> torch.Tensor:
        """The routing distribution of `layer` in this pass: the router's probabilities averaged
        over the tokens, normalised to sum 1 (fMoE's expert-map row). Without a router (synthetic
        routing) the share of routed slots each expert got."""
        if layer not in self._distribution:
            if self.routers is not None and self.hidden.get(layer) is not None:
                p = self.host_part(("distribution", layer), lambda: distribution_part(self.routers[layer],
                                                                                     self.hidden[layer]))
            else:
                p = torch.bincount(self.routed[layer].reshape(-1), minlength=self.num_experts).float()
            p = p.clamp_min(0)  # DeepSeek-V3's bias can make a sigmoid score negative
            self._distribution[layer] = p / p.sum().clamp_min(1e-12)
        return self._distribution[layer]


def distribution_part(router: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Device part: a layer's router probabilities averaged over the pass's tokens [N]."""
    return router_scores(router, hidden).mean(dim=0)


class Predictor(Protocol):
    name: str

    def device_part(self, it: Iteration, layer: int, hidden: torch.Tensor) -> dict:
        """Before layer `layer`'s routing is copied to the host: tensors to compute on the device from
        its router input `hidden` [T, H], by key; `after_layer` reads their host copies in `it.host`."""
        ...

    def begin(self, it: Iteration) -> list[Prediction]:
        """The embedding layer has run: predictions that need no routing yet."""
        ...

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        """MoE layer `layer` has routed (it is in `it.routed`): predictions for later layers."""
        ...

    def replan(self) -> None:
        """The plan was recomputed (the engine was configured again)."""
        ...

    def close(self) -> None:
        ...


class BasePredictor:
    """No-op defaults for the optional parts of the protocol."""

    name = "base"

    def device_part(self, it: Iteration, layer: int, hidden: torch.Tensor) -> dict:
        return {}

    def begin(self, it: Iteration) -> list[Prediction]:
        return []

    def after_layer(self, it: Iteration, layer: int) -> list[Prediction]:
        return []

    def replan(self) -> None:
        pass

    def close(self) -> None:
        pass


def cosine_rows(matrix: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of every row of `matrix` [M, D] with `vector` [D] (0 for a zero row)."""
    norms = matrix.norm(dim=1) * vector.norm()
    return (matrix @ vector) / norms.clamp_min(1e-12)

