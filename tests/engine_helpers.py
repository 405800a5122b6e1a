"""Shared by the CPU and GPU engine tests: train a case for some steps in this process."""

from __future__ import annotations

import contextlib

import torch

from megatrain.config import CaseConfig
from megatrain.data import make_batches
from megatrain.systems import build_system
from megatrain.systems.native import NativeOptions


def native_options(options: dict) -> dict:
    """The options of an engine case that the native oracle has too (mlp_chunk_tokens); the rest are the engine's."""
    return {k: v for k, v in options.items() if k in NativeOptions.__dataclass_fields__}


@contextlib.contextmanager
def built(system: str, steps: int, **kw):
    """(the system built for a case, its batches), closed on exit."""
    case = CaseConfig(system=system, steps=steps, **kw)
    trainer = build_system(case)
    try:
        yield trainer, make_batches(case, case.shape().vocab_size)
    finally:
        trainer.close()


def train(system: str, steps: int = 10, **kw) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    """(per-step losses, final fp32 parameters by name, the system's metrics) of `steps` steps of a case."""
    with built(system, steps, **kw) as (trainer, data):
        losses = [trainer.step(*data.batch_at(i)) for i in range(steps)]
        return losses, trainer.named_parameters_fp32(), trainer.metrics()


def train_delayed_native(steps: int, warmup: int = 0, **kw) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The reference of update_delay=1: native training where each AdamW step applies the previous step's gradient
    (clipped by its own norm), and the last gradient once training ends (as the engine's export has it); with
    `warmup` (update_delay_warmup) the first `warmup` AdamW steps apply their own step's gradient."""
    with built("native", steps, **kw) as (trainer, data):
        opt = trainer.optimizer
        apply = opt.step
        params = [p for group in opt.param_groups for p in group["params"]]
        pending: list[torch.Tensor] = []
        applied = 0

        def delayed_step():
            nonlocal applied
            if applied < warmup:
                apply()
                applied += 1
                return
            clipped = [p.grad.clone() for p in params]
            if pending:
                for p, g in zip(params, pending, strict=True):
                    p.grad.copy_(g)
                apply()
            pending[:] = clipped
            applied += 1

        opt.step = delayed_step
        losses = [trainer.step(*data.batch_at(i)) for i in range(steps)]
        if pending:
            for p, g in zip(params, pending, strict=True):
                p.grad = g
            apply()
        return losses, trainer.named_parameters_fp32()


def _state(trainer) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(fp32 parameters, every AdamW moment and step count flattened into one tensor) of a trainer now."""
    params = trainer.named_parameters_fp32()  # the engine: after its host optimizer and resident units synced
    if hasattr(trainer, "store"):
        s = trainer.store
        steps = [t.float().flatten().cpu() for t in trainer.optimizer.adamw.steps.values()]
        steps += [t.float().flatten().cpu() for t in trainer.schedule.resident_adamw.steps.values()]
        moments = [t.float() for t in s.moments.tensors().values()]
        return params, torch.cat([*moments, *steps, torch.tensor([trainer.optimizer.step_count])])
    state = trainer.optimizer.state.values()
    return params, torch.cat([t.detach().float().flatten().cpu() for st in state for t in st.values()])


def train_with_nan_gradient(system: str, nan_step: int, steps: int, **kw) -> dict:
    """Train `steps` steps with one gradient element made NaN at step `nan_step`: the head's for the engine, the
    final norm's for a module-owning system. Returns the losses, the state before and after that step, the state
    at the end and the system's skipped-step count."""
    with built(system, steps, **kw) as (trainer, data):
        current = {"step": -1}
        if hasattr(trainer, "schedule"):
            sched = trainer.schedule
            finish = sched._finish_grads

            def poisoned(step, unit, grad_acc, grad_slot):
                if current["step"] == nan_step and unit.index == len(sched.units) - 1:
                    grad_acc[0] = float("nan")
                finish(step, unit, grad_acc, grad_slot)

            sched._finish_grads = poisoned
        else:
            trainer.model.norm.weight.register_hook(
                lambda g: g * float("nan") if current["step"] == nan_step else g)
        out = {"losses": []}
        for i in range(steps):
            if i == nan_step:
                out["before"] = _state(trainer)
            current["step"] = i
            out["losses"].append(trainer.step(*data.batch_at(i)))
            if i == nan_step:
                out["after"] = _state(trainer)
        out["end"] = _state(trainer)
        out["skipped_steps"] = trainer.skipped_steps
        return out


def assert_nan_step_skipped(run: dict) -> None:
    """The run of train_with_nan_gradient skipped exactly its NaN step, left the state untouched, and trained on."""
    (before_p, before_m), (after_p, after_m), (end_p, _) = run["before"], run["after"], run["end"]
    assert run["skipped_steps"] == 1
    assert all(torch.equal(after_p[n], before_p[n]) for n in before_p)  # weights untouched
    assert torch.equal(after_m, before_m)  # moments and step counts untouched
    assert all(torch.isfinite(p).all() for p in end_p.values())  # the next step trains on
    assert any(not torch.equal(end_p[n], after_p[n]) for n in end_p)
    assert all(torch.isfinite(torch.tensor(run["losses"])))


def rerouting(route, asked: list | None = None):
    """A stand-in for megatrain.models.handwritten.moe.route that, left to route anew with gradients on (a recompute
    not given its forward's experts), sends the first three tokens to other experts, as a rounding of the router's
    input can; each such call is appended to `asked`. Routing given experts, or without gradients, is route's."""
    def route_or_reroute(logits, k, norm_topk_prob, experts_TK=None):
        weights, experts = route(logits, k, norm_topk_prob, experts_TK)
        if not torch.is_grad_enabled() or experts_TK is not None:
            return weights, experts
        if asked is not None:
            asked.append(1)
        experts = experts.clone()
        experts[:3] = (experts[:3] + 1) % logits.shape[-1]
        return weights, experts
    return route_or_reroute
