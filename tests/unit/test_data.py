"""Synthetic and text batch sources, with a tokenizer built in memory. CPU, seconds: pytest tests/unit/test_data.py"""

import json
from types import SimpleNamespace

import pytest
import torch
from tokenizers import Tokenizer as TokenizerFile
from tokenizers import models, pre_tokenizers, trainers

from megatrain.data import SyntheticTokens, TextBatches, make_batches, read_documents, split_inputs_labels
from megatrain.models.loss import IGNORE_INDEX
from megatrain.tokenizer import Tokenizer

DOCS = ["the cat sat on the mat", "a dog ran in the park today", "the end"]
EOS = "<|endoftext|>"


@pytest.fixture
def tokenizer_dir(tmp_path):
    """A word-level tokenizer.json trained on DOCS (ids: <unk> 0, EOS 1, then words)."""
    tok = TokenizerFile(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(DOCS, trainers.WordLevelTrainer(special_tokens=["<unk>", EOS]))
    out = tmp_path / "tok"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    return out


def expected_stream(tokenizer_dir) -> list[int]:
    tok = TokenizerFile.from_file(str(tokenizer_dir / "tokenizer.json"))
    stream = []
    for doc in DOCS:
        stream += tok.encode(doc).ids + [tok.token_to_id(EOS)]
    return stream


def write_jsonl(path, records) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_synthetic_batches_depend_only_on_seed_and_step():
    a, b = SyntheticTokens(100, 3, 8, seed=7), SyntheticTokens(100, 3, 8, seed=7)
    x0, y0 = a.batch_at(0)
    assert x0.shape == y0.shape == (3, 8) and x0.dtype == torch.long
    assert 0 <= int(x0.min()) and int(x0.max()) < 100
    assert torch.equal(x0, b.batch_at(0)[0]) and torch.equal(y0, b.batch_at(0)[1])
    assert torch.equal(a.batch_at(5)[0], b.batch_at(5)[0])
    assert not torch.equal(x0, a.batch_at(1)[0])
    assert not torch.equal(x0, SyntheticTokens(100, 3, 8, seed=8).batch_at(0)[0])
    # Iteration yields batch_at(0), batch_at(1), ...
    it = iter(a)
    assert torch.equal(next(it)[0], x0) and torch.equal(next(it)[0], a.batch_at(1)[0])


def test_synthetic_repeat_gives_the_same_batch_every_step():
    data = SyntheticTokens(100, 2, 8, seed=3, repeat=True)
    assert torch.equal(data.batch_at(0)[0], data.batch_at(9)[0])
    assert torch.equal(data.batch_at(0)[0], SyntheticTokens(100, 2, 8, seed=3).batch_at(0)[0])


def test_synthetic_labels_are_the_next_tokens():
    inputs, labels = SyntheticTokens(50, 2, 16, seed=1).batch_at(4)
    assert torch.equal(labels[:, :-1], inputs[:, 1:])
    assert not (labels == IGNORE_INDEX).any()


def test_split_inputs_labels_shifts_and_masks_padding():
    tokens = torch.tensor([[10, 11, 12, 13], [20, 21, 0, 0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    inputs, labels = split_inputs_labels(tokens, valid)
    assert inputs.tolist() == [[10, 11, 12], [20, 21, 0]]
    assert labels.tolist() == [[11, 12, 13], [21, IGNORE_INDEX, IGNORE_INDEX]]
    # the caller's block is not modified
    assert tokens.tolist() == [[10, 11, 12, 13], [20, 21, 0, 0]]


def test_jsonl_is_packed_into_blocks_with_eos_and_masked_tail(tmp_path, tokenizer_dir):
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [{"text": d, "id": i} for i, d in enumerate(DOCS)])
    stream = expected_stream(tokenizer_dir)  # 6 + 7 + 2 words + 3 EOS = 18 tokens
    seq = 4
    data = TextBatches(path, tokenizer_dir, batch=2, seq=seq, vocab_size=64)
    n_blocks = -(-len(stream) // (seq + 1))
    assert data.tokens.shape == (n_blocks, seq + 1)

    blocks_in, blocks_lab = [], []
    for step in range(-(-n_blocks // 2)):
        x, y = data.batch_at(step)
        assert x.shape == y.shape == (2, seq)
        blocks_in += x.tolist()
        blocks_lab += y.tolist()
    for k in range(n_blocks):
        block = stream[k * (seq + 1):(k + 1) * (seq + 1)]
        assert blocks_in[k][:len(block) - 1] == block[:-1]
        assert blocks_lab[k] == block[1:] + [IGNORE_INDEX] * (seq + 1 - len(block))
    # every token but the first of each block is some position's label
    assert sum(lab != IGNORE_INDEX for row in blocks_lab[:n_blocks] for lab in row) == len(stream) - n_blocks


def test_batches_wrap_around_the_blocks(tmp_path, tokenizer_dir):
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [{"text": d} for d in DOCS])
    data = TextBatches(path, tokenizer_dir, batch=3, seq=4, vocab_size=64)
    n_blocks = data.tokens.shape[0]
    x_first, _ = data.batch_at(0)
    x_wrapped, _ = data.batch_at(n_blocks)  # step * batch = 3 * n_blocks, a whole number of passes
    assert torch.equal(x_first, x_wrapped)


def test_plain_text_documents_are_blank_line_separated(tmp_path, tokenizer_dir):
    path = tmp_path / "docs.txt"
    path.write_text("\n\n".join(DOCS) + "\n\n\n")
    assert [d.strip() for d in read_documents(path)] == DOCS
    capitals = path.rename(tmp_path / "DOCS.TXT")
    assert [d.strip() for d in read_documents(capitals)] == DOCS  # a .TXT file is text too
    path = capitals.rename(path)
    jsonl = tmp_path / "docs.jsonl"
    write_jsonl(jsonl, [{"text": d} for d in DOCS])
    from_text = TextBatches(path, tokenizer_dir, batch=2, seq=4, vocab_size=64)
    from_jsonl = TextBatches(jsonl, tokenizer_dir, batch=2, seq=4, vocab_size=64)
    assert torch.equal(from_text.tokens, from_jsonl.tokens) and torch.equal(from_text.valid, from_jsonl.valid)


def test_jsonl_skips_blank_lines_and_reads_utf8(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "caf\\u00e9"}\n\n   \n{"text": "日本"}\n', encoding="utf-8")
    assert list(read_documents(path)) == ["café", "日本"]


@pytest.mark.parametrize("line,message", [
    ('{"body": "no text field"}', ":2: JSONL records need a string 'text' field"),
    ('"just a string with text in it"', ":2: JSONL records need a string 'text' field"),
    ('{"text": null}', ":2: JSONL records need a string 'text' field"),
    ('{"text": "unterminated', ":2: not a JSON record"),
])
def test_bad_jsonl_record_names_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        list(read_documents(path))


def test_vocab_size_smaller_than_tokenizer_ids_is_refused(tmp_path, tokenizer_dir):
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [{"text": d} for d in DOCS])
    top = max(expected_stream(tokenizer_dir))
    TextBatches(path, tokenizer_dir, batch=1, seq=4, vocab_size=top + 1)
    with pytest.raises(ValueError, match=f"ids reach {top} but the model's vocab_size is {top}"):
        TextBatches(path, tokenizer_dir, batch=1, seq=4, vocab_size=top)


def test_the_eos_token_is_the_tokenizer_configs_else_a_known_name(tokenizer_dir):
    tok = Tokenizer(tokenizer_dir)
    assert tok.token(tok.eos) == EOS
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "end"}}))
    tok = Tokenizer(tokenizer_dir)
    assert tok.token(tok.eos) == "end" and tok.document("the end")[-1] == tok.eos


def test_missing_tokenizer_and_empty_data_are_refused(tmp_path, tokenizer_dir):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    with pytest.raises(ValueError, match="no tokenizer.json"):
        TextBatches(path, tmp_path, batch=1, seq=4, vocab_size=64)
    with pytest.raises(ValueError, match="holds no text"):
        TextBatches(path, tokenizer_dir, batch=1, seq=4, vocab_size=64)


def test_make_batches_picks_the_source(tmp_path, tokenizer_dir):
    case = SimpleNamespace(data="synthetic", batch=2, seq=8, seed=0, repeat_batch=True, tokenizer=None)
    assert isinstance(make_batches(case, 100), SyntheticTokens)
    path = tmp_path / "docs.jsonl"
    write_jsonl(path, [{"text": d} for d in DOCS])
    case = SimpleNamespace(data=str(path), batch=2, seq=8, seed=0, repeat_batch=False, tokenizer=str(tokenizer_dir))
    assert isinstance(make_batches(case, 100), TextBatches)
