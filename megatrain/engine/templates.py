"""Stateless layer templates: one module per distinct structure, bound to streamed weights per call.

A template's own parameters live on the meta device and are never used: each call passes views
of the GPU weight buffer through torch.func.functional_call, so no per-layer module and no
autograd graph outlives the call.
"""

from __future__ import annotations

import warnings

import torch
from torch.func import functional_call

from megatrain.engine.layout import Unit
from megatrain.models import DecoderLayer, ModelConfig, RMSNorm
from megatrain.models.loss import linear_cross_entropy


def bind(unit: Unit, flat: torch.Tensor, requires_grad: bool) -> dict[str, torch.Tensor]:
    """Template parameter name -> view of the unit's tile in `flat` (a GPU weight buffer)."""
    views = {}
    for slot in unit.params:
        v = unit.view(flat, slot)
        views[slot.local] = v.requires_grad_() if requires_grad else v
    return views


class CompiledCall:
    """A template call, through torch.compile where asked (one graph for forward, one for recompute+backward); a
    compiler failure falls back to eager, which computes the same, once and for good."""

    def __init__(self, call, compile_layer: bool):
        self._call = call
        self.compiled = compile_layer
        self._compiled_fn = torch.compile(call, dynamic=False) if compile_layer else None
        if compile_layer:
            from megatrain.compile_check import watch

            watch()

    def __call__(self, *args):
        if self.compiled:
            try:
                return self._compiled_fn(*args)
            except Exception as exc:
                if not is_compiler_failure(exc):  # an OOM or a bug in the layer is the caller's to see
                    raise
                # a compiler failure must not stop training: eager computes the same
                warnings.warn(f"torch.compile of the layer failed ({type(exc).__name__}: {exc}); running eager",
                              stacklevel=3)
                self.compiled = False
        return self._call(*args)


class LayerTemplate(CompiledCall):
    """A decoder layer called with bound weights; optionally through torch.compile, which fuses the
    norms, RoPE and SwiGLU elementwise work (one graph for forward, one for recompute+backward).

    routing (a mixture of experts in the engine): each call also returns the experts each token went to, last, and
    takes a forward's to replay (DecoderLayer's experts_TK), so the recompute's gradient is of the forward's
    routing."""

    def __init__(self, cfg: ModelConfig, compile_layer: bool = False, mlp_chunk_tokens: int = 0,
                 routing: bool = False):
        if mlp_chunk_tokens and cfg.is_moe:
            raise ValueError("option mlp_chunk_tokens chunks a dense SwiGLU; a mixture of experts computes only the "
                             "routed tokens per expert: leave it 0")
        with torch.device("meta"):
            self.module = DecoderLayer(cfg)
        self.module.mlp.chunk_tokens = mlp_chunk_tokens
        self.routing = routing and cfg.is_moe
        super().__init__(self._layer, compile_layer)

    def _layer(self, params, x_BSH, cos_SD, sin_SD, mask_B1SS=None, experts_TK=None):
        kwargs = {"experts_TK": experts_TK, "routing": True} if self.routing else {}
        return functional_call(self.module, params, (x_BSH, cos_SD, sin_SD, mask_B1SS), kwargs)

    def __call__(self, params: dict, x_BSH: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
                 mask_B1SS: torch.Tensor | None = None, experts_TK: torch.Tensor | None = None):
        return super().__call__(params, x_BSH, cos_SD, sin_SD, mask_B1SS, experts_TK)


def is_compiler_failure(exc: BaseException) -> bool:
    """Whether `exc` is torch.compile's own failure (the backend, Inductor, Dynamo's internals), not an error the
    eager layer would raise too: an out-of-memory anywhere in its cause chain is never a compiler failure."""
    from torch._dynamo import exc as dynamo_exc
    from torch._inductor import exc as inductor_exc

    compiler = (dynamo_exc.BackendCompilerFailed, dynamo_exc.InternalTorchDynamoError)
    compiler += (inductor_exc.InductorError,) if hasattr(inductor_exc, "InductorError") else ()
    if not isinstance(exc, compiler):
        return False
    cause = exc
    while cause is not None:
        if isinstance(cause, torch.OutOfMemoryError):
            return False
        cause = cause.__cause__ or getattr(cause, "inner_exception", None)
    return True


class HeadTemplate:
    """Final RMSNorm + chunked LM-head cross-entropy."""

    def __init__(self, cfg: ModelConfig):
        with torch.device("meta"):
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def loss(self, norm_weight: torch.Tensor, head_weight_VH: torch.Tensor, h_BSH: torch.Tensor,
             labels_BS: torch.Tensor, normalizer: int) -> torch.Tensor:
        hn = functional_call(self.norm, {"weight": norm_weight}, (h_BSH,))
        return linear_cross_entropy(hn.flatten(0, 1), head_weight_VH, labels_BS.flatten(), normalizer)


def add_rows(grad_VH: torch.Tensor, tokens_T: torch.Tensor, rows_TH: torch.Tensor, cuda: bool) -> None:
    """grad_VH[tokens_T[i]] += rows_TH[i] in fp32, repeatably: on the GPU index_put_'s accumulate sorts, where
    index_add_ uses atomics; on the CPU index_put_ adds with atomics across threads (from 32768 elements), where
    index_add_ adds in token order."""
    rows_TH = rows_TH.float()
    if cuda:
        grad_VH.index_put_((tokens_T,), rows_TH, accumulate=True)
    else:
        grad_VH.index_add_(0, tokens_T, rows_TH)
