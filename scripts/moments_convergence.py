"""Compact AdamW moments, and the update delayed a step, against exact fp32 AdamW on a real fine-tune: the finetune
demo's data and model (finetune_demo.py), trained once per variant (--moments fp32,bf16,int8,fp32+delay: a moment
format, '+delay' for the engine's option update_delay=1, '+delayK' with its first K updates exact,
update_delay_warmup=K) with the held-out loss at every eval; one JSON record per run.

    python scripts/moments_convergence.py OUT [--steps 100] [--eval-every 20] [--shape 0.5b] [--device cuda]
    python scripts/moments_convergence.py OUT --shape tiny --device cpu --dtype float32 --steps 6 --eval-every 3 \
        --seq 64 --batch 2 --vocab 512          # a CPU check of the script end to end

OUT/ gets the corpus, tokenizer and random init (as the demo), run-<variant>/ (each train run) and records.jsonl:
per run its variant and moments, held-out losses by step, training losses, host bytes per parameter (memory.json)
and wall time, then a summary record: each other run's largest relative held-out difference from fp32 against
TOLERANCE. The engine streams every unit by default (--option resident_layers=0, resident_embedding=false), so the
host kernel runs the updates; --resident lets the plan keep units on the GPU (the torch path of
megatrain.optim.compact).
"""

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's package, and the demo beside us
sys.path.insert(0, str(Path(__file__).resolve().parent))
from finetune_demo import random_init, train_tokenizer, write_corpus  # noqa: E402

from megatrain.bench.env import environment  # noqa: E402

MOMENTS = ("fp32", "bf16", "int8")
TOLERANCE = 0.02  # the claim: a compact run's held-out loss within 2% of fp32's at every eval


def tiny_init(out: Path) -> Path:
    """A two-layer Qwen2 of width 64 (transformers' own random init): the CPU check's model."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out / "init", safe_serialization=True)
    return out / "init"


def run_one(args, out: Path, init: Path, tokenizer: Path, variant: str) -> dict:
    moments, _, extra = variant.partition("+")
    delay = re.fullmatch(r"delay(\d*)", extra)
    if extra and not delay:
        raise SystemExit(f"variant {variant!r}: a moment format ({', '.join(MOMENTS)}), optionally '+delay' or "
                         "'+delayK' (the first K updates exact)")
    warmup = int(delay.group(1) or 0) if delay else 0
    run_dir = out / f"run-{variant}"
    cmd = [sys.executable, "-m", "megatrain", "train", "--init-from", str(init), "--tokenizer", str(tokenizer),
           "--data", str(out / "train.jsonl"), "--eval-data", str(out / "eval.jsonl"), "--eval-every",
           str(args.eval_every), "--seq", str(args.seq), "--batch", str(args.batch), "--steps", str(args.steps),
           "--lr", "3e-4", "--lr-schedule", "cosine", "--warmup-steps", str(max(1, args.steps // 10)), "--min-lr",
           "3e-5", "--device", args.device, "--dtype", args.dtype, "--precision", "mixed", "--moments", moments,
           "--log-every", str(args.eval_every), "--no-save", "--out", str(run_dir), "--overwrite"]
    if not args.resident and args.device == "cuda":
        cmd += ["--option", "resident_layers=0", "--option", "resident_embedding=false"]
    if delay:
        cmd += ["--option", "update_delay=1", "--option", f"update_delay_warmup={warmup}"]
    print("$", " ".join(cmd), flush=True)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True)
    wall_s = time.perf_counter() - t0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    memory = run_dir / "memory.json"
    return {"what": "moments_convergence", "variant": variant, "moments": moments,
            "update_delay": int(bool(delay)), "update_delay_warmup": warmup, "shape": args.shape, "steps": args.steps,
            "seq": args.seq, "batch": args.batch, "device": args.device, "dtype": args.dtype, "command": cmd[1:],
            "eval_loss": {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m},
            "loss": {m["step"]: m["loss"] for m in lines if "loss" in m},
            "memory": json.loads(memory.read_text()) if memory.exists() else None, "wall_s": wall_s}


def summary(records: list[dict]) -> dict:
    """Each other run's largest relative held-out difference from the first (exact fp32), at the evals both have."""
    exact = records[0]["eval_loss"]
    out = {"what": "moments_convergence_summary", "tolerance": TOLERANCE, "env": environment()}
    for r in records[1:]:
        worst = max(abs(r["eval_loss"][s] - exact[s]) / exact[s] for s in exact if s in r["eval_loss"])
        out[r.get("variant", r["moments"])] = {"max_rel_eval_diff": worst, "within_tolerance": worst <= TOLERANCE,
                             "final_eval_loss": r["eval_loss"][max(r["eval_loss"])]}
    out["fp32_final_eval_loss"] = exact[max(exact)]
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--shape", choices=("0.5b", "tiny"), default="0.5b", help="the demo's Qwen2.5-0.5B shape, or tiny")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--vocab", type=int, default=16384, help="the BPE tokenizer's vocabulary (tiny: 512)")
    p.add_argument("--resident", action="store_true", help="let the plan keep units on the GPU")
    p.add_argument("--moments", default=",".join(MOMENTS),
                   help="variants to run, fp32 first: moment formats, each optionally with '+delay' (update_delay=1) "
                        "or '+delayK' (and update_delay_warmup=K)")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    write_corpus(out)
    tokenizer = train_tokenizer(out, args.vocab)
    init = random_init(out) if args.shape == "0.5b" else tiny_init(out)
    records = [run_one(args, out, init, tokenizer, m) for m in args.moments.split(",")]
    records.append(summary(records))
    with (out / "records.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    print(json.dumps(records[-1]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
