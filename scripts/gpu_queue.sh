#!/usr/bin/env bash
# Run several suites back to back on the GPU host, past the 10-minute limit of one device call.
#
#   bash scripts/gpu_queue.sh start 'SUITE [suite args]' ['run COMMAND ARGS' ...]
#       installs the DeepSpeed wheelhouse (.whl, scripts/wheelhouse.sh) and runs the suites in order
#       (an item 'run CMD...' runs CMD) in a new process session, which outlives the call; a suite
#       runs the cases of this machine's profile (add --any-hardware to an item to run the others too);
#       the log is /tmp/megatrain-queue/log.
#   bash scripts/gpu_queue.sh collect SECONDS SUITE [SUITE ...]
#       waits until the queue ends or SECONDS pass, then puts the log and a tarball of each
#       suite's results (paths results/SUITE/...) into $OUT. Each call of it keeps the lent machine
#       busy (and so held); the next call must follow within the machine's idle release (30 s). On a machine
#       without the queue (the lent one was given back in between: a fresh one started) it ends at once, status 3,
#       instead of holding the new machine for SECONDS (it did: 540 s of a session's 1800 spent waiting on nothing).
#       At most 8 files come back from $OUT: put more into a tarball. A chain of collects is not guaranteed even
#       when each call follows the last at once: one of two such hand-overs found a fresh machine (the queue and
#       its unfinished items lost, ~140 s of a fresh start spent). Order the queue most telling first, and keep
#       work whose records must come back within the first call's window.
#
# Prefer self-contained calls that resume where a chain would lose its tail: a suite resumes its run by case id at
# the same commit (`cp -r results/SUITE $OUT/SUITE; python3 -m megatrain suite SUITE --out-dir $OUT/SUITE`, the
# records committed between calls), and scripts/gpu_checks.sh resumes from its record. At 4e32950 the second call of
# a queue found a fresh machine and 73 of the GPU suite's 228 checks went with the first.
#
# Every call that starts a queue carries .whl and .paper (the device tool's carry; both are git-ignored): without
# them DeepSpeed's and the paper's cases are recorded skipped, and a later call must carry them for the resumed
# suite to run those cases again (it does: a skip for what the machine lacked is not final).
#
# Results go to /tmp/megatrain-queue/results/SUITE, outside the repository copy: each device call
# re-syncs that copy from the developer's tree, which would replace or delete records written
# into results/ by an earlier call (it did: one record was lost that way). Every case's record is
# appended as it finishes, so each collect brings back all measured so far; unpack the tarballs
# into the repository's results/. `python -m megatrain suite` resumes a run by case id.
#
# Example (a lent 512 GiB host, one of its GPUs):
#   export MEGATRAIN_HOST_MEM_GIB=500 MEGATRAIN_COMMIT=<sha> MEGATRAIN_DIRTY=0 MEGATRAIN_HOST_KIND=nvidia-h200-x4
#   export CUDA_VISIBLE_DEVICES=0
#   bash scripts/gpu_queue.sh start "reproduce_14b --only '^paper '" smoke_gpu && \
#       bash scripts/gpu_queue.sh collect 540 reproduce_14b smoke_gpu
set -uo pipefail
Q=/tmp/megatrain-queue
mode=$1; shift
case "$mode" in
start)
    mkdir -p "$Q"; rm -f "$Q/done"
    if ls .whl/*.whl >/dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || exit 1
    fi
    # each suite appends to a copy of the repository's records, so a collected tarball holds them all
    # and a run at the same commit resumes
    printf '%s\n' "$@" > "$Q/items"
    while IFS= read -r item; do
        eval "set -- $item"
        if [ "$1" != run ] && [ -d "results/$1" ] && [ ! -d "$Q/results/$1" ]; then
            mkdir -p "$Q/results" && cp -r "results/$1" "$Q/results/$1"
        fi
    done < "$Q/items"
    setsid bash -c '
        export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        while IFS= read -r item; do
            echo "=== $(date -u +%FT%TZ) $item"
            eval "set -- $item"
            if [ "$1" = run ]; then
                shift; "$@"
            else
                suite=$1; shift
                python3 -m megatrain suite "$suite" --out-dir "'"$Q"'/results/$suite" "$@"
            fi
            rc=$?
            echo "=== $(date -u +%FT%TZ) exit $rc: $item"
        done < '"$Q"'/items
        touch '"$Q"'/done' > "$Q/log" 2>&1 < /dev/null &
    echo "queue started: $(wc -l < "$Q/items") suites; log $Q/log"
    ;;
collect)
    seconds=$1; shift
    if [ ! -e "$Q/log" ]; then  # a fresh machine: the one that ran the queue was given back (idle 30 s) with it
        echo "no queue on this machine: the machine that ran it was given back, and its results with it" >&2
        exit 3
    fi
    end=$((SECONDS + seconds))
    while [ ! -e "$Q/done" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    O=${OUT:-/tmp/out}; mkdir -p "$O"
    cp "$Q/log" "$O/queue.log" 2>/dev/null
    grep -v '^{' "$Q/log" | tail -n 40
    for suite in "$@"; do
        [ -d "$Q/results/$suite" ] && tar czf "$O/$suite.tgz" -C "$Q" "results/$suite"
    done
    [ -e "$Q/done" ] && echo "queue: done" || echo "queue: still running"
    ;;
*)
    echo "usage: $0 start 'SUITE [args]'... | collect SECONDS SUITE..." >&2; exit 2 ;;
esac
