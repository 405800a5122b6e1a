"""Token batches: a seeded synthetic stream (benchmarks) and tokenized JSONL / plain text.

A batch is (inputs [B, S], labels [B, S]) with labels[t] = the token after inputs[t] and
IGNORE_INDEX (-100) where there is no next token or the position is padding.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from megatrain.models.loss import IGNORE_INDEX
from megatrain.tokenizer import Tokenizer


def split_inputs_labels(tokens_BS1: torch.Tensor, valid_BS1: torch.Tensor | None = None):
    """Shift a [B, S+1] token block into inputs [B, S] and labels [B, S], masking padding."""
    inputs, labels = tokens_BS1[:, :-1].clone(), tokens_BS1[:, 1:].clone()
    if valid_BS1 is not None:
        labels[~valid_BS1[:, 1:]] = IGNORE_INDEX
    return inputs, labels


def _stream_seed(seed: int, step: int) -> int:
    """A 32-bit seed per (seed, step): torch's CPU generator keys on the low 32 bits only."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{step}".encode(), digest_size=4).digest(), "little")


class SyntheticTokens:
    """Uniform random tokens from a seeded generator; step k's batch depends only on (seed, k)."""

    def __init__(self, vocab_size: int, batch: int, seq: int, seed: int, repeat: bool = False):
        self.vocab_size, self.batch, self.seq, self.seed, self.repeat = vocab_size, batch, seq, seed, repeat

    def batch_at(self, step: int):
        gen = torch.Generator().manual_seed(_stream_seed(self.seed, 0 if self.repeat else step))
        tokens = torch.randint(0, self.vocab_size, (self.batch, self.seq + 1), generator=gen)
        return split_inputs_labels(tokens)

    def __iter__(self) -> Iterator:
        step = 0
        while True:
            yield self.batch_at(step)
            step += 1


def records(path: str | Path, flag: str = "--data") -> Iterator[tuple[str, object]]:
    """(where, record) of every record of a data file, where being 'FLAG PATH:LINE': a .txt file's blank-line separated
    documents as {"text": document}, any other file's JSON lines (blank lines skipped). A byte that is not UTF-8 or a
    line that is not JSON is a ValueError naming its file and line. The one reader of data files: bench's text batches
    (read_documents) and train's examples (megatrain.train.data) both read through it."""
    path = Path(path)
    if path.suffix.lower() == ".txt":  # A.TXT too
        line_no = 1
        for doc in _utf8(path.read_bytes(), f"{flag} {path}", 1).split("\n\n"):
            if doc.strip():
                yield f"{flag} {path}:{line_no}", {"text": doc}
            line_no += doc.count("\n") + 2
        return
    with path.open("rb") as f:
        for line_no, raw in enumerate(f, 1):
            where = f"{flag} {path}:{line_no}"
            line = _utf8(raw, f"{flag} {path}", line_no)
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not a JSON record ({exc})") from None
            except RecursionError:  # Python's JSON reader recurses once per level
                raise ValueError(f"{where}: a JSON record nested too deep to read (arrays or objects ~1000 levels "
                                 "in)") from None
            yield where, record


def _utf8(raw: bytes, file_where: str, first_line: int) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = first_line + raw[:exc.start].count(b"\n")
        raise ValueError(f"{file_where}:{line}: byte {raw[exc.start]:#04x} is not UTF-8; save the file as UTF-8") \
            from None


def read_documents(path: str | Path) -> Iterator[str]:
    """Documents of a .txt file (blank-line separated) or a JSONL file (field 'text'): records() read for bench."""
    for where, record in records(path):
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ValueError(f"{where}: JSONL records need a string 'text' field")
        yield record["text"]


class TextBatches:
    """Packs tokenized documents into [B, S+1] blocks, each document ending with EOS (megatrain.tokenizer).

    Documents are concatenated and cut into full blocks; the final partial block is right-padded and masked.
    """

    def __init__(self, path: str | Path, tokenizer_dir: str | Path, batch: int, seq: int, vocab_size: int):
        tok = Tokenizer(tokenizer_dir)
        stream: list[int] = []
        for doc in read_documents(path):
            stream.extend(tok.document(doc))
        if not stream:
            raise ValueError(f"{path} holds no text")
        if max(stream) >= vocab_size:
            raise ValueError(f"tokenizer ids reach {max(stream)} but the model's vocab_size is {vocab_size}")
        self.batch, self.seq = batch, seq
        block = seq + 1
        n_blocks = -(-len(stream) // block)
        padded = torch.zeros(n_blocks * block, dtype=torch.long)
        padded[: len(stream)] = torch.tensor(stream)
        valid = torch.zeros(n_blocks * block, dtype=torch.bool)
        valid[: len(stream)] = True
        self.tokens, self.valid = padded.view(n_blocks, block), valid.view(n_blocks, block)

    def batch_at(self, step: int):
        idx = (torch.arange(self.batch) + step * self.batch) % self.tokens.shape[0]
        return split_inputs_labels(self.tokens[idx], self.valid[idx])


def make_batches(case, vocab_size: int):
    """The batch source a case asks for: an object with batch_at(step) -> (inputs, labels)."""
    if case.data == "synthetic":
        return SyntheticTokens(vocab_size, case.batch, case.seq, case.seed, repeat=case.repeat_batch)
    return TextBatches(case.data, case.tokenizer, case.batch, case.seq, vocab_size)
