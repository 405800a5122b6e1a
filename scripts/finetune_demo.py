"""`train` end to end on the GPU (issue 14): a Qwen2.5-0.5B-shaped model, randomly initialised and saved as a
Hugging Face checkpoint, trained on real English text that ships with Python (the docstrings of its standard
library) with a byte-level BPE tokenizer trained on that text; killed (SIGKILL) after a checkpoint, resumed, and its
export reloaded by transformers to generate.

    python scripts/finetune_demo.py OUT [--steps 240] [--system megatrain] [--save-every 50] [--kill-after 100]

OUT/ gets tokenizer/, init/, train.jsonl and eval.jsonl (every 20th standard-library file held out), run/ (the train
run: metrics.jsonl, memory.json of the resumed part, hf/) and summary.json (losses, held-out losses, the kill and
the resume, the reloaded model's held-out loss against the random init's, generations, environment).
"""

import argparse
import ast
import json
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere: this checkout's package
from megatrain.bench.env import environment  # noqa: E402

SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"}
SPECIAL = "<|endoftext|>"
PROMPTS = ["Return the number of", "Raise ValueError if", "This module provides", "The default value of"]


def stdlib_documents(min_chars: int = 500) -> list[tuple[str, str]]:
    """(file, text) per standard-library module: its module, class and function docstrings, in source order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for path in sorted(root.rglob("*.py")):
        if SKIP_DIRS & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.ClassDef |
                                                                   ast.AsyncFunctionDef))]
        text = "\n\n".join(d for n in nodes if (d := ast.get_docstring(n)))
        if len(text) >= min_chars:
            docs.append((str(path.relative_to(root)), text))
    return docs


def write_corpus(out: Path) -> dict:
    docs = stdlib_documents()
    held_out = docs[::20]
    train = [d for i, d in enumerate(docs) if i % 20]
    for name, part in (("train.jsonl", train), ("eval.jsonl", held_out)):
        with (out / name).open("w") as f:
            for _, text in part:
                f.write(json.dumps({"text": text}) + "\n")
    return {"files": len(docs), "train_files": len(train), "eval_files": len(held_out),
            "train_chars": sum(len(t) for _, t in train), "eval_chars": sum(len(t) for _, t in held_out)}


def train_tokenizer(out: Path, vocab: int) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = (json.loads(line)["text"] for line in (out / "train.jsonl").open())
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=[SPECIAL],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = out / "tokenizer"
    path.mkdir(exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIAL, "model_max_length": 32768}))
    return path


def random_init(out: Path) -> Path:
    """Qwen2.5-0.5B's shape (config.json of Qwen/Qwen2.5-0.5B), transformers' own random init, saved."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                                   rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out / "init", safe_serialization=True)
    return out / "init"


def run(cmd: list[str]) -> subprocess.Popen:
    print("$", " ".join(cmd), flush=True)
    return subprocess.Popen(cmd)


def held_out_loss(model_dir: Path, tokenizer_dir: Path, eval_file: Path, docs: int = 16, seq: int = 1024) -> float:
    """transformers' own mean token loss over the first `seq` tokens of the first held-out documents."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for line in list(eval_file.open())[:docs]:
            ids = torch.tensor([tok.encode(json.loads(line)["text"])[:seq]], device="cuda")
            loss = model(ids, labels=ids).loss
            total += float(loss) * (ids.shape[1] - 1)
            count += ids.shape[1] - 1
    return total / count


def generate(model_dir: Path, new_tokens: int = 24) -> dict[str, str]:
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids.cuda()
        gen = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.eos_token_id)
        out[prompt] = tok.decode(gen[0, ids.shape[1]:])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--kill-after", type=int, default=100, help="SIGKILL once this step's checkpoint is complete "
                   "(a multiple of --save-every)")
    p.add_argument("--system", default="megatrain")
    p.add_argument("--vocab", type=int, default=16384, help="the BPE tokenizer's vocabulary")
    args = p.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    corpus = write_corpus(out)
    tokenizer = train_tokenizer(out, args.vocab)
    init = random_init(out)
    prep_s = time.perf_counter() - t0
    run_dir = out / "run"
    cmd = [sys.executable, "-m", "megatrain", "train", "--system", args.system, "--init-from", str(init),
           "--tokenizer", str(tokenizer), "--data", str(out / "train.jsonl"), "--eval-data", str(out / "eval.jsonl"),
           "--eval-every", "40", "--seq", "1024", "--batch", "8", "--steps", str(args.steps), "--lr", "3e-4",
           "--lr-schedule", "cosine", "--warmup-steps", "20", "--min-lr", "3e-5", "--save-every", str(args.save_every),
           "--keep", "2",
           "--device", "cuda", "--dtype", "bfloat16", "--precision", "mixed", "--log-every", "20",
           "--out", str(run_dir), "--overwrite"]
    t0 = time.perf_counter()
    proc = run(cmd)
    marker = run_dir / "checkpoints" / f"step-{args.kill_after}" / "trainer.json"
    while proc.poll() is None and not marker.exists():
        time.sleep(0.2)
    if proc.poll() is not None:
        raise SystemExit(f"train ended (exit {proc.returncode}) before step {args.kill_after}'s checkpoint")
    proc.kill()  # SIGKILL: no handler runs, whatever was in flight is lost
    proc.wait()
    first_s = time.perf_counter() - t0
    before_kill = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    killed_at = max(m["step"] for m in before_kill if "loss" in m)
    t0 = time.perf_counter()
    resumed = run([sys.executable, "-m", "megatrain", "train", "--resume", str(run_dir)])
    if resumed.wait() != 0:
        raise SystemExit(f"the resumed run failed (exit {resumed.returncode})")
    resumed_s = time.perf_counter() - t0
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    steps = {m["step"]: m for m in lines if "loss" in m}  # a step run twice (after the checkpoint): the resumed one
    evals = {m["step"]: m["eval_loss"] for m in lines if "eval_loss" in m}
    repeated = [(m["step"], m["loss"], steps[m["step"]]["loss"]) for m in before_kill
                if "loss" in m and m["step"] > args.kill_after]
    summary = {
        "what": "scripts/finetune_demo.py: Qwen2.5-0.5B-shaped random init, stdlib docstrings, kill -9, resume, "
                "export, reload, generate", "system": args.system, "command": cmd[1:], "corpus": corpus,
        "tokenizer_vocab": args.vocab, "steps": args.steps, "killed_after_checkpoint": args.kill_after,
        "last_step_logged_before_kill": killed_at,
        "steps_rerun_after_resume": [{"step": s, "loss_before_kill": a, "loss_after_resume": b}
                                     for s, a, b in repeated],
        "loss_first": steps[1]["loss"], "loss_last": steps[args.steps]["loss"],
        "loss_by_20": {s: steps[s]["loss"] for s in sorted(steps) if s % 20 == 0 or s == 1},
        "eval_loss": evals, "target_tokens_per_s_median": sorted(m["target_tokens_per_s"] for m in steps.values())[
            len(steps) // 2], "memory_resumed_run": json.loads((run_dir / "memory.json").read_text()),
        "wall_s": {"prepare": prep_s, "first_run_until_kill": first_s, "resumed_run": resumed_s},
        "reloaded_held_out_loss": held_out_loss(run_dir / "hf", tokenizer, out / "eval.jsonl"),
        "init_held_out_loss": held_out_loss(init, tokenizer, out / "eval.jsonl"),
        "generations": generate(run_dir / "hf"),
        "env": environment(),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: summary[k] for k in ("loss_first", "loss_last", "eval_loss", "reloaded_held_out_loss",
                                              "init_held_out_loss", "generations")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
