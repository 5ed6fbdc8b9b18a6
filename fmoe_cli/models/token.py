"""A resident float32 or bf16 decode token in one C call (issue 21; bf16: issue 39 §3).

At a decode token of a small model on the CPU, the host's steps between the weights cost more than the weights:
the per-step path (models/decoder.py, attention.py, offload/engine.py) is about a dozen ctypes calls and a few dozen
Python frames a layer. Where a token's computation is exactly the kernels' steps, `TokenInC` runs all of them in
one call (decode.c fmoe_decode_token): per layer the input norm, the fused q/k/v rows, the attention (q/k norms,
RoPE, the KV append), o_proj, the residual add and post-attention norm, the router, the K resident experts, their
weighted sum and the residual add; then the final norm and the LM head. The embedding (its module, hooks and all)
and the rotary embedding stay torch's, as before; the engine's bookkeeping (observers, the policies' touches,
counters) runs after the call with the routing decode.c returns (Engine.resident_routed).

Bits: the same C functions in the same order on the same values as the per-step path, so the logits are its
bits (tests/test_token.py); the residual adds are one float32 rounding each, as torch's. At bf16
(decode.c fmoe_decode_token_bf16) the per-step path's torch steps between the C ones are bf16 ops, which decode.c
computes as torch does (each result in float32, rounded once to bf16): the residual add after the experts, and
the experts' weighted sum (engine._combine_decode: the products rounded to bf16 beside a Qwen router's bf16
weights, float32 beside Mixtral's, summed in order in float32, rounded once). The router is not: no C order gives a
bf16 F.linear's, softmax's and torch.topk's bits (bf16 logits tie often, and topk's order among ties is its own), so
decode.c calls the router module back once a layer (`_router_callback`, ctypes) and the tokens stay transformers'.

It engages only where the per-step path would run exactly those functions (`TokenInC.ready`, checked each token):
float32 or bf16 hidden states on the CPU, every weight the steps read of that dtype; Qwen3-MoE or Mixtral decoder
layers with their decode forwards (`dense.ours`: no forward put over them since) and no forward hooks on what the
per-step path calls; every layer's q/k/v fused rows, o_proj and the LM head through the kernels' rows; the routers'
float32 logits in C (bf16: their modules, called back); every layer resident in one engine without a prefetcher, its
experts through the kernels (`Engine.resident_decode`); every cache layer a `GrowingLayer` with room reserved for the
token. Anything else runs the per-step path unchanged.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch.nn.modules import module as _module

from fmoe_cli import kernels
from fmoe_cli.models.attention import DECODE_FAMILIES, head_norms, implementation, reserve
from fmoe_cli.models.dense import QuantLinear, is_ours
from fmoe_cli.offload.engine import IMPLEMENTATION_NAME

LAYERS = {"Qwen3MoeDecoderLayer", "MixtralDecoderLayer"}  # their MoE blocks: the router, then the engine's experts
MAX_TOP_K = 64  # decode.c decode_layer's routed experts a layer (its stack arrays); more: the per-step path

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class Rows(ctypes.Structure):  # decode.c DecodeRows
    _fields_ = [("rows", _ptr), ("bias", _ptr), ("outputs", _i64), ("hidden", _i64), ("code", _i64),
                ("proj_bytes", _i64), ("group", _i64), ("meta_group", _i64), ("chunk", _i64), ("q8", _i64)]


class Layer(ctypes.Structure):  # decode.c DecodeLayer
    _fields_ = [("input_norm", _ptr), ("post_norm", _ptr), ("input_eps", _f32), ("post_eps", _f32),
                ("qk_eps", _f32), ("scale", _f32), ("qkv", Rows), ("o", Rows), ("heads_q", _i64), ("heads_k", _i64),
                ("dim", _i64), ("qk_weight", _ptr), ("keys", _ptr), ("values", _ptr), ("capacity", _i64),
                ("router", _ptr), ("experts", _i64), ("top_k", _i64), ("normalise", _i64), ("expert_rows", _ptr),
                ("neurons", _i64), ("expert", Rows), ("weights_bf16", _i64)]


# decode.c DecodeModel.route: (layer, its normed token [H] bf16, index [K] int64, weights [K] float32) -> 0, or 1
ROUTE = ctypes.CFUNCTYPE(ctypes.c_int, _i64, _ptr, _ptr, _ptr)


class Model(ctypes.Structure):  # decode.c DecodeModel
    _fields_ = [("layers", _i64), ("hidden", _i64), ("layer", ctypes.POINTER(Layer)), ("norm", _ptr),
                ("norm_eps", _f32), ("head", Rows), ("threads", _i64), ("threads_min_bytes", _i64), ("route", ROUTE)]


def rows_of(rows: torch.Tensor, spec: kernels.Spec, bias: torch.Tensor | None, keep: list,
            dtype: torch.dtype = torch.float32) -> Rows | None:
    """A linear's rows [O, row bytes] in the kernels' format `spec`, as decode.c takes them for tokens of `dtype`
    (None: a bias it does not take: one of another dtype). `keep` holds the tensors the pointers are of."""
    if bias is not None and not row_of(bias, dtype):
        return None
    keep += [rows, bias]
    return Rows(rows.data_ptr(), None if bias is None else bias.data_ptr(), rows.shape[0], spec.hidden, spec.code,
                spec.projection_bytes, spec.group, spec.meta_group, spec.chunk, int(spec.int8_activations))


def linear_rows(linear, keep: list, dtype: torch.dtype = torch.float32) -> Rows | None:
    """The rows a one-token call of `linear` on tokens of `dtype` computes with (models/dense.py): a QuantLinear's
    packed rows, or an nn.Linear's weight of that dtype through its kernel-row forward; None where it computes
    otherwise."""
    if isinstance(linear, QuantLinear):
        if "forward" in linear.__dict__ or linear.kernel is None or not linear.packed.is_cpu:
            return None
        return rows_of(linear.packed, linear.kernel, linear.bias, keep, dtype)
    if type(linear) is not torch.nn.Linear or not is_ours(linear) or linear.weight.dtype != dtype:
        return None
    weight = linear.weight.detach()
    return rows_of(weight.view(torch.uint8), linear.forward.spec, linear.bias, keep, dtype)


def row_of(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether decode.c reads `t` as it is: contiguous values of `dtype` on the CPU."""
    return t.dtype == dtype and t.is_cpu and t.is_contiguous()


class TokenInC:
    """A causal LM's decode token in one call (decode.c fmoe_decode_token), where it is the per-step path's steps.
    `runs`: the tokens it computed; `enabled` False: every token the per-step path (tests, A/B benchmarks)."""

    def __init__(self, model) -> None:
        self.model, self.inner = model, model.model
        self.layers = list(self.inner.layers[: model.config.num_hidden_layers])
        self.runs = 0
        self.enabled = True
        self._plan = _NO_PLAN  # the engine's plan the structure was made for: a weak reference to its first layer
        self._dtype = None  # and the tokens' dtype
        self._struct = None  # Model, or False: this model's steps are not the kernels' (decided once a plan)

    def forward(self, hidden_states: torch.Tensor, position_embeddings, cache) -> torch.Tensor | None:
        """The logits [1, 1, V] of the token whose embedding is hidden_states [1, 1, H], its cos and sin, on `cache`;
        None where the per-step path must run (nothing has been written then). Without the kernels (FMOE_KERNELS=torch,
        no compiler: no structure is ever made, `_make`) that is said before the engine is looked up (a few µs a
        token: a generator over the layers' modules)."""
        engine = self.engine() if self.enabled and kernels.library() is not None else None
        dtype = hidden_states.dtype
        if engine is None or dtype not in kernels.COMPUTE_DTYPES or not self.ready(engine, dtype):
            return None
        cos, sin = (t.contiguous() for t in position_embeddings)
        if cos.dtype != dtype or sin.dtype != dtype:
            return None
        struct = self._struct
        position = None
        for layer, attn in zip(struct.layer_list, self.attentions):  # the cache's room for the token, every layer
            slots = reserve(cache, attn.layer_idx)
            if slots is None:
                return None
            keys, values, start = slots
            if not (row_of(keys, dtype) and row_of(values, dtype) and keys.shape[-1] == layer.dim and keys.shape[0] == 1
                    and keys.shape[1] == layer.heads_k and (position is None or start == position)):
                return None
            position = start
            layer.keys, layer.values, layer.capacity = keys.data_ptr(), values.data_ptr(), keys.shape[-2]
        struct.model.threads = torch.get_num_threads()
        h = hidden_states.reshape(-1).clone()  # [H]: the residual stream, in place
        logits = torch.empty(1, 1, struct.model.head.outputs, dtype=dtype)
        k = struct.layer_list[0].top_k
        index = torch.empty(len(self.layers), k, dtype=torch.int64)
        weights = torch.empty(len(self.layers), k, dtype=torch.float32)
        lib = kernels.library()
        call = lib.fmoe_decode_token if dtype == torch.float32 else lib.fmoe_decode_token_bf16
        status = call(ctypes.byref(struct.model), h.data_ptr(), cos.data_ptr(), sin.data_ptr(), position,
                      logits.data_ptr(), index.data_ptr(), weights.data_ptr())
        if struct.error is not None:  # a router raised (in the callback): as the per-step path would raise it
            error, struct.error = struct.error, None
            raise error
        if status == 1:  # a router's routing the structure did not expect: the per-step path computes the token
            return None
        if status != 0:
            raise MemoryError("the decode token's kernel could not allocate its workspace")
        for attn in self.attentions:
            cache.layers[attn.layer_idx].commit(position + 1)
        for i, (moe, cast) in enumerate(zip(self.moe_index, struct.bf16_weights)):  # the weights as the router gives them
            w = weights[i:i + 1]
            engine.resident_routed(moe, index[i:i + 1], w.to(torch.bfloat16) if cast else w)
        self.runs += 1
        return logits

    def engine(self):
        """The engine of every layer's experts (one), or None."""
        engines = {id(e): e for e in (layer.mlp.experts.__dict__.get("_fmoe_engine") for layer in self.layers)
                   if e is not None}
        if len(engines) != 1:
            return None
        return next(iter(engines.values()))

    def ready(self, engine, dtype: torch.dtype = torch.float32) -> bool:
        """Whether this token's per-step path is exactly decode.c's steps: the structure made for the engine's plan
        and tokens of `dtype`, and nothing changed since in what the per-step path would call (forwards, hooks)."""
        first = engine.layers[0] if engine.layers else None
        if self._plan() is not first or self._dtype != dtype:  # a new plan (or none), or another dtype
            # weak: a strong reference to the plan's layers kept its caches alive through the next Engine.configure,
            # the old plan's beside the new one's (issue 39 §6: fmoe bench re-plans between its policies)
            self._plan, self._dtype = (_NO_PLAN if first is None else weakref.ref(first)), dtype
            self._struct = self._make(engine, dtype)
        if not self._struct or not engine.resident_decode(self._probe, self.act):
            return False
        if (_module._global_forward_hooks or _module._global_forward_pre_hooks
                or implementation(self.model.config, "experts") != IMPLEMENTATION_NAME):
            return False
        for module in self.called:
            if module._forward_hooks or module._forward_pre_hooks:
                return False
        return all(is_ours(module) for module in self.decode_forwards)

    def _make(self, engine, dtype: torch.dtype):
        """The structure decode.c takes for this model, the engine's plan and tokens of `dtype`, or False where a step
        is not the kernels' (then this plan's tokens all run the per-step path)."""
        if not engine.layers or kernels.library() is None or not kernels.decode_steps_in_c():
            return False
        model, inner = self.model, self.inner
        keep: list = []  # every tensor a pointer is of
        layers, attentions, moe_index, called, forwards = [], [], [], [], []
        hidden = model.config.hidden_size
        self._probe = torch.zeros(1, hidden, dtype=dtype)
        self.act = None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            router, experts = getattr(mlp, "gate", None), getattr(mlp, "experts", None)
            if type(layer).__name__ not in LAYERS or experts is None or router is None:
                return False
            norm = DECODE_FAMILIES.get(type(attn).__name__)
            fused = getattr(attn, "fused_qkv", None)
            before, after = layer.input_layernorm, layer.post_attention_layernorm
            if (fused is None or not fused.takes(self._probe) or norm not in ("heads", None)
                    or getattr(model.config, "clip_qkv", None) is not None
                    or not all(row_of(t, dtype) for t in (before.weight, after.weight, router.weight))):
                return False
            dim = attn.head_dim
            heads_q, heads_k = attn.q_proj.out_features // dim, attn.k_proj.out_features // dim
            if dim % 2 or dim > kernels.MAX_HEAD_DIM or heads_q % heads_k:
                return False
            qk_weight, qk_eps = head_norms(attn) if norm == "heads" else (None, 0.0)
            if qk_weight is not None:
                qk_weight = qk_weight.contiguous()
                if not row_of(qk_weight, dtype):
                    return False
            qkv = rows_of(fused.rows, fused.kernel, fused.bias, keep, dtype)
            o = linear_rows(attn.o_proj, keep, dtype)
            if not engine.resident_decode(self._probe, experts.act_fn):  # (each layer's SiLU its own module)
                return False
            i = experts._fmoe_layer
            spec = engine.store.kernel
            rows = engine.resident_rows(i)
            neurons = {r.shape[0] for r in rows}
            if (qkv is None or o is None or spec is None or len(neurons) != 1
                    or not all(r.is_contiguous() for r in rows)):
                return False
            if self.act is None:
                self.act = experts.act_fn
            pointers = (ctypes.c_void_p * len(rows))(*[r.data_ptr() for r in rows])
            keep += [qk_weight, before.weight, after.weight, router.weight, rows, pointers]
            mixtral = type(router).__name__ == "MixtralTopKRouter"  # its weights stay float32 (models/decoder.py)
            normalise = mixtral or bool(router.norm_topk_prob)
            layers.append(Layer(
                before.weight.data_ptr(), after.weight.data_ptr(), before.variance_epsilon, after.variance_epsilon,
                qk_eps, attn.scaling, qkv, o, heads_q, heads_k, dim,
                None if qk_weight is None else qk_weight.data_ptr(), None, None, 0,
                router.weight.data_ptr(), router.weight.shape[0], router.top_k, int(normalise),
                ctypes.cast(pointers, ctypes.c_void_p), neurons.pop(), rows_of(rows[0], spec, None, keep),
                int(dtype == torch.bfloat16 and not mixtral)))
            attentions.append(attn)
            moe_index.append(i)
            called += [layer, attn, mlp, router, experts]
            forwards += [layer, attn, mlp, router]
            if not isinstance(attn.o_proj, QuantLinear):
                called.append(attn.o_proj)
                forwards.append(attn.o_proj)
        if len({layer.top_k for layer in layers}) != 1 or layers[0].top_k > MAX_TOP_K:
            return False
        head, norm = model.lm_head, inner.norm
        head_rows = linear_rows(head, keep, dtype)
        if head_rows is None or not row_of(norm.weight, dtype):
            return False
        called += [norm, head]
        forwards += [norm] + ([] if isinstance(head, QuantLinear) else [head])
        keep.append(norm.weight)
        array = (Layer * len(layers))(*layers)
        result = _Struct(None, list(array), keep + [array])
        route = ROUTE() if dtype == torch.float32 else ROUTE(self._router_callback(result, hidden, layers[0].top_k))
        result.model = Model(len(layers), hidden, array, norm.weight.data_ptr(), norm.variance_epsilon, head_rows, 1,
                             kernels.THREADS_MIN_BYTES, route)
        result.keep.append(route)
        self.attentions, self.moe_index, self.called, self.decode_forwards = attentions, moe_index, called, forwards
        return result

    def _router_callback(self, struct: "_Struct", hidden: int, k: int):
        """decode.c's DecodeModel.route at bf16: layer i's router module on the token's normed row, as the per-step
        path calls it (models/decoder.py `_decode_moe`: its F.linear, softmax, top-k and cast, torch's bits), its
        experts and weights written where decode.c reads them. A router's exception is kept for the caller to raise;
        weights of another dtype than the structure's (struct.bf16_weights[i]): declined (1)."""
        routers = [layer.mlp.gate for layer in self.layers]

        def route(i: int, x: int, index: int, weights: int) -> int:
            try:
                row = torch.frombuffer((ctypes.c_uint16 * hidden).from_address(x), dtype=torch.bfloat16).view(1, hidden)
                _, top, chosen = routers[i](row)
                if chosen.shape != (1, k) or (top.dtype == torch.bfloat16) != struct.bf16_weights[i]:
                    return 1
                torch.frombuffer((ctypes.c_int64 * k).from_address(index), dtype=torch.int64).copy_(chosen[0])
                torch.frombuffer((ctypes.c_float * k).from_address(weights), dtype=torch.float32).copy_(top[0])
                return 0
            except Exception as exc:  # (an exception cannot cross the C frames: kept, raised after the call)
                struct.error = exc
                return 1

        return route


def _NO_PLAN():
    return None


class _Struct:
    """The structure decode.c reads, its layers (to set their cache buffers each token) and what it points into."""

    def __init__(self, model: Model | None, layer_list: list, keep: list) -> None:
        self.model, self.layer_list, self.keep = model, layer_list, keep
        self.bf16_weights = [bool(layer.weights_bf16) for layer in layer_list]  # each layer's router weights are bf16
        self.error: BaseException | None = None  # a bf16 router's exception in decode.c's callback
