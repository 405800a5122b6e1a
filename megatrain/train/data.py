"""Training data: JSONL (pre-tokenized, text, alpaca, sharegpt/ChatML messages) and plain text, into rows of
seq+1 tokens with a loss mask, one example per row (truncated, padded with labels IGNORE_INDEX).

Formats, by the keys of a JSONL line (FORMATS):
- {"input_ids": [...], "labels"?: [...], "attention_mask"?: [...]}: tokens as given; a line of exactly seq+1 ids is
  one sequence (inputs ids[:-1], targets ids[1:]); every token is a target, but where labels (transformers' form:
  as long as input_ids, each the token itself or -100) says -100; an attention_mask's 0s are padding, at the line's
  start or end, dropped (neither attended to nor trained), as transformers' collators pad.
- {"text": "..."}: tokenized, EOS appended; every token is a target.
- {"instruction", "input"?, "output", "system"?} (alpaca) and {"messages": [{"role", "content"}], "system"?} or
  {"conversations": [{"from", "value"}], "system"?} (sharegpt/ChatML): rendered with the tokenizer's chat template,
  a system key as the conversation's first turn; the loss is on the assistant's tokens only, unless
  train_on_prompt.
Every key of a line, and of a turn, is read: one outside its format's (an "id", a "url", a turn's "weight"), or the
keys of two formats in one line, is refused by name, unless --ignore-column names it (then dropped from every line and
turn). A .txt file holds documents separated by blank lines, each like {"text": ...}. A Hugging Face dataset's rows
are read as these lines (megatrain.train.datasets), a null column as an absent one.

A --data folder trains its .jsonl files, or its .txt files, directly in it (sorted by name), or is a Hugging Face
dataset (megatrain.train.datasets): one of the three, and nothing else that looks like data (DATA_SUFFIXES): a folder
holding two kinds, or a data file it would not train (one in a subfolder, another format, compressed), is refused
naming those files.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch

import megatrain.user_files as user_files
from megatrain.data import records
from megatrain.models.loss import IGNORE_INDEX
from megatrain.tokenizer import Tokenizer
from megatrain.train.datasets import SPLIT_FLAGS, HFData, hf_records, hf_source

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
# A line's format, by the key that marks it, and every key it reads (the marking key first); its name in messages
FORMATS = {"input_ids": ("pre-tokenized", ("input_ids", "labels", "attention_mask")),
           "text": ("text", ("text",)),
           "instruction": ("alpaca", ("instruction", "input", "output", "system")),
           "messages": ("chat", ("messages", "system")),
           "conversations": ("sharegpt", ("conversations", "system"))}
TURN_KEYS = {"role": ("role", "content"), "from": ("from", "value")}  # a turn's keys, by the one that marks its form
# names of files that hold data, compressed or not: a folder's that it would not train are refused, not skipped
DATA_SUFFIXES = (".jsonl", ".txt", ".json", ".parquet", ".arrow", ".csv", ".tsv")
OWN_SUFFIXES = (".jsonl", ".txt")  # what megatrain reads itself: a folder trains those of one of them


@dataclass
class Example:
    ids: list[int]
    target: list[bool]  # target[i]: token i is predicted with a loss
    where: str = ""  # the flag, file and line it came from, for messages


def data_files(paths: list[str], flag: str = "--data", split: str | None = None) -> list[Path | HFData]:
    """The files named, a folder standing for the files it trains (_folder_files), and the Hugging Face datasets named
    (their `split`); flag names them in messages. Only regular files are read (a FIFO would block forever): another
    path named is refused; so is a split where no dataset is named (JSONL and text files have none)."""
    files: list[Path | HFData] = []
    for p in map(Path, paths):
        dataset = hf_source(p, split, flag)
        if dataset is not None:
            files.append(dataset)
        elif p.is_dir():
            files += _folder_files(p, flag)
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
    if split is not None and not any(isinstance(f, HFData) for f in files):
        raise ValueError(f"{SPLIT_FLAGS[flag]} {split} names a split of a Hugging Face dataset, and {flag} names none "
                         "(JSONL and text files have no splits): drop it")
    return files


def _folder_files(folder: Path, flag: str) -> list[Path]:
    """The files a folder that is no dataset trains: its .jsonl files, or its .txt files, directly in it, sorted by
    name; ValueError naming what looks like data and would not be trained (the other kind beside them, a data file in
    a subfolder, of another format or compressed). Hidden folders (.git, .ipynb_checkpoints) are no one's data. An
    entry that is not a regular file (a FIFO, a broken link) is skipped with a warning; one that links out of the
    folder is refused (megatrain.user_files)."""
    found: dict[str, list[Path]] = {suffix: [] for suffix in OWN_SUFFIXES}
    untrained = []
    for f in sorted(folder.iterdir()):
        suffix = f.suffix.lower()  # a.JSONL too
        if suffix in found and f.is_file():
            try:  # trained on, so published in the export's weights: not through a link out of the folder named
                user_files.within(folder, f)
            except ValueError as exc:
                raise ValueError(f"{flag} {exc}") from None
            found[suffix].append(f)
        elif suffix in found:
            warnings.warn(f"{flag} {folder}: skipped {f.name}, not a regular file (a folder, a FIFO, a broken or "
                          "looping link)", stacklevel=1)  # this line's: said once however often listed
        elif f.is_dir() and not f.name.startswith("."):
            untrained += sorted(p for p in f.rglob("*") if _looks_like_data(p)
                                and not any(part.startswith(".") for part in p.relative_to(folder).parts))
        elif _looks_like_data(f):
            untrained.append(f)
    kinds = [suffix for suffix, files in found.items() if files]
    if not kinds and untrained:
        raise ValueError(f"{flag} {folder} has no .jsonl or .txt files directly in it, and holds "
                         f"{_names(untrained, folder)}, which it would not train: name each file to train ({flag} "
                         "FILE, repeatable)")
    if len(kinds) > 1:
        raise ValueError(f"{flag} {folder} holds both .jsonl files ({_names(found['.jsonl'], folder)}) and .txt files "
                         f"({_names(found['.txt'], folder)}), and a folder trains those of one format: name the files "
                         f"to train ({flag} FILE, repeatable)")
    if kinds and untrained:
        raise ValueError(f"{flag} {folder} holds {_names(untrained, folder)}, which it would not train (a folder "
                         f"trains the {kinds[0]} files directly in it): name each file to train ({flag} FILE, "
                         "repeatable), or move the others out")
    return found[kinds[0]] if kinds else []


def _looks_like_data(path: Path) -> bool:
    return any(suffix.lower() in DATA_SUFFIXES for suffix in path.suffixes) and path.is_file()


def _names(files: list[Path], folder: Path) -> str:
    names = [f.relative_to(folder).as_posix() for f in files]
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


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


def _messages(record: dict, mark: str, where: str) -> list[dict]:
    """The conversation of an alpaca or chat line (its format marked by key `mark`), its system key the first
    turn."""
    if mark == "instruction":
        prompt = _string(record, "instruction", where)
        if record.get("input"):  # absent, null or "": no input
            prompt += "\n\n" + _string(record, "input", where)
        answer = _string(record, "output", where)
        turns = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
    else:
        turns = _turns(record[mark], mark, where)
    if record.get("system"):  # absent, null or "": no system turn (the template's own default, if any)
        if turns and turns[0]["role"] == "system":
            raise ValueError(f"{where}: a system key and a system turn: give the system prompt once")
        turns = [{"role": "system", "content": _string(record, "system", where)}, *turns]
    return turns


def _turns(turns, key: str, where: str) -> list[dict]:
    if not isinstance(turns, list) or not all(isinstance(turn, dict) for turn in turns):
        raise ValueError(f"{where}: {key} must be a list of {{role, content}} objects, got {json.dumps(turns)[:60]}")
    out = []
    for turn in turns:
        role_key, content_key = TURN_KEYS["from" if "from" in turn else "role"]
        if extra := [k for k in turn if k not in (role_key, content_key)]:
            raise ValueError(f"{where}: a turn of {key} holds {extra[0]!r}, which megatrain does not read (a turn is "
                             f"{role_key} and {content_key}): drop it, or --ignore-column {extra[0]} to train without "
                             "it")
        role = _string(turn, role_key, where)
        if role not in ROLES:
            raise ValueError(f"{where}: unknown role {role!r}; known: {', '.join(ROLES)}")
        out.append({"role": ROLES[role], "content": _string(turn, content_key, where)})
    return out


def _format(record, where: str, ignored: tuple[str, ...]) -> tuple[str, dict]:
    """(the key marking the line's format, the line without the ignored keys, in its turns too); ValueError naming a
    key no format reads, or the keys of two formats."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a line must be a JSON object such as {{\"text\": ...}}, got "
                         f"{json.dumps(record)[:60]}")
    if ignored:
        record = {k: [{t: v for t, v in turn.items() if t not in ignored} if isinstance(turn, dict) else turn
                      for turn in v] if k in ("messages", "conversations") and isinstance(v, list) else v
                  for k, v in record.items() if k not in ignored}
    marks = [k for k in FORMATS if k in record]
    if not marks:
        raise ValueError(f"{where}: a line needs input_ids, text, instruction/output (alpaca) or "
                         f"messages/conversations (chat); it has {sorted(record)}")
    if len(marks) > 1:
        raise ValueError(f"{where}: holds {marks[0]} and {marks[1]}, the keys of two formats ({FORMATS[marks[0]][0]} "
                         f"and {FORMATS[marks[1]][0]}): one line is one example; --ignore-column {marks[1]} trains "
                         f"its {marks[0]} alone")
    name, keys = FORMATS[marks[0]]
    if extra := [k for k in record if k not in keys]:
        raise ValueError(f"{where}: holds {extra[0]!r}, which megatrain does not read (the keys of {name} lines: "
                         f"{', '.join(keys)}): drop it, or --ignore-column {extra[0]} to train without it")
    return marks[0], record


def _tokens(record: dict, where: str) -> Example:
    """The example of a pre-tokenized line: every token a target but where labels says -100; an attention mask's
    0s (padding at the start or end) dropped."""
    ids = record["input_ids"]
    bad = [t for t in ids if type(t) is not int or t < 0][:1] if isinstance(ids, list) and ids else [ids]
    if bad:
        raise ValueError(f"{where}: input_ids must be a non-empty list of token ids (integers >= 0); "
                         f"{json.dumps(bad[0])[:60]} is not")
    target = [True] * len(ids)
    if "labels" in record:
        labels = _aligned(record, "labels", len(ids), where)
        # labels[0] is no one's target (transformers shifts them): only the others are read
        wrong = next((i for i in range(1, len(ids)) if labels[i] not in (ids[i], IGNORE_INDEX)), None)
        if wrong is not None:
            raise ValueError(f"{where}: labels[{wrong}] is {json.dumps(labels[wrong])[:20]}, neither "
                             f"input_ids[{wrong}] ({ids[wrong]}) nor {IGNORE_INDEX}: labels only say which tokens are "
                             f"trained (transformers' form: unshifted, {IGNORE_INDEX} for no loss), each token's "
                             "target being the line's next one")
        target = [label != IGNORE_INDEX for label in labels]
    if "attention_mask" in record:
        mask = _aligned(record, "attention_mask", len(ids), where)
        if not all(m in (0, 1) for m in mask):
            raise ValueError(f"{where}: attention_mask must hold 1s (tokens) and 0s (padding), got "
                             f"{json.dumps(next(m for m in mask if m not in (0, 1)))[:20]}")
        first = mask.index(1) if 1 in mask else len(mask)
        last = len(mask) - mask[::-1].index(1) if 1 in mask else first
        if 0 in mask[first:last]:
            raise ValueError(f"{where}: attention_mask holds 0s between 1s, at {mask.index(0, first)}: its 0s are "
                             "read as padding, at the line's start or end (split the line where it holds two "
                             "documents)")
        ids, target = ids[first:last], target[first:last]
    return Example(ids, target)


def _aligned(record: dict, key: str, length: int, where: str) -> list:
    values = record[key]
    if not isinstance(values, list) or len(values) != length or \
            not all(type(v) is int or type(v) is bool for v in values):
        raise ValueError(f"{where}: {key} must be a list of {length} integers, one per input_ids token, got "
                         f"{json.dumps(values)[:60]}")
    return values


def _example(record, where: str, tokenizer: Tokenizer | None, train_on_prompt: bool,
             ignored: tuple[str, ...] = ()) -> Example:
    """The example of one JSONL record, its keys named by `ignored` dropped."""
    mark, record = _format(record, where, ignored)
    if mark == "input_ids":
        return _tokens(record, where)
    if mark == "text":
        text = _string(record, "text", where)
        return _document(_need(tokenizer, where), text)
    messages = _messages(record, mark, where)
    tokenizer = _need(tokenizer, where)
    try:
        ids, assistant = tokenizer.chat(messages)
    except ValueError as exc:  # the template's, said of the line it failed on
        raise ValueError(f"{where}: {exc}") from None
    return Example(ids, [train_on_prompt or a for a in assistant])


def read_examples(files: list[Path | HFData], tokenizer: Tokenizer | None, train_on_prompt: bool,
                  flag: str = "--data", ignored: tuple[str, ...] = ()) -> list[Example]:
    """Every example of the files and datasets, in order, the keys `ignored` (--ignore-column) dropped from every
    line and turn; a ValueError names the flag, file and line (dataset and row) of the first bad one."""
    examples = []
    for path in files:
        source = hf_records(path, flag) if isinstance(path, HFData) else records(path, flag)
        for where, record in source:
            example = _example(record, where, tokenizer, train_on_prompt, ignored)
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
