"""Training data: JSONL (pre-tokenized, text, alpaca, sharegpt/ChatML messages) and plain text, into rows of
seq+1 tokens with a loss mask, one example per row (truncated, padded with labels IGNORE_INDEX).

Formats, by the keys of a JSONL line:
- {"input_ids": [...]}: tokens as given; a line of exactly seq+1 ids is one sequence (inputs ids[:-1],
  targets ids[1:]); every token is a target.
- {"text": "..."}: tokenized, EOS appended; every token is a target.
- {"instruction", "input"?, "output"} (alpaca) and {"messages": [{"role", "content"}]} or
  {"conversations": [{"from", "value"}]} (sharegpt/ChatML): rendered with the tokenizer's chat template;
  the loss is on the assistant's tokens only, unless train_on_prompt.
A .txt file holds documents separated by blank lines, each like {"text": ...}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from megatrain.models.loss import IGNORE_INDEX

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Example:
    ids: list[int]
    target: list[bool]  # target[i]: token i is predicted with a loss


def data_files(paths: list[str]) -> list[Path]:
    """The files named, a folder standing for its .jsonl and .txt files (sorted)."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".txt"))
        elif p.exists():
            files.append(p)
        else:
            raise ValueError(f"--data {p}: no such file or folder")
    if not files:
        raise ValueError(f"--data {' '.join(paths)}: no .jsonl or .txt files")
    return files


class Tokenizer:
    """A local Hugging Face tokenizer directory (tokenizer.json, and tokenizer_config.json's chat template)."""

    def __init__(self, path: str):
        from transformers import AutoTokenizer

        if not (Path(path) / "tokenizer.json").exists():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (a local Hugging Face tokenizer directory)")
        self.tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.eos = self.tok.eos_token_id
        self.path = path

    def text(self, text: str) -> Example:
        ids = self.tok.encode(text, add_special_tokens=False) + ([self.eos] if self.eos is not None else [])
        return Example(ids, [True] * len(ids))

    def chat(self, messages: list[dict], train_on_prompt: bool) -> Example:
        """Render a conversation; assistant turns are targets. Each assistant turn's tokens are the difference
        between the rendering up to it and the rendering before it with the generation prompt."""
        if not self.tok.chat_template:
            raise ValueError(f"{self.path}: the tokenizer has no chat template (tokenizer_config.json); "
                             "chat data needs one")
        ids: list[int] = []
        target: list[bool] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], generation_prompt=True)
            full = self._render(messages[:i + 1], generation_prompt=False)
            if prompt[:len(ids)] != ids or full[:len(prompt)] != prompt:
                raise ValueError(f"{self.path}: the chat template does not render conversations prefix by prefix; "
                                 "its assistant tokens cannot be told apart")
            target += [train_on_prompt] * (len(prompt) - len(ids)) + [True] * (len(full) - len(prompt))
            ids = full
        full = self._render(messages, generation_prompt=False)
        target += [train_on_prompt] * (len(full) - len(ids))
        return Example(full, target)

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        if not messages:
            return []
        out = self.tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


def _messages(record: dict, where: str) -> list[dict]:
    if "instruction" in record:
        prompt = record["instruction"] + (f"\n\n{record['input']}" if record.get("input") else "")
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": record["output"]}]
    turns = record.get("messages") or record.get("conversations")
    out = []
    for turn in turns:
        role = ROLES.get(turn.get("role", turn.get("from")))
        if role is None:
            raise ValueError(f"{where}: unknown role {turn.get('role', turn.get('from'))!r}")
        out.append({"role": role, "content": turn.get("content", turn.get("value"))})
    return out


def read_examples(files: list[Path], tokenizer: Tokenizer | None, train_on_prompt: bool) -> list[Example]:
    examples = []
    for path in files:
        if path.suffix == ".txt":
            for doc in path.read_text(encoding="utf-8").split("\n\n"):
                if doc.strip():
                    examples.append(_need(tokenizer, path).text(doc))
            continue
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"{path}:{line_no}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{where}: not a JSON record ({exc})") from None
                if "input_ids" in record:
                    ids = [int(t) for t in record["input_ids"]]
                    examples.append(Example(ids, [True] * len(ids)))
                elif "text" in record:
                    examples.append(_need(tokenizer, where).text(record["text"]))
                elif "instruction" in record or "messages" in record or "conversations" in record:
                    examples.append(_need(tokenizer, where).chat(_messages(record, where), train_on_prompt))
                else:
                    raise ValueError(f"{where}: a line needs input_ids, text, instruction/output (alpaca) or "
                                     f"messages/conversations (chat); it has {sorted(record)}")
    if not examples:
        raise ValueError(f"no examples in {', '.join(map(str, files))}")
    return examples


def _need(tokenizer: Tokenizer | None, where) -> Tokenizer:
    if tokenizer is None:
        raise ValueError(f"{where}: text and chat data need --tokenizer DIR")
    return tokenizer


class Rows:
    """Examples as [N, seq+1] token rows with a target mask, one example per row: truncated, or right-padded
    (pad tokens are never targets). Row order per epoch: file order, or a permutation seeded by (seed, epoch)."""

    def __init__(self, examples: list[Example], seq: int, vocab_size: int, shuffle: bool, seed: int):
        n = len(examples)
        self.tokens = torch.zeros(n, seq + 1, dtype=torch.long)
        self.target = torch.zeros(n, seq + 1, dtype=torch.bool)
        self.truncated = 0
        for i, ex in enumerate(examples):
            k = min(len(ex.ids), seq + 1)
            self.truncated += len(ex.ids) > seq + 1
            self.tokens[i, :k] = torch.tensor(ex.ids[:k])
            self.target[i, :k] = torch.tensor(ex.target[:k])
        top = int(self.tokens.max())
        if top >= vocab_size:
            raise ValueError(f"token id {top} is outside the model's vocabulary of {vocab_size}: "
                             "a tokenizer of another model?")
        self.shuffle, self.seed = shuffle, seed
        self._orders: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            n = len(self)
            self._orders = {epoch: torch.randperm(n, generator=gen) if self.shuffle else torch.arange(n)}
        return self._orders[epoch]

    def batch(self, first_row: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs [count, seq], labels [count, seq]) of rows first_row.. of the epoch-ordered stream."""
        idx = [int(self.order(p // len(self))[p % len(self)]) for p in range(first_row, first_row + count)]
        tokens, target = self.tokens[idx], self.target[idx]
        labels = tokens[:, 1:].clone()
        labels[~target[:, 1:]] = IGNORE_INDEX
        return tokens[:, :-1].clone(), labels
