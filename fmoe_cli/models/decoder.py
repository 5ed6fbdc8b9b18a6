"""A decode token's decoder layer on the CPU: its norms, residual adds and router on fewer host steps (issue 21).

At a decode step of a small model on the CPU, the host's steps around the weights cost more than the weights do
(docs/architecture.md § The decoder layer at a decode token). Three changes, all with transformers' bits:

- **The router's matrix-vector product on one thread.** A decode token's router logits are one row times the
  router's [N, H] weight, F.linear as transformers calls it. torch runs it on its OpenMP team, whose sleeping
  threads (fmoe sets OMP_WAIT_POLICY=PASSIVE, fmoe_cli/__init__.py) cost more to wake than the few µs of work they
  split, and on a machine busy with other work a wake can take milliseconds (big int4, load 2–3: 85 µs median and
  3.2 ms mean a call on the team, 53 µs and 0.13 ms on one thread). The same F.linear runs under `one_thread`, but
  only for a weight whose shape and dtype a probe found to give the team's bits on one thread at the thread count
  it runs with (`one_thread_linear_same_bits`; MKL splits some shapes' sums over the threads: an f32 [60, 2048]
  did not). Then the family's own steps (softmax, top-k, the normalisation, its cast), without the reshape and the
  casts that are no-ops at one token.
- **The decoder layer's forward** for Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE at one token: the input norm, the
  attention (its module: models/attention.py's decode forward), the residual add, the post-attention norm, the
  MLP (its module: the router above, the engine), the residual add — transformers' steps in its order, each RMSNorm
  as `rms_norm` (its ops, without the casts that are no-ops in float32, and without the norm modules' calls); the
  model's final norm likewise.
- **The causal LM's forward** at one new token on a cache, where every layer has the decode forward and attends
  to the whole cache: the embedding, the position, the rotary embedding, the layers, the final norm and the LM
  head (modules called as the model calls them), without the model's decorators, output capture and causal mask
  (none, for one query without padding on a full-attention cache).

Every module these forwards call (the layers, attention, MLP, router, norm, LM head) has its forward called directly
where no hook would run (`dense.forward_of`; a plain nn.Linear as its one F.linear, `dense.call_linear`), and the
modules and parameters they read come from their modules' tables (`module_attribute`, not nn.Module's __getattr__):
nn.Module's per-call steps and each __getattr__ cost microseconds, several a layer (docs/bench.md § Host work per
layer). (torch's one-op F.rms_norm gives the module's float32 bits here but
took as long as rms_norm's six ops: its kernel runs the same steps.)

Anything else — a prefill, an attention mask, training, a device other than the CPU, another dtype — runs
transformers' own forwards.
"""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.nn.functional as F

from fmoe_cli import kernels
from fmoe_cli.models.attention import decode_input, implementation, one_thread, rms_norm
from fmoe_cli.models.dense import call_linear, forward_of, ours
from fmoe_cli.offload.engine import IMPLEMENTATION_NAME
from fmoe_cli.offload.layout import hooked
from fmoe_cli.prediction.base import module_attribute

# The decoder layers with the decode forward, their norms' classes (the standard RMSNorm: rms_norm's steps), and
# their routers' classes with how they turn logits into weights: "softmax-dtype" (softmax(logits, dtype=float32),
# normalised if `norm_topk_prob`, cast back to the logits' dtype), "mixtral" (softmax(logits.float()), always
# normalised, left in float32).
DECODE_LAYERS = {"Qwen3MoeDecoderLayer", "Qwen2MoeDecoderLayer", "MixtralDecoderLayer", "OlmoeDecoderLayer"}
NORMS = {"Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm", "MixtralRMSNorm", "OlmoeRMSNorm"}
ROUTERS = {"Qwen3MoeTopKRouter": "softmax-dtype", "Qwen2MoeTopKRouter": "softmax-dtype",
           "OlmoeTopKRouter": "softmax-dtype", "MixtralTopKRouter": "mixtral"}
# The sparse MoE blocks whose forward is the router, then the experts (Qwen2-MoE's adds a shared expert: its own).
MOE_BLOCKS = {"Qwen3MoeSparseMoeBlock", "MixtralSparseMoeBlock", "OlmoeSparseMoeBlock"}
# The rotary embeddings whose forward is transformers' standard RoPE (the same code in each family): cos and sin of
# the position times `inv_freq`, times `attention_scaling`, cast to the input's dtype (`rope_step`).
ROTARIES = {"Qwen3MoeRotaryEmbedding", "Qwen2MoeRotaryEmbedding", "MixtralRotaryEmbedding", "OlmoeRotaryEmbedding"}


def install_decode_layers(model) -> int:
    """On a CPU model: give the standard families' decoder layers, routers and final norm their decode forwards.
    Returns how many decoder layers got one."""
    installed = 0
    inner = getattr(model, "model", None)
    for layer in getattr(inner, "layers", []):
        if type(layer).__name__ not in DECODE_LAYERS or next(layer.parameters()).device.type != "cpu":
            continue
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if all(type(n).__name__ in NORMS for n in norms):
            layer.forward = _decode_layer(layer, layer.forward)
            installed += 1
        router = getattr(layer.mlp, "gate", None)
        if type(router).__name__ in ROUTERS:
            router.forward = _decode_router(router, router.forward)
            if type(layer.mlp).__name__ in MOE_BLOCKS and hasattr(layer.mlp, "experts"):
                layer.mlp.forward = _decode_moe(layer.mlp, layer.mlp.forward)
    norm = getattr(inner, "norm", None)
    if installed and type(norm).__name__ in NORMS:
        norm.forward = _decode_norm(norm, norm.forward)
        if installed == len(inner.layers) and full_attention(model.config):
            model.forward = _decode_model(model, model.forward)
    return installed


def full_attention(config) -> bool:
    """Every layer attends to the whole cache (no sliding window), as each family's model forward decides it: by
    `layer_types` where the config has them (Qwen2-MoE), else by `sliding_window` (Mixtral, Qwen3-MoE; OLMoE has
    neither)."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return getattr(config, "sliding_window", None) is None


def _decode_model(model, original):
    """transformers' causal LM forward for one new token on a cache (as generate.next_logits calls it): the
    embedding, the position, the rotary embedding, every decoder layer, the final norm and the LM head — modules
    called as the model calls them (their hooks fire: the engine's on the embedding) — without the model's per-call
    bookkeeping: its decorators and output capture, and the causal mask, which for one query on a full-attention
    cache without padding is none (masking_utils: _ignore_causal_mask_sdpa; the attention's decode forward runs
    only without one). `original` otherwise."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast

    from fmoe_cli.models.token import TokenInC

    inner, config = model.model, model.config
    layers = list(inner.layers[: config.num_hidden_layers])
    token = model.decode_token = TokenInC(model)  # where a token's steps are all the kernels' (models/token.py)
    rope = rope_step(inner.rotary_emb)

    def forward(input_ids=None, cache=None, past_key_values=None, use_cache=None, logits_to_keep=0, **kwargs):
        cache = cache if cache is not None else past_key_values
        if (kwargs or cache is None or not use_cache or logits_to_keep not in (0, 1) or input_ids is None
                or input_ids.shape != (1, 1) or input_ids.device.type != "cpu" or model.training
                or implementation(config, "attn") != "sdpa"):
            if past_key_values is not None:
                kwargs["past_key_values"] = past_key_values
            elif cache is not None:
                kwargs["cache"] = cache
            return original(input_ids=input_ids, use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        # (submodules and parameters read from their modules' tables, module_attribute: nn.Module's __getattr__
        # costs about 1 µs a name, some twenty names a token)
        hidden_states = module_attribute(inner, "embed_tokens")(input_ids)  # [1, 1, H]
        position = cache.get_seq_length()
        position_ids = torch.full((1, 1), position)  # [1, 1] int64: the model's arange (a third of torch.tensor's time)
        rotary = module_attribute(inner, "rotary_emb")
        if rope is None or hooked(rotary):
            position_embeddings = rotary(hidden_states, position_ids=position_ids)
        else:
            position_embeddings = rope(hidden_states, position)
        logits = token.forward(hidden_states, position_embeddings, cache)  # the whole token in one C call, or None
        if logits is not None:
            return model_output(MoeCausalLMOutputWithPast, logits=logits, cache=cache)
        for layer in layers:
            hidden_states = forward_of(layer)(hidden_states, attention_mask=None, position_ids=position_ids,
                                              cache=cache, use_cache=True, position_embeddings=position_embeddings)
        hidden_states = forward_of(module_attribute(inner, "norm"))(hidden_states)
        # one position: the last-token slice (slice_logits_to_keep) is the tensor itself
        logits = call_linear(module_attribute(model, "lm_head"), hidden_states)
        return model_output(MoeCausalLMOutputWithPast, logits=logits, cache=cache)

    return forward


def model_output(cls, **values):
    """`cls(**values)` for a transformers ModelOutput dataclass `cls`, the same object — its class, its attributes
    (every field, None where not given) and its dict (the fields that are not None, in field order) — without
    ModelOutput's per-call steps: the dataclass's __init__ through ModelOutput's __setattr__ (a set of the field names
    and the cache-name check at each of its seven fields), and __post_init__'s checks and pytree registration (done
    when the class was defined). About 40 µs a decode token on the CPU; 2 µs so."""
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(cls))
    out = cls.__new__(cls)
    attributes = dict.fromkeys(names)
    attributes.update(values)
    for name, value in attributes.items():
        if value is not None:
            collections.OrderedDict.__setitem__(out, name, value)
    out.__dict__.update(attributes)
    return out


_FIELDS: dict = {}  # a ModelOutput class -> its field names in order


def rope_step(rotary):
    """The rotary embedding's forward for one position of a decode token, (x, position) -> (cos, sin) [1, 1, D]: its
    ops in its order — the position as float32 times `inv_freq`, the two halves' cat, cos and sin — without the
    module's call, its decorator and the ops that give their input back (a float32 cast of float32 values, a product
    by an `attention_scaling` of 1); the same values, bit for bit. None where the forward is not those ops (a class
    not in ROTARIES) or its frequencies change with the sequence (the dynamic and longrope types)."""
    rope_type = getattr(rotary, "rope_type", None)
    if (type(rotary).__name__ not in ROTARIES or not isinstance(rope_type, str) or "dynamic" in rope_type
            or rope_type == "longrope"):
        return None

    def step(x: torch.Tensor, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = module_attribute(rotary, "inv_freq")  # (float32, or cast to it as the forward does)
        inv_freq = inv_freq if inv_freq.dtype == torch.float32 else inv_freq.float()
        # the forward's float32 product of the position and each frequency, the position a Python number (torch
        # rounds it to float32 once, exact below 2²⁴, and multiplies in float32: the same product, without making
        # a tensor of it), then viewed as [1, 1, D/2]
        freqs = (inv_freq * float(position)).view(1, 1, -1)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        scaling = rotary.attention_scaling
        if scaling != 1.0:
            cos, sin = cos * scaling, sin * scaling
        if x.dtype != torch.float32:
            cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return cos, sin

    return step


def _decode_layer(layer, original):
    """transformers' decoder layer forward for one token (its steps, in its order, on fewer ops); `original`
    otherwise."""
    attn, mlp = layer.self_attn, layer.mlp
    before, after = layer.input_layernorm, layer.post_attention_layernorm
    in_c = norms_in_c(before, after)  # the dtype of the hidden states whose norms run in C, or None

    def forward(hidden_states, *args, **kwargs):
        if (args or kwargs.get("attention_mask") is not None or hidden_states.shape[:-1] != (1, 1) or layer.training
                or "past_key_values" in kwargs or not decode_input(hidden_states)):
            return original(hidden_states, *args, **kwargs)
        # (the norms' weights read from their tables: module_attribute)
        if hidden_states.dtype == in_c:  # the norms and the first residual add in C (decode.c)
            _, normed = kernels.rms_norm(hidden_states, module_attribute(before, "weight"), before.variance_epsilon)
            attended, _ = forward_of(attn)(hidden_states=normed, **kwargs)
            hidden_states, normed = kernels.rms_norm(hidden_states, module_attribute(after, "weight"),
                                                     after.variance_epsilon, add=attended)
            return hidden_states + forward_of(mlp)(normed)
        residual = hidden_states
        normed = rms_norm(hidden_states, module_attribute(before, "weight"), before.variance_epsilon)
        hidden_states, _ = forward_of(attn)(hidden_states=normed, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = forward_of(mlp)(rms_norm(hidden_states, module_attribute(after, "weight"),
                                                 after.variance_epsilon))
        return residual + hidden_states

    return ours(forward)


def _decode_moe(block, original):
    """transformers' sparse MoE block forward for one token: the router (its module), then the experts — the engine's
    experts forward called directly where the experts module's call would only reach it (the model's experts
    implementation is fmoe's, and no hook on the module); `original` otherwise."""
    router, experts = block.gate, block.experts
    config = experts.config

    def forward(hidden_states):
        if hidden_states.shape[:-1] != (1, 1) or block.training or not decode_input(hidden_states):
            return original(hidden_states)
        x = hidden_states.view(1, -1)  # [1, H]
        _, weights, index = forward_of(router)(x)
        engine = experts.__dict__.get("_fmoe_engine")
        if engine is None or hooked(experts) or implementation(config, "experts") != IMPLEMENTATION_NAME:
            return experts(x, index, weights).reshape(1, 1, -1)
        return engine.experts_forward(experts, x, index, weights).view(1, 1, -1)  # (its output: a new [1, H])

    return ours(forward)


def _decode_norm(norm, original):
    """An RMSNorm's forward for one token (rms_norm's steps; float32 and bf16 in C); `original` otherwise."""
    in_c = norms_in_c(norm)

    def forward(hidden_states):
        if hidden_states.shape[:-1] != (1, 1) or not decode_input(hidden_states):
            return original(hidden_states)
        weight = module_attribute(norm, "weight")
        if hidden_states.dtype == in_c:
            return kernels.rms_norm(hidden_states, weight, norm.variance_epsilon)[1]
        return rms_norm(hidden_states, weight, norm.variance_epsilon)

    return ours(forward)


def norms_in_c(*norms) -> torch.dtype | None:
    """The dtype of the tokens whose RMSNorms by these modules run in C (kernels.rms_norm), or None: where the kernels
    are built and the weights are contiguous rows on the CPU of one dtype, float32 or bf16, the tokens of theirs."""
    dtypes = {n.weight.dtype for n in norms}
    if not kernels.decode_steps_in_c() or len(dtypes) != 1 or not all(
            n.weight.is_contiguous() and n.weight.device.type == "cpu" for n in norms):
        return None
    dtype = dtypes.pop()
    return dtype if dtype in kernels.COMPUTE_DTYPES else None


def _decode_router(router, original):
    """transformers' router forward for one token: the logits' F.linear on one thread where that gives the team's
    bits, then the family's steps without its no-op reshape and cast; `original` otherwise."""
    kind = ROUTERS[type(router).__name__]
    weight, top_k = router.weight, router.top_k
    normalise = kind == "mixtral" or router.norm_topk_prob
    # torch's thread count -> whether one thread gives its bits (probed once, now for the threads now)
    same_bits = {torch.get_num_threads(): one_thread_linear_same_bits(weight)}
    in_c = (kernels.decode_steps_in_c() and weight.dtype == torch.float32 and weight.is_contiguous()
            and weight.device.type == "cpu")

    def forward(hidden_states):
        if (hidden_states.dim() != 2 or hidden_states.shape[0] != 1 or router.training
                or not decode_input(hidden_states) or hidden_states.dtype != weight.dtype):
            return original(hidden_states)
        if in_c and hidden_states.is_contiguous():  # float32: the logits, softmax, top-k and normalisation in C
            return kernels.router_decode(hidden_states, weight, top_k, normalise)
        threads = torch.get_num_threads()
        if threads not in same_bits:
            same_bits[threads] = one_thread_linear_same_bits(weight)
        if same_bits[threads]:
            with one_thread():
                logits = F.linear(hidden_states, weight)  # [1, N]
        else:
            logits = F.linear(hidden_states, weight)
        if kind == "mixtral":  # (.float() of float32 logits is themselves: one op less)
            probs = torch.nn.functional.softmax(logits if logits.dtype == torch.float32 else logits.float(), dim=-1)
        else:
            probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, top_k, dim=-1)  # [1, K]
        if normalise:
            top /= top.sum(dim=-1, keepdim=True)
        if kind != "mixtral" and top.dtype != logits.dtype:
            top = top.to(logits.dtype)
        return logits, top, index

    return ours(forward)


def one_thread_linear_same_bits(weight: torch.Tensor) -> bool:
    """Whether F.linear of one row by `weight` gives on one thread the bits it gives on torch's intra-op threads now:
    three random rows, each compared bit for bit. A BLAS that splits the row's sum over its threads gives other
    bits (random rows show it); one that splits the outputs, the same."""
    if torch.get_num_threads() == 1:
        return True
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(1, weight.shape[1], generator=g).to(weight.dtype)
        want = F.linear(x, weight)
        with one_thread():
            got = F.linear(x, weight)
        if not torch.equal(got, want):
            return False
    return True
