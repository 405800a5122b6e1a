"""Streaming engine vs the native reference, and its repeatability at several thread counts, fp32 on CPU. CPU only,
~35 s: pytest tests/unit/test_engine.py"""

import contextlib
import dataclasses
import json

import pytest
import torch
from engine_helpers import (
    assert_nan_step_skipped,
    built,
    native_options,
    rerouting,
    train_delayed_native,
    train_with_nan_gradient,
)
from engine_helpers import train as _train
from families import GENERIC_KINDS, KINDS, family_config, generic_config
from torch._dynamo.exc import BackendCompilerFailed
from train_helpers import SHAPE

from megatrain.checks.walk import tiny_config
from megatrain.config import CaseConfig
from megatrain.engine.config import EngineConfig, MegaTrainOptions
from megatrain.engine.layout import build_units
from megatrain.engine.plan import activation_placement, check_fits, plan_memory
from megatrain.engine.state import STATE_FILE
from megatrain.engine.store import HostStore
from megatrain.engine.templates import LayerTemplate, bind
from megatrain.engine.uses import use_order
from megatrain.memory import GPU_FILL, Budget
from megatrain.models import Transformer, model_shape, rotary_tables
from megatrain.models.checkpoint import shape_from_config
from megatrain.optim.config import OptimConfig
from megatrain.optim.host_adamw import FlatAdamW
from megatrain.systems import build_system
from megatrain.systems.megatrain import engine_config

CASES = {
    "untied-qkv-bias-gqa": dict(model="tiny", batch=2, seq=16),
    "tied-mha": dict(model="tiny-tied", batch=2, seq=16),
    "one-layer": dict(model="tiny", num_layers=1, batch=2, seq=8),
    "five-layers": dict(model="tiny", num_layers=5, batch=2, seq=8),
    "batch1-seq1": dict(model="tiny", batch=1, seq=1),
    "seq7-tied": dict(model="tiny-tied", batch=3, seq=7),
    "clipping-active": dict(model="tiny", batch=2, seq=16, optim=OptimConfig(lr=1e-3, max_grad_norm=0.05)),
    "grad-accumulation": dict(model="tiny", batch=4, micro_batch=1, seq=16),
    "accum-clip-tied": dict(model="tiny-tied", batch=6, micro_batch=2, seq=7,
                            optim=OptimConfig(lr=1e-3, max_grad_norm=0.05)),
    "offloaded-activations": dict(model="tiny", batch=4, micro_batch=2, seq=16, options={"offload_activations": True}),
    "first-2-of-4-offloaded-accum": dict(model="tiny", num_layers=4, batch=4, micro_batch=2, seq=16,
                                         options={"offload_activations": 2}),
    "offload-chunked-mlp-tied": dict(model="tiny-tied", num_layers=3, batch=2, seq=16,
                                     options={"offload_activations": True, "mlp_chunk_tokens": 8}),
    "recompute-2-of-4-inputs-accum": dict(model="tiny", num_layers=4, batch=4, micro_batch=2, seq=16,
                                          options={"recompute_inputs": 2}),
    "recompute-1-offload-2-tied-chunked": dict(model="tiny-tied", num_layers=5, batch=2, seq=16,
                                               options={"recompute_inputs": 1, "offload_activations": 2,
                                                        "mlp_chunk_tokens": 8}),
    "recompute-all-3-2-resident-clip": dict(model="tiny", num_layers=4, batch=4, micro_batch=2, seq=16,
                                            optim=OptimConfig(lr=1e-3, max_grad_norm=0.05),
                                            options={"recompute_inputs": 3, "resident_layers": 2}),
    "resident-embedding-clip": dict(model="tiny", batch=4, micro_batch=2, seq=16,
                                    optim=OptimConfig(lr=1e-3, max_grad_norm=0.05),
                                    options={"resident_embedding": True}),
    "resident-embedding-tied": dict(model="tiny-tied", batch=2, seq=7, options={"resident_embedding": True}),
    "resident-layers-accum-clip": dict(model="tiny", num_layers=4, batch=4, micro_batch=2, seq=16,
                                       optim=OptimConfig(lr=1e-3, max_grad_norm=0.05),
                                       options={"resident_layers": 2}),
    "all-resident-but-head-tied": dict(model="tiny-tied", num_layers=3, batch=2, seq=7,
                                       options={"resident_embedding": True, "resident_layers": 3}),
    "torch-optimizer-kernel": dict(model="tiny", batch=4, micro_batch=2, seq=16,
                                   optim=OptimConfig(lr=1e-3, max_grad_norm=0.05),
                                   options={"optimizer_kernel": "torch"}),
    # mixtures of experts; GPT-OSS's with the load-balancing loss through every way a layer input is kept
    "moe-accum-clip": dict(model="tiny-moe", batch=4, micro_batch=2, seq=16,
                           optim=OptimConfig(lr=1e-3, max_grad_norm=0.05)),
    "gpt-oss-aux-recompute-offload-resident-accum": dict(model="tiny-gpt-oss", num_layers=4, batch=4, micro_batch=2,
                                                         seq=16, options={"recompute_inputs": 1,
                                                                          "offload_activations": 1,
                                                                          "resident_layers": 1}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_streamed_engine_matches_native(name):
    native = {**CASES[name], "options": native_options(CASES[name].get("options", {}))}
    ref_losses, ref_params, _ = _train("native", **native)
    losses, params, metrics = _train("megatrain", **CASES[name])
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    assert params.keys() == ref_params.keys()
    for n in params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-5, msg=n)
    if "clip" in name:
        assert max(metrics["grad_norms"]) > CASES[name]["optim"].max_grad_norm  # clipping really acted


@pytest.mark.parametrize("name", ["moe-accum-clip", "gpt-oss-aux-recompute-offload-resident-accum"])
def test_the_recompute_replays_the_forwards_routing(name, monkeypatch):
    """The engine's recompute of a mixture-of-experts layer sends each token to the experts its forward did: on the
    GPU the compiled forward and recompute are two graphs that round the router's input otherwise, and 24 of 4096
    tokens of GPT-OSS-20B's layer took other experts in the recompute (results/gpu_checks/recompute-3a9538f-h200.jsonl),
    a gradient of another routing than the loss's. Stood in for here by a router that, left to route with gradients
    on, sends three tokens elsewhere: the engine never asks it (through a regenerated input's second forward and the
    load-balancing loss's counts too), so it trains bit for bit as without it."""
    from megatrain.models.handwritten import moe

    case = dict(CASES[name], steps=3)
    want = _train("megatrain", **case)
    asked = []
    monkeypatch.setattr(moe, "route", rerouting(moe.route, asked))
    got = _train("megatrain", **case)
    assert not asked and got[0] == want[0]
    for n in want[1]:
        assert torch.equal(got[1][n], want[1][n]), n
    native = _train("native", **{**case, "options": native_options(case.get("options", {}))})
    assert asked and native[0] != want[0]  # the stand-in reroutes where a layer routes anew with gradients on


@pytest.mark.parametrize("name", ["accum-clip-tied", "gpt-oss-aux-recompute-offload-resident-accum"])
def test_a_forward_through_the_training_graph_trains_as_the_no_grad_one(name):
    """forward_graph=training (debug): each layer's forward runs with gradients on, as native's checkpointed layer
    does, its autograd graph dropped at once, so that a compiled layer's forward and recompute are one graph
    (GPT-OSS-20B's offset against native comes with the engine's compiled layers, which by default run two: issue
    72). The same arithmetic: on the CPU, bit for bit the default's, through offloaded, regenerated and resident
    layer inputs and the load-balancing loss."""
    case = dict(CASES[name], steps=3)
    options = case.pop("options", {})
    default = _train("megatrain", **case, options=options)
    training = _train("megatrain", **case, options={**options, "forward_graph": "training"})
    assert training[0] == default[0] and all(torch.equal(training[1][n], p) for n, p in default[1].items())


def test_a_forward_through_the_training_graph_routes_anew_in_the_recompute_as_native_does(monkeypatch):
    """Its recompute is not given the forward's experts: the forward's own graph on the same input routes the same.
    The rerouting stand-in, asked with gradients on in the forward and the recompute alike, then trains the engine as
    it does native (where the default, replaying, never asks it)."""
    from megatrain.models.handwritten import moe

    case = dict(model="tiny-gpt-oss", num_layers=4, batch=4, micro_batch=2, seq=16, steps=3)
    options = {"offload_activations": 1, "resident_layers": 1}
    asked = []
    monkeypatch.setattr(moe, "route", rerouting(moe.route, asked))
    ours = _train("megatrain", **case, options={**options, "forward_graph": "training"})
    assert asked
    ref = _train("native", **case, options=native_options(options))
    torch.testing.assert_close(torch.tensor(ours[0]), torch.tensor(ref[0]), rtol=1e-5, atol=0)
    for n, p in ref[1].items():
        torch.testing.assert_close(ours[1][n], p, rtol=1e-5, atol=1e-5, msg=n)


def test_a_compiled_forward_through_the_training_graph_compiles_what_native_compiles():
    """The point of forward_graph=training: the engine's compiled layers then trace and compile the graphs native's
    checkpointed layers do (the same graphs, the same captured calls), where by default they compile twice as many
    (here 12 graphs to native's 6): a no-grad graph for the forward, and the recompute's, given the forward's
    experts."""
    from torch._dynamo.utils import counters

    kw = dict(model="tiny-gpt-oss", num_layers=2, batch=2, seq=16, steps=2, compile=True)
    compiled = []
    for system, options in [("native", {}), ("megatrain", {"forward_graph": "training"})]:
        torch._dynamo.reset()
        counters.clear()
        _train(system, **kw, options=options)
        compiled.append((counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]))
    assert compiled[1] == compiled[0]


def test_a_forward_through_the_training_graph_is_refused_for_transformers_modules():
    with pytest.raises(ValueError, match="forward_graph=training runs a hand-written model's layers"):
        _train("megatrain", model="tiny-hf-gemma3", batch=2, seq=8, steps=1, options={"forward_graph": "training"})


@pytest.mark.parametrize("model", ["tiny", "tiny-tied"])
def test_units_lay_out_exactly_the_modules_parameters(model):
    cfg = model_shape(model)
    with torch.device("meta"):
        module = Transformer(cfg)
    slots = {slot.name: slot.shape for unit in build_units(cfg) for slot in unit.params}
    assert slots == {n: tuple(p.shape) for n, p in module.named_parameters()}


# every family's tiny config: the hand-written families' (from their config.json), the generic ones', and the walk's
# Kimi-Linear, whose 4-element A_log put its experts 8 bytes off 16-byte alignment (torch._grouped_mm refused them)
TILED_MODELS = [f"handwritten:{k}" for k in KINDS] + [f"generic:{k}" for k in GENERIC_KINDS] + ["walk:kimi_linear"]


@pytest.mark.parametrize("name", TILED_MODELS)
def test_every_tensor_starts_16_byte_aligned_in_every_tile_and_the_padding_is_zero(name):
    """Each tile the store holds (bf16 weights and gradients, the fp32 master, each format of moments) starts every
    tensor of every unit 16-byte aligned: what kernels that load 16 bytes at a time need of the streamed views."""
    source, kind = name.split(":")
    config = tiny_config(kind) if source == "walk" else \
        (family_config if source == "handwritten" else generic_config)(kind, **SHAPE)
    cfg = shape_from_config(config.to_dict())
    for moments in ("fp32", "bf16", "int8"):
        store = HostStore(cfg, torch.bfloat16, "mixed", pin=False, moments=moments)
        tiles = [store.weights, store.grads, store.master, store.moments.exp_avg, store.moments.exp_avg_sq]
        off = [(slot.name, tile.dtype) for unit in store.units for slot in unit.params for tile in tiles
               if unit.view(store.tile(tile, unit), slot).data_ptr() % 16]
        assert not off, off
        padding = [store.tile(tile, unit)[a:b] for unit in store.units for a, b in unit.gaps for tile in tiles]
        assert not any(pad.any() for pad in padding)


def _saved_state(path, edit, **case) -> list[float]:
    """The loss of one step of the engine on `case`, its state saved in path with its state.json's fields changed by
    edit(fields)."""
    with built("megatrain", **case) as (trainer, data):
        losses = [trainer.step(*data.batch_at(0))]
        trainer.save_state(path)
    meta = json.loads((path / STATE_FILE).read_text())
    edit(meta)
    (path / STATE_FILE).write_text(json.dumps(meta))
    return losses


def test_a_state_saved_before_the_layout_digest_resumes_where_its_models_layout_is_unchanged(tmp_path):
    case = dict(model="tiny", batch=2, seq=8, steps=3)
    straight = _train("megatrain", **case)[:2]
    # as states were saved before the digest, which laid out the tiny model's tensors back to back as now
    losses = _saved_state(tmp_path, lambda meta: meta.pop("layout"), **case)
    with built("megatrain", **case) as (trainer, data):
        trainer.load_state(tmp_path)
        losses += [trainer.step(*data.batch_at(i)) for i in range(1, 3)]
        resumed = losses, trainer.named_parameters_fp32()
    assert_same_run(resumed, straight)


@pytest.mark.parametrize("edit, why", [
    (lambda meta: meta.update(layout="0123456789abcdef"), r"laid out otherwise \(layout 0123456789abcdef\) than"),
    (lambda meta: meta.pop("layout"), "was saved with each tile's tensors back to back, and this engine starts some")])
def test_a_state_laid_out_otherwise_is_refused_in_one_line(tmp_path, edit, why):
    """GPT-OSS's 4 sinks and router biases are padded now: its tiles lay out otherwise than before the digest."""
    case = dict(model="tiny-gpt-oss", batch=2, seq=8, steps=1)
    _saved_state(tmp_path, edit, **case)
    with built("megatrain", **case) as (trainer, _):
        with pytest.raises(ValueError, match=why) as refusal:
            trainer.load_state(tmp_path)
    assert "\n" not in str(refusal.value)


def test_offloaded_activations_cross_pcie_and_leave_nothing_behind():
    _, _, plain = _train("megatrain", steps=2, model="tiny", num_layers=4, batch=2, seq=8)
    _, _, off = _train("megatrain", steps=2, model="tiny", num_layers=4, batch=2, seq=8,
                       options={"offload_activations": True})
    act_bytes = 4 * 2 * 8 * 64 * 4  # layers 0..3 inputs, [2, 8, 64] fp32 each, out and back
    assert off["d2h_bytes"] - plain["d2h_bytes"] == act_bytes
    assert off["h2d_bytes"] - plain["h2d_bytes"] == act_bytes


def test_only_the_first_k_layer_inputs_cross_pcie():
    _, _, plain = _train("megatrain", steps=2, model="tiny", num_layers=4, batch=2, seq=8)
    _, _, off = _train("megatrain", steps=2, model="tiny", num_layers=4, batch=2, seq=8,
                       options={"offload_activations": 3})
    act_bytes = 3 * 2 * 8 * 64 * 4  # layers 1..3's inputs, [2, 8, 64] fp32 each, out and back
    assert off["d2h_bytes"] - plain["d2h_bytes"] == act_bytes
    assert off["h2d_bytes"] - plain["h2d_bytes"] == act_bytes


def test_recomputed_inputs_cost_weight_loads_and_no_activation_traffic():
    kw = dict(steps=2, model="tiny", num_layers=4, batch=2, seq=8)
    _, _, plain = _train("megatrain", **kw)
    layer_bytes = build_units(CaseConfig(system="megatrain", model="tiny").shape())[1].numel * 4
    # (recomputed, offloaded) -> layer loads beyond two a layer: layers 1..R load again, but the slots' reuse of
    # unit R (refwd R then bwd R, one use apart) saves one, and all of them recomputed lose the head's saving of L
    for r, k, extra in [(1, 2, 0), (2, 0, 1), (3, 0, 3)]:
        _, _, run = _train("megatrain", **kw, options={"recompute_inputs": r, "offload_activations": k})
        act_bytes = k * 2 * 8 * 64 * 4  # the offloaded inputs, [2, 8, 64] fp32 each, out and back
        assert run["h2d_bytes"] - plain["h2d_bytes"] == extra * layer_bytes + act_bytes, (r, k)
        assert run["d2h_bytes"] - plain["d2h_bytes"] == act_bytes, (r, k)
        case = _engine(**kw, options={"recompute_inputs": r, "offload_activations": k})
        assert plan_memory(case).extra_h2d_bytes == extra * layer_bytes


def test_use_order_regenerates_the_recomputed_inputs_right_before_their_backward():
    uses = [(u, phase) for u, phase, _, _ in use_order(4, recomputed=2)]
    assert uses == [(1, "fwd"), (2, "fwd"), (3, "fwd"), (4, "fwd"), (5, "head"), (4, "bwd"), (1, "refwd"),
                    (2, "refwd"), (3, "bwd"), (2, "bwd"), (1, "bwd")]
    assert [load for u, phase, _, load in use_order(4, recomputed=2) if phase == "bwd"] == [False, True, False, True]


def test_auto_recompute_takes_from_the_offloaded_inputs_what_the_host_cannot_hold(monkeypatch):
    from megatrain.engine import plan as plan_mod

    case = _engine(model="qwen2.5-3b", dtype="bfloat16", precision="bf16", batch=1, seq=65536, device="cuda",
                   options={"offload_activations": 10, "recompute_inputs": "auto"})
    activation = 65536 * case.model.hidden_size * 2
    fixed = {"resident_embedding": False, "resident_layers": 0}
    host_at_10 = plan_memory(_options(case, **fixed, offload_activations=10)).host_bytes
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(host_at_10, 2**45, "test"))  # room for all 10
    assert activation_placement(case) == (10, 0)
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(host_at_10 - 3 * activation + 1, 2**45, "test"))
    assert activation_placement(case) == (7, 3)  # 3 short: 3 recomputed instead
    planned = plan_memory(case)
    assert planned.host_activation_bytes == 7 * activation and planned.recomputed_inputs == 3
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**30, 2**45, "test"))  # hopeless: all recomputed
    assert activation_placement(case) == (0, 10)
    with pytest.raises(ValueError, match="recompute_inputs must be 'auto' or an integer from 0 to the model's 36"):
        plan_memory(_options(case, recompute_inputs=36))


def test_the_plan_decides_in_one_pass_and_probes_the_machine_once(monkeypatch):
    """plan_memory is entered once per plan and the machine probed once: the placement's choices (offloaded and
    recomputed inputs, then resident units) weigh the bytes of candidate placements (_bytes), which decides nothing."""
    from megatrain.engine import plan as plan_mod

    case = _engine(model="qwen2.5-3b", dtype="bfloat16", precision="bf16", batch=1, seq=65536, device="cuda",
                   options={"offload_activations": "auto", "recompute_inputs": "auto"})
    calls = {"plan_memory": 0, "budget_here": 0, "_bytes": 0}

    def counting(name, f):
        def counted(*args, **kwargs):
            calls[name] += 1
            return f(*args, **kwargs)
        return counted

    for name in calls:
        monkeypatch.setattr(plan_mod, name, counting(name, getattr(plan_mod, name)))
    monkeypatch.setattr(plan_mod, "budget", lambda device, host_mem_gib: Budget(2**40, 24 * 2**30, "test"))
    plan = check_fits(case)
    assert plan.fits and plan.offloaded_layers > 0, "auto searched for the fewest inputs to offload"
    assert calls["plan_memory"] == 1 and calls["budget_here"] == 1
    assert calls["_bytes"] <= case.model.num_layers + 5  # the offload search, then one byte count per choice


def test_auto_offload_takes_the_fewest_layers_that_fit_and_residency_fills_what_is_left(monkeypatch):
    from megatrain.engine import plan as plan_mod

    case = _engine(model="qwen2.5-3b", dtype="bfloat16", batch=4, seq=16384, device="cuda",
                   options={"offload_activations": "auto"})
    layers = case.model.num_layers
    at = {k: plan_memory(_options(case, offload_activations=k, resident_embedding=False,
                                  resident_layers=0)).gpu_bytes for k in (0, 9, 10)}
    activation = 4 * 16384 * case.model.hidden_size * 2
    assert at[0] - at[10] == 10 * activation  # each offloaded input leaves the GPU
    gpu = int((at[10] + at[9]) / 2 / GPU_FILL)  # room for 10 offloaded, not for 9
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, gpu, "test"))
    planned = plan_memory(case)
    assert planned.offloaded_layers == 10 and planned.host_activation_bytes == 10 * activation
    assert planned.resident_units == [] and planned.gpu_bytes <= gpu * GPU_FILL
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, 2**45, "test"))  # everything fits: none
    assert plan_memory(case).offloaded_layers == 0
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, 2**30, "test"))  # nothing fits: all
    assert plan_memory(case).offloaded_layers == layers
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, None, "test"))  # no GPU: none
    assert plan_memory(case).offloaded_layers == 0
    with pytest.raises(ValueError, match="layer count from 0 to the model's 36 layers"):
        plan_memory(_options(case, offload_activations=37))


def test_resident_embedding_never_crosses_pcie_and_matches_the_streamed_one_in_bf16():
    kw = dict(steps=2, model="tiny", num_layers=3, batch=2, seq=8)
    _, _, streamed = _train("megatrain", **kw)
    _, _, resident = _train("megatrain", options={"resident_embedding": True}, **kw)
    embed_bytes = build_units(model_shape("tiny", num_layers=3))[0].numel * 4  # fp32 weights, fp32 grads
    assert streamed["h2d_bytes"] - resident["h2d_bytes"] == embed_bytes
    assert streamed["d2h_bytes"] - resident["d2h_bytes"] == embed_bytes
    # bf16 mode, one step: the GPU-side torch AdamW and the host one-pass kernel agree to a bf16 ulp
    kw = dict(steps=1, model="tiny-tied", batch=2, seq=16, dtype="bfloat16", precision="bf16",
              optim=OptimConfig(lr=1e-2, weight_decay=5.0))
    _, host_params, _ = _train("megatrain", **kw)
    _, gpu_params, _ = _train("megatrain", options={"resident_embedding": True}, **kw)
    for name, p in host_params.items():
        torch.testing.assert_close(gpu_params[name], p, rtol=2 ** -7, atol=1e-6, msg=name)


def test_resident_layers_take_no_slot_and_never_cross_pcie():
    plan = use_order(4, frozenset({1, 2}))
    assert [use for use in plan if use[0] in (1, 2)] == [(1, "fwd", None, False), (2, "fwd", None, False),
                                                          (2, "bwd", None, False), (1, "bwd", None, False)]
    streamed = [(u, ph, load) for u, ph, slot, load in use_order(4) if u > 2]
    assert [(u, ph, load) for u, ph, slot, load in plan if u > 2] == streamed  # the rest streams as before
    kw = dict(steps=2, model="tiny", num_layers=4, batch=2, seq=8)
    _, _, plain = _train("megatrain", **kw)
    _, _, res = _train("megatrain", options={"resident_layers": 2}, **kw)
    units = build_units(model_shape("tiny", num_layers=4))
    assert plain["h2d_bytes"] - res["h2d_bytes"] == 2 * (units[1].numel + units[2].numel) * 4  # in twice a step
    assert plain["d2h_bytes"] - res["d2h_bytes"] == (units[1].numel + units[2].numel) * 4


def _engine(**case) -> EngineConfig:
    """The engine's config of a megatrain case."""
    return engine_config(CaseConfig(system="megatrain", **case))


def _options(config: EngineConfig, **options) -> EngineConfig:
    """config with these options (the rest at their defaults)."""
    return dataclasses.replace(config, options=MegaTrainOptions(**options))


def _qwen_3b_b8(**options) -> EngineConfig:
    return _engine(model="qwen2.5-3b", dtype="bfloat16", batch=8, seq=1024, device="cuda", options=options)


def test_auto_resident_layers_fill_the_gpu_share_the_plan_leaves(monkeypatch):
    from megatrain.engine import plan as plan_mod

    case = _qwen_3b_b8(resident_embedding=False, resident_layers="auto")
    base = plan_memory(_qwen_3b_b8(resident_embedding=False, resident_layers=0)).gpu_bytes
    per_layer = plan_mod.resident_bytes(case, build_units(case.model)[1])
    gpu = int((base + 5.5 * per_layer) / GPU_FILL)
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, gpu, "test"))
    assert plan_mod.resident_unit_indices(case) == [1, 2, 3, 4, 5]
    planned = plan_memory(case)
    assert planned.resident_units == [1, 2, 3, 4, 5]
    assert planned.gpu_bytes == base + 5 * per_layer
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, None, "test"))  # no GPU: nothing resident
    assert plan_mod.resident_unit_indices(case) == []


def test_by_default_the_plan_makes_resident_what_fits_and_nothing_when_the_batch_needs_the_memory(monkeypatch):
    from megatrain.engine import plan as plan_mod

    streamed = plan_memory(_qwen_3b_b8(resident_embedding=False, resident_layers=0)).gpu_bytes
    embedding = plan_mod.resident_bytes(_qwen_3b_b8(), build_units(model_shape("qwen2.5-3b"))[0])
    per_layer = plan_mod.resident_bytes(_qwen_3b_b8(), build_units(model_shape("qwen2.5-3b"))[1])
    gpu = int((streamed + embedding + 2.5 * per_layer) / GPU_FILL)
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, gpu, "test"))
    assert plan_memory(_qwen_3b_b8()).resident_units == [0, 1, 2]
    # batch 64 needs more than that GPU for its activations alone: nothing is made resident (and the plan says
    # that it does not fit, rather than the resident units making it not fit)
    assert plan_memory(dataclasses.replace(_qwen_3b_b8(), batch=64)).resident_units == []
    monkeypatch.setattr(plan_mod, "budget_here", lambda c: Budget(2**40, 2**45, "test"))  # a huge GPU: everything
    assert plan_memory(_qwen_3b_b8()).resident_units == list(range(37))


def test_the_plan_places_for_the_machine_it_is_given_not_this_one():
    """A projection plans for another machine's memory (megatrain.perf_model.model_check): the limits it passes decide
    the placement, as this machine's would (this CPU machine alone makes nothing resident)."""
    case = _qwen_3b_b8()
    assert plan_memory(case).resident_units == []
    huge = Budget(2**40, 2**45, "given")
    assert plan_memory(case, huge).resident_units == list(range(37))
    assert check_fits(case, huge).resident_units == list(range(37))
    long = _options(dataclasses.replace(case, batch=1, micro_batch=1, seq=131072), offload_activations="auto")
    small = Budget(2**40, 24 * 2**30, "given")
    assert activation_placement(long, small)[0] > 0 == activation_placement(long)[0]


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_resident_embedding_takes_true_false_or_auto(bad):
    with pytest.raises(ValueError, match=r"megatrain: option resident_embedding=.*: expected true or false or 'auto'"):
        CaseConfig(system="megatrain", model="tiny", options={"resident_embedding": bad})


@pytest.mark.parametrize("bad,why", [(-1, "must be 'auto' or an integer >= 0"), (1.5, "expected an integer or 'auto'"),
                                     ("2", "expected an integer or 'auto'"),
                                     (5, "must be 'auto' or an integer from 0 to the model's 4 layers")])
def test_resident_layers_out_of_range_are_refused_before_allocating(bad, why):
    with pytest.raises(ValueError, match=f"resident_layers.*{why}"):
        check_fits(_engine(model="tiny", num_layers=4, options={"resident_layers": bad}))


# 512 tokens a micro-batch x 64 wide: the embedding gradient's scatter-add is past torch's parallel grain (32768
# elements), where index_put_'s accumulate adds with atomics from several threads on the CPU; 256 ids: many repeats
REPEATABLE = dict(model="tiny", batch=4, micro_batch=2, seq=256, steps=4)


@pytest.fixture
def num_threads(request):
    """torch's intra-op thread count for one test (its parameter); the previous count is restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def assert_same_run(a: tuple[list[float], dict], b: tuple[list[float], dict]) -> None:
    """(losses, parameters by name) of two runs are bitwise equal."""
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][n], b[1][n]) for n in a[1]), [n for n in a[1] if not torch.equal(a[1][n], b[1][n])]


@pytest.mark.parametrize("num_threads", [1, 2, 16], indirect=True)
def test_two_runs_are_bitwise_equal_at_any_thread_count(num_threads):
    first, second = (_train("megatrain", **REPEATABLE)[:2] for _ in range(2))
    assert_same_run(first, second)


@pytest.mark.parametrize("num_threads", [1, 2, 16], indirect=True)
def test_resumed_run_is_bitwise_the_uninterrupted_one(tmp_path, num_threads):
    steps, cut = REPEATABLE["steps"], 2
    straight = _train("megatrain", **REPEATABLE)[:2]
    with built("megatrain", **REPEATABLE) as (trainer, data):
        losses = [trainer.step(*data.batch_at(i)) for i in range(cut)]
        trainer.save_state(tmp_path)
    with built("megatrain", **REPEATABLE) as (trainer, data):  # a new engine from the saved state
        trainer.load_state(tmp_path)
        losses += [trainer.step(*data.batch_at(i)) for i in range(cut, steps)]
        resumed = losses, trainer.named_parameters_fp32()
    assert_same_run(resumed, straight)


def test_clipping_changes_the_result():
    loose, _, _ = _train("megatrain", model="tiny", batch=2, seq=16, optim=OptimConfig(lr=1e-3, max_grad_norm=0))
    tight, _, _ = _train("megatrain", model="tiny", batch=2, seq=16, optim=OptimConfig(lr=1e-3, max_grad_norm=0.05))
    assert loose[-1] != pytest.approx(tight[-1], rel=1e-4)


def test_each_layer_crosses_twice_and_bytes_are_counted():
    cfg = model_shape("tiny", num_layers=4)
    plan = use_order(cfg.num_layers)
    loads = [u for u, _, _, load in plan if load]
    for layer in range(1, cfg.num_layers):
        assert loads.count(layer) == 2
    assert loads.count(cfg.num_layers) == 1  # still in its slot when backward reaches it
    assert loads.count(cfg.num_layers + 1) == 1  # head: forward and backward fused
    _, _, metrics = _train("megatrain", steps=2, model="tiny", num_layers=4, batch=2, seq=8)
    units = build_units(cfg)
    expected = sum(units[u].numel for u in loads) + units[0].numel
    assert metrics["h2d_bytes"] == expected * 4
    assert metrics["d2h_bytes"] == sum(u.numel for u in units) * 4


def test_one_weight_slot_loads_every_use_and_trains_as_two_do():
    """weight_slots=1 (the paper's ablation of double buffering): every streamed use loads into the one slot, layer L
    again after the head, each load once the use before it has run; the same arithmetic as two slots, bit for bit
    (on CPU the copies are synchronous: a load issued before the last use ran would overwrite its weights)."""
    cfg = model_shape("tiny", num_layers=4)
    one = use_order(cfg.num_layers, slots=1)
    assert all(slot == 0 and load for _, _, slot, load in one)
    assert [use[:2] for use in one] == [use[:2] for use in use_order(cfg.num_layers)]
    kw = dict(steps=3, model="tiny", num_layers=4, batch=2, seq=8)
    two, single = _train("megatrain", **kw), _train("megatrain", options={"weight_slots": 1}, **kw)
    assert single[0] == two[0]
    assert all(torch.equal(p, two[1][name]) for name, p in single[1].items())
    assert single[2]["h2d_bytes"] - two[2]["h2d_bytes"] == build_units(cfg)[cfg.num_layers].numel * 4  # a step's


def test_each_host_update_shows_once_in_the_next_steps_timeline():
    """The host optimizer's worker thread hands its spans over under a lock (it appends while the training thread
    reads): the previous step's update of every unit is in a step's timeline, once."""
    with built("megatrain", 3, model="tiny", num_layers=2, batch=2, seq=8) as (trainer, data):
        for i in range(3):
            trainer.step(*data.batch_at(i))
        updated = [t["unit"] for t in trainer.schedule.timeline if t["stream"] == "optim"]
        assert sorted(updated) == [u.index for u in trainer.store.units]


def test_bf16_precision_mode_trains_on_cpu():
    losses, _, metrics = _train("megatrain", steps=15, model="tiny", batch=2, seq=16, dtype="bfloat16",
                                precision="bf16", repeat_batch=True, optim=OptimConfig(lr=1e-2, weight_decay=0))
    assert losses[-1] < losses[0] - 0.1
    # bf16 w + g, fp32 m + v (12) and no optimizer scratch; the store also keeps the tied model's norm tiles
    assert metrics["host_store_bytes_per_param"] == pytest.approx(12.0, rel=1e-3)


def test_bf16_mode_one_pass_kernel_matches_the_torch_kernel_after_a_step():
    # One step from the same weights: both kernels see the same gradients, their fp32 arithmetic
    # differs in the last bits (torch divides by sqrt(bias correction), ours multiplies by its inverse),
    # so the stored bf16 weights agree to a bf16 ulp, or to 1e-6 where the update cancels the weight (later
    # steps diverge: Adam's first updates are ~lr x sign(g), and tiny gradients can flip sign).
    kw = dict(steps=1, model="tiny", batch=2, seq=16, dtype="bfloat16", precision="bf16",  # decay big enough
              optim=OptimConfig(lr=1e-2, max_grad_norm=0.5, weight_decay=5.0))  # to see in bf16 (5% a step)
    _, fused_params, _ = _train("megatrain", **kw)
    _, torch_params, _ = _train("megatrain", options={"optimizer_kernel": "torch"}, **kw)
    init = build_system(CaseConfig(system="megatrain", **kw))  # built, not stepped: the initial weights
    try:
        start = init.named_parameters_fp32()
    finally:
        init.close()
    for name, p in fused_params.items():
        torch.testing.assert_close(p, torch_params[name], rtol=2 ** -7, atol=1e-6)
        assert not torch.equal(p, start[name]), f"{name} did not move"


def test_bf16_precision_requires_bf16_dtype():
    with pytest.raises(ValueError, match="needs --dtype bfloat16"):
        _train("megatrain", steps=1, model="tiny", precision="bf16", dtype="float32")


def test_host_bytes_per_param_plan():
    mixed = plan_memory(_engine(model="qwen2.5-7b", dtype="bfloat16", seq=1024, batch=8))
    bf16 = plan_memory(_engine(model="qwen2.5-7b", dtype="bfloat16", precision="bf16", seq=1024, batch=8))
    assert sum(mixed.host_tiles_bytes_per_param.values()) == 16
    assert sum(bf16.host_tiles_bytes_per_param.values()) == 12
    assert mixed.host_bytes_per_param < 16.5 and bf16.host_bytes_per_param < 12.5


def test_refuses_what_does_not_fit_before_allocating_and_suggests_only_what_fits():
    case = CaseConfig(system="megatrain", model="qwen2.5-7b", dtype="bfloat16", seq=1024, device="cuda",
                      options={"host_mem_gib": 110})  # 16 B/param ~ 117 GiB does not fit, 12 B/param ~ 88 GiB does
    assert not check_fits(engine_config(case)).fits
    with pytest.raises(ValueError, match=r"host memory: needs .* GiB .* use --precision bf16"):
        build_system(case)
    huge = dataclasses.replace(case, model="qwen2.5-72b", options={"host_mem_gib": 64})
    assert "no precision fits" in check_fits(engine_config(huge)).advice


def test_one_pass_kernel_equals_torch_adamw_and_rounds_to_bf16():
    from megatrain.optim import fused

    if not fused.available():
        pytest.skip("no C++ compiler for the one-pass kernel")
    torch.manual_seed(0)
    ref = torch.randn(1000, requires_grad=True)
    p, m, v = ref.detach().clone(), torch.zeros(1000), torch.zeros(1000)
    w = torch.empty(1000, dtype=torch.bfloat16)
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    for step in range(1, 6):
        g = torch.randn(1000).bfloat16()
        ref.grad = g.float() * 0.5
        opt.step()
        fused.fused_adamw(p, g, m, v, w, step, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-6)
    assert torch.equal(w, p.bfloat16())


def test_one_pass_kernel_on_bf16_weights_equals_fp32_scratch_and_round():
    from megatrain.optim import fused

    if not fused.available():
        pytest.skip("no C++ compiler for the one-pass kernel")
    torch.manual_seed(0)
    w = torch.randn(1000).bfloat16()
    w_ref, m, v, m_ref, v_ref = w.clone(), torch.zeros(1000), torch.zeros(1000), torch.zeros(1000), torch.zeros(1000)
    for step in range(1, 6):
        g = torch.randn(1000).bfloat16()
        fused.fused_adamw(w, g, m, v, None, step, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)  # bf16 in place
        p32 = w_ref.float()  # the two-pass way: fp32 scratch, update, round back
        fused.fused_adamw(p32, g, m_ref, v_ref, w_ref, step, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)
    assert torch.equal(w, w_ref) and torch.equal(m, m_ref) and torch.equal(v, v_ref)
    with pytest.raises(RuntimeError, match="pass no weight_out"):
        fused.fused_adamw(w, g, m, v, w.clone(), 6, 0.5, 1e-2, 0.9, 0.95, 1e-8, 0.1)


def test_flat_adamw_equals_torch_adamw():
    torch.manual_seed(0)
    optim = OptimConfig(lr=1e-2, weight_decay=0.1)
    shapes = [(7, 5), (5,), (3, 3)]
    ref = [torch.randn(s, requires_grad=True) for s in shapes]
    flat = torch.cat([p.detach().flatten() for p in ref])
    m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    torch_opt = torch.optim.AdamW(ref, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                                  weight_decay=optim.weight_decay)
    ours = FlatAdamW(optim)
    for _ in range(5):
        grads = [torch.randn(s) for s in shapes]
        for p, g in zip(ref, grads, strict=True):
            p.grad = g.clone()
        torch_opt.step()
        ours.update("k", flat, torch.cat([g.flatten() for g in grads]), m, v, optim.weight_decay)
    torch.testing.assert_close(flat, torch.cat([p.detach().flatten() for p in ref]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("system,options", [("megatrain", {}), ("megatrain", {"resident_embedding": True,
                                                                               "resident_layers": 1}),
                                            ("native", {})], ids=["megatrain", "megatrain-resident", "native"])
def test_non_finite_gradient_norm_skips_the_update(system, options):
    said = pytest.warns(UserWarning, match=r"^step 2: gradient norm is nan; update skipped \(1 skipped so far\)$")
    with said if system == "megatrain" else contextlib.nullcontext():  # the engine says so as it skips
        run = train_with_nan_gradient(system, nan_step=2, steps=4, model="tiny", batch=2, seq=16, options=options)
    assert_nan_step_skipped(run)


def _failing_compiled_layer(exc: BaseException):
    template = LayerTemplate(model_shape("tiny"), compile_layer=False)
    template.compiled = True

    def fail(*args):
        raise exc

    template._compiled_fn = fail
    return template


def _layer_inputs():
    cfg = model_shape("tiny")
    unit = build_units(cfg)[1]
    params = bind(unit, torch.randn(unit.numel) * 0.02, requires_grad=False)
    cos, sin = rotary_tables(cfg, 8, torch.device("cpu"), torch.float32)
    return params, torch.randn(1, 8, cfg.hidden_size), cos, sin


def test_compile_failure_falls_back_to_eager_with_a_warning():
    template = _failing_compiled_layer(BackendCompilerFailed(lambda *a: None, RuntimeError("no compiler"), None))
    with pytest.warns(UserWarning, match="torch.compile of the layer failed"):
        out = template(*_layer_inputs())
    assert out.shape == (1, 8, 64) and not template.compiled


@pytest.mark.parametrize("exc", [torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("shape mismatch"),
                                 "compile-wrapped-oom"], ids=["oom", "layer-bug", "oom-inside-compile"])
def test_errors_that_are_not_the_compilers_are_raised(exc):
    if exc == "compile-wrapped-oom":
        exc = BackendCompilerFailed(lambda *a: None, torch.OutOfMemoryError("CUDA out of memory"), None)
    template = _failing_compiled_layer(exc)
    with pytest.raises(type(exc)):
        template(*_layer_inputs())
    assert template.compiled


DELAYED = {
    "clip-accum": dict(model="tiny", num_layers=3, batch=4, micro_batch=2, seq=16, steps=6,
                       optim=OptimConfig(lr=1e-3, max_grad_norm=0.05)),
    "tied-torch-kernel": dict(model="tiny-tied", batch=2, seq=7, steps=5, optim=OptimConfig(lr=1e-3),
                              options={"optimizer_kernel": "torch"}),
    "warmup-2": dict(model="tiny", num_layers=3, batch=4, micro_batch=2, seq=16, steps=6,
                     optim=OptimConfig(lr=1e-3, max_grad_norm=0.05), options={"update_delay_warmup": 2}),
}


@pytest.mark.parametrize("name", sorted(DELAYED))
def test_delayed_update_matches_adamw_applying_the_previous_steps_gradient(name):
    kw = dict(DELAYED[name])
    steps = kw.pop("steps")
    options = kw.pop("options", {})
    warmup = options.get("update_delay_warmup", 0)
    ref_losses, ref_params = train_delayed_native(steps, warmup, **kw)
    losses, params, metrics = _train("megatrain", steps=steps, **kw, options={**options, "update_delay": 1})
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)
    for n in params:
        torch.testing.assert_close(params[n], ref_params[n], rtol=1e-5, atol=1e-5, msg=n)
    exact_options = {k: v for k, v in options.items() if k != "update_delay_warmup"}
    exact, _, _ = _train("megatrain", steps=steps, **kw, options=exact_options)
    # the warm-up's updates are exact: until the first delayed one lands, step by step the same run
    assert losses[:warmup + 1] == exact[:warmup + 1] and losses[warmup + 1] != exact[warmup + 1]
    assert metrics["host_store_bytes_per_param"] == pytest.approx(16 + 8, rel=1e-3)  # fp32: + weights and grads


@pytest.mark.parametrize("precision,dtype,warmup", [("mixed", "bfloat16", 0), ("bf16", "bfloat16", 0),
                                                   ("mixed", "float32", 0), ("mixed", "bfloat16", 4)])
def test_delayed_run_resumes_bitwise_and_evaluates_the_latest_weights(tmp_path, precision, dtype, warmup):
    """Saved after 3 steps and resumed; with a warm-up of 4 the save is in the warm-up and the resumed run delays
    its last update."""
    case = dict(model="tiny", num_layers=2, batch=2, seq=16, steps=5, precision=precision, dtype=dtype,
                optim=OptimConfig(lr=1e-3, max_grad_norm=0.05),
                options={"update_delay": 1, "update_delay_warmup": warmup})
    straight = _train("megatrain", **case)[:2]
    with built("megatrain", **case) as (trainer, data):
        losses = [trainer.step(*data.batch_at(i)) for i in range(3)]
        held_out = trainer.evaluate(*data.batch_at(4))
        trainer.save_state(tmp_path)
        saved = trainer.named_parameters_fp32()
    with built("megatrain", **case) as (trainer, data):
        trainer.load_state(tmp_path)
        assert trainer.evaluate(*data.batch_at(4)) == held_out
        assert all(torch.equal(v, saved[n]) for n, v in trainer.named_parameters_fp32().items())
        losses += [trainer.step(*data.batch_at(i)) for i in range(3, 5)]
        resumed = losses, trainer.named_parameters_fp32()
    assert_same_run(resumed, straight)


def test_delayed_update_with_a_non_finite_step_skips_it_and_trains_on():
    with pytest.warns(UserWarning, match=r"^step 2: gradient norm is nan; update skipped"):
        run = train_with_nan_gradient("megatrain", 2, 5, model="tiny", batch=2, seq=16, options={"update_delay": 1})
    assert run["skipped_steps"] == 1
    assert all(torch.isfinite(torch.tensor(run["losses"])))
    assert all(torch.isfinite(p).all() for p in run["end"][0].values())


@pytest.mark.parametrize("options,why", [({"update_delay": 2}, r"must be 0 \(exact AdamW\) or 1"),
                                         ({"update_delay_warmup": 3}, "with update_delay=1"),
                                         ({"update_delay": 1, "update_delay_warmup": -1}, "step count >= 0"),
                                         ({"update_delay": 1, "resident_layers": 1}, "streams every unit"),
                                         ({"update_delay": 1, "resident_embedding": True}, "streams every unit")])
def test_update_delay_refuses_what_it_cannot_do(options, why):
    with pytest.raises(ValueError, match=why):
        MegaTrainOptions(**options)


def test_delayed_update_plans_its_second_copies_and_no_resident_unit():
    config = EngineConfig(model=model_shape("tiny"), batch=2, micro_batch=2, seq=16, dtype="bfloat16",
                          precision="mixed", options=MegaTrainOptions(update_delay=1))
    plan = plan_memory(config)
    assert plan.host_tiles_bytes_per_param == {"weights": 2, "grads": 2, "exp_avg": 4, "exp_avg_sq": 4, "master": 4,
                                               "weights_next": 2, "grads_pending": 2}
    assert plan.resident_units == []


@pytest.mark.parametrize("precision", ["mixed", "bf16"])
def test_delayed_step_two_trains_on_the_first_update_in_bf16_precisions(precision):
    """The master-and-copy (mixed) and copy-then-update (bf16) paths of update_delay=1: step 2 streams the weights
    step 0's gradient made, so its loss is bitwise the exact run's second loss when that run sees step 2's batch."""
    case = dict(model="tiny", num_layers=2, batch=2, seq=16, precision=precision, dtype="bfloat16",
                optim=OptimConfig(lr=1e-2, max_grad_norm=0.05))
    with built("megatrain", 3, **case, options={"update_delay": 1}) as (trainer, data):
        delayed = [trainer.step(*data.batch_at(i)) for i in range(3)]
    with built("megatrain", 2, **case) as (trainer, data):
        exact = [trainer.step(*data.batch_at(i)) for i in (0, 2)]
    assert delayed[0] == exact[0] and delayed[2] == exact[1] and delayed[1] != exact[1]


def test_update_delay_is_refused_across_ranks():
    with pytest.raises(ValueError, match="runs in one process"):
        EngineConfig(model=model_shape("tiny"), batch=2, micro_batch=2, seq=16, ranks=2,
                     options=MegaTrainOptions(update_delay=1))


@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_a_compiled_layer_leaves_flex_attention_to_its_own_graph():
    """The GPU's document mask (a BlockMask, built here on the CPU) through a compiled layer, the engine's template and
    native's in-place compile alike: FlexAttention stays out of the layer's graphs (torch 2.11's Inductor lowered it
    inside the engine's no-grad layer graph with stale q/k strides: 4e-5 from native on packed rows on an H200), and
    the layer computes what the eager one does with the dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    from megatrain.models.masks import _allowed, document_positions

    cfg = model_shape("tiny")
    seq, gen = 16, torch.Generator().manual_seed(0)
    segments_BS = torch.tensor([[0] * seq, [0] * 6 + [1] * 10])
    positions = document_positions(segments_BS)
    cos, sin = (t[positions][:, None] for t in rotary_tables(cfg, seq, torch.device("cpu"), torch.float32))
    block = create_block_mask(lambda b, h, q, kv: _allowed(q, kv, 0, segments_BS, b), 2, None, seq, seq, device="cpu")
    index, rows = torch.arange(seq), torch.arange(2)[:, None, None]
    dense = _allowed(index[None, :, None], index[None, None, :], 0, segments_BS, rows)[:, None]
    layer = Transformer(cfg).layers[0]
    x = torch.randn(2, seq, cfg.hidden_size, generator=gen)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    template = LayerTemplate(cfg, compile_layer=False)
    engine = torch.compile(template._layer, dynamic=False, backend=record)
    native = torch.compile(layer, dynamic=False, backend=record)
    with torch.no_grad():  # FlexAttention's CPU kernel has no backward
        eager = layer(x, cos, sin, dense)
        outs = [engine(dict(layer.named_parameters()), x, cos, sin, block), native(x, cos, sin, block)]
    flex = [n for g in graphs for n in g.graph.nodes if "flex_attention" in str(n.target)]
    assert graphs and not flex, f"FlexAttention lowered inside a compiled layer: {flex}"
    for out in outs:
        torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
