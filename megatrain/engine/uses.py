"""The order in which a step uses each unit's weights, and which weight slot each use takes.

Units: 0 embed, 1..L layers, L+1 head. Per step the GPU uses layers 1..L forward, the head (forward, loss and backward
fused, so its weights cross PCIe once), layers L..1 backward. Two weight slots hold consecutive uses: a use whose
unit is still in a slot reuses it without a load (layer L after the head). With one slot (the double-buffering
ablation) every use of a unit not in it loads into it. With R recomputed inputs, layers 1..R run
forward again ('refwd') right before layer R+1's backward, to regenerate them. The schedule runs this order, the
memory plan counts its loads and the performance model replays it.
"""

from __future__ import annotations

from typing import NamedTuple


class Use(NamedTuple):
    unit: int  # unit index
    phase: str  # 'fwd', 'head', 'bwd', or 'refwd' (a recomputed input regenerated)
    slot: int | None  # the weight slot it reads; None for a resident unit (its weights stay on the GPU)
    load: bool  # its weights are loaded into the slot first


def use_order(num_layers: int, resident: frozenset = frozenset(), recomputed: int = 0, slots: int = 2) -> list[Use]:
    """Every use of a step, in order, over `slots` weight slots (1 or 2); resident units take no slot and no load."""
    uses = [(u, "fwd") for u in range(1, num_layers + 1)] + [(num_layers + 1, "head")]
    uses += [(u, "bwd") for u in range(num_layers, recomputed + 1, -1)]
    uses += [(u, "refwd") for u in range(1, recomputed + 1)]
    uses += [(u, "bwd") for u in range(min(recomputed + 1, num_layers), 0, -1)]
    content: list[int | None] = [None] * slots
    order, prev = [], None
    for unit, phase in uses:
        if unit in resident:
            order.append(Use(unit, phase, None, False))
            continue
        if unit in content:
            slot, load = content.index(unit), False
        else:
            slot, load = (0 if prev is None else (prev + 1) % slots), True
            content[slot] = unit
        order.append(Use(unit, phase, slot, load))
        prev = slot
    return order
