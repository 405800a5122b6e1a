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


def read_documents(path: str | Path) -> Iterator[str]:
    """Documents of a .jsonl file (field 'text') or a plain-text file (blank-line separated)."""
    path = Path(path)
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as e:
                        raise ValueError(f"{path}:{line_no}: not a JSON record ({e})") from e
                    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
                        raise ValueError(f"{path}:{line_no}: JSONL records need a string 'text' field")
                    yield record["text"]
    else:
        for doc in path.read_text(encoding="utf-8").split("\n\n"):
            if doc.strip():
                yield doc


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
