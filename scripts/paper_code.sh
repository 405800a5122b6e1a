#!/usr/bin/env bash
# The paper's code for the `paper` system (megatrain/systems/paper_code.py): its package `infinity` and its SFT entry point
# (examples/sft/) at one commit of github.com/DLYuanGod/MegaTrain, copied out of a git checkout (or bare clone) into
# .paper/ at the repository root, with the commit in .paper/COMMIT. .paper/ is git-ignored and never committed; the
# offline GPU host gets it as a carried folder (as .whl/), where the system finds it without a setting
# (MEGATRAIN_PAPER_CODE=DIR points it anywhere else). Their compiled files (__pycache__, an aarch64 build of an
# extension the single-GPU path does not import, egg-info) stay behind.
# Usage: bash scripts/paper_code.sh CHECKOUT [REVISION]   (REVISION: 919520f, the commit our records name, by default)
set -euo pipefail
if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: bash scripts/paper_code.sh CHECKOUT [REVISION]  (CHECKOUT: a git clone of" \
         "https://github.com/DLYuanGod/MegaTrain)" >&2
    exit 2
fi
SOURCE=$(cd "$1" && pwd)  # absolute: the archive is taken after the cd to the repository root below
REVISION=${2:-919520f}
COMMIT=$(git -C "$SOURCE" rev-parse --verify --quiet "$REVISION^{commit}") || {
    echo "paper_code: $SOURCE has no commit $REVISION (a clone of DLYuanGod/MegaTrain, fetched?)" >&2
    exit 2
}
cd "$(dirname "$0")/.."
rm -rf .paper
mkdir .paper
git -C "$SOURCE" archive --format=tar "$COMMIT" -- infinity examples/sft LICENSE \
    ':(exclude,glob)**/__pycache__/**' ':(exclude,glob)**/build/**' ':(exclude,glob)**/*.egg-info/**' \
    | tar -x -C .paper
echo "$COMMIT" > .paper/COMMIT
echo "paper_code: .paper/ holds $(find .paper -name '*.py' | wc -l) Python files of DLYuanGod/MegaTrain $COMMIT" \
     "($(du -sh .paper | cut -f1))"
