"""Training data: JSONL (pre-tokenized, text, alpaca, sharegpt/ChatML messages) and plain text, into rows of
seq+1 tokens with a loss mask, one example per row (truncated, padded with labels IGNORE_INDEX).

Formats, by the keys of a JSONL line:
- {"input_ids": [...]}: tokens as given; a line of exactly seq+1 ids is one sequence (inputs ids[:-1],
  targets ids[1:]); every token is a target.
- {"text": "..."}: tokenized, EOS appended; every token is a target.
- {"instruction", "input"?, "output"} (alpaca) and {"messages": [{"role", "content"}]} or
  {"conversations": [{"from", "value"}]} (sharegpt/ChatML): rendered with the tokenizer's chat template;
  the loss is on the assistant's tokens only, unless train_on_prompt.
A .txt file holds documents separated by blank lines, each like {"text": ...}. A Hugging Face dataset's rows are read
as these lines (megatrain.train.datasets).
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from megatrain.data import records
from megatrain.models.loss import IGNORE_INDEX
from megatrain.tokenizer import Tokenizer
from megatrain.train.datasets import SPLIT_FLAGS, HFData, hf_records, hf_source

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}


@dataclass
class Example:
    ids: list[int]
    target: list[bool]  # target[i]: token i is predicted with a loss
    where: str = ""  # the flag, file and line it came from, for messages


def data_files(paths: list[str], flag: str = "--data", split: str | None = None) -> list[Path | HFData]:
    """The files named, a folder standing for its .jsonl and .txt files (sorted), and the Hugging Face datasets named
    (their `split`); flag names them in messages. Only regular files are read (a FIFO would block forever): another
    entry of a folder is skipped with a warning, another path named is refused."""
    files: list[Path | HFData] = []
    for p in map(Path, paths):
        dataset = hf_source(p, split, flag)
        if dataset is not None:
            files.append(dataset)
        elif p.is_dir():
            for f in sorted(f for f in p.iterdir() if f.suffix in (".jsonl", ".txt")):
                if f.is_file():
                    files.append(f)
                else:
                    warnings.warn(f"{flag} {p}: skipped {f.name}, not a regular file (a folder, a FIFO, a broken or "
                                  "looping link)", stacklevel=1)  # this line's: said once however often listed
        elif p.is_file():
            files.append(p)
        elif p.exists() or p.is_symlink():
            raise ValueError(f"{flag} {p} is not a regular file (a FIFO, a device, a broken or looping link): name a "
                             "file or a folder of them")
        else:
            hub = "" if p.suffix else f" (a Hugging Face hub dataset: give its split too, {SPLIT_FLAGS[flag]} SPLIT)"
            raise ValueError(f"{flag} {p}: no such file or folder{hub}")
    if not files:
        raise ValueError(f"{flag} {' '.join(paths)}: no .jsonl or .txt files, and no dataset")
    return files


def _string(record: dict, key: str, where: str) -> str:
    value = record.get(key)
    if not isinstance(value, str):
        raise ValueError(f"{where}: {key} must be a string, got {json.dumps(value)[:60]}")
    try:
        value.encode()
    except UnicodeEncodeError as exc:  # JSON's \ud800 escapes: half of a pair, no character
        raise ValueError(f"{where}: {key} holds a lone surrogate, {value[exc.start]!r} at character {exc.start}, "
                         "half of a UTF-16 pair that is no character: write the character itself") from None
    return value


def _messages(record: dict, where: str) -> list[dict]:
    if "instruction" in record:
        prompt = _string(record, "instruction", where)
        if record.get("input"):  # absent, null or "": no input
            prompt += "\n\n" + _string(record, "input", where)
        return [{"role": "user", "content": prompt}, {"role": "assistant", "content": _string(record, "output", where)}]
    key = "messages" if "messages" in record else "conversations"
    turns = record[key]
    if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
        raise ValueError(f"{where}: {key} must be a list of {{role, content}} objects, got {json.dumps(turns)[:60]}")
    out = []
    for turn in turns:
        sharegpt = "from" in turn
        role = _string(turn, "from" if sharegpt else "role", where)
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; known: {', '.join(ROLES)}")
        out.append({"role": ROLES[role], "content": _string(turn, "value" if sharegpt else "content", where)})
    return out


def _example(record, where: str, tokenizer: Tokenizer | None, train_on_prompt: bool) -> Example:
    """The example of one JSONL record."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a line must be a JSON object such as {{\"text\": ...}}, got "
                         f"{json.dumps(record)[:60]}")
    if "input_ids" in record:
        ids = record["input_ids"]
        bad = [t for t in ids if type(t) is not int or t < 0][:1] if isinstance(ids, list) and ids else [ids]
        if bad:
            raise ValueError(f"{where}: input_ids must be a non-empty list of token ids (integers >= 0); "
                             f"{json.dumps(bad[0])[:60]} is not")
        return Example(ids, [True] * len(ids))
    if "text" in record:
        text = _string(record, "text", where)
        return _document(_need(tokenizer, where), text)
    if "instruction" in record or "messages" in record or "conversations" in record:
        messages = _messages(record, where)
        tokenizer = _need(tokenizer, where)
        try:
            ids, assistant = tokenizer.chat(messages)
        except ValueError as exc:  # the template's, said of the line it failed on
            raise ValueError(f"{where}: {exc}") from None
        return Example(ids, [train_on_prompt or a for a in assistant])
    raise ValueError(f"{where}: a line needs input_ids, text, instruction/output (alpaca) or "
                     f"messages/conversations (chat); it has {sorted(record)}")


def read_examples(files: list[Path | HFData], tokenizer: Tokenizer | None, train_on_prompt: bool,
                  flag: str = "--data") -> list[Example]:
    """Every example of the files and datasets, in order; a ValueError names the flag, file and line (dataset and
    row) of the first bad one."""
    examples = []
    for path in files:
        source = hf_records(path, flag) if isinstance(path, HFData) else records(path, flag)
        for where, record in source:
            example = _example(record, where, tokenizer, train_on_prompt)
            if not example.ids:  # a conversation of no messages, a text of no tokens and no EOS
                raise ValueError(f"{where}: holds no token to train on: drop the line")
            examples.append(replace(example, where=where))
    if not examples:
        raise ValueError(f"{flag}: no examples in {', '.join(map(str, files))}")
    return examples


def _document(tokenizer: Tokenizer, text: str) -> Example:
    ids = tokenizer.document(text)
    return Example(ids, [True] * len(ids))


def _need(tokenizer: Tokenizer | None, where) -> Tokenizer:
    if tokenizer is None:
        raise ValueError(f"{where}: text and chat data need --tokenizer DIR")
    return tokenizer


def _pack(examples: list[Example], width: int) -> list[tuple[list[int], list[bool], list[int]]]:
    """Examples into rows of `width` tokens, in order, each row holding whole documents (one longer than a row is
    split into row-sized documents); (ids, target, segment) per row, segment numbering the documents of a row from
    1. The padding at a row's end continues its last document: causal attention keeps it out of every real token's
    view, and it is never a target."""
    rows: list[tuple[list[int], list[bool], list[int]]] = []
    ids: list[int] = []
    target: list[bool] = []
    segment: list[int] = []
    for ex in examples:
        for a in range(0, len(ex.ids), width):
            piece = ex.ids[a:a + width]
            if len(ids) + len(piece) > width:
                rows.append((ids, target, segment))
                ids, target, segment = [], [], []
            doc = (segment[-1] if segment else 0) + 1
            ids, target, segment = ids + piece, target + ex.target[a:a + width], segment + [doc] * len(piece)
    if ids:
        rows.append((ids, target, segment))
    return rows


class Rows:
    """Examples as [N, seq+1] token rows with a target mask. Packed (the default): whole documents side by side in
    each row, with their segment ids, so attention and positions stay within a document
    (models.masks.rope_and_masks); or one example per row (pack=False), truncated or right-padded. Pad
    tokens are never targets, nor is a document's first token (it would be predicted from the previous document).
    Row order per epoch: file order, or a permutation seeded by (seed, epoch). A token id outside the vocabulary,
    and data with no target token at all, are refused (flag names the data in messages)."""

    def __init__(self, examples: list[Example], seq: int, vocab_size: int, shuffle: bool, seed: int,
                 pack: bool = True, flag: str = "--data"):
        outside = next((ex for ex in examples if max(ex.ids) >= vocab_size), None)
        if outside is not None:
            raise ValueError(f"{outside.where}: token id {max(outside.ids)} is outside the model's vocabulary of "
                             f"{vocab_size}: a tokenizer of another model?")
        if pack:
            rows = _pack(examples, seq + 1)
        else:
            rows = [(ex.ids[:seq + 1], ex.target[:seq + 1], [1] * min(len(ex.ids), seq + 1)) for ex in examples]
        n = len(rows)
        self.tokens = torch.zeros(n, seq + 1, dtype=torch.long)
        self.target = torch.zeros(n, seq + 1, dtype=torch.bool)
        self.segments = torch.ones(n, seq + 1, dtype=torch.int32)
        for i, (ids, target, segment) in enumerate(rows):
            k = len(ids)
            self.tokens[i, :k] = torch.tensor(ids)
            self.target[i, :k] = torch.tensor(target)
            self.segments[i, :k] = torch.tensor(segment)
            self.segments[i, k:] = segment[-1]
        self.examples, self.pack = len(examples), pack
        self.truncated = 0 if pack else sum(len(ex.ids) > seq + 1 for ex in examples)
        self.fill = sum(len(r[0]) for r in rows) / max(1, n * (seq + 1))  # share of row tokens that are data
        if not (self.target[:, 1:] & (self.segments[:, 1:] == self.segments[:, :-1])).any():  # batch()'s labels
            raise ValueError(f"{flag}: no token of the data is a target, so the loss would be over none: a "
                             "document's first token is never predicted (one-token documents have no target), nor "
                             "a chat prompt's tokens without --train-on-prompt (a chat without an assistant turn "
                             "has none)")
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

    def batch(self, first_row: int, count: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(inputs [count, seq], labels [count, seq], segments [count, seq] or None when no row holds two documents)
        of rows first_row.. of the epoch-ordered stream."""
        idx = [int(self.order(p // len(self))[p % len(self)]) for p in range(first_row, first_row + count)]
        tokens, target, segments = self.tokens[idx], self.target[idx], self.segments[idx]
        labels = tokens[:, 1:].clone()
        labels[~target[:, 1:] | (segments[:, 1:] != segments[:, :-1])] = IGNORE_INDEX
        inputs = segments[:, :-1]
        packed = bool((inputs != inputs[:, :1]).any())
        return tokens[:, :-1].clone(), labels, inputs.clone() if packed else None
