#!/usr/bin/env python3
"""How often the speculative predictor ranks a layer's experts as its router chooses them: before (the router's
matrix, and a correction bias on the router itself: prediction/base.py `plain_router_choice`, all that
`router_scores` read until 29 Nov) and after (each layer's `RouterChoice`, models/families.py `ROUTER_FORMS`).

A tiny random checkpoint of each family (benchmarks/families_survey.py's config, not saved), its routers' matrices
spread (normal(0, 0.5), as the survey's checkpoints) and every other float tensor of each MoE block's routing module
and of the block itself moved off its init by N(0, σ) (biases from 0, scales from 1: at init they change no ranking),
a prompt of random tokens through transformers' forward:
- same layer: the tokens of all MoE layers where the predictor's K best for the layer's router input are not the K
  experts its router chose;
- one layer ahead: the recall of layer L's chosen experts by the K best of layer L's router on layer L−1's experts'
  input (the speculative predictor's prefetch, MoEpic Eq. 3), L >= 1, over tokens and layers.
Over --seeds seeds (the model, the perturbation and the prompt): median [min-max].

    python benchmarks/router_choice.py [--families afmoe,ernie4_5_moe] [--std 0.05] [--tokens 30] [--seeds 5]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import transformers  # noqa: E402

from fmoe_cli.models.demo import build_tokenizer  # noqa: E402
from fmoe_cli.models.families import ROUTER_FORMS, find_moe_layers  # noqa: E402
from fmoe_cli.prediction.base import plain_router_choice, router_scores  # noqa: E402
from fmoe_cli.types import MoeLayer  # noqa: E402

# Config fields without which a family's router chooses as its matrix ranks: DeepSeek-V2's group-limited greedy
# (K = 2 from one of 4 groups), Laguna's softcapped logits.
CHOICE_OVERRIDES = {
    "deepseek_v2": dict(topk_method="group_limited_greedy", n_group=4, topk_group=1),
    "laguna": dict(moe_router_logit_softcapping=2.0),
}
# The families ROUTER_FORMS names (gemma4: its text model).
FORM_FAMILIES = ("afmoe", "axk2", "deepseek_v2", "ernie4_5_moe", "gemma4", "hy_v3", "kolibri1", "laguna", "lfm2_moe",
                 "minimax_m2")


def routing_module(layer: MoeLayer):
    return layer.gate if layer.gate is not None else layer.router


def perturbed_model(family: str, std: float, seed: int):
    """`family`'s tiny random model with its routers spread and their choice-only biases and scales moved by N(0, std)
    (the module docstring); returns the model and its MoE layers."""
    survey = __import__("families_survey")
    tokenizer = build_tokenizer()
    config = survey.tiny_config(family, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    for key, value in CHOICE_OVERRIDES.get(family, {}).items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    modules = dict(model.named_modules())
    with torch.no_grad():
        for layer in find_moe_layers(model, family):
            block = modules[layer.name.rsplit(".", 1)[0]]
            routing = routing_module(layer)
            owned = [*routing.named_parameters(), *routing.named_buffers(),
                     *block.named_parameters(recurse=False), *block.named_buffers(recurse=False)]
            for name, tensor in owned:
                if tensor is layer.router.weight:
                    tensor.normal_(0.0, 0.5)
                elif tensor.is_floating_point() and name != "layer_scalar":  # Gemma 4's output scale: not routing
                    tensor.add_(torch.randn_like(tensor) * std)
    return model, find_moe_layers(model, family)


def routed(model, layers: list[MoeLayer], input_ids: torch.Tensor, hidden: torch.Tensor | None = None):
    """Per MoE layer, from one forward of the model: (its router's input [T, H], its experts' input [T, H], the
    experts its router chose [T, K]), the router called by the family's own code (with the block's bias, on the
    input the layer hands it). hidden [T, H]: every router's input replaced by it."""
    seen, hooks = {}, []
    for layer in layers:
        def router_in(module, args, kwargs, i=layer.index):
            x = args[0] if hidden is None else hidden.reshape(args[0].shape).to(args[0].dtype)
            seen[i, "router"] = x.reshape(-1, x.shape[-1])
            return (x, *args[1:]), kwargs

        def chosen(module, args, kwargs, output, i=layer.index):
            seen[i, "chosen"] = output[2].reshape(seen[i, "router"].shape[0], -1)

        def experts_in(module, args, i=layer.index):
            seen[i, "experts"] = args[0].reshape(-1, args[0].shape[-1])

        hooks += [routing_module(layer).register_forward_pre_hook(router_in, with_kwargs=True),
                  routing_module(layer).register_forward_hook(chosen, with_kwargs=True),
                  layer.experts.register_forward_pre_hook(experts_in)]
    try:
        with torch.no_grad():
            model(input_ids)
    finally:
        for hook in hooks:
            hook.remove()
    return [(seen[layer.index, "router"], seen[layer.index, "experts"], seen[layer.index, "chosen"])
            for layer in layers]


def agreement(family: str, std: float, tokens: int, seed: int) -> dict[str, tuple[int, int, float]]:
    """{'before' / 'after': (tokens ranked otherwise, tokens × layers, one-layer-ahead recall)}."""
    model, layers = perturbed_model(family, std, seed)
    input_ids = torch.randint(5, 300, (1, tokens), generator=torch.Generator().manual_seed(seed))
    route = routed(model, layers, input_ids)
    out = {}
    for when, choices in (("before", [plain_router_choice(layer.router) for layer in layers]),
                          ("after", [layer.choice for layer in layers])):
        wrong, hits, asked = 0, 0, 0
        for i, (router_input, _, chosen) in enumerate(route):
            k = chosen.shape[-1]
            best = router_scores(choices[i], router_input).topk(k, dim=-1).indices
            wrong += int((best.sort(dim=-1).values != chosen.sort(dim=-1).values).any(dim=-1).sum())
            if i:
                ahead = router_scores(choices[i], route[i - 1][1]).topk(k, dim=-1).indices
                hits += int((ahead[:, :, None] == chosen[:, None, :]).any(dim=-1).sum())
                asked += chosen.numel()
        out[when] = (wrong, tokens * len(layers), hits / asked if asked else float("nan"))
    return out


def spread(values: list[float], digits: int) -> str:
    return (f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"
            if len(values) > 1 else f"{values[0]:.{digits}f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FORM_FAMILIES), help="comma-separated (default: ROUTER_FORMS')")
    parser.add_argument("--std", type=float, default=0.05, help="σ of the biases' and scales' perturbation")
    parser.add_argument("--tokens", type=int, default=30)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()  # the tiny configs' notices (Gemma 4's last layer, LFM2's conv)
    print(f"transformers {transformers.__version__}, σ = {args.std}, {args.tokens} tokens, seeds 0-{args.seeds - 1}; "
          f"ROUTER_FORMS names {len(ROUTER_FORMS)} routers\n")
    print("| family | same layer, ranked otherwise: before | after | one layer ahead, recall: before | after |")
    print("|---|---|---|---|---|")
    for family in args.families.split(","):
        runs = [agreement(family, args.std, args.tokens, seed) for seed in range(args.seeds)]
        total = runs[0]["before"][1]
        cells = [spread([r[w][0] for r in runs], 0) + f" of {total}" for w in ("before", "after")]
        cells += [spread([r[w][2] for r in runs], 2) for w in ("before", "after")]
        print(f"| {family} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
