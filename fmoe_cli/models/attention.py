"""A decode token's attention on the CPU: q/k/v in one kernel call, and fewer host steps (issue 21).

At a decode step (one token) of a small model the attention's weights are not what costs: the host's steps
around them are (docs/bench.md § The decode step's attention on the CPU). Four changes, the first three exact:

- **Fused q/k/v.** Under `--dense int8|int4` the q, k and v projections of a layer are QuantLinears of one format
  over the same input; their packed rows are concatenated into one tensor [Oq + Ok + Ov, row bytes] (one host copy:
  each QuantLinear's `packed` becomes a view of its rows, the separate tensors are freed), so a decode token's
  three projections are one `kernels.linear_forward` call (one ctypes call, one wake of the kernels' threads). Each
  output is one row's own dot product (experts.c fmoe_linear_forward), so every output has the bits its own
  QuantLinear gives it. Left as stored (`--dense bf16`), float q, k and v rows are fused the same way where the
  kernels take a decode token's float rows (models/dense.py `one_row_kernels`: float32 and bf16): each
  nn.Linear's weight becomes a view of one [Oq + Ok + Ov, H] tensor, and each output has the bits its own linear's
  kernel row gives it.
- **A decode forward** for the standard GQA families (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE): transformers' steps
  in the family's order, on views of one [1, Hq + Hk + Hv, 1, D] tensor (for one token, the transposed
  [1, 1, heads, D] is that view): Qwen3-MoE's q_norm and k_norm as one RMSNorm over both (Qwen3MoeRMSNorm's ops,
  each head's row with its own norm's weight), OLMoE's norms as its modules, `apply_rotary_pos_emb`'s formula over
  q's and k's heads at once (rotate_half as a roll by a signed sin), the cache's `update`, torch's SDPA with the arguments transformers gives it, o_proj.
  Elementwise ops over more heads at once, and reductions over each head's D values, give every value the bits it
  has alone, so the logits are transformers' bit for bit (tests/test_attention.py). SDPA runs with torch's
  intra-op threads at one (`one_thread`): at one query token the flash attention's OpenMP team costs more to wake
  than the few µs of work it splits, and it splits by head, so its bits do not depend on the thread count.
  Anything else — a prefill (more than one token; in C: below), an attention mask, a device other than the CPU, OLMoE's
  `clip_qkv`, an attention implementation other than SDPA, DeepSeek's MLA — runs transformers' own forward.
- **float32 q/k/v as one F.linear without the kernels** (`LinearQKV`: their rows in one tensor, each projection's
  weight a view of it), where a probe finds the one linear gives each projection's bits at the thread count it runs
  with; o_proj's and the projections' forwards are called without nn.Module's call where nothing hooks them.
- **float32 and bf16 in C.** Where the kernels are built (`kernels.decode_steps_in_c`), a float32 or bf16 token's
  steps after its projections — Qwen3-MoE's per-head norms, RoPE, the cache's append (generate.py's
  `GrowingLayer.reserve` and `commit`) and the attention — are one call (kernels.attention_decode, decode.c). Not
  torch's bits: decode.c sums its reductions in its own order (within float32 rounding; RoPE's products and sums
  are torch's, bf16's rounded as torch's bf16 ops round them); the tokens stay transformers', and every policy runs
  the same steps (docs/architecture.md § A float32 token's steps in C).
- **A prompt's attention in C** (`prefill`): a prefill without a mask on a GrowingLayer cache (a prompt on an empty
  cache) computes q/k/v in one kernel call (every dense format), then each token's steps as a decode token at its
  position (kernels.attention_prefill: the bits of T decode steps), then o_proj. OLMoE's per-projection norms and a
  clip keep transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fmoe_cli import kernels
from fmoe_cli.generate import GrowingLayer
from fmoe_cli.kernels import one_thread
from fmoe_cli.models.dense import (ATTENTION, QuantLinear, call_linear, forward_of, kernel_forward, kernel_rows,
                                   ours)

# The decoder layers' attention classes with the decode forward, and where their q/k norms sit:
# "heads" (Qwen3-MoE: over each head's dims, before the transpose), "projection" (OLMoE: over the whole projection),
# None (no norm).
DECODE_FAMILIES = {"Qwen3MoeAttention": "heads", "Qwen2MoeAttention": None, "MixtralAttention": None,
                   "OlmoeAttention": "projection"}


class FusedQKV:
    """One layer's q, k and v projections computed in one kernel call (their rows in one tensor): QuantLinears of one
    format, or float nn.Linears of one dtype (`--dense bf16`)."""

    def __init__(self, q, k, v) -> None:
        parts = (q, k, v)
        self.sizes = [p.out_features for p in parts]
        self.bias = None if q.bias is None else torch.cat([p.bias.detach() for p in parts])
        if isinstance(q, QuantLinear):
            self.rows = torch.cat([p.packed.data for p in parts])  # [Oq + Ok + Ov, row bytes] uint8
            self.kernel, self.dtype = q.kernel, None
            for p, rows in zip(parts, self.rows.split(self.sizes)):  # each one's rows a view of the fused tensor
                p.packed = nn.Parameter(rows, requires_grad=False)
            return
        weight = torch.cat([p.weight.detach() for p in parts])  # [Oq + Ok + Ov, H] float32 or bf16
        for p, rows in zip(parts, weight.split(self.sizes)):
            p.weight = nn.Parameter(rows, requires_grad=False)
        self.rows = weight.view(torch.uint8)  # the kernels' view of float rows: [O, H·itemsize] bytes
        self.kernel, self.dtype = kernels.spec_of("", weight.dtype, q.in_features), weight.dtype

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the kernels compute these tokens x [T, H] (kernels.takes; float rows: x of their dtype)."""
        return kernels.takes(x) and (self.dtype is None or x.dtype == self.dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side, [T, Oq + Ok + Ov] of x's dtype, for x [T, H] (the kernels take x: `takes`)."""
        return kernel_forward(x, self.rows, self.kernel, self.bias)


def fusable(q, k, v) -> bool:
    """Whether three projections can be one kernel call: on the CPU, over the same input width, with biases on all
    three or none, and either QuantLinears of one format and kernel view, or float nn.Linears of one dtype whose
    decode rows the kernels take (models/dense.py `kernel_rows`, on the fused rows' size)."""
    parts = (q, k, v)
    if len({p.in_features for p in parts}) != 1 or len({p.bias is None for p in parts}) != 1:
        return False
    if all(isinstance(p, QuantLinear) and p.kernel is not None for p in parts):
        return (len({(p.format, p.kernel, p.packed.device.type) for p in parts}) == 1
                and q.packed.device.type == "cpu")
    if not all(type(p) is nn.Linear for p in parts) or len({(p.weight.dtype, p.weight.device.type) for p in parts}) != 1:
        return False
    weight = q.weight
    return (kernels.library() is not None and not weight.is_meta and weight.device.type == "cpu"
            and kernel_rows(weight.dtype, q.in_features, sum(p.weight.nbytes for p in parts)))


class LinearQKV:
    """One layer's float32 q, k and v projections as one F.linear over their rows in one tensor, where the kernels do
    not fuse them (torch's path: no kernels built, FMOE_KERNELS=torch): one op instead of three linears and a cat.
    Each projection's weight (and bias) becomes a view of the fused rows (one copy). Used for a token only where a
    probe finds the one linear gives each projection's bits at the thread count it runs with (`same_bits`)."""

    def __init__(self, q, k, v) -> None:
        parts = (q, k, v)
        self.sizes = [p.out_features for p in parts]
        self.weight = torch.cat([p.weight.detach() for p in parts])  # [Oq + Ok + Ov, H]
        for p, rows in zip(parts, self.weight.split(self.sizes)):
            p.weight = nn.Parameter(rows, requires_grad=False)
        self.bias = None
        if q.bias is not None:
            self.bias = torch.cat([p.bias.detach() for p in parts])
            for p, values in zip(parts, self.bias.split(self.sizes)):
                p.bias = nn.Parameter(values, requires_grad=False)
        self.dtype = self.weight.dtype
        self._same_bits: dict[int, bool] = {}  # torch's thread count -> the probe's answer

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the one linear gives each projection's bits for x [1, H]: of the rows' dtype, and the probe's yes at
        torch's thread count now."""
        if x.dtype != self.dtype:
            return False
        threads = torch.get_num_threads()
        same = self._same_bits.get(threads)
        if same is None:
            same = self._same_bits[threads] = self.same_bits()
        return same

    def same_bits(self) -> bool:
        """Whether F.linear over the fused rows gives, for one row, the bits of the three projections' own F.linear
        side by side: three random rows compared bit for bit (a BLAS whose sums depend on the output count would
        give other bits: random rows show it)."""
        g = torch.Generator().manual_seed(0)
        biases = [None] * 3 if self.bias is None else self.bias.split(self.sizes)
        with torch.no_grad():
            for _ in range(3):
                x = torch.randn(1, self.weight.shape[1], generator=g).to(self.dtype)
                parts = [F.linear(x, w, b) for w, b in zip(self.weight.split(self.sizes), biases)]
                if not torch.equal(F.linear(x, self.weight, self.bias), torch.cat(parts, -1)):
                    return False
        return True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """q, k and v side by side, [T, Oq + Ok + Ov], for x [T, H]."""
        return F.linear(x, self.weight, self.bias)


def linear_fusable(q, k, v) -> bool:
    """Whether three projections can be one F.linear (LinearQKV): float32 nn.Linears on the CPU (not meta), over the
    same input width, with biases on all three or none. (bf16 rows stay three: without the kernels each is a
    torch.mv, models/dense.py one_row_matvec, sooner than a bf16 F.linear.)"""
    parts = (q, k, v)
    return (all(type(p) is nn.Linear for p in parts) and len({p.in_features for p in parts}) == 1
            and len({p.bias is None for p in parts}) == 1 and not q.weight.is_meta
            and all(p.weight.dtype == torch.float32 and p.weight.device.type == "cpu" for p in parts))


def install_decode_attention(model) -> int:
    """On a CPU model: fuse each attention's quantised q/k/v and give the standard families' attention the decode
    forward. Returns how many attention modules got the decode forward."""
    installed = 0
    rope: dict = {}  # the token's sin with its first half negated, made once for every layer (_decode_forward)
    for name, attn in model.named_modules():
        if name.rsplit(".", 1)[-1] != ATTENTION:
            continue
        norm = DECODE_FAMILIES.get(type(attn).__name__, "unknown")
        if norm == "unknown" or next(attn.parameters()).device.type != "cpu":
            continue  # transformers' own forward (DeepSeek's MLA; a model on a GPU)
        q, k, v = attn.q_proj, attn.k_proj, attn.v_proj
        fused = attn.fused_qkv = FusedQKV(q, k, v) if fusable(q, k, v) else None
        linear = attn.linear_qkv = LinearQKV(q, k, v) if fused is None and linear_fusable(q, k, v) else None
        attn.forward = _decode_forward(attn, attn.forward, fused or linear, norm, rope)
        installed += 1
    return installed


def _decode_forward(attn, original, fused: FusedQKV | LinearQKV | None, norm: str | None, rope: dict):
    """transformers' forward of `attn` for one token (its steps, in its order, on fewer ops); `original` otherwise.
    `rope`: shared by the model's layers, the last token's `sin` and its signed form."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward, use_gqa_in_sdpa

    config = attn.config
    clip = getattr(config, "clip_qkv", None)
    dim = attn.head_dim
    heads_q, heads_k = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
    half = dim // 2
    q_norm, k_norm, o_proj = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None), attn.o_proj
    o_kernel = isinstance(o_proj, QuantLinear) and o_proj.kernel is not None
    gqa = {}  # (k's, v's head dims) -> transformers' use_gqa_in_sdpa without a mask (it reads os.environ: asked once)
    qk_weight, eps = head_norms(attn) if norm == "heads" else (None, None)
    # The steps in C (kernels.attention_decode): what decode.c takes of this layer's shape; float32 or bf16 compute,
    # a token whose q/k/v, cos and sin, cache and per-head norm weights are of one of those dtypes.
    in_c = (kernels.decode_steps_in_c() and dim % 2 == 0 and dim <= kernels.MAX_HEAD_DIM
            and heads_q % heads_k == 0)
    # A prompt's attention in C too (`prefill`): where the decode steps are, without OLMoE's per-projection norms or
    # a clip (their torch steps stay).
    prefill_in_c = in_c and norm != "projection" and clip is None

    def forward(hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs):
        if (prefill_in_c and attention_mask is None and cache is not None and hidden_states.dim() == 3
                and hidden_states.shape[0] == 1 and 1 < hidden_states.shape[1] <= kernels.MAX_TOKENS
                and not attn.training and implementation(config, "attn") == "sdpa" and "past_key_values" not in kwargs
                and not kwargs.get("output_attentions") and decode_input(hidden_states)):
            out = prefill(hidden_states, position_embeddings, cache)
            if out is not None:
                return out, None
        if (attention_mask is not None or hidden_states.shape[:-1] != (1, 1) or attn.training or clip is not None
                or implementation(config, "attn") != "sdpa" or "past_key_values" in kwargs
                or kwargs.get("output_attentions") or not decode_input(hidden_states)):
            return original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask,
                            cache=cache, **kwargs)
        x = hidden_states.view(1, -1)  # [1, H]
        if fused is not None and fused.takes(x):
            qkv = fused(x)  # [1, Oq + Ok + Ov]
            if norm == "projection":  # OLMoE: each projection's own norm, over the whole projection
                q, k, v = qkv.split(fused.sizes, -1)
                qkv = torch.cat([q_norm(q), k_norm(k), v], -1)
        else:
            q, k, v = forward_of(attn.q_proj)(x), forward_of(attn.k_proj)(x), forward_of(attn.v_proj)(x)
            if norm == "projection":
                q, k = q_norm(q), k_norm(k)
            qkv = torch.cat([q, k, v], -1)
        cos, sin = position_embeddings  # [1, 1, D]: apply_rotary_pos_emb's, broadcast over q's and k's heads at once
        if (in_c and qkv.dtype in kernels.COMPUTE_DTYPES and cache is not None and cos.dtype == qkv.dtype
                and (qk_weight is None or qk_weight.dtype == qkv.dtype)):
            slots = reserve(cache, attn.layer_idx)
            if slots is not None and slots[0].dtype == qkv.dtype:  # norms, RoPE, the cache's append, the attention
                keys, values, position = slots
                out = kernels.attention_decode(qkv, heads_q, heads_k, dim, qk_weight, eps or 0.0, cos.contiguous(),
                                               sin.contiguous(), keys, values, position, attn.scaling)
                cache.layers[attn.layer_idx].commit(position + 1)
                return project_out(out), None
        # One token: [1, 1, heads, D] transposed, as transformers has it, is this view: the same values in memory order.
        heads = qkv.view(1, -1, 1, dim)  # [1, Hq + Hk + Hv, 1, D]
        qk, v = heads[:, :heads_q + heads_k], heads[:, heads_q + heads_k:]
        if norm == "heads":  # Qwen3MoeRMSNorm's steps over each head's D values
            qk = rms_norm(qk, qk_weight, eps)
        # rotate_half(qk) · sin = cat(-qk₂, qk₁) · sin = roll(qk, D/2) · cat(-sin₁, sin₂), value for value: a product's
        # sign is exact, (-a)·b = a·(-b). The signed sin is made once a token (the layers share `sin`).
        if rope.get("sin") is not sin:
            rope["sin"], rope["signed"] = sin, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        qk = (qk * cos) + (qk.roll(half, -1) * rope["signed"])
        q, k = qk[:, :heads_q], qk[:, heads_q:]
        if cache is not None:
            k, v = append(cache, attn.layer_idx, k, v, kwargs)
        dims = (k.shape[-1], v.shape[-1])
        if dims not in gqa:
            gqa[dims] = use_gqa_in_sdpa(None, k, v)
        with one_thread():
            if attn.num_key_value_groups > 1 and not gqa[dims]:  # transformers' other GQA form
                out = sdpa_attention_forward(attn, q, k, v, None, dropout=0.0, scaling=attn.scaling)[0]
            else:
                out = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=None, dropout_p=0.0, scale=attn.scaling, is_causal=False,
                    **({"enable_gqa": True} if attn.num_key_value_groups > 1 else {}))
        return project_out(out.view(1, -1)), None  # [1, Hq·D], heads in order (transformers' transpose and reshape)

    def prefill(hidden_states: torch.Tensor, position_embeddings, cache):
        """A prompt's T tokens [1, T, H] on an empty or full-attention cache without a mask: the q/k/v rows in one
        kernel call (every dense format: float rows too), then each token's norms, RoPE, cache append and causal
        attention in C (kernels.attention_prefill: the bits of T decode steps), o_proj -> [1, T, H]; None where C
        does not take them (dtypes, a cache that is not a GrowingLayer)."""
        x = hidden_states.view(-1, hidden_states.shape[-1])  # [T, H]
        tokens, dtype = x.shape[0], x.dtype
        cos, sin = (t.reshape(tokens, dim) for t in position_embeddings)  # [1, T, D] -> [T, D]
        if cos.dtype != dtype or (qk_weight is not None and qk_weight.dtype != dtype):
            return None
        slots = reserve(cache, attn.layer_idx, tokens, like=x.new_empty(1, heads_k, 0, dim))
        if slots is None or slots[0].dtype != dtype:
            return None
        if fused is not None and fused.takes(x):
            qkv = fused(x)  # [T, Oq + Ok + Ov]
        else:
            qkv = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], -1)
        if qkv.dtype != dtype:  # (a projection that does not keep x's dtype: transformers' steps)
            return None
        keys, values, position = slots
        out = kernels.attention_prefill(qkv, heads_q, heads_k, dim, qk_weight, eps or 0.0, cos.contiguous(),
                                        sin.contiguous(), keys, values, position, attn.scaling)
        cache.layers[attn.layer_idx].commit(position + tokens)
        return project_out(out)

    def project_out(out: torch.Tensor) -> torch.Tensor:
        """o_proj of the heads' outputs [T, Hq·D] -> [1, T, H]."""
        if o_kernel and kernels.takes(out):  # QuantLinear.forward's steps, without its reshapes
            y = kernel_forward(out, o_proj.packed, o_proj.kernel, o_proj.bias)
        else:
            y = call_linear(o_proj, out)
        return y.view(1, out.shape[0], -1)

    return ours(forward)


def head_norms(attn) -> tuple[torch.Tensor, float]:
    """Qwen3-MoE's q_norm and k_norm in one: each head's row [D] with its own norm's weight, [Hq + Hk, 1, D], and
    their epsilon."""
    dim = attn.head_dim
    heads_q, heads_k = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
    eps = attn.q_norm.variance_epsilon
    assert attn.k_norm.variance_epsilon == eps, "q_norm and k_norm with different epsilons"
    weight = torch.cat([attn.q_norm.weight.detach().expand(heads_q, -1), attn.k_norm.weight.detach().expand(heads_k, -1)])
    return weight[:, None, :], eps


def reserve(cache, layer_idx: int, new: int = 1, like: torch.Tensor | None = None):
    """The cache layer's buffers for `new` more positions, and the first of them (generate.py's GrowingLayer.reserve;
    `like`: the keys' shape and dtype where the cache is still empty); None where the layer is not one (transformers'
    own layers: their `update`)."""
    layers = getattr(cache, "layers", None)
    if layers is None or layer_idx >= len(layers):
        return None
    reserve_some = getattr(layers[layer_idx], "reserve", None)
    return None if reserve_some is None else reserve_some(new, like)


def append(cache, layer_idx: int, keys: torch.Tensor, values: torch.Tensor, kwargs: dict):
    """`cache.update(keys, values, layer_idx, kwargs=kwargs)`: the layer's keys and values with these appended. Where
    the cache's layer is a GrowingLayer (generate.py) and the cache does not offload, transformers' Cache.update only
    calls the layer's update (no layer to add, no offload step): that update called directly, without the wrapper's
    steps (a few µs a layer); the cache's own update otherwise."""
    layers = getattr(cache, "layers", None)
    if layers is not None and layer_idx < len(layers) and getattr(cache, "offloading", None) is False:
        layer = layers[layer_idx]
        if type(layer) is GrowingLayer:
            return layer.update(keys, values)
    return cache.update(keys, values, layer_idx, kwargs=kwargs)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm (Qwen3MoeRMSNorm and its copies) over x's last dim: its ops in its order, without the
    casts to float32 and back that are no-ops for float32 (each value's bits are the module's)."""
    h = x if x.dtype == torch.float32 else x.to(torch.float32)
    scale = h.pow(2).mean(-1, keepdim=True)
    scale.add_(_epsilon(eps)).rsqrt_()  # in place on the mean's own tensor: the same kernels, no new tensors
    if h is x:
        h = h * scale
    else:
        h.mul_(scale)
    h = h if x.dtype == torch.float32 else h.to(x.dtype)
    if weight.dtype != h.dtype or weight.dim() > h.dim():
        return weight * h  # (a weight of another dtype promotes: a new tensor, as the module's)
    return h.mul_(weight)  # weight · h, into h (a new tensor here): a product's bits do not depend on its factors' order


_EPSILONS: dict = {}


def _epsilon(eps: float) -> torch.Tensor:
    """eps as the float32 scalar tensor torch makes of the Python float in `variance + eps` (a float32 tensor plus a
    Python scalar computes in float32 with the scalar rounded to it once), made once: a Python scalar is wrapped in a
    new tensor at every op."""
    tensor = _EPSILONS.get(eps)
    if tensor is None:
        tensor = _EPSILONS[eps] = torch.tensor(eps, dtype=torch.float32)
    return tensor


def decode_input(x: torch.Tensor) -> bool:
    """The decode forward's inputs: a float32 or bf16 token on the CPU."""
    return x.is_cpu and x.dtype in kernels.COMPUTE_DTYPES


def implementation(config, kind: str) -> str | None:
    """`config._attn_implementation` (kind "attn") or `config._experts_implementation` ("experts"), what the modules
    dispatch on, read where the property keeps it (`_<kind>_implementation_internal`): the property's read goes through
    two Python `__getattribute__`s of transformers' config classes, a few µs a layer at every decode token. Through the
    property where the config keeps it elsewhere."""
    value = object.__getattribute__(config, "__dict__").get(_INTERNAL[kind], _MISSING)  # (not the config class's
    # own __getattribute__, which `config.__dict__` goes through: microseconds, several reads a layer)
    return getattr(config, _PROPERTY[kind]) if value is _MISSING else value


_INTERNAL = {"attn": "_attn_implementation_internal", "experts": "_experts_implementation_internal"}
_PROPERTY = {"attn": "_attn_implementation", "experts": "_experts_implementation"}
_MISSING = object()
