"""Data parallel over torchrun ranks on CPU (gloo): N ranks train as one process does, keep one host copy of the
state, and a rank that dies leaves the last checkpoint to resume from. CPU only; the subprocess ones start torchrun
(~10 s each on two cores): pytest tests/unit/test_distributed.py"""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types

import pytest
import torch
from safetensors.torch import load_file
from train_helpers import LR, ROOT, hf_model, metrics, pretokenized, run_train, train_args

from megatrain.engine.config import EngineConfig
from megatrain.engine.distributed import RANK_TIMEOUT_ENV, RankLost, Ranks, per_rank
from megatrain.engine.host_optimizer import HostOptimizer
from megatrain.engine.plan import check_fits, plan_memory
from megatrain.engine.store import HostStore
from megatrain.memory import GIB, GPU_RESERVE_BYTES, PROCESS_OVERHEAD_BYTES, Budget
from megatrain.models import model_shape
from megatrain.optim import fused
from megatrain.optim.config import OptimConfig
from megatrain.optim.state_bytes import QBLOCK

SAVES = ["--save-every", "2", "--batch", "12", "--micro-batch", "1"]  # whole micro-batches on 1, 2, 3 or 2 x 2 ranks


def launch(launcher: list[str], args: list[str], fault: str | None = None) -> subprocess.Popen:
    """`torchrun LAUNCHER -m megatrain ARGS` from the repository root, one thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("MEGATRAIN_FAULT", None)
    if fault:
        env["MEGATRAIN_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *launcher, "-m", "megatrain",
                             *map(str, args)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def torchrun(nproc: int, args: list[str], fault: str | None = None) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc-per-node nproc -m megatrain ARGS`, run to its end (--standalone: a free port,
    so launches of tests run side by side cannot take each other's)."""
    proc = launch(["--standalone", "--nproc-per-node", str(nproc)], args, fault)
    stdout, stderr = proc.communicate(timeout=300)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """A tiny model, 24 rows of data, and its 6-step run in this process (no torchrun): the reference."""
    root = tmp_path_factory.mktemp("dp")
    init, data = hf_model("qwen2", root / "init"), pretokenized(root / "data.jsonl", rows=24)
    assert run_train(init, data, root / "one", steps=6, extra=SAVES) == 0
    return init, data, root


@pytest.fixture(scope="module")
def two_ranks(one_process):
    """The reference's 6-step run on 2 ranks, trained once for the tests that hold it against another."""
    init, data, root = one_process
    out = root / "ranks-2"
    _ok(torchrun(2, train_args(init, data, out, steps=6, extra=SAVES)))
    return out


def _weights(out):
    return load_file(out / "hf" / "model.safetensors")


def _assert_close_runs(out, ref):
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics(out)]),
                               torch.tensor([m["loss"] for m in metrics(ref)]), rtol=1e-6, atol=0)
    a, b = _weights(out), _weights(ref)
    assert a.keys() == b.keys()
    for name in a:  # as the engine against native (test_engine): Adam turns the k bias's ~0 gradient's noise into steps
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


def _assert_near_runs(out, ref):
    """_assert_close_runs for compact moments: the ranks sum gradients in another order than one process, which moves
    a few moments across a rounding boundary (bf16's stochastic one, an int8 level) and those elements' steps by a
    fraction of the learning rate (seen: ~30 of 99k elements, by <7e-5); a shard updated twice or not at all moves
    nearly every element."""
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics(out)]),
                               torch.tensor([m["loss"] for m in metrics(ref)]), rtol=1e-5, atol=0)
    a, b = _weights(out), _weights(ref)
    assert a.keys() == b.keys()
    diff = torch.cat([(a[name] - b[name]).abs().flatten() for name in a])
    assert diff.max() <= LR and (diff > 1e-5).float().mean() < 0.01


@pytest.mark.subprocess
def test_two_ranks_train_as_one_process_at_the_same_global_batch(one_process, two_ranks):
    _assert_close_runs(two_ranks, one_process[2] / "one")


@pytest.mark.subprocess
def test_three_ranks_with_resident_layers_train_as_one_process_at_the_same_global_batch(one_process):
    init, data, root = one_process
    out = root / "ranks-3"
    options = ["--option", "resident_embedding=true", "--option", "resident_layers=1"]
    _ok(torchrun(3, train_args(init, data, out, steps=6, extra=SAVES + options)))
    _assert_close_runs(out, root / "one")


@pytest.mark.subprocess
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_two_ranks_with_compact_moments_train_as_one_process_with_them(one_process, moments):
    """The shared store holds the compact moments; each rank encodes its shard's (whole int8 blocks) as one would."""
    init, data, root = one_process
    extra = SAVES + ["--moments", moments]
    assert run_train(init, data, root / f"one-{moments}", steps=6, extra=extra) == 0
    out = root / f"ranks-2-{moments}"
    _ok(torchrun(2, train_args(init, data, out, steps=6, extra=extra)))
    _assert_near_runs(out, root / f"one-{moments}")


@pytest.mark.subprocess
def test_two_ranks_train_a_mixture_of_experts_with_its_load_balancing_loss_as_one_process(tmp_path):
    """Each rank's micro-batches weigh their share of the global batch in the load-balancing loss (weighed as the
    whole batch, the loss would differ from the first step). The weights as compact moments' are compared: an expert
    or head row whose gradient is rounding noise takes Adam steps of either sign in another summation order."""
    init, data = hf_model("qwen3-moe-aux", tmp_path / "init"), pretokenized(tmp_path / "data.jsonl", rows=24)
    assert run_train(init, data, tmp_path / "one", steps=4, extra=SAVES) == 0
    _ok(torchrun(2, train_args(init, data, tmp_path / "two", steps=4, extra=SAVES)))
    torch.testing.assert_close(torch.tensor([m["loss"] for m in metrics(tmp_path / "two")]),
                               torch.tensor([m["loss"] for m in metrics(tmp_path / "one")]), rtol=1e-6, atol=0)
    _assert_near_runs(tmp_path / "two", tmp_path / "one")


@pytest.mark.subprocess
def test_two_simulated_nodes_of_two_ranks_train_as_one_process(one_process):
    """Hybrid: one copy of the state per node, shards summed within the node then across nodes."""
    init, data, root = one_process
    out = root / "2-nodes-x-2"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    nodes = [launch(["--nnodes", "2", "--node-rank", str(k), "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                     "--master-port", str(port)], train_args(init, data, out, steps=6, extra=SAVES)) for k in (0, 1)]
    for node in nodes:
        _, stderr = node.communicate(timeout=300)
        assert node.returncode == 0, stderr[-4000:]
    _assert_close_runs(out, root / "one")


@pytest.mark.subprocess
def test_the_state_is_in_host_memory_once_whatever_the_ranks():
    proc = _ok(torchrun(3, ["bench", "--system", "megatrain", "--model", "tiny", "--batch", "3", "--micro-batch", "1",
                            "--seq", "8", "--steps", "2", "--json"]))
    metrics = json.loads(proc.stdout.strip().splitlines()[-1])["metrics"]
    store = metrics["host_store_bytes"]
    assert metrics["ranks"] == 3
    # summed over the ranks, the pages of the shared state count once (to the kernel's rounding of each rank's PSS to
    # KiB per mapping, 4 KiB pages, and the update counts beside), not three times
    assert store * 0.99 <= metrics["host_state_pss_bytes_node"] <= store * 1.01
    assert metrics["host_state_rss_bytes"] > store / 3  # rank 0 maps it all, touching more than its shard


@pytest.mark.subprocess
def test_a_dead_rank_stops_the_run_and_its_resume_is_bitwise_the_uninterrupted_one(one_process, two_ranks):
    init, data, root = one_process
    straight, cut = two_ranks, root / "cut"
    killed = torchrun(2, train_args(init, data, cut, steps=6, extra=SAVES), fault="rank-1-step-3")
    assert killed.returncode != 0
    assert f"its last complete checkpoint {cut / 'checkpoints' / 'step-2'} is intact" in killed.stderr
    assert sorted(p.name for p in (cut / "checkpoints").iterdir()) == ["step-2"]
    other_n = root / "cut-resumed-on-3"
    shutil.copytree(cut, other_n)
    _ok(torchrun(2, ["train", "--resume", cut]))
    assert [m["loss"] for m in metrics(cut)] == [m["loss"] for m in metrics(straight)]
    assert all(torch.equal(a, b) for a, b in zip(_weights(cut).values(), _weights(straight).values(), strict=True))
    _ok(torchrun(3, ["train", "--resume", other_n]))  # one copy of the state: any number of ranks resumes it
    _assert_close_runs(other_n, straight)


@pytest.mark.subprocess
def test_a_stopped_rank_ends_the_run_in_one_line_naming_it_within_the_rank_timeout(one_process, monkeypatch):
    """SIGSTOP: alive, holding its sockets, answering no one; the other rank waited forever (its share of an update)
    or 30 minutes (a collective)."""
    init, data, root = one_process
    out = root / "stopped"
    monkeypatch.setenv(RANK_TIMEOUT_ENV, "5")
    proc = launch(["--standalone", "--nproc-per-node", "2"], train_args(init, data, out, steps=6, extra=SAVES),
                  fault="stop-rank-1-step-3")
    try:
        t0 = time.monotonic()
        line = next((line for line in proc.stderr if line.startswith("error: ")), "")
        took_s = time.monotonic() - t0
        stopped = re.search(r"rank 1 \(pid (\d+), stopped\)", line)
        assert stopped, line
        os.kill(int(stopped[1]), signal.SIGKILL)  # as whoever stopped it would, so that torchrun ends now
        assert proc.wait(timeout=120) != 0
    finally:
        proc.kill()
    assert took_s < 60, "five seconds of waiting, the rest starting up"
    assert f"its last complete checkpoint {out / 'checkpoints' / 'step-2'} is intact" in line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-2"]


def test_the_wait_for_a_stopped_ranks_share_of_an_update_is_bounded_and_names_it():
    from megatrain.engine.shared_store import ShardedHostOptimizer

    other = subprocess.Popen(["sleep", "60"])
    try:
        os.kill(other.pid, signal.SIGSTOP)
        waiting = ShardedHostOptimizer.__new__(ShardedHostOptimizer)  # the wait alone: no store, no worker
        done = threading.Event()
        done.set()
        waiting.done, waiting._error, waiting.skip, waiting.submitted, waiting.limit_s = [done], None, set(), 1, 0.3
        waiting.store = types.SimpleNamespace(updates=torch.tensor([[1], [0]]), pids=torch.tensor([os.getpid(),
                                                                                                    other.pid]))
        t0 = time.monotonic()
        with pytest.raises(RankLost, match=rf"local rank 1 \(pid {other.pid}, stopped\) has not done its share of "
                                           rf"unit 0's update in 0.3 s \({RANK_TIMEOUT_ENV}\)"):
            waiting.wait(0)
        assert time.monotonic() - t0 < 5
    finally:
        other.kill()
        other.wait()


def test_shards_tile_each_unit_in_aligned_pieces_and_the_last_rank_takes_the_rest():
    for world in (1, 2, 3, 7):
        for numel in (1, 64, 16448, 43264, 10**6 + 3):
            spans = [Ranks(r, world, torch.device("cpu"), None).shard(numel) for r in range(world)]
            assert spans[0][0] == 0 and spans[-1][1] == numel
            assert all(lo % 128 == 0 for lo, _ in spans)
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))  # back to back


@pytest.mark.parametrize("kernel", ["fused", "torch"])
@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_three_ranks_shards_updated_apart_equal_the_whole_update(kernel, moments):
    """ShardedHostOptimizer's shards (Ranks.shard) through HostOptimizer._update, one rank after another on one
    store, against one optimizer updating every unit whole: bitwise, int8 blocks and the decay split included."""
    if kernel == "fused" and not fused.available():
        pytest.skip("no C++ compiler for the host AdamW kernel")
    cpu, optim, world = torch.device("cpu"), OptimConfig(lr=1e-2, moments=moments), 3
    stores = [HostStore(model_shape("tiny"), torch.bfloat16, "mixed", pin=False, moments=moments)
              for _ in range(2)]
    whole = HostOptimizer(stores[0], optim, kernel)
    ranks = [HostOptimizer(stores[1], optim, kernel) for _ in range(world)]
    for r, rank in enumerate(ranks):  # as ShardedHostOptimizer.shard, without its process group
        rank.shard = lambda unit, r=r: Ranks(r, world, cpu, None).shard(unit.numel)
    assert all(lo % QBLOCK == 0 for unit in stores[0].units for rank in ranks for lo, _ in [rank.shard(unit)])
    torch.manual_seed(0)
    for store in stores:
        store.initialise(0, cpu)
    for step in (1, 2, 3):
        grads = torch.randn_like(stores[0].grads)
        for store in stores:
            store.grads.copy_(grads)
        for unit in stores[0].units:
            whole._update(unit, 0.5, step, 1e-2, stores[0].update_tiles(False))
            for rank in ranks:
                rank._update(unit, 0.5, step, 1e-2, rank.store.update_tiles(False))
    def tiles(store, unit):  # the unit's state (a flat tensor's padding after a tile is never written)
        return [store.tile(store.weights, unit), store.tile(store.master, unit),
                *store.moment_tiles(unit).tensors().values()]

    for unit in stores[0].units:
        assert all(torch.equal(a, b) for a, b in zip(tiles(stores[0], unit), tiles(stores[1], unit), strict=True))
    for optimizer in (whole, *ranks):
        optimizer.close()


def test_the_plan_counts_the_host_state_once_and_each_ranks_process_and_share_of_the_batch():
    config = EngineConfig(model=model_shape("tiny"), batch=4, micro_batch=1, seq=8)
    one, two = plan_memory(config), plan_memory(per_rank(config, 2, 2))
    assert two.host_state_bytes == one.host_state_bytes
    assert two.host_bytes == one.host_bytes + PROCESS_OVERHEAD_BYTES
    assert two.gpu_checkpoint_bytes * 2 == one.gpu_checkpoint_bytes  # each rank saves its half of the batch's inputs
    cpu = Budget(100 * GIB, None, "test")  # on CPU each rank's device share is host memory too
    assert check_fits(per_rank(config, 2, 2), cpu).host_need_bytes == two.host_bytes + 2 * (
        two.gpu_bytes - GPU_RESERVE_BYTES)


def test_a_batch_the_ranks_cannot_share_in_whole_micro_batches_is_refused():
    config = EngineConfig(model=model_shape("tiny"), batch=4, micro_batch=1, seq=8)
    assert Ranks(0, 2, torch.device("cpu"), None).per_rank(config).batch == 2
    with pytest.raises(ValueError, match="multiple of the 3 ranks x --micro-batch 1"):
        Ranks(0, 3, torch.device("cpu"), None).per_rank(config)



def test_a_process_started_alone_is_one_rank_whose_collectives_hand_back_what_they_are_given():
    """One process is one rank (Ranks.alone): no process group exists, every collective returns its input, so the
    engine, the systems and train ask the same Ranks in one process as under torchrun (no `ranks is None` anywhere)."""
    import torch.distributed as dist

    from megatrain.engine import distributed

    ranks = distributed.current("cpu")
    assert ranks == Ranks.alone("cpu") and not ranks.launched and not dist.is_initialized()
    assert (ranks.rank, ranks.world, ranks.local_world, ranks.first, ranks.node_first) == (0, 1, 1, True, True)
    grad = torch.arange(3000, dtype=torch.float32)
    assert ranks.sum_gradient(grad, replicated=False) is grad and ranks.summed(grad) is grad
    assert ranks.shard(grad.numel()) == (0, 3000)
    assert ranks.from_first({"a": 1}) == {"a": 1} and ranks.gather(7) == [7] and ranks.agree(15) == 15
    norm_and_loss = torch.tensor([4.0, 2.0])
    ranks.sum_norm_and_loss(norm_and_loss)
    ranks.barrier()
    assert norm_and_loss.tolist() == [4.0, 2.0] and not dist.is_initialized()
    rows = torch.arange(8).view(4, 2)
    assert torch.equal(ranks.split_rows(rows)[0], rows)
    config = EngineConfig(model=model_shape("tiny"), batch=4, micro_batch=2, seq=8)
    assert ranks.per_rank(config) == config
    unasked = [f"{p.relative_to(ROOT)}:{n}" for p in (ROOT / "megatrain").rglob("*.py")
               for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"ranks is (not )?None", line)]
    assert not unasked, f"one process is one rank: ask Ranks, not whether there is one: {unasked}"


@pytest.mark.filterwarnings("ignore:.*reduce_scatter_tensor.* is deprecated:FutureWarning")  # torch 2.13 says so
def test_gradients_reduce_scatter_where_torch_names_it_reduce_scatter_tensor(monkeypatch, tmp_path):
    """The GPU hosts run torch 2.11, which has reduce_scatter_tensor only (2.13 adds reduce_scatter_single and
    deprecates the other): a rank's gradient sum runs under either name. One in-process rank over gloo."""
    import torch.distributed as dist
    monkeypatch.delattr(dist, "reduce_scatter_single", raising=False)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ranks = Ranks(0, 1, torch.device("cpu"), None)
        grad = torch.arange(3000, dtype=torch.float32)
        shard = ranks.sum_gradient(grad.clone(), replicated=False)
        assert torch.equal(shard, grad)  # one rank: the whole sum is its own gradient
    finally:
        dist.destroy_process_group()


def test_a_peer_heard_of_before_it_reads_as_ended_is_named_once_it_does():
    """A killed rank closes its sockets before it is a zombie: the rank that heard of it waits a moment to name it
    (under load the collective's error came first, and the line said only 'another rank')."""
    ending = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        ranks = Ranks(0, 2, torch.device("cpu"), None, pids=(os.getpid(), ending.pid))
        assert ranks.unanswering(settle_s=0.0) == "another rank"  # still running when first looked at
        assert ranks.unanswering() == f"rank 1 (pid {ending.pid}, ended)"
    finally:
        ending.wait()


_ENGINE_SCRIPT = """
import json, os, sys
import torch
import megatrain
init, out = sys.argv[1], sys.argv[2]
rows = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
settings = dict(seq=17, batch=4, micro_batch=1, lr=1e-3, dtype="float32", device="cpu", log=lambda line: None)
with megatrain.Engine(init, **settings) as engine:
    losses = [engine.step(rows[i:i + 4]) for i in (0, 4)]
    engine.export(out + "/hf")
    engine.save(out + "/state")
with megatrain.Engine(init, **settings) as engine:
    engine.load(out + "/state")
    losses.append(engine.step(rows[:4]))
# one write of the whole line: two ranks share torchrun's stdout, and print's text and newline as two writes (stdout
# unbuffered) interleaved once as '{rank 1}{rank 0}' on one line (CI at 74f313b)
sys.stdout.write(json.dumps({"rank": int(os.environ.get("RANK", 0)), "losses": losses}) + "\\n")
sys.stdout.flush()
"""


@pytest.mark.subprocess
def test_the_engine_under_torchrun_trains_saves_and_exports_as_one_process(one_process, tmp_path):
    """megatrain.Engine on 2 ranks, each stepping the same global batch (train's ranks' contract), equals one
    process: the losses, the export rank 0 writes (returned on every rank once written) and a save both ranks load."""
    init = one_process[0]
    script = tmp_path / "engine.py"
    script.write_text(_ENGINE_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    runs = {}
    for name, launcher in (("one", []), ("two", ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                                                 "2"])):
        proc = subprocess.run([sys.executable, *launcher, str(script), str(init), str(tmp_path / name)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=300)
        _ok(proc)
        runs[name] = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    (one,), two = runs["one"], runs["two"]
    assert sorted(r["rank"] for r in two) == [0, 1]
    for rank in two:  # the ranks sum their shares' gradients in another order than one process: rounding apart
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(one["losses"]), rtol=1e-6, atol=0)
    a, b = (load_file(tmp_path / name / "hf" / "model.safetensors") for name in ("one", "two"))
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-5, msg=name)


ENDING = """
import atexit, pathlib, sys
import torch.distributed as dist
from megatrain.cli import exit_process
from megatrain.systems.dist import single_process_env

marker, own_world = sys.argv[1], sys.argv[2] == "1"
atexit.register(lambda: pathlib.Path(marker).write_text("the interpreter's teardown ran"))
if own_world:
    single_process_env()
    dist.init_process_group("gloo")
    dist.destroy_process_group()
print("the last line", flush=False)
exit_process(2)
"""


@pytest.mark.subprocess
@pytest.mark.parametrize("own_world", [True, False])
def test_a_process_that_made_its_own_process_groups_ends_without_the_interpreters_teardown(tmp_path, own_world):
    """exit_process (`python -m megatrain`'s end, and the test scripts' that call main): a one-process FSDP2 or
    DeepSpeed run, its groups destroyed, still aborted in the teardown now and then (exit -6 for 2 after its error
    line, CI); such a process skips the teardown with its output flushed, any other ends as sys.exit does."""
    from train_helpers import python_process

    marker = tmp_path / "teardown"
    proc = python_process(ENDING, str(marker), "1" if own_world else "0")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["the last line"]
    assert marker.exists() is not own_world
