"""Which of transformers' causal LMs the generic path trains, measured: every model type whose causal-LM class is a
`*ForCausalLM`, built at a tiny size (its own config class with the sizes below), one step streamed through the engine
against transformers' own loss and gradient norm on the same batch (fp32, CPU), in train mode: a family whose config
class sets dropout or jitter draws it, its masks seeded alike on both sides (megatrain.models.draws).

Each family ends in one of: 'trains' (loss and gradient norm equal transformers' to 1e-5 and 1e-4), 'refused' (the
generic path names why it cannot stream it), 'differs' (it ran, and computed something else), 'fails' (the engine
raised), 'unbuilt' (its config or model cannot be built at the tiny size, so it was not measured). scripts/
walk_transformers.py writes the table; tests/unit/test_generic_walk.py runs it.

The published checkpoints (megatrain.models.published) walk the same way, each from its own config.json: every width
cut to the tiny sizes, every switch as published (try_published), and on a GPU at their published widths at a cut
depth (curve_published).
"""

from __future__ import annotations

import math
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass

import torch

from megatrain.checks import band

STATUSES = ("trains", "refused", "differs", "fails", "unbuilt")
# sizes each config key takes where a family's config has it: the tiny shape every family is measured at
TINY = {
    "vocab_size": 128, "vocab_size_per_layer_input": 128, "hidden_size_per_layer_input": 8,
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "embed_dim": 64,
    "intermediate_size": 128, "ffn_dim": 128, "n_inner": 128, "decoder_ffn_dim": 128, "ffn_hidden_size": 128,
    "intermediate_size_mlp": 128, "dense_intermediate_size": 128, "moe_intermediate_size": 32,
    "shared_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_experts_intermediate_size": 32,
    "expert_ffn_hidden_size": 32,
    "num_hidden_layers": 4, "n_layer": 4, "num_layers": 4, "n_layers": 4, "decoder_layers": 4,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "head_dim": 16, "kv_channels": 16, "attention_head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "num_experts_per_token": 2, "moe_topk": 2, "moe_k": 2, "n_group": 1, "topk_group": 1,
    "num_expert_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
    "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 8, "linear_num_heads": 4,
    "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_chunk_size": 8, "ssm_state_size": 8,
    "state_size": 8, "mamba_num_heads": 4,
    "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2, "swa_head_dim": 16,
    "rotary_dim": 8, "max_position_embeddings": 256, "n_positions": 256, "sliding_window": 8, "sliding_window_size": 8,
    "attention_chunk_size": 8,
    # Gemma 4's full-attention layers: a head of their own, wider than the sliding layers' (published 512 to 256),
    # and their own KV heads (fewer: 4 to 16); its experts beside the MLP
    "global_head_dim": 32, "num_global_key_value_heads": 1, "top_k_experts": 2,
}
ALWAYS = ("num_experts_per_tok", "head_dim")  # set where the config has them unset too (None: derived, or unusable)
SEQ, BATCH = 16, 2
MAX_PARAMS = 20_000_000  # a family whose tiny config is larger keeps sizes of its own: not built (memory, minutes)


@dataclass(frozen=True)
class FamilyResult:
    """One model type's outcome: its causal-LM class, the status (STATUSES) and what it says (the reason, the
    numbers, the error)."""

    model_type: str
    causal_lm: str
    status: str
    detail: str = ""


def causal_lm_types() -> dict[str, str]:
    """Every model type of the installed transformers whose causal-LM class is a *ForCausalLM, and that class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {t: c for t, c in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()) if c.endswith("ForCausalLM")}


def tiny_config(model_type: str):
    """The model type's config class at the tiny size: each TINY key its default has (and is set), token ids inside
    the vocabulary."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class().to_dict()
    sizes = {k: v for k, v in TINY.items() if defaults.get(k) is not None or (k in defaults and k in ALWAYS)}
    if "qk_rope_head_dim" in sizes and "head_dim" in sizes:  # MLA: head_dim is the rotary part's
        sizes["head_dim"] = sizes["qk_rope_head_dim"]
    if defaults.get("num_kv_shared_layers"):  # the last layers reuse earlier ones' keys and values (Gemma 3n: 15 of
        # 35): at 4 layers the last 2, after one producer of each attention type
        sizes["num_kv_shared_layers"] = 2
        if defaults.get("layer_types"):
            sizes["layer_types"] = ["sliding_attention", "full_attention"] * 2
    return config_class(**sizes, **_tokens_inside(defaults))


def _tokens_inside(hf: Mapping) -> dict:
    """The token ids of a config that fall outside the tiny vocabulary, set to 1."""
    return {k: [1] if isinstance(v, list) else 1 for k, v in hf.items()
            if k.endswith("_token_id") and v is not None and (max(v) if isinstance(v, list) else v) >= 128}


def try_family(model_type: str, causal_lm: str) -> FamilyResult:
    """Measure one model type (never raises: the outcome is the result)."""
    try:
        config = tiny_config(model_type)
    except Exception as exc:
        return FamilyResult(model_type, causal_lm, "unbuilt", _error(exc))
    return FamilyResult(model_type, causal_lm, *measure(config))


def measure(config) -> tuple[str, str]:
    """(status, detail) of one engine step of transformers' config object `config` against transformers' own step
    on the same weights and batch (never raises)."""
    import transformers

    from megatrain.models.draws import Draws
    from megatrain.models.generic import GenericConfig
    from megatrain.models.generic.module import reseed_units
    from megatrain.models.generic.skeleton import Parts
    from megatrain.models.weights import named_weights

    try:
        with torch.device("meta"):
            params = sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())
        if params > MAX_PARAMS:
            return "unbuilt", f"at the tiny sizes it still has {params / 1e6:.0f}M parameters (sizes of its own the " \
                "walk does not shrink)"
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config).float().train()
    except Exception as exc:
        return "unbuilt", _error(exc)
    cfg = GenericConfig.from_hf(reference.config.to_dict())
    try:
        cfg.check()
    except ValueError as exc:
        return "refused", str(exc)
    except Exception as exc:
        return "fails", _error(exc)
    tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
    x, y = tokens[:, :-1], tokens[:, 1:]
    try:
        weights = {n: t.detach().clone() for n, t in named_weights(reference).items()}
        if cfg.random_settings:  # its dropout's masks drawn as the engine draws them (step 0, micro-batch 0)
            reseed_units(Parts(reference), Draws(), lambda: reference.training)
        ref_loss, ref_norm = _reference_step(reference, x, y)
    except Exception as exc:  # transformers' own model does not run at the tiny size: nothing to measure against
        return "unbuilt", f"transformers' own forward: {_error(exc)}"
    try:
        loss, norm = _engine_step(cfg, weights, x, y)
    except ValueError as exc:
        return "refused", str(exc)
    except Exception as exc:
        return "fails", _error(exc)
    if math.isclose(loss, ref_loss, rel_tol=1e-5) and math.isclose(norm, ref_norm, rel_tol=1e-4):
        draws = "".join(f", {k}={v:g}" for k, v in cfg.random_settings.items())  # drawn alike on both sides
        return "trains", f"loss {loss:.6f}, gradient norm {norm:.5f}{draws}"
    return "differs", f"loss {loss:.6f} vs transformers' {ref_loss:.6f}, gradient norm {norm:.5f} vs {ref_norm:.5f}"


def _engine_step(cfg, weights: dict, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    from megatrain.engine.config import EngineConfig
    from megatrain.engine.trainer import StreamingSystem

    engine = StreamingSystem(EngineConfig(model=cfg, batch=BATCH, micro_batch=BATCH, seq=SEQ))
    try:
        engine.load_weights(weights.items())
        loss = engine.step(x, y)
        return loss, engine.last_grad_norm
    finally:
        engine.close()


def _reference_step(model, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    logits = model(x, use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="sum") / y.numel()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], math.inf)
    return loss.item(), norm.item()


def _error(exc: BaseException) -> str:
    """The exception and where in transformers or here it came from, on one line."""
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" ({frame.filename.rsplit('/', 2)[-1]}:{frame.lineno})" if frame else ""
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"[:300]


def walk(model_types: dict[str, str] | None = None) -> list[FamilyResult]:
    """try_family over `model_types` (default: every *ForCausalLM type of the installed transformers)."""
    return [try_family(t, c) for t, c in (model_types or causal_lm_types()).items()]


def as_dicts(results: list) -> list[dict]:
    return [asdict(r) for r in results]


# ---- the published checkpoints (megatrain.models.published) -------------------------------------------------------
@dataclass(frozen=True)
class PublishedResult:
    """One published checkpoint's outcome at the tiny widths: its hub id, model type, status (STATUSES), what it
    says, and where it was walked (commit, CPU and torch; empty in rows walked before it was kept)."""

    hub_id: str
    model_type: str
    status: str
    detail: str = ""
    walked: str = ""


def published_depth(hf: Mapping, least: int = 4) -> int:
    """The fewest leading layers that hold every kind of layer a config.json has: each value of each per-layer list
    (its config class's derived ones too: Gemma's 5 sliding layers to a full one, Llama 4's NoPE layers), at least
    `least` (4 at the tiny widths, where the first dense layer is 1: MoE layers after it); twice that where its last
    layers reuse earlier layers' keys and values (Gemma 4's E-sizes: GenericConfig.with_layers keeps their share), so
    both producers and readers remain."""
    from megatrain.models.generic import GenericConfig

    shape = GenericConfig.from_hf(hf)
    depth = least
    for values in (*hf.values(), *_derived(shape).values()):
        if _per_layer(values, shape.num_layers):
            firsts = {v: n for n, v in reversed(list(enumerate(values)))}
            depth = max(depth, 1 + max(firsts.values()))
    if hf.get("num_kv_shared_layers"):
        depth *= 2
    return min(depth, shape.num_layers)


def _derived(shape) -> dict:
    """The settings transformers' config class holds for a GenericConfig ({} where transformers refuses the config:
    refused, with why, where its model is built)."""
    from megatrain.models.generic.skeleton import transformers_config

    try:
        return dict(vars(transformers_config(shape)))
    except ValueError:
        return {}


def _per_layer(values, num_layers: int) -> bool:
    """A kind per layer: a list of a name or a flag for each layer (not a list of layer indices)."""
    return isinstance(values, list) and len(values) == num_layers and \
        all(v in (0, 1) or isinstance(v, str) for v in values)


def _layer_kinds(shape) -> set[tuple[str, object]]:
    """Every (per-layer setting, value) a model's layers hold: the config.json's per-layer lists and those its config
    class derives (Gemma's layer types with the last layer made full)."""
    return {(key, v) for key, values in {**shape.hf, **_derived(shape)}.items()
            if _per_layer(values, shape.num_layers) for v in values}


def curve_depth(hf: Mapping) -> int:
    """The GPU column's depth: the fewest layers, at least CURVE_LEAST_LAYERS, whose cut holds every kind of layer
    the checkpoint has, as transformers builds the cut (Gemma 4 makes a cut's last layer full: its 26B-A4B and 31B
    hold both kinds in 2 layers, 2.4B and 2.3B parameters at their widths, where published_depth's 6 held 5.6B and
    4.3B); published_depth where later layers reuse earlier layers' keys and values (Gemma 4's E-sizes)."""
    from megatrain.models.generic import GenericConfig

    depth = published_depth(hf, CURVE_LEAST_LAYERS)
    if hf.get("num_kv_shared_layers"):
        return depth
    shape = GenericConfig.from_hf(hf)
    kinds = _layer_kinds(shape)
    return next((n for n in range(CURVE_LEAST_LAYERS, depth) if _layer_kinds(shape.with_layers(n)) >= kinds), depth)


def published_at_depth(hf: Mapping, least: int = 4, depth: int | None = None) -> dict:
    """A published config.json at its published widths, cut to `depth` layers (default published_depth's); a head
    width the source leaves out where its config class has none either (Hunyuan's) is hidden_size /
    num_attention_heads, what the family's modeling code falls back to."""
    from megatrain.models.generic import GenericConfig

    cut = GenericConfig.from_hf(hf).with_layers(depth or published_depth(hf, least)).hf
    if cut.get("head_dim", 0) is None or "head_dim" not in cut and _class_defaults(cut).get("head_dim", 0) is None:
        cut["head_dim"] = cut["hidden_size"] // cut["num_attention_heads"]
    return cut


def _class_defaults(hf: Mapping) -> dict:
    """The config.json its model type's config class writes with every default (none where transformers has no such
    model type: refused, with why, where its model is built)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[hf["model_type"]]().to_dict() if hf["model_type"] in CONFIG_MAPPING else {}


def tiny_published(hf: Mapping) -> dict:
    """A published config.json at the walk's tiny widths with every switch as published: each TINY key it sets to a
    size (not 0, None or a flag: per-layer inputs of width 0 stay off) takes the tiny one, a list sized by the head
    width (longrope's factors) keeps its first entries, the depth is published_depth, token ids fall inside the
    vocabulary."""
    from megatrain.models.generic.config import LAYERS_KEYS

    defaults = _class_defaults(hf)
    cut = {k: TINY[k] if k in TINY and k not in LAYERS_KEYS and v and not isinstance(v, bool) else v
           for k, v in published_at_depth(hf).items()}
    if cut.get("qk_rope_head_dim") and cut.get("head_dim"):  # MLA: head_dim is the rotary part's
        cut["head_dim"] = cut["qk_rope_head_dim"]
    mamba = {**defaults, **cut}
    if mamba.get("mamba_n_heads") and isinstance(cut.get("mamba_d_head"), int):  # Mamba-2's inner width is its heads
        # times their width, which its config class checks: Falcon-H1's its own (mamba_d_ssm), Granite 4's twice the
        # hidden size (mamba_expand)
        if mamba.get("mamba_d_ssm"):
            cut["mamba_d_ssm"] = mamba["mamba_n_heads"] * cut["mamba_d_head"]
        elif mamba.get("mamba_expand"):
            cut["mamba_d_head"] = mamba["mamba_expand"] * cut["hidden_size"] // mamba["mamba_n_heads"]
    for key in ("rope_scaling", "rope_parameters"):
        rope = cut.get(key)
        if isinstance(rope, dict) and isinstance(rope.get("long_factor"), list):
            head_dim = cut.get("head_dim") or cut["hidden_size"] // cut["num_attention_heads"]
            rotary = round(head_dim * cut.get("partial_rotary_factor", 1.0)) // 2
            cut[key] = {**rope, "long_factor": rope["long_factor"][:rotary],
                        "short_factor": rope["short_factor"][:rotary]}
    return {**cut, **_tokens_inside({**defaults, **cut})}


def try_published(row) -> PublishedResult:
    """Measure one published checkpoint (a megatrain.models.published.Published) at the tiny widths (never
    raises)."""
    from megatrain.models.generic import GenericConfig
    from megatrain.models.generic.skeleton import transformers_config

    try:
        config = transformers_config(GenericConfig.from_hf(tiny_published(row.config)))
    except ValueError as exc:  # transformers does not know or build it, or the generic path refuses what it sets
        return PublishedResult(row.hub_id, row.model_type, "refused", str(exc))
    except Exception as exc:
        return PublishedResult(row.hub_id, row.model_type, "unbuilt", _error(exc))
    return PublishedResult(row.hub_id, row.model_type, *measure(config))


# ---- the walk on a GPU: several steps in bf16, the engine against transformers' own run ----------------------------
CURVE_STEPS, CURVE_LR = 8, 1e-3


# what every curve of the walk trains (a record carries it, so that a reader can judge and re-run it): CURVE_STEPS
# AdamW steps at CURVE_LR of one repeated batch of BATCH x SEQ tokens
CURVE_SETTING = {"steps": CURVE_STEPS, "lr": CURVE_LR, "batch": BATCH, "seq": SEQ}


CURVE_STATUSES = ("tracks", "leaves", "fails", "skipped")


def band_excess(native: list[float], reordered: list[float], ours: list[float]) -> float:
    """By how much `ours` leaves native's band at its worst step (<= 0: inside; inf: a loss not finite), by the GPU
    suite's rule (megatrain.checks.band): the spread |reordered - native|, each unlearnt step's raised to the largest
    share of its loss any unlearnt step's was, each learnt step's (native's loss under MEMORISED) to the largest among
    them; 3 spreads + 1% of native's loss + 1e-4. (Until 16315c0 every step's spread was raised to the largest share
    of any step's, learnt ones too: a learnt step's share of a loss of 1e-3 made the early steps' band wide and the
    learnt steps' narrower than native's own wandering there.)"""
    ref = torch.tensor(native, dtype=torch.float64)
    spread = band.share_floor((torch.tensor(reordered, dtype=torch.float64) - ref).abs(), ref)
    return band.band_excess(torch.tensor(ours, dtype=torch.float64), ref, spread, ref < band.MEMORISED)[1]


def curve_family(model_type: str, causal_lm: str, device: str = "cuda") -> dict:
    """One model type at the tiny size on `device` (curve)."""
    return {"model_type": model_type, "causal_lm": causal_lm, **curve(model_type, lambda: tiny_config(model_type),
                                                                      device)}


CURVE_MAX_PARAMS = 5_000_000_000  # native holds 12 bytes a parameter on the GPU, the host the engine's state beside
# the reference's fp32 weights: a published model larger than this at its cut depth is skipped, with its count
CURVE_LEAST_LAYERS = 2  # the GPU column's depth: every kind of layer, at least two (a layer streamed after another);
# a model whose dense layers come first (DeepSeek-V3's 3) may hold no experts there: the CPU column trains them


def curve_published(hub_id: str, device: str = "cuda") -> dict:
    """One published checkpoint at its published widths and curve_depth's layers on `device` (curve)."""
    from megatrain.models.generic import GenericConfig
    from megatrain.models.generic.skeleton import transformers_config
    from megatrain.models.published import get_published

    row = get_published(hub_id)
    shape = GenericConfig.from_hf(published_at_depth(row.config, depth=curve_depth(row.config)))
    out = {"hub_id": hub_id, "model_type": row.model_type, "num_layers": shape.num_layers}
    try:
        params = shape.num_params()
    except ValueError as exc:
        return {**out, "status": "fails", "detail": str(exc)}
    if params > CURVE_MAX_PARAMS:
        return {**out, "status": "skipped", "detail": f"{params / 1e9:.1f}B parameters at {shape.num_layers} layers, "
                f"more than {CURVE_MAX_PARAMS / 1e9:.0f}B (one GPU under AdamW, the host beside it)"}
    return {**out, "num_params": params, **curve(hub_id, lambda: transformers_config(shape), device)}


def curve(name: str, config, device: str = "cuda") -> dict:
    """A model (`config()` makes transformers' config object of it), CURVE_STEPS AdamW steps of one repeated batch in
    bf16 precision (bf16 weights, fp32 moments), eager: the engine (streamed) against transformers' own module under
    plain PyTorch (`native`: the model's module and torch.optim.AdamW) from the same weights, judged as the GPU
    suite's curves are: each step within 3 spreads + 1% of the loss + 1e-4 of native's, the spread native's own with
    its gradient sums in another order (micro-batches of one row). Never raises: 'fails' carries the error."""
    import transformers

    from megatrain.config import CaseConfig
    from megatrain.models.draws import random_settings
    from megatrain.models.generic import GenericConfig
    from megatrain.models.weights import named_weights
    from megatrain.optim.config import OptimConfig
    from megatrain.systems import build_system

    seconds: dict[str, float] = {}  # where a curve's time went (a published width's took minutes on the GPU host)
    try:
        start = time.perf_counter()
        torch.manual_seed(0)
        # drawn on the curve's device (transformers' init of a published width's billions of weights took most of a
        # minute on the host), the host keeping the copy both systems load
        with torch.device(device):
            reference = transformers.AutoModelForCausalLM.from_config(config()).float()
        cfg = GenericConfig.from_hf(reference.config.to_dict())
        weights = {n: t.detach().to("cpu", copy=True) for n, t in named_weights(reference).items()}
        del reference
        if torch.device(device).type == "cuda":  # its blocks back to the device before the systems plan on what is free
            torch.cuda.empty_cache()
        seconds["weights"] = time.perf_counter() - start
        tokens = torch.randint(0, cfg.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
        x, y = tokens[:, :-1], tokens[:, 1:]

        def without_draws(hf: dict) -> dict:  # the same model computing the same way with nothing drawn
            return {k: without_draws(v) if isinstance(v, dict) else
                    0.0 if k in random_settings({k: v}) else v for k, v in hf.items()}

        # native's rounding noise: its run with the gradient sums in another order, of the model without its draws
        # (another split of the batch draws other dropout masks, which is no rounding)
        quiet = GenericConfig.from_hf(without_draws(cfg.hf)) if cfg.random_settings else cfg

        def losses(system: str, micro_batch: int, shape=cfg) -> list[float]:
            case = CaseConfig(model=name, model_shape=shape, system=system, batch=BATCH, micro_batch=micro_batch,
                              seq=SEQ, device=device, dtype="bfloat16", precision="bf16", steps=CURVE_STEPS,
                              warmup=0, repeat_batch=True, optim=OptimConfig(lr=CURVE_LR, max_grad_norm=1.0))
            start = time.perf_counter()
            built = build_system(case)
            try:
                built.load_weights(weights.items())
                return [built.step(x, y) for _ in range(CURVE_STEPS)]
            finally:
                built.close()
                key = f"{system}{'' if micro_batch == BATCH else '_reordered'}{'' if shape is cfg else '_undrawn'}"
                seconds[key] = time.perf_counter() - start

        native, ours = losses("native", BATCH), losses("megatrain", BATCH)
        quiet_native = native if quiet is cfg else losses("native", BATCH, quiet)
        reordered = losses("native", 1, quiet)
    except Exception as exc:
        return {"status": "fails", "detail": _error(exc), "seconds": seconds}
    # the spread in the band: |reordered - native| of the model without draws, carried onto the curve that draws
    excess = band_excess(native, [n + r - q for n, r, q in zip(native, reordered, quiet_native, strict=True)], ours)
    status = "tracks" if excess <= 0 else "leaves"
    detail = f"loss {native[0]:.4f} -> {native[-1]:.4f} (transformers), {ours[0]:.4f} -> {ours[-1]:.4f} (engine)" + \
        ("" if status == "tracks" else f"; {excess:.2e} outside the band")
    return {"status": status, "detail": detail, "losses": ours, "native_losses": native,
            "native_reordered_losses": reordered, "native_undrawn_losses": quiet_native, "max_excess_over_band": excess,
            "seconds": seconds}
