"""Inductor's compile cache carried from one GPU run to the next: the lent machines start bare each session, so every
GPU suite run paid every first compile again (the generic path's fp32 sets 150-460 s each, ~2000 s of the suite's
~7400 s of check time: scripts/gpu_durations.py). The cache's FX graph entries hold their Triton kernels (Inductor
bundles them), so TORCHINDUCTOR_CACHE_DIR alone is packed; a carried entry that does not match (another torch,
another GPU, a changed graph) is a miss, compiled as before.
    python scripts/compile_cache.py pack CACHE_DIR OUT [--part-mib 15] [--max-mib 40]
        CACHE_DIR as OUT.0, OUT.1, ... (xz tar parts of at most --part-mib each: a device call brings back files of
        16 MiB at most); none where the whole would pass --max-mib (what a call may carry beside the tree), saying so
    python scripts/compile_cache.py unpack OUT CACHE_DIR
        the parts into CACHE_DIR, keeping what is there (Inductor's own entries win); a member that would land outside
        CACHE_DIR, or is not a plain file or folder, is refused
Only what our own GPU run wrote is unpacked (Inductor reads its entries with pickle): the parts come back from the
device call and are carried to the next one, never taken from elsewhere."""

import argparse
import io
import lzma
import sys
import tarfile
from pathlib import Path

MIB = 2**20


def parts_of(out: Path) -> list[Path]:
    """OUT.0, OUT.1, ... as they are on disk, in order."""
    parts = []
    while (part := out.with_name(f"{out.name}.{len(parts)}")).is_file():
        parts.append(part)
    return parts


def pack(cache_dir: Path, out: Path, part_mib: float = 15.0, max_mib: float = 40.0) -> list[Path]:
    """CACHE_DIR's files (less Inductor's lock files) as xz tar parts OUT.0, OUT.1, ...; [] where the whole would be
    over max_mib. Old parts of OUT are removed first, so a smaller cache leaves no stale tail."""
    for old in parts_of(out):
        old.unlink()
    buffer = io.BytesIO()
    raw = 0
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=3) as tar:
        for path in sorted(cache_dir.rglob("*")):
            relative = path.relative_to(cache_dir)
            if path.is_file() and not path.is_symlink() and relative.parts[0] != "locks":
                tar.add(path, arcname=str(relative), recursive=False)
                raw += path.stat().st_size
    data = buffer.getvalue()
    print(f"compile_cache: {cache_dir} {raw / MIB:.1f} MiB in files, {len(data) / MIB:.1f} MiB packed")
    if len(data) > max_mib * MIB:
        print(f"compile_cache: not packed: over --max-mib {max_mib:g}")
        return []
    step = int(part_mib * MIB)
    parts = []
    for n, start in enumerate(range(0, len(data), step)):
        part = out.with_name(f"{out.name}.{n}")
        part.write_bytes(data[start:start + step])
        parts.append(part)
    print(f"compile_cache: {len(parts)} part(s): {', '.join(p.name for p in parts)}")
    return parts


def unpack(out: Path, cache_dir: Path) -> int:
    """The parts of OUT into cache_dir, leaving its own files as they are; the count of files added."""
    parts = parts_of(out)
    if not parts:
        raise SystemExit(f"compile_cache: no {out.name}.0 beside {out}: nothing to unpack")
    data = b"".join(p.read_bytes() for p in parts)
    try:
        tar = tarfile.open(fileobj=io.BytesIO(data), mode="r:xz")
        members = tar.getmembers()  # the whole archive read: a part lost on the way shows here, before anything lands
    except (tarfile.TarError, lzma.LZMAError, EOFError) as e:
        raise SystemExit(f"compile_cache: {out.name}.* is not a whole archive ({e}): pack it again") from e
    root = cache_dir.resolve()
    added = 0
    with tar:
        for member in members:  # all of them first: a refused archive leaves nothing behind
            if not (member.isfile() or member.isdir()) or not (root / member.name).resolve().is_relative_to(root):
                raise SystemExit(f"compile_cache: refused {member.name!r}: not a plain file or folder inside the "
                                 "cache")
        for member in members:
            target = (root / member.name).resolve()
            if member.isfile() and not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
                added += 1
    print(f"compile_cache: {added} file(s) from {len(parts)} part(s) into {cache_dir}")
    return added


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verbs = parser.add_subparsers(dest="verb", required=True)
    packing = verbs.add_parser("pack")
    packing.add_argument("cache_dir", type=Path)
    packing.add_argument("out", type=Path)
    packing.add_argument("--part-mib", type=float, default=15.0)
    packing.add_argument("--max-mib", type=float, default=40.0)
    unpacking = verbs.add_parser("unpack")
    unpacking.add_argument("out", type=Path)
    unpacking.add_argument("cache_dir", type=Path)
    args = parser.parse_args(argv)
    if args.verb == "pack":
        if not args.cache_dir.is_dir():
            raise SystemExit(f"compile_cache: no cache at {args.cache_dir}: nothing compiled there")
        pack(args.cache_dir, args.out, args.part_mib, args.max_mib)
    else:
        unpack(args.out, args.cache_dir)


if __name__ == "__main__":
    sys.exit(main())
