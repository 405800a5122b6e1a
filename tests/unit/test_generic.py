"""The generic path (transformers' own modules, megatrain.models.generic) on every system against transformers +
torch.optim.AdamW + clip_grad_norm_: the families only it trains, exports, bitwise resume, FLOP accounting and
refusals (packed documents: test_train.py, over both kinds). CPU; megatrain and native in seconds a case, DeepSpeed
and FSDP2 each in a fresh process (marked subprocess): pytest tests/unit/test_generic.py -m "not subprocess"; all:
pytest tests/unit/test_generic.py"""

import json
import math

import pytest
import torch

transformers = pytest.importorskip("transformers")

from families import EXPERTS, GENERIC_KINDS, RANDOM_KINDS, TOP_K, generic_config  # noqa: E402
from train_helpers import (  # noqa: E402
    BATCH,
    CLIP,
    SHAPE,
    STEPS,
    VOCAB,
    assert_as_near_as_transformers,
    float64_twin,
    generic_model,
    hf_model,
    metrics,
    needs_deepspeed,
    pretokenized,
    reference_training,
    run_train,
    train_any,
)

from megatrain.cli import main  # noqa: E402
from megatrain.models.generic import GenericConfig  # noqa: E402
from megatrain.models.loss import IGNORE_INDEX  # noqa: E402
from megatrain.models.weights import named_weights  # noqa: E402

# DeepSpeed and FSDP2 train transformers' module through one wrapper (GenericCausalLM) whatever the family, which
# megatrain and native check with every family: they check it with one of each structure (dense with sliding layers
# and a tied head; MLA over experts with a router's buffer; linear and full attention over experts; state crossing
# layers, checkpointed per layer: gemma4; keys equal to values on full layers of their own width, over experts beside
# the MLP: gemma4_26b_a4b)
OFFLOAD_GENERIC_KINDS = ("gemma3", "deepseek_v3", "qwen3_next", "gemma4", "gemma4_26b_a4b")
# where transformers' own eager and sdpa attention part by more than its float32 rounding (Gemma 4's large
# checkpoints' switches: by 2e-5 at step 6 dense, 4e-5 at step 5 over experts), the reference runs sdpa, the
# attention every system here runs
SDPA_REFERENCE = ("gemma4_31b", "gemma4_26b_a4b")


def _cases():
    for system in ("megatrain", "native", "deepspeed", "fsdp"):
        for kind in GENERIC_KINDS if system in ("megatrain", "native") else OFFLOAD_GENERIC_KINDS:
            marks = [pytest.mark.subprocess] if system in ("deepspeed", "fsdp") else []
            marks += needs_deepspeed if system == "deepspeed" else []
            yield pytest.param(system, kind, marks=marks, id=f"{system}-{kind}")


@pytest.mark.parametrize("system,kind", _cases())
def test_train_matches_transformers_and_the_export_reloads_with_its_logits(tmp_path, system, kind):
    """Losses and the export's logits as near transformers' (float64 the judge: train_helpers.AS_NEAR; Gemma's
    rounding grows a hundredfold over the 10 steps, and its logits move by 1e-3 on another CPU's rounding)."""
    init = generic_model(kind, tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl")
    attn = "sdpa" if kind in SDPA_REFERENCE else "eager"
    assert train_any(system, init, data, tmp_path / "run") == 0
    ref_losses, ref_model = reference_training(init, data, attn=attn)
    judge_losses, judge = reference_training(init, data, attn=attn, float64=True)
    ours = [m for m in metrics(tmp_path / "run") if "loss" in m]
    assert [m["step"] for m in ours] == list(range(1, STEPS + 1))
    assert_as_near_as_transformers({"losses": [m["loss"] for m in ours]}, {"losses": ref_losses},
                                   {"losses": judge_losses})
    assert max(m["grad_norm"] for m in ours) > CLIP  # clipping acted
    source, export = (json.loads((d / "config.json").read_text()) for d in (init, tmp_path / "run" / "hf"))
    assert export == source, "the source's config.json whole, not transformers' rendering (use_cache turned false)"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "hf",
                                                                 attn_implementation="eager").eval()
    assert type(exported) is type(ref_model)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = [{"logits": model.eval()(tokens).logits} for model in (exported, ref_model, judge)]
    assert_as_near_as_transformers(*logits)


def _random_cases():
    for system in ("megatrain", "native", "deepspeed", "fsdp"):
        for kind in RANDOM_KINDS if system in ("megatrain", "native") else ("seed_oss",):
            marks = [pytest.mark.subprocess] if system in ("deepspeed", "fsdp") else []
            marks += needs_deepspeed if system == "deepspeed" else []
            yield pytest.param(system, kind, marks=marks, id=f"{system}-{kind}")


@pytest.mark.parametrize("system,kind", _random_cases())
def test_dropout_and_jitter_train_as_transformers_in_train_mode(tmp_path, system, kind):
    """A config's dropout (attention, residual, embedding) and router jitter train as transformers' own modules train
    them in train mode, drawing each layer's masks from the seed the reference draws them from; without them (what
    every system trained before: eval mode) the curve is another."""
    init = generic_model(kind, tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl")
    assert train_any(system, init, data, tmp_path / "run") == 0
    ref_losses, _ = reference_training(init, data, attn="sdpa")
    ours = torch.tensor([m["loss"] for m in metrics(tmp_path / "run") if "loss" in m])
    torch.testing.assert_close(ours, torch.tensor(ref_losses), rtol=1e-5, atol=0)
    if system == "megatrain":
        eval_mode = transformers.AutoModelForCausalLM.from_pretrained(init).float().eval()
        tokens = torch.tensor([json.loads(line)["input_ids"] for line in
                               (tmp_path / "data.jsonl").read_text().splitlines()[:BATCH]])  # step 1's rows
        with torch.no_grad():
            logits = eval_mode(tokens[:, :-1]).logits
        undrawn = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        # step 1's loss drew masks: eval mode misses it by more than the tolerance train mode meets
        assert abs(float(undrawn) - float(ours[0])) > 1e-5 * float(ours[0])


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
def test_init_from_reads_and_translates_its_config_once(tmp_path, monkeypatch, kind):
    """The checkpoint's config.json is read and translated once, where train checks its flags: the check's model is
    the one built, loaded and exported (the hand-written llama, and gemma3 through transformers' own modules)."""
    import megatrain.models.checkpoint as checkpoint

    reads = []
    read = checkpoint.read_config
    monkeypatch.setattr(checkpoint, "read_config", lambda path: reads.append(path) or read(path))
    init = hf_model(kind, tmp_path / "init") if kind == "llama" else generic_model(kind, tmp_path / "init")
    assert run_train(init, pretokenized(tmp_path / "data.jsonl"), tmp_path / "run", steps=1) == 0
    assert reads == [init]


def test_a_hand_written_family_through_the_generic_path_matches_transformers(tmp_path):
    """--generic: a Llama checkpoint through transformers' own modules, not our Transformer."""
    from train_helpers import hf_model

    init = hf_model("llama", tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl")
    assert train_any("megatrain", init, data, tmp_path / "run", extra=["--generic"]) == 0
    ref_losses, _ = reference_training(init, data)
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics(tmp_path / "run")]), torch.tensor(ref_losses),
                               rtol=1e-5, atol=0)
    assert json.loads((tmp_path / "run" / "hf" / "config.json").read_text())["model_type"] == "llama"


@pytest.mark.parametrize("system,kind", [(s, k) for s in ("megatrain", "native") for k in ("deepseek_v3", "seed_oss")])
def test_a_checkpoint_resumes_bit_for_bit(tmp_path, system, kind):
    """DeepSeek-V3's router biases are buffers a checkpoint holds: a resume that lost them would route otherwise.
    Seed-OSS's dropout: a resumed run draws the masks of the uninterrupted one (its steps' seeds)."""
    init = generic_model(kind, tmp_path / "init")
    data = pretokenized(tmp_path / "data.jsonl", rows=10)
    extra = ["--save-every", "2"]
    assert train_any(system, init, data, tmp_path / "straight", extra=extra) == 0
    assert train_any(system, init, data, tmp_path / "cut", extra=extra, interrupt=5) == 130
    assert train_any(system, init, data, tmp_path / "cut", resume=True) == 0
    assert [m["loss"] for m in metrics(tmp_path / "cut")] == [m["loss"] for m in metrics(tmp_path / "straight")]
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "hf")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "cut" / "hf")
    assert all(torch.equal(p, q) for p, q in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_what_cannot_stream_exits_2_naming_why(tmp_path, capsys):
    data = pretokenized(tmp_path / "data.jsonl")
    varied = pretokenized(tmp_path / "docs.jsonl", rows=30, varied=True)
    hybrid = generic_model("qwen3_next", tmp_path / "qwen3_next")
    assert train_any("megatrain", hybrid, varied, tmp_path / "packed") == 2
    assert "linear_attention layers would carry state" in capsys.readouterr().err
    assert train_any("megatrain", hybrid, varied, tmp_path / "apart", steps=1, extra=["--no-pack"]) == 0
    aux = generic_model("mixtral", tmp_path / "mixtral", output_router_logits=True)
    assert train_any("megatrain", aux, data, tmp_path / "aux") == 2
    assert "output_router_logits" in capsys.readouterr().err
    per_layer = tmp_path / "gemma3n"
    config = transformers.Gemma3nTextConfig(**{**SHAPE, "num_hidden_layers": 4}, head_dim=16,
                                            hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
                                            layer_types=["sliding_attention", "full_attention"] * 2,
                                            num_kv_shared_layers=2)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(per_layer)
    assert main(["train", "--init-from", str(per_layer), "--data", str(data), "--steps", "1",
                 "--out", str(tmp_path / "n")]) == 2
    # its per-layer inputs and shared KV would cross (Gemma 4's do); its rotary tables passed by position do not
    assert "1 positional inputs besides the hidden states" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v3", "qwen3_next", "gemma4_26b_a4b"])
def test_active_parameters_count_routed_experts_at_k_of_e_and_shared_experts_whole(kind):
    config = generic_config(kind, **SHAPE)
    cfg = GenericConfig.from_hf(config.to_dict())
    model = transformers.AutoModelForCausalLM.from_config(config)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n and "shared" not in n)
    shared = sum(p.numel() for n, p in model.named_parameters() if "shared_expert" in n)
    assert shared > 0 or kind in ("mixtral", "gemma4_26b_a4b")  # Gemma 4's MLP beside the experts is a dense one
    assert cfg.num_params() == sum(p.numel() for p in model.parameters())
    assert (cfg.num_experts, cfg.num_experts_per_tok) == (EXPERTS, TOP_K)
    assert cfg.active_params() == cfg.num_params() - routed * (EXPERTS - TOP_K) // EXPERTS
    flat = sum(math.prod(p.shape) for n, p in model.named_parameters() if ".layers." in n and p.ndim >= 2)
    assert cfg.layer_matmul_params() * cfg.num_layers == pytest.approx(flat - routed * (EXPERTS - TOP_K) / EXPERTS)


@pytest.mark.parametrize("name,total_b,active_b", [("gemma-4-31b", 30.7, 30.7), ("gemma-4-26b-a4b", 25.2, 3.8)])
def test_gemma4_large_counts_match_the_model_card(name, total_b, active_b):
    """The model card's parameters: 31B 30.7B; 26B-A4B 25.2B, 3.8B of them active (8 of 128 experts, top_k_experts)."""
    from megatrain.models import model_shape

    cfg = model_shape(name)
    assert (round(cfg.num_params() / 1e9, 1), round(cfg.active_params() / 1e9, 1)) == (total_b, active_b)


def test_attention_flops_count_each_layers_head_width():
    """Gemma 4's full layers attend with heads of their own width (global_head_dim: 32 beside 16 here)."""
    from megatrain.models.flops import attention_flops_per_seq

    cfg = GenericConfig.from_hf(generic_config("gemma4_31b", **SHAPE).to_dict())
    widths = [16, 32, 16, 32]
    assert [cfg.layer_head_dim(n) for n in range(4)] == widths
    assert attention_flops_per_seq(cfg, 64) == sum(2 * 2.0 * cfg.attended_pairs(n, 64) * cfg.num_heads * w
                                                   for n, w in enumerate(widths))


@pytest.mark.parametrize("name,num_layers", [("gemma-4-31b", 4), ("gemma-4-26b-a4b", 3)])
def test_a_cut_of_gemma4_counts_the_layer_types_its_model_runs(name, num_layers):
    """Gemma 4's config class makes the last layer full whatever config.json lists: the cut to 4 (31B) or 3 (26B-A4B)
    layers of 5 sliding to 1 full runs one full layer, which the FLOP accounting (attended pairs) counts."""
    from megatrain.models import model_shape
    from megatrain.models.generic.skeleton import Skeleton

    cfg = model_shape(name, num_layers)
    built = tuple("sliding_attention" if layer.self_attn.is_sliding else "full_attention"
                  for layer in Skeleton(cfg).layers)
    assert cfg.layer_types == built and built[-1] == "full_attention"
    assert cfg.attended_pairs(len(built) - 1, 4096) > cfg.attended_pairs(0, 4096)  # the full layer past the window


# Gemma 4's state crossing layers through the engine's plans: every layer streamed or the first two resident, saved
# inputs offloaded or regenerated by a third forward, one micro-batch or two (the readers' and the preamble's
# gradients accumulated per micro-batch); and its large checkpoints' layers, which share no state, through the same
CROSSING_PLANS = {
    "streamed": dict(resident_layers=0, resident_embedding=False),
    "resident": dict(resident_layers=2, resident_embedding=True),
    "offloaded": dict(resident_layers=0, offload_activations=True),
    "recomputed": dict(resident_layers=0, offload_activations=True, recompute_inputs=2),
}


@pytest.mark.parametrize("micro_batch", [1, 2])
@pytest.mark.parametrize("plan", CROSSING_PLANS)
@pytest.mark.parametrize("kind", ["gemma4", "gemma4_moe", "gemma4_unified", "gemma4_31b", "gemma4_26b_a4b"])
def test_state_crossing_layers_has_transformers_gradient_for_every_weight(kind, plan, micro_batch):
    """One engine step's loss and gradients (the host's, and a resident unit's on its device) against
    transformers', weight by weight: a gradient that missed a crossing (the per-layer table's, a KV publisher's from
    its readers) would differ there."""
    from megatrain.engine.config import EngineConfig, MegaTrainOptions
    from megatrain.engine.trainer import StreamingSystem
    from megatrain.optim.config import OptimConfig

    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(generic_config(kind, **SHAPE)).float().eval()
    cfg = GenericConfig.from_hf(reference.config.to_dict())
    gen = torch.Generator().manual_seed(1)
    x, y = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
    engine = StreamingSystem(EngineConfig(model=cfg, batch=2, micro_batch=micro_batch, seq=16,
                                          optim=OptimConfig(max_grad_norm=0),  # gradients left as computed
                                          options=MegaTrainOptions(**CROSSING_PLANS[plan])))
    try:
        engine.load_weights((n, p.detach()) for n, p in named_weights(reference).items())  # a tied head once
        loss = engine.step(x, y)
        store, resident = engine.store, engine.schedule.resident
        grads = {slot.name: unit.view(resident[unit.index].grad if unit.index in resident else
                                      store.tile(store.grads, unit), slot).clone()
                 for unit in store.units for slot in unit.params}
    finally:
        engine.close()
    judge = float64_twin(reference)
    losses = []
    for model in (reference, judge):
        losses.append(torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten()))
        losses[-1].backward()
    # float64 the judge (train_helpers.AS_NEAR): Gemma 4 gets its float32 gradients 1e-5 of their largest value from
    # it, the experts' 4e-5 where ours are computed per micro-batch, and another CPU's vector width moves them alike
    assert_as_near_as_transformers({"loss": loss}, *({"loss": value.item()} for value in losses))
    assert_as_near_as_transformers(grads, *({n: p.grad for n, p in model.named_parameters()}
                                            for model in (reference, judge)))


@pytest.mark.parametrize("kind", ["gemma4", "gemma4_moe"])
def test_state_crossing_layers_keeps_the_model_causal(kind):
    """Tokens after position t change no loss at or before t: what a layer publishes (keys and values) and the
    preamble's per-layer inputs carry no later position into an earlier one, in a step with two micro-batches."""
    from megatrain.engine.config import EngineConfig
    from megatrain.engine.trainer import StreamingSystem

    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(generic_config(kind, **SHAPE)).float()
    cfg = GenericConfig.from_hf(reference.config.to_dict())
    gen = torch.Generator().manual_seed(2)
    x, y = (torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(2))
    t = 9
    y[:, t + 1:] = IGNORE_INDEX
    later = x.clone()
    later[:, t + 1:] = torch.randint(0, VOCAB, (2, 16 - t - 1), generator=gen)
    losses = []
    for tokens in (x, later, x.roll(1, dims=1)):
        engine = StreamingSystem(EngineConfig(model=cfg, batch=2, micro_batch=1, seq=16))
        try:
            engine.load_weights((n, p.detach()) for n, p in reference.state_dict().items())
            losses.append(engine.step(tokens, y))
        finally:
            engine.close()
    # the same to float32's rounding (the experts' tokens grouped otherwise round otherwise: one ulp of the loss on
    # MKL's SSE2 path, nox -s tolerance), where an earlier token changes it far beyond
    assert abs(losses[0] - losses[1]) <= 4 * torch.finfo(torch.float32).eps * losses[0] < abs(losses[0] - losses[2])


@pytest.mark.parametrize("kind", ["gemma4", "gemma4_26b_a4b"])
def test_gemma4_runs_through_bench_and_the_python_api(tmp_path, capfd, kind):
    """bench --model CHECKPOINT and megatrain.Engine reach the same program: the Engine's losses are train's (the
    E-sizes' state crossing layers; the large checkpoints' k=v full layers and experts beside the MLP)."""
    from train_helpers import BATCH, BETAS, EPS, LR, SEQ, WD

    import megatrain

    init = generic_model(kind, tmp_path / "init")
    assert main(["bench", "--system", "megatrain", "--model", str(init), "--batch", "2", "--seq", "16", "--steps",
                 "2", "--json"]) == 0
    record = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
    assert record["status"] == "ok" and all(math.isfinite(x) for x in record["losses"])
    data = pretokenized(tmp_path / "data.jsonl", rows=8)
    constant = ["--lr-schedule", "constant", "--warmup-steps", "0"]
    assert train_any("megatrain", init, data, tmp_path / "cli", steps=2, extra=constant) == 0
    rows = [json.loads(line)["input_ids"] for line in data.read_text().splitlines()]
    with megatrain.Engine(init, seq=SEQ + 1, batch=BATCH, micro_batch=2, lr=LR, weight_decay=WD, max_grad_norm=CLIP,
                          adam_betas=BETAS, adam_eps=EPS, dtype="float32", device="cpu") as engine:
        losses = [engine.step(torch.tensor(rows[i:i + BATCH])) for i in (0, BATCH)]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor([m["loss"] for m in metrics(tmp_path / "cli")]),
                               rtol=1e-5, atol=0)


def test_the_memory_plan_holds_the_state_crossing_layers_and_refuses_a_gpu_that_cannot(monkeypatch):
    """Gemma 4's per-layer inputs (4 layers x 8) and the keys and values its two publishers keep (2 x 2 x 2 heads x
    16) for every token of the step are on the GPU beside the rest: a GPU that holds all but them is refused."""
    from megatrain.engine.config import EngineConfig, MegaTrainOptions
    from megatrain.engine.plan import check_fits, plan_memory
    from megatrain.memory import Budget

    cfg = GenericConfig.from_hf(generic_config("gemma4", **SHAPE).to_dict())
    assert cfg.crossing_numel_per_token == 4 * 8 + 2 * 2 * 2 * 16
    config = EngineConfig(model=cfg, batch=8, micro_batch=2, seq=1024, device="cuda",
                          options=MegaTrainOptions(resident_layers=0, resident_embedding=False))
    large = Budget(host_bytes=2**40, gpu_bytes=2**40, host_source="test")
    crossing = 8 * 1024 * cfg.crossing_numel_per_token * 4
    planned = plan_memory(config, large).gpu_bytes
    short = Budget(host_bytes=2**40, gpu_bytes=planned - crossing // 2, host_source="test")
    assert not check_fits(config, short).fits
    monkeypatch.setattr(GenericConfig, "crossing_numel_per_token", property(lambda self: 0))
    assert planned - plan_memory(config, large).gpu_bytes == crossing
    assert check_fits(config, short).fits


def test_a_compiled_program_built_again_of_one_config_runs_the_first_ones_templates():
    """Each build of a compiled generic program traced and compiled transformers' modules again (the GPU suite's
    tiny generic models: ~2 000 s of its 4 018 timed at d0c54b8). A program of the same config, shapes, dtype and
    device takes the first one's compiled templates; eager, or another sequence, its own. Train and eval mode reach a
    shared template's module from the program that runs it."""
    from megatrain.engine.config import EngineConfig
    from megatrain.engine.programs.generic import GenericProgram
    from megatrain.models import model_shape

    cfg, cpu = model_shape("tiny-hf-gemma3"), torch.device("cpu")

    def program(compiled=True, seq=32):
        return GenericProgram(EngineConfig(model=cfg, batch=2, micro_batch=2, seq=seq, device="cpu",
                                           compile=compiled), cpu)

    first, again = program(), program()
    assert first.templates.keys() == again.templates.keys() and len(first.templates) >= 2  # sliding and full
    assert all(again.templates[s] is t for s, t in first.templates.items())
    assert not any(program(seq=64).templates[s] is t for s, t in first.templates.items())
    eager, eager_again = program(compiled=False), program(compiled=False)
    assert not any(eager_again.templates[s] is t for s, t in eager.templates.items())
    again.train(False)
    assert not any(t.module.training for t in first.templates.values())
    again.train(True)
    assert all(t.module.training for t in first.templates.values())


@pytest.mark.slow
def test_an_engine_built_again_compiled_trains_as_the_first_and_compiles_nothing_new():
    """Two MegaTrain cases of one compiled generic model in one process: the same losses bit for bit, the second
    build's layers run without a graph of their own (Dynamo's count of unique graphs unchanged) and stay compiled."""
    from torch._dynamo.utils import counters

    from megatrain.bench.case import run_case
    from megatrain.config import CaseConfig

    case = CaseConfig(model="tiny-hf-gemma3", system="megatrain", batch=4, micro_batch=2, seq=32, steps=2, warmup=0,
                      device="cpu", dtype="float32", compile=True)
    first = run_case(case)
    assert first["status"] == "ok", first["error"]
    graphs = counters["stats"]["unique_graphs"]
    again = run_case(case)
    assert again["status"] == "ok", again["error"]
    assert again["losses"] == first["losses"]
    assert counters["stats"]["unique_graphs"] == graphs
    check = again["system_config"]["compile_check"]
    assert not check["eager_fallback"] and not check["recompile_limit_hits"], check
