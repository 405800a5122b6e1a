"""`megatrain.Engine`: one training system over a model, driven a step at a time by a loop, train's
(megatrain.train.loop) or another program's. Both open it by the one build sequence here: the settings by train's rules
(EngineSettings), the model (a registry shape, or a checkpoint folder by the one road, megatrain.models.checkpoint),
the case and its pre-flight (plan), the system (Engine.built), its first weights (the checkpoint's, or a saved
state's) and the Hugging Face export."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager, suppress
from pathlib import Path

import torch

import megatrain.user_files as user_files
from megatrain.build_log import build_lines_to
from megatrain.checked_files import checked_loads, files_problem, mismatch
from megatrain.config import CaseConfig
from megatrain.engine import distributed
from megatrain.engine.distributed import Ranks
from megatrain.models.checkpoint import Checkpoint, open_checkpoint
from megatrain.models.loss import IGNORE_INDEX
from megatrain.optim.config import check_lr
from megatrain.preflight import preflight
from megatrain.run_config import DTYPES
from megatrain.systems import build_system, system_spec
from megatrain.train import checkpoint, trust
from megatrain.train.config import EngineSettings, check_device
from megatrain.train.export import EXPORT_FILE, export_checkpoint, export_dtype, not_exported
from megatrain.train.rundir import written_aside

STATE_FILE = "engine_state.json"  # Engine.save's: its files' checksums (and this user's signature, for pickles)


def plan(settings: EngineSettings, source: Checkpoint | None) -> tuple[CaseConfig, list[str]]:
    """(the case `settings` train, what a run of it says before it starts). The case is of one step: its length is the
    loop's. The lines are the checkpoint's notes and the pre-flight's, which refuses what does not fit this machine.
    `source` is the checkpoint settings.init_from names, opened (None: settings.model, a registry shape)."""
    label = source.path.name if source else settings.model
    case = settings.make_case(label, model_shape=source.shape if source else None, steps=1, warmup=0)
    return case, [*(source.notes if source else ()), *preflight(case)]


class Engine:
    """One training system (MegaTrain's engine by default) over a model, for a training loop (another program's;
    train's own opens it by Engine.built): each `step` is one AdamW step over a batch, the loss (token cross-entropy)
    computed inside. `model` is a local Hugging Face checkpoint directory (its weights loaded) or a registry shape
    (python -m megatrain models, initialised from `seed`). The settings are train's, by the same names and with its
    defaults (device cpu: give device="cuda", dtype="bfloat16" on a GPU; generic=True, train's --generic); `option`
    holds the system's (--option KEY=VALUE). `log` takes every line it says, the build's included. Under torchrun
    every rank makes the same Engine and steps the same global batch, as train's ranks do: each trains its share of
    the rows, and the state is one copy in host memory; save and export write from rank 0 and return on every rank
    once written."""

    def __init__(self, model: str | os.PathLike, *, seq: int = EngineSettings.seq, batch: int = EngineSettings.batch,
                 micro_batch: int = EngineSettings.micro_batch, system: str = EngineSettings.system,
                 device: str = EngineSettings.device, dtype: str = EngineSettings.dtype,
                 precision: str = EngineSettings.precision, lr: float = EngineSettings.lr,
                 weight_decay: float = EngineSettings.weight_decay,
                 max_grad_norm: float = EngineSettings.max_grad_norm,
                 adam_betas: tuple[float, float] = EngineSettings.adam_betas,
                 adam_eps: float = EngineSettings.adam_eps, moments: str = EngineSettings.moments,
                 seed: int = EngineSettings.seed, compile: bool = False, generic: bool = EngineSettings.generic,
                 option: dict | None = None, log=print):
        if not isinstance(model, str | os.PathLike):
            raise ValueError(f"Engine's model is a Hugging Face checkpoint directory or a registry name, got {model!r}")
        path = Path(model).expanduser()
        # a path (not a registry name: those have no '/'), found or not: one not found is 'no such directory', as
        # train --init-from says, not an unknown registry name
        is_dir = path.is_dir() or isinstance(model, os.PathLike) or os.sep in os.fspath(model) \
            or os.fspath(model).startswith((".", "~"))
        named = {"init_from": str(path)} if is_dir else {"model": os.fspath(model)}
        settings = EngineSettings(**named, generic=generic, seq=seq, batch=batch, micro_batch=micro_batch,
                                  system=system, device=device, dtype=dtype, precision=precision, lr=lr,
                                  weight_decay=weight_decay, max_grad_norm=max_grad_norm, adam_betas=adam_betas,
                                  adam_eps=adam_eps, moments=moments, seed=seed, compile=compile,
                                  option={} if option is None else option)
        check_device(device)
        ranks = distributed.current(device)  # under torchrun: this rank's (the process groups made here)
        if not ranks.first:
            log = _silent  # rank 0 speaks for the ranks, as train's does
        # the one road train --init-from takes: its model (hand-written or transformers' own) and config.json
        source = open_checkpoint(path, generic) if is_dir else None
        case, notes = plan(settings, source)
        for note in notes:
            log(note)
        if system_spec(system).pickled:  # its save signs with the user's key: one that cannot is refused now
            if ranks.first:
                trust.check_key(create=True)
            ranks.barrier()
            trust.check_key(create=False)
        with build_lines_to(log):
            self._build(case, source, ranks)
        self.load_checkpoint()

    @classmethod
    def built(cls, case: CaseConfig, source: Checkpoint | None, ranks: Ranks) -> Engine:
        """The engine of a planned case (plan's, its steps the caller's) on `ranks`, as Engine() builds it: its system
        built (its lines to the build log), at the seed's initial weights until load_checkpoint or load_state."""
        engine = cls.__new__(cls)
        engine._build(case, source, ranks)
        return engine

    def _build(self, case: CaseConfig, source: Checkpoint | None, ranks: Ranks) -> None:
        self.case, self.checkpoint, self.ranks = case, source, ranks
        self.model_dir = source.path if source else None
        self._system = build_system(case)

    @property
    def system(self):
        """The training system (megatrain.systems_registry.TrainSystem) this engine drives."""
        if self._system is None:
            raise ValueError("the engine is closed (close(), or its with block ended): make a new Engine")
        return self._system

    def load_checkpoint(self) -> None:
        """The weights of the checkpoint the engine was made of (none: a registry shape, its seed's stand)."""
        if self.checkpoint:
            self.system.load_weights(self.checkpoint.weights())

    def load_state(self, d: Path, files: dict, trust_checkpoint: bool) -> None:
        """The state the system saved in folder d, every file it opens held to `files` (its record's checksums; a
        pickle only where trusted: megatrain.checked_files)."""
        with checked_loads(d, files, trust_checkpoint):
            self.system.load_state(d)

    def step(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """One optimizer step over input_ids [rows, tokens] (at most batch x seq, right-padded; fewer are padded with
        rows and tokens that are no target); labels as Hugging Face's causal models take them: the same shape, the
        model shifts them, -100 where no loss (None: every next token). Returns the mean token loss."""
        return self.system.step(*self._batch(input_ids, labels))

    def evaluate(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> float:
        """The mean token loss of a batch, as `step` reads it, without gradients or an update."""
        return self.system.evaluate(*self._batch(input_ids, labels))

    @property
    def last_grad_norm(self) -> float:
        """The global gradient norm of the last step, before clipping."""
        return self.system.last_grad_norm

    def set_lr(self, lr: float) -> None:
        """The learning rate of the following steps (a schedule is the caller's): a finite number >= 0."""
        check_lr(lr)
        self.system.set_lr(lr)

    def save(self, path: str | os.PathLike) -> None:
        """The full training state (weights, AdamW moments, step counts) into the directory `path`, swapped in whole
        once written (an existing one is replaced), with its files' checksums (signed with this user's key where the
        system's state holds pickles, as train's checkpoints are); `load` continues from it."""
        d = Path(path)
        if d.exists():  # replaced whole: only a state this program saved, its files as its record lists them
            listed = set()
            with suppress(ValueError):
                listed = {STATE_FILE, *_state_record(d)["files"]}
            if not d.is_dir() or (strays := user_files.strangers(d, listed)):
                what = "is a file" if not d.is_dir() else f"holds {d / strays[0]}, which its {STATE_FILE} does not list"
                raise ValueError(f"Engine.save({str(d)!r}): {d} {what}: Engine.save did not write it, and saving there "
                                 "would delete it; choose another path")
        if not self.ranks.first:  # every rank takes part, rank 0 writes the one copy of the state
            self.system.save_state(None)
            self.ranks.barrier()
            return
        with _writing(d, "Engine.save"), written_aside(d) as tmp:
            self.system.save_state(tmp)
            # the steps whose dropout was drawn: a loaded engine draws the next step's masks (megatrain.models.draws)
            meta = {} if (draws := getattr(self.system, "draws", None)) is None else {"steps_drawn": draws.step}
            checkpoint.seal(tmp, meta, system_spec(self.case.system).pickled, STATE_FILE)
        self.ranks.barrier()

    def load(self, path: str | os.PathLike, trust_checkpoint: bool = False) -> None:
        """Continue from a `save` directory: the next step is as if training had never stopped. A state whose files
        do not match their checksums is refused; one holding pickles (DeepSpeed's, FSDP's) loads only if this user
        saved it here, or with trust_checkpoint (loading a pickle runs whatever code it holds)."""
        d = Path(path)
        record = _state_record(d)
        if problem := mismatch(d, record["files"]):
            raise ValueError(f"{problem}: the state in {d} was changed or damaged since it was saved")
        checkpoint.check_system(d, record["files"], self.case.system,
                                f"load it into an Engine of that system (this one's is system={self.case.system!r})")
        trust.check_trusted(d, record, system_spec(self.case.system).pickled, trust_checkpoint)
        if (draws := getattr(self.system, "draws", None)) is not None:
            drawn = record.get("steps_drawn", 0)
            if not isinstance(drawn, int) or isinstance(drawn, bool) or drawn < 0:
                raise ValueError(f"{d / STATE_FILE}: steps_drawn must be an integer >= 0, got {drawn!r}: it is not "
                                 "what Engine.save writes")
        self.load_state(d, record["files"], trust_checkpoint)
        if draws is not None:
            draws.step = drawn

    def export(self, path: str | os.PathLike, tokenizer_dir: str | os.PathLike | None = None,
               dtype: str | None = None) -> Path:
        """The current weights as a Hugging Face checkpoint in `path`, as train exports them: the model directory's
        config.json carried over, with the tokenizer files and generation config of tokenizer_dir (default: the model
        directory's); the weights in `dtype` (train's --export-dtype: default the model directory's, else the
        compute dtype)."""
        tokenizer = tokenizer_dir or self.model_dir
        if Path(path).exists() and not Path(path).is_dir():
            raise ValueError(f"Engine.export({str(path)!r}) is a file, which the export would replace: choose a folder")
        if theirs := not_exported(Path(path)):
            raise ValueError(f"Engine.export({str(path)!r}): {path} holds {theirs[0]}, which no export wrote there (it "
                             f"has no {EXPORT_FILE}), and exporting there would replace it: choose another folder")
        if dtype not in (None, *DTYPES):
            raise ValueError(f"Engine.export's dtype must be one of {DTYPES}, got {dtype!r}")
        with _writing(Path(path), "Engine.export"):
            self.write_export(Path(path), None if tokenizer is None else os.fspath(tokenizer),
                              {"engine": self.case.model}, export_dtype(dtype, self._source_config, self.case)[0])
        self.ranks.barrier()
        return Path(path)

    def write_export(self, path: Path, tokenizer_dir: str | None, provenance: dict, dtype: torch.dtype) -> None:
        """The current weights in `dtype` as a Hugging Face checkpoint in `path` (the checkpoint's config.json, the
        tokenizer files of tokenizer_dir, `provenance` in its EXPORT_FILE), written by rank 0: every rank gives its
        part of the weights."""
        weights = self.system.export_weights()  # with several ranks, every rank's part: the weights are on rank 0
        if self.ranks.first:
            export_checkpoint(weights, self.case, path, tokenizer_dir, provenance, dtype, self._source_config)

    @property
    def _source_config(self) -> dict | None:
        """The config.json of the checkpoint trained from, which an export's starts from (None: a registry shape)."""
        return self.checkpoint.config if self.checkpoint else None

    def close(self) -> None:
        """Release the system's memory, threads and pinned buffers (once: closing again does nothing)."""
        if self._system is not None:
            self._system.close()
            self._system = None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _batch(self, input_ids: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [batch, seq]: targets[:, i] is the token after inputs[:, i]; padding is no
        target."""
        vocab = self.case.shape().vocab_size
        _check_ids("input_ids", input_ids, vocab)
        rows, tokens = input_ids.shape
        batch, seq = self.case.batch, self.case.seq
        if rows > batch or tokens > seq:
            raise ValueError(f"a batch of {rows} x {tokens} tokens is larger than the engine's batch x seq, {batch} x "
                             f"{seq}: give Engine(batch=, seq=) the largest batch you step")
        labels = input_ids if labels is None else labels
        _check_ids("labels", labels, vocab, IGNORE_INDEX)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} differ in shape")
        inputs = torch.zeros(batch, seq, dtype=torch.long)
        targets = torch.full((batch, seq), IGNORE_INDEX, dtype=torch.long)
        inputs[:rows, :tokens] = input_ids
        targets[:rows, :max(tokens - 1, 0)] = labels[:, 1:]
        if not (targets != IGNORE_INDEX).any():
            raise ValueError("the batch has no target: every label is -100, or rows of fewer than two tokens")
        return inputs, targets


def _silent(line: str) -> None:
    """The log of a rank other than 0: rank 0 speaks for the ranks."""


def _check_ids(name: str, ids, vocab: int, ignore: int | None = None) -> None:
    """ValueError unless ids is a [rows, tokens] tensor of token ids of a vocabulary of `vocab` (or `ignore`)."""
    if not isinstance(ids, torch.Tensor) or ids.ndim != 2 or ids.dtype.is_floating_point or ids.dtype.is_complex \
            or ids.dtype == torch.bool:
        got = f"a {type(ids).__name__}" if not isinstance(ids, torch.Tensor) else \
            f"a {ids.ndim}-D tensor of {str(ids.dtype).removeprefix('torch.')}"
        raise ValueError(f"{name} must be a 2-D torch.Tensor of token ids ([rows, tokens], an integer dtype), got "
                         f"{got}: torch.tensor(ids) of a list of rows, .long() of floats")
    ids = ids.long()  # uint8's 255 + 1 is 0
    outside = (ids < 0) | (ids >= vocab)
    bad = ids[outside & (ids != ignore) if ignore is not None else outside]
    if bad.numel():
        allowed = f"{ignore} (no loss) or " if ignore is not None else ""
        raise ValueError(f"{name} holds {int(bad[0])}, which is not {allowed}a token id of the model's vocabulary "
                         f"(0 to {vocab - 1}): a tokenizer of another model?")


def _state_record(d: Path) -> dict:
    """The record Engine.save wrote in d (STATE_FILE: its files' checksums); ValueError where it is not one."""
    user_files.plain_entry(d / STATE_FILE, "the record of Engine.save's state")
    try:
        record = json.loads((d / STATE_FILE).read_bytes())
    except (OSError, ValueError, RecursionError):
        raise ValueError(f"{d} is not what Engine.save writes: {STATE_FILE} is missing or unreadable") from None
    problem = files_problem(record.get("files")) if isinstance(record, dict) else "in an object"
    if problem:
        raise ValueError(f"{d / STATE_FILE}: files must be {problem}: it is not what Engine.save writes")
    return record


@contextmanager
def _writing(path: Path, what: str):
    """An OSError writing `path` (a full disk, a read-only or missing directory) as a ValueError naming it; what was
    there stands (it is written aside and swapped in only once complete). What it writes is writable by this user
    alone (user_files.private)."""
    try:
        with user_files.private():
            yield
    except OSError as exc:
        raise ValueError(f"{what}({str(path)!r}): cannot write there ({exc.strerror}); nothing was replaced: free "
                         "space, or choose a writable directory") from None
