"""Whether `train --resume` may load a checkpoint whose format can run code (a pickle: DeepSpeed's `*.pt`, torch
distributed checkpoint's `.metadata`): only if this user wrote it on this machine, or with --trust-checkpoint.

A checkpoint of such a system carries in its trainer.json an HMAC-SHA256, under a key of this user's, of the rest of
trainer.json, which holds the checksum of every file: a checkpoint copied from elsewhere, or edited (its checksums
recomputed), fails it. The key is 32 random bytes made whole (written aside, linked in) in the pre-flight of the first
run that signs, in the user's config directory ($XDG_CONFIG_HOME/megatrain/checkpoint.key, else
~/.config/megatrain/checkpoint.key), readable by this user only; a key of another length (an empty one signs for
anyone) or that others can read is refused, never used.
Formats that cannot run code (our raw tiles, safetensors, `torch.load(weights_only=True)`) need no key. The bytes
checked are the bytes loaded: a system opens each pickle once, through megatrain.checked_files.open_checked, which
checks them through that handle against the signed checksum and refuses a pickle another user could rewrite meanwhile.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import tempfile
from pathlib import Path

KEY_FILE = "checkpoint.key"
KEY_BYTES = 32
SIGNATURE = "hmac_sha256"  # the key of trainer.json that holds the HMAC of the rest of it


def key_path() -> Path:
    """The user's checkpoint key: $XDG_CONFIG_HOME/megatrain/checkpoint.key, else under ~/.config (as the XDG spec
    says, a relative XDG_CONFIG_HOME is ignored: it would name another key in each working directory)."""
    config = Path(os.environ.get("XDG_CONFIG_HOME") or "")
    return (config if config.is_absolute() else Path.home() / ".config") / "megatrain" / KEY_FILE


def _key(create: bool) -> bytes | None:
    """The user's key (made, with create, if there is none yet); ValueError naming its path for a key that proves
    nothing (another user could have read or written it, it is not 32 bytes) or that cannot be made or read."""
    path = key_path()
    if create and not os.path.lexists(path):
        _make_key(path)
    if not path.exists():
        if os.path.lexists(path):
            raise ValueError(f"{path}, the key that proves a checkpoint was written here, is a link to nothing: "
                             "delete it (a new one is made, and checkpoints it signed then need --trust-checkpoint)")
        return None
    st = path.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"{path}, the key that proves a checkpoint was written here, must be this user's and "
                         f"readable by no one else (owner uid {st.st_uid}, mode {st.st_mode & 0o777:o}): "
                         f"chown it to yourself and chmod 600 it, or delete it (checkpoints it signed then need "
                         "--trust-checkpoint)")
    try:
        key = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{path}, the key that proves a checkpoint was written here, cannot be read "
                         f"({exc.strerror}): make it a file this user can read, or delete it") from None
    if len(key) != KEY_BYTES:  # an empty key (a disk that filled as it was written) would let anyone sign
        raise ValueError(f"{path}, the key that proves a checkpoint was written here, holds {len(key)} bytes, not "
                         f"{KEY_BYTES}: it was cut short or replaced; delete it (a new one is made, and checkpoints "
                         "it signed then need --trust-checkpoint)")
    return key


def _make_key(path: Path) -> None:
    """KEY_BYTES random bytes written aside and linked in under path whole: a full disk or a kill leaves no key, not
    a short one, and of two processes making it at once the first's stands (a link never replaces a file)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mode 600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(secrets.token_bytes(KEY_BYTES))
                f.flush()
                os.fsync(f.fileno())
            os.link(tmp, path)
        except FileExistsError:  # another process made it meanwhile: that one is the key
            pass
        finally:
            os.unlink(tmp)
    except OSError as exc:
        raise ValueError(f"cannot make the checkpoint key {path} ({exc.strerror}): a run that saves a checkpoint in "
                         "a pickle format signs it with this key; make that directory writable (or free space there), "
                         "or point XDG_CONFIG_HOME at a writable one") from None


def check_key(create: bool) -> None:
    """The pre-flight of a run that will sign (create: the key is made if there is none) or check a pickle
    checkpoint: ValueError naming the key's path for a key that cannot be used, before anything runs."""
    _key(create)


def _digest(key: bytes, meta: dict) -> str:
    body = json.dumps({k: v for k, v in meta.items() if k != SIGNATURE}, sort_keys=True, separators=(",", ":"))
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


def signed(meta: dict) -> dict:
    """trainer.json's content `meta` (its file checksums included) with this user's HMAC of it."""
    return {**meta, SIGNATURE: _digest(_key(create=True), meta)}


def check_trusted(checkpoint: Path, meta: dict, pickled: tuple[str, ...], trust: bool) -> None:
    """Refuse (ValueError) to load a checkpoint whose files include pickles (`pickled`: glob patterns relative to
    it) unless its trainer.json `meta` carries this user's HMAC, every such file among its checksummed ones, or
    `trust` (--trust-checkpoint) says to load it anyway."""
    if not pickled or trust:
        return
    found = sorted(p.relative_to(checkpoint).as_posix() for pattern in pickled for p in checkpoint.glob(pattern))
    key, signature = _key(create=False), meta.get(SIGNATURE)
    if key is not None and isinstance(signature, str) and hmac.compare_digest(signature, _digest(key, meta)) \
            and set(found) <= set(meta.get("files") or {}):
        return
    first = checkpoint / (found[0] if found else pickled[0])
    why = "it carries no signature" if signature is None else f"its signature is not this user's key's ({key_path()})"
    raise ValueError(f"{first} is a pickle, and loading it runs whatever code it holds; this checkpoint was not "
                     f"written by this user on this machine, or was changed since ({why}): pass --trust-checkpoint "
                     "to load it if you trust whoever made it")
