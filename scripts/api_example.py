"""The Python API in one runnable file (CPU, seconds; CUDA where there is one): Trainer, the train command as an
object, trains the registry's tiny shape from scratch and exports it; then an Engine, driven by a loop of its own,
fine-tunes that export with its own learning-rate schedule and exports the result.

    python scripts/api_example.py OUT

OUT/ gets data.jsonl, run/ (the Trainer's run: train.log, metrics.jsonl, tensorboard/ where tensorboard is
installed, checkpoints/, hf/) and engine-hf/ (the Engine's export).
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: this checkout's package
import megatrain  # noqa: E402

SEQ, BATCH, VOCAB = 64, 4, 256


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    data = out / "data.jsonl"  # pre-tokenized rows; text, chat and Hugging Face datasets go the same way
    data.write_text("".join(json.dumps({"input_ids": torch.randint(0, VOCAB, (SEQ + 1,), generator=gen).tolist()})
                            + "\n" for _ in range(32)))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    report_to = ["tensorboard"] if importlib.util.find_spec("tensorboard") else []
    result = megatrain.Trainer(model="tiny", data=data, seq=SEQ, batch=BATCH, steps=8, lr=1e-3, warmup_steps=2,
                               device=device, out=out / "run", overwrite=True, report_to=report_to).train()
    print(f"Trainer: {result.step} steps, loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f}, "
          f"Hugging Face checkpoint {result.export}")

    rows = torch.tensor([json.loads(line)["input_ids"] for line in data.read_text().splitlines()])
    steps = 8
    with megatrain.Engine(result.export, seq=SEQ + 1, batch=BATCH, lr=1e-3, device=device) as engine:
        for step in range(steps):
            engine.set_lr(1e-3 * 0.5 * (1 + math.cos(math.pi * step / steps)))  # the loop's own schedule
            batch = rows[step * BATCH % len(rows):][:BATCH]
            loss = engine.step(batch)  # labels: the next tokens of input_ids, as transformers' causal models take them
            print(f"Engine step {step + 1}: loss {loss:.3f}, grad norm {engine.last_grad_norm:.3f}")
        print(f"Engine: Hugging Face checkpoint {engine.export(out / 'engine-hf')}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
