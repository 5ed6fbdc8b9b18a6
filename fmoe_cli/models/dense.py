"""`--dense int8|int4`: the non-expert linears stored quantised, one copy (types.DENSE_FORMATS).

Targets: every nn.Linear of the decoder layers' attention (`…self_attn.*`: q/k/v/o, DeepSeek's
low-rank q_a/q_b/kv_a/kv_b) and the LM head unless it is tied to the embedding (a tied head is the
embedding: a lookup, left as stored); the head in int8 for both formats (DenseFormat.head, docs/quantization.md
says why). A target W [out, in] is quantised row by row in
the experts' formats (offload/quant.py: groups of G along `in`, each row its codes then its
scales): a row of W is one "projection" of the expert layout, so the same `quantize` and
`dequantize` serve both.

    int8:  ŵ = q·s,     q ∈ [−127, 127], float16 s per G = 128 weights
    int4:  ŵ = q·s + m, q ∈ [0, 15],     float16 s, m per G = 64 weights

`QuantLinear` keeps only the packed rows (and the bias): the float weight is dropped once
quantised, so host RAM (and, on a GPU, VRAM) holds the dense weights at their stored size. Its
forward dequantises blocks of output rows into a workspace shared by every QuantLinear (bounded
like the experts': offload/quant.py DEQUANT_WORKSPACE_BYTES) and multiplies:

    y[:, rows] = x · ŵ[rows]ᵀ (+ b[rows])

A model whose weights fit the workspace dequantises each weight whole, so its matmul is the one
transformers computes with the dequantised weight (the exactness reference: transformers'
generate on the same checkpoint with every target replaced by `QuantLinear.dequantized()`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fmoe_cli import kernels
from fmoe_cli.offload.layout import hooked
from fmoe_cli.offload.quant import QUANTIZE_ROWS, block_rows, dequantize, quantize
from fmoe_cli.types import DEFAULT_ACTIVATIONS, DENSE_FORMATS, DenseFormat, QuantFormat

ATTENTION = "self_attn"  # the attention module of every supported family's decoder layer


def ours(forward):
    """Marks a forward this package installs on a module (a decode token's: models/token.py checks that a module
    still has it before it computes the module's steps in C)."""
    forward.fmoe_decode = True
    return forward


def forward_of(module):
    """What calling `module` runs at a decode token: its forward, without nn.Module's per-call steps (hooks, tracing,
    a checkpointing layer's checks: microseconds a call, several calls a layer), where no hook would run; else the
    module itself."""
    return module if hooked(module) else module.forward


def call_linear(module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` at a decode token, for a linear `module`: where calling it would run nn.Linear's own forward and
    nothing else (no hook, no forward put over it), that forward's one op on the weight and bias read from the
    module's table (`linear_forward`); else `forward_of(module)(x)`."""
    if type(module) is nn.Linear and "forward" not in module.__dict__ and not hooked(module):
        return linear_forward(module, x)
    return forward_of(module)(x)


def linear_forward(linear: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """nn.Linear.forward's op, F.linear(x, weight, bias), with the weight and bias read from the module's parameters:
    through nn.Module's __getattr__ each name costs about 1 µs (o_proj's two a layer, the LM head's two a token)."""
    parameters = linear._parameters
    return F.linear(x, parameters["weight"], parameters["bias"])


def is_ours(module) -> bool:
    """Whether `module`'s forward is one `ours` marked (not one put over it since)."""
    return getattr(module.__dict__.get("forward"), "fmoe_decode", False)


def kernel_forward(x: torch.Tensor, rows: torch.Tensor, kernel, bias: torch.Tensor | None) -> torch.Tensor:
    """y [T, O] of x's dtype = x [T, H] · ŵᵀ (+ b) for quantised `rows` [O, row bytes] through the CPU kernels (the
    float32 sum rounded once to x's dtype, then the bias added): a QuantLinear's, and a fused q/k/v's."""
    y = kernels.linear_forward(x, rows, kernel)
    if x.dtype != torch.float32:
        y = y.to(x.dtype)
    return y if bias is None else y.add_(bias)


class QuantLinear(nn.Module):
    """An nn.Linear stored as quantised rows: `packed` [out, projection_bytes(in)] uint8, dequantised per call."""

    def __init__(self, linear: nn.Linear, fmt: QuantFormat, activations: str = DEFAULT_ACTIVATIONS) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.format = fmt
        self.dtype = linear.weight.dtype  # the compute dtype ŵ is rounded to (as the reference's weight)
        weight = linear.weight.detach()
        width = fmt.projection_bytes(self.in_features)
        packed = torch.empty(self.out_features, width, dtype=torch.uint8, device=weight.device)
        if not weight.is_meta:  # (a meta model, `fmoe plan`: the shape alone)
            for start in range(0, self.out_features, QUANTIZE_ROWS):
                rows = weight[start:start + QUANTIZE_ROWS]
                packed[start:start + QUANTIZE_ROWS] = quantize(rows[:, None, :], fmt)[:, 0]
        self.packed = nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        self.kernel = kernels.quant_spec(fmt, self.in_features, activations=activations)  # the CPU kernels' view

    def dequantized(self, rows: slice = slice(None), dtype: torch.dtype | None = None, workspace=None) -> torch.Tensor:
        """ŵ[rows] [n, in] of the compute dtype (or `dtype`)."""
        segment = self.packed[rows][:, None, :]
        ws, out = workspace if workspace is not None else (None, None)
        return dequantize(segment, self.format, self.in_features, dtype or self.dtype, ws, out)[:, 0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, self.in_features)
        if self.kernel is not None and kernels.takes(tokens):  # the CPU kernels: ŵ never materialised
            return kernel_forward(tokens, self.packed, self.kernel, self.bias).view(*x.shape[:-1], self.out_features)
        return self.torch_forward(x)

    def torch_forward(self, x: torch.Tensor) -> torch.Tensor:
        """ŵ dequantised in blocks of output rows, then torch's matmuls (a GPU, a long prefill, no kernels)."""
        # a neuron row of the expert layout is three projections, a linear's row one: 3× the rows in the same bytes
        rows = 3 * block_rows(self.in_features, x.dtype)
        workspace = _workspace(x.device, x.dtype, min(rows, self.out_features) * self.in_features)
        if rows >= self.out_features:  # whole: the reference's own matmul
            return F.linear(x, self.dequantized(dtype=x.dtype, workspace=workspace), self.bias)
        y = x.new_empty(*x.shape[:-1], self.out_features)
        for start in range(0, self.out_features, rows):
            part = slice(start, start + rows)
            bias = None if self.bias is None else self.bias[part]
            y[..., part] = F.linear(x, self.dequantized(part, x.dtype, workspace), bias)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.format.bits}"


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor | None]] = {}


def _workspace(device: torch.device, dtype: torch.dtype, elements: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One float32 workspace (and one of the compute dtype) per device, shared by every QuantLinear: calls
    run one at a time, and each result is consumed by its matmul before the next call."""
    key = (device, dtype)
    ws = _WORKSPACES.get(key)
    if ws is None or ws[0].numel() < elements:
        with torch.inference_mode(False):  # normal tensors: written in and out of inference mode
            ws = _WORKSPACES[key] = (torch.empty(elements, dtype=torch.float32, device=device),
                                     None if dtype == torch.float32 else torch.empty(elements, dtype=dtype,
                                                                                    device=device))
    return ws


def head_is_tied(model) -> bool:
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None or embedding is None:
        return False
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return bool(getattr(text, "tie_word_embeddings", False)) or head.weight is embedding.weight


def dense_targets(model, fmt: DenseFormat) -> dict[str, QuantFormat]:
    """The module names `fmt` quantises, each with its format: the attention's linears (`fmt.quant`), and the untied
    LM head (`fmt.head`). A linear whose input width is not a multiple of 8 stays as stored (the packing splits a row
    in halves or quarters)."""
    names = {name: fmt.quant for name, module in model.named_modules()
             if isinstance(module, nn.Linear) and ATTENTION in name.split(".")}
    if fmt.head is not None and not head_is_tied(model):
        head = model.get_output_embeddings()
        names |= {name: fmt.head for name, module in model.named_modules()
                  if module is head and isinstance(module, nn.Linear)}
    return {n: q for n, q in names.items() if model.get_submodule(n).in_features % 8 == 0}


def quantize_dense(model, dense: str, activations: str = DEFAULT_ACTIVATIONS) -> int:
    """Replace every target of `--dense` by a QuantLinear (its float weight is freed as it goes; on a meta model
    the shapes alone), computing with `activations` on the CPU. Returns how many were replaced."""
    fmt = DENSE_FORMATS[dense]
    if fmt is None:
        return 0
    targets = dense_targets(model, fmt)
    for name, quant in targets.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, attr, QuantLinear(getattr(parent, attr), quant, activations))
    return len(targets)


def flatten_head_input(model) -> bool:
    """An unquantised LM head (nn.Linear) computes on its input flattened to [rows, in]. A prefill hands it the
    last token's slice hidden[:, -1:, :], whose size-1 dims keep the prompt's strides (T·H, H, 1), and torch's
    bf16 matmul on the CPU takes a slow path for such a view: `a3b`'s 32000 × 2048 head took 0.6–0.8 s of CPU
    for that one row instead of 16–33 ms (torch 2.13; the same bits either way). Returns whether it applied (not
    over a forward put on the head before: it runs nn.Linear's own)."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or "forward" in head.__dict__:
        return False

    def flat(x: torch.Tensor) -> torch.Tensor:  # (nn.Linear's forward, on x's rows: linear_forward)
        return linear_forward(head, x.reshape(-1, x.shape[-1])).view(*x.shape[:-1], head.out_features)

    head.forward = flat
    return True


def one_row_matvec(model) -> int:
    """bf16 nn.Linears without a bias on the CPU (the attention's projections and the LM head, when `--dense` leaves
    them as stored) compute a single row as torch.mv(W, x): at a decode token torch's bf16 F.linear reorders the
    weight for oneDNN on every call, and the matrix-vector product gives the same bits 20–27 % sooner on an AVX-512
    machine (docs/bench.md § bf16 rows at a decode token). Installed per weight shape only where a probe gives F.linear's bits on this
    machine, so nothing changes where the two differ. Returns how many linears took it."""
    same_bits: dict[tuple, bool] = {}
    count = 0
    for name, module in model.named_modules():
        if (type(module) is not nn.Linear or module.bias is not None or module.weight.dtype != torch.bfloat16
                or module.weight.device.type != "cpu" or module.weight.is_meta):
            continue
        if not (ATTENTION in name.split(".") or module is model.get_output_embeddings()):
            continue
        shape = tuple(module.weight.shape)
        if shape not in same_bits:
            probe = torch.randn(1, shape[1], generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
            same_bits[shape] = torch.equal(F.linear(probe, module.weight), torch.mv(module.weight, probe[0])[None])
        if same_bits[shape]:
            module.forward = _matvec_forward(module, module.forward)
            count += 1
    return count


def kernel_rows(dtype: torch.dtype, in_features: int, weight_bytes: int) -> bool:
    """Whether a decode token's float rows of this dtype and size go through the kernels: float32 and bf16, at every
    size. (float32 rows below 1024 inputs and 4 MB stayed torch's F.linear until the token in C, models/token.py,
    which computes every row with the kernels: the per-step path must give its bits. In the caches F.linear was
    faster on them, docs/bench.md § Float dense rows through the kernels.)"""
    return dtype in kernels.COMPUTE_DTYPES


def one_row_kernels(model) -> int:
    """The float32 and bf16 nn.Linears on the CPU of the attention and the LM head (when `--dense` leaves them as
    stored) compute a single row — a decode token — through the CPU kernels (`kernel_forward`: the rows read once,
    bf16 widened in registers, the float32 sum rounded once to x's dtype, then the bias): torch's F.linear and
    torch.mv stream these rows at 14–16 GB/s on an AVX2 EPYC where the kernel reaches 16–21. Not F.linear's bits: each output is one row's dot in the kernel's order, as an expert's
    is; the tokens stay transformers' (tests/test_exactness.py), and every policy's logits stay the resident run's
    bit for bit (the same rows in every run). Several rows (a prefill) stay F.linear in float32 and take the kernels
    in bf16 (`several_rows`). Returns how many linears took it; 0 without the kernels (then `one_row_matvec` serves
    bf16)."""
    if kernels.library() is None:
        return 0
    count = 0
    for name, module in model.named_modules():
        if (type(module) is not nn.Linear or module.weight.dtype not in kernels.COMPUTE_DTYPES
                or module.weight.device.type != "cpu" or module.weight.is_meta):
            continue
        if not (ATTENTION in name.split(".") or module is model.get_output_embeddings()):
            continue
        if not kernel_rows(module.weight.dtype, module.in_features, module.weight.nbytes):
            continue
        module.forward = _kernel_row_forward(module, module.forward, ATTENTION in name.split("."))
        count += 1
    return count


def several_rows(x: torch.Tensor, in_features: int) -> bool:
    """Whether several rows x [..., H] (a prefill) of a float linear go through the kernels too: bf16, up to
    kernels.MAX_TOKENS rows. torch 2.13's bf16 matmul on a CPU without native bf16 is slow (a3b's fused q/k/v rows
    5120 × 2048 at 64 tokens, 2 threads: 66 ms against the kernel's 17; docs/bench.md § Prefill: register tiles);
    float32 prefill rows stay F.linear (MKL's sgemm is as fast as the tiles)."""
    return (x.dtype == torch.bfloat16 and x.shape[-1] == in_features
            and 1 < x.numel() // in_features <= kernels.MAX_TOKENS)


def _kernel_row_forward(linear: nn.Linear, forward, prefill: bool = False):
    """prefill: several rows too where `several_rows` takes them (the attention's projections; an LM head computes
    the prompt's last row alone)."""
    spec = kernels.spec_of("", linear.weight.dtype, linear.in_features)
    rows = []  # the weight's bytes as [O, H·itemsize] rows: a view (no copy), remade if the weight is replaced

    def kernel_row(x: torch.Tensor) -> torch.Tensor:
        weight = linear.weight
        if x.dtype != weight.dtype or x.device.type != "cpu" or weight.device.type != "cpu":
            rows.clear()  # (a model moved to another device: keep no reference to its CPU weight)
            return forward(x)
        if x.numel() != linear.in_features and not (prefill and several_rows(x, linear.in_features)):
            return forward(x)
        if not rows or rows[0].data_ptr() != weight.data_ptr():
            rows[:] = [weight.detach().view(torch.uint8)]
        y = kernel_forward(x.reshape(-1, linear.in_features), rows[0], spec, linear.bias)
        return y.view(*x.shape[:-1], linear.out_features)

    kernel_row.spec = spec
    return ours(kernel_row)


def _matvec_forward(linear: nn.Linear, forward):
    def matvec(x: torch.Tensor) -> torch.Tensor:
        if x.numel() != linear.in_features or x.dtype != torch.bfloat16 or x.device.type != "cpu":
            return forward(x)  # (a model moved to a GPU after loading: cuBLAS's bits are F.linear's own)
        return torch.mv(linear.weight, x.reshape(-1)).view(*x.shape[:-1], linear.out_features)

    return matvec


def dense_bytes_saved(model, dense: str) -> int:
    """Bytes the non-expert weights shrink by under `--dense` (on the meta skeleton, before any weight is read):
    Σ over the targets of the float weight's bytes − the packed rows'."""
    fmt = DENSE_FORMATS[dense]
    if fmt is None:
        return 0
    saved = 0
    for name, quant in dense_targets(model, fmt).items():
        w = model.get_submodule(name).weight
        saved += w.numel() * w.element_size() - w.shape[0] * quant.projection_bytes(w.shape[1])
    return saved


def dense_reference(reference, quantized) -> int:
    """The exactness reference: every target linear of the transformers model `reference` gets the dequantised
    weight of the same module of the loaded (quantised) model. Returns how many were replaced."""
    count = 0
    for name, module in quantized.named_modules():
        if isinstance(module, QuantLinear):
            with torch.no_grad():
                reference.get_submodule(name).weight.copy_(module.dequantized())
            count += 1
    return count
