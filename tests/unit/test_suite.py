"""Suite files, case identity, hardware profiles, the pre-flight memory fit and records files. CPU, seconds:
pytest tests/unit/test_suite.py"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from megatrain import preflight
from megatrain.bench.args import BenchFlags
from megatrain.bench.record import append_jsonl, read_jsonl
from megatrain.bench.suite import SUITES_DIR, bench_args, launch_command, load_suite
from megatrain.config import CaseConfig
from megatrain.flags import CaseFlags, add_flags
from megatrain.hardware import PROFILES, get_profile, same_machine
from megatrain.probe import Machine
from megatrain.systems import deepspeed_zero3, fsdp_offload
from megatrain.train.config import add_train_arguments

H200_X2 = Machine(gpu_name="NVIDIA H200", gpu_count=2, gpu_mem_gib=139.8, host_mem_gib=251.5, host_available_gib=245.0,
                  cpu="Intel Xeon", cpu_cores=32)
H200_X4 = replace(H200_X2, gpu_count=4, host_mem_gib=503.0, host_available_gib=495.0)
CPU = Machine(host_mem_gib=7.0, host_available_gib=6.0, cpu="AMD EPYC", cpu_cores=2)


def _suite(tmp_path, text):
    path = tmp_path / "s.toml"
    path.write_text(text)
    return load_suite(str(path))


def test_every_shipped_suite_loads():
    names = sorted(p.stem for p in SUITES_DIR.glob("*.toml"))
    assert {"smoke", "smoke_gpu", "reproduce_14b", "scaling", "context"} <= set(names)
    for name in names:
        suite = load_suite(name)
        assert suite.cases and suite.description
        for case in suite.cases:
            assert case.hardware in PROFILES
            bench_args(case.config)  # every case is expressible on the bench command line


def test_suites_results_and_reports_follow_the_workspace_and_a_checkout_stays_its_own(tmp_path):
    code = ("from megatrain import workspace; from megatrain.bench import suite; "
            "print(workspace.CHECKOUT, workspace.WORKSPACE, suite.SUITES_DIR)")
    checkout = Path(__file__).resolve().parents[2]
    with_suites = tmp_path / "with"
    (with_suites / "suites").mkdir(parents=True)
    ran = [subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, check=True,
                          env={**os.environ, "MEGATRAIN_WORKSPACE": workspace}).stdout.split()
           for workspace in (str(with_suites), str(tmp_path), "")]
    shipped = checkout / "megatrain" / "suites"  # a workspace without suites/ runs the package's own
    assert ran == [[str(checkout), str(with_suites.resolve()), str(with_suites.resolve() / "suites")],
                   [str(checkout), str(tmp_path.resolve()), str(shipped)],
                   [str(checkout), str(checkout), str(checkout / "suites")]]
    assert sorted(p.name for p in shipped.glob("*.toml")) == sorted(p.name for p in (checkout / "suites").glob("*"))


def test_bench_and_train_take_the_shared_case_flags_from_one_declaration():
    bench, train = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_flags(bench, BenchFlags)
    add_train_arguments(train)
    for f in dataclasses.fields(CaseFlags):
        flag = "--" + f.name.replace("_", "-")
        a, b = bench._option_string_actions[flag], train._option_string_actions[flag]
        assert (a.dest, a.type, a.choices, a.metavar, a.nargs) == (b.dest, b.type, b.choices, b.metavar, b.nargs), flag
        helps = [h.split(" (default")[0] for h in (a.help or "", b.help or "")]
        if flag == "--system":  # train trains every system but the paper's code, which bench runs
            helps[0] = helps[0].replace(" paper |", "")
        assert a.help is None or helps[0] == helps[1], flag
    assert "(default native)" in bench._option_string_actions["--system"].help
    assert "(default megatrain)" in train._option_string_actions["--system"].help


def test_group_is_a_product_with_overrides(tmp_path):
    suite = _suite(tmp_path, """
hardware = "cpu-ci"
[[cases]]
systems = ["native", "megatrain"]
models = "tiny"
batch = [2, 4]
seq = [16, 32, 64]
micro_batch = 2
options = { mlp_chunk_tokens = 8 }
""")
    assert len(suite.cases) == 2 * 2 * 3
    assert all(c.config.micro_batch == 2 and c.config.options == {"mlp_chunk_tokens": 8} for c in suite.cases)
    assert len({c.case_id for c in suite.cases}) == 12


def test_case_id_is_stable_and_ignores_presentation(tmp_path):
    a = _suite(tmp_path, 'hardware = "cpu-ci"\n[[cases]]\nname = "a"\nsystems = "native"\nmodels = "tiny"\n')
    b = _suite(tmp_path, 'hardware = "cpu-ci"\n[[cases]]\nname = "b"\nlabel = "ref"\nsystems = "native"\n'
                         'models = "tiny"\n')
    assert a.cases[0].case_id == b.cases[0].case_id
    assert len(a.cases[0].case_id) == 12 and a.cases[0].case_id == load_suite(str(tmp_path / "s.toml")).cases[0].case_id


def test_a_hosts_depth_applies_where_a_group_names_none(tmp_path):
    suite = _suite(tmp_path, """
hardware = ["h200-141g-128g", "h200-141g-512g"]
[num_layers_by_hardware]
"h200-141g-128g" = 10
[[cases]]
name = "host"
systems = "megatrain"
models = "qwen2.5-14b"
[[cases]]
name = "own"
systems = "native"
models = "qwen2.5-14b"
num_layers = 4
""")
    depth = {(c.group, c.hardware): c.config.num_layers for c in suite.cases}
    assert depth == {("host", "h200-141g-128g"): 10, ("host", "h200-141g-512g"): None,
                     ("own", "h200-141g-128g"): 4, ("own", "h200-141g-512g"): 4}
    shipped = load_suite("reproduce_14b")  # the full depth keeps its case ids: the 512 GiB host's records resume
    assert {c.config.num_layers for c in shipped.cases if c.hardware == "h200-141g-512g"} == {None}
    assert {c.config.num_layers for c in shipped.cases if c.hardware == "h200-141g-256g"} == {24}
    for table, match in (('"tpu" = 4', "unknown hardware profile"), ('"cpu-ci" = 0', "whole number of layers"),
                         ('"cpu-ci" = 2.5', "whole number of layers")):
        with pytest.raises(ValueError, match=match):
            _suite(tmp_path, f'hardware = "cpu-ci"\n[num_layers_by_hardware]\n{table}\n[[cases]]\n'
                             'systems = "native"\nmodels = "tiny"\n')


def test_ladder_chains_group_by_everything_but_the_ladder_value(tmp_path):
    suite = _suite(tmp_path, """
hardware = "cpu-ci"
[[cases]]
systems = ["native", "megatrain"]
models = "tiny"
ladder = "batch"
batch = [2, 4, 8]
""")
    chains = {c.ladder for c in suite.cases}
    assert len(chains) == 2
    with pytest.raises(ValueError, match="must increase"):
        _suite(tmp_path, 'hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\n'
                         'ladder = "batch"\nbatch = [4, 2]\n')


@pytest.mark.parametrize("text, match", [
    ('hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\nbatchsize = 2\n', "unknown keys"),
    ('hardware = "tpu"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\n', "unknown hardware profile"),
    ('hardware = "cpu-ci"\n[[cases]]\nsystems = "nope"\nmodels = "tiny"\n', "unknown system"),
    ('hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\n[[cases]]\nsystems = "native"\n'
     'models = "tiny"\n', "appears twice"),
    ('hardware = "cpu-ci"\n[[cases]]\nname = "g"\nsystems = "native"\nmodels = "tiny"\nbatch = "four"\n',
     r"s\.toml: \[\[cases\]\] group 'g': .*"),
    ('hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\noptim = {bogus = 1}\n',
     r"s\.toml: \[\[cases\]\] group 0: .*bogus"),
    ('hardware = "cpu-ci"\n[[cases]\nsystems = "native"\n', r"s\.toml: not valid TOML: .*line 2"),
    ('hardware = "cpu-ci"\ntimeout_s = nan\n[[cases]]\nsystems = "native"\nmodels = "tiny"\n',
     r"s\.toml: timeout_s = nan must be a number of seconds > 0"),
    ('hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\ntimeout_s = -5\n',
     r"timeout_s=-5: expected a number of seconds > 0"),
])
def test_invalid_suites_say_what_to_change(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        _suite(tmp_path, text)


def test_profiles_match_their_machines_only():
    assert get_profile("h200-141g-256g").mismatch(H200_X2) is None
    assert "host memory" in get_profile("h200-141g-256g").mismatch(H200_X4)
    assert "needs a H100" in get_profile("h100-80g").mismatch(H200_X2)
    assert "has none" in get_profile("h200-141g-512g").mismatch(CPU)
    assert get_profile("cpu-ci").mismatch(H200_X4) is None, "CPU cases run anywhere"
    assert same_machine(H200_X2, replace(H200_X2, host_mem_gib=251.0))
    assert not same_machine(H200_X2, H200_X4)


def _case(system, model="qwen2.5-14b", precision="mixed", batch=16, seq=1024):
    return CaseConfig(system=system, model=model, precision=precision, batch=batch, seq=seq, device="cuda",
                      dtype="bfloat16")


def test_offload_baselines_do_not_fit_14b_on_a_256_gib_host_but_do_on_512():
    for system in ("deepspeed", "fsdp"):
        assert not preflight.plan_memory(_case(system), H200_X2)["fits"]
        assert preflight.plan_memory(_case(system), H200_X4)["fits"]
    plan = preflight.plan_memory(_case("deepspeed"), H200_X2)
    assert "host memory" in plan["reason"] and plan["host_bytes"] > 20 * 14.7e9


def test_native_needs_the_whole_model_on_the_gpu():
    assert preflight.plan_memory(_case("native", model="qwen2.5-1.5b", batch=8), H200_X2)["fits"]
    plan = preflight.plan_memory(_case("native"), H200_X2)
    assert not plan["fits"] and "GPU memory" in plan["reason"]


def test_megatrain_bf16_fits_where_mixed_precision_does_not():
    machine = replace(H200_X2, host_mem_gib=125.0, host_available_gib=120.0)  # the 128 GiB hosts
    assert preflight.plan_memory(_case("megatrain", model="qwen2.5-7b", precision="bf16"), machine)["fits"]
    assert not preflight.plan_memory(_case("megatrain", model="qwen2.5-7b"), machine)["fits"]


def test_cpu_cases_count_everything_as_host_memory():
    plan = preflight.plan_memory(CaseConfig(system="native", model="tiny"), CPU)
    assert plan["fits"] and plan["gpu_bytes"] == 0


def test_missing_packages_and_modules_are_named():
    assert preflight.unavailable("native") is None
    reason = preflight.unavailable("deepspeed")
    assert reason is None or "deepspeed" in reason


def test_a_depth_ladder_climbs_num_layers_and_stops_after_its_first_failure(tmp_path):
    suite = _suite(tmp_path, """
description = "d"
hardware = "cpu-ci"
[[cases]]
systems = "native"
models = "tiny"
ladder = "num_layers"
num_layers = [2, 4, 8]
""")
    assert [c.config.num_layers for c in suite.cases] == [2, 4, 8]
    assert len({c.ladder for c in suite.cases}) == 1, "one chain: the depths of one system and setting"
    with pytest.raises(ValueError, match="must increase"):
        _suite(tmp_path, 'description = "d"\nhardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "tiny"\n'
                         'ladder = "num_layers"\nnum_layers = [4, 2]\n')


def test_offload_baselines_host_estimates_follow_their_measured_bytes_per_parameter():
    """DeepSpeed's peak RSS measured 24.4-24.9 B/param (1.5B-14B), FSDP2's 16.9-21.7 with its power-of-two pinned
    blocks (results/smoke_gpu, results/reproduce_14b): the pre-flight counts at least that, so it refuses first."""
    for model, fsdp_measured in (("qwen2.5-1.5b", 16.9), ("qwen2.5-3b", 19.1), ("qwen2.5-14b", 21.7)):
        n = CaseConfig(model=model).shape().num_params()
        ds, _ = deepspeed_zero3.memory_bytes(_case("deepspeed", model=model))
        fsdp, _ = fsdp_offload.memory_bytes(_case("fsdp", model=model))
        assert ds / n == 25
        assert fsdp_measured <= fsdp / n <= fsdp_measured + 1.5


def test_deepspeed_counts_a_mixture_of_experts_at_its_measured_host_bytes_and_refuses_what_the_kernel_killed():
    """Qwen3-30B-A3B's 6 layers peaked at 29.5 B/param under DeepSpeed (the MoE block a ZeRO-3 leaf); GPT-OSS-20B's 4
    layers, estimated at 25 (107 GiB), were killed by the kernel on a 126 GiB host (results/moe, run at 9103d75)."""
    for model, layers in (("qwen3-30b-a3b", 6), ("gpt-oss-20b", 4)):
        case = replace(_case("deepspeed", model=model), num_layers=layers)
        n = case.shape().num_params()
        assert deepspeed_zero3.memory_bytes(case)[0] / n == 30 >= 29.5
    gpt_oss = replace(_case("deepspeed", model="gpt-oss-20b"), num_layers=4)
    host_128 = replace(H200_X2, gpu_count=1, host_mem_gib=125.9, host_available_gib=122.0)
    plan = preflight.plan_memory(gpt_oss, host_128)
    assert not plan["fits"] and "host memory" in plan["reason"]
    assert preflight.plan_memory(replace(gpt_oss, num_layers=3), host_128)["fits"]


def test_zero_offload_holds_parameters_and_gradients_on_the_gpu_and_the_optimizer_on_the_host():
    zero2, zero3 = (replace(_case("deepspeed"), options={"zero_stage": stage}) for stage in (2, 3))
    n = zero2.shape().num_params()
    host, gpu = deepspeed_zero3.memory_bytes(zero2)
    assert host == 28 * n and gpu == 4 * n + preflight.activation_bytes(zero2)  # bf16 parameters and gradients
    # 116.25 GiB of host RSS measured at batch 16 of the 7B width's 14 layers on an H100 host; accumulating 4
    # micro-batches there was OOM-killed: the estimate counts the host's fp32 accumulation buffer too and refuses it
    seven = replace(zero2, model="qwen2.5-7b", num_layers=14, micro_batch=16)
    host_128 = replace(H200_X2, gpu_name="NVIDIA H100 80GB HBM3", gpu_count=1, gpu_mem_gib=79.2, host_mem_gib=125.9,
                       host_available_gib=124.0)
    assert preflight.plan_memory(seven, host_128)["host_bytes"] / 2**30 == pytest.approx(116.25, rel=0.01)
    plan = preflight.plan_memory(replace(seven, batch=64), host_128)
    assert not plan["fits"] and "host memory" in plan["reason"]
    # at 10 layers ZeRO-Offload accumulating ran (82 GiB); ZenFlow steps at every micro-batch, so it is refused there
    # whatever the memory; in one micro-batch of 16 the kernel killed it there (3a2d6d9), so its host bound refuses
    # that, and 8 layers fit
    ten = replace(seven, num_layers=10, batch=64)
    assert preflight.plan_memory(ten, host_128)["fits"]
    zenflow = replace(ten, options={"zero_stage": 2, "zenflow": True})
    plan = preflight.plan_memory(zenflow, host_128)
    assert not plan["fits"] and "--micro-batch equal to the batch" in plan["reason"]
    plan = preflight.plan_memory(replace(zenflow, batch=16), host_128)
    assert not plan["fits"] and "host memory" in plan["reason"]
    assert preflight.plan_memory(replace(zenflow, batch=16, num_layers=8), host_128)["fits"]
    # four ranks share batch 64 one micro-batch each: no rank accumulates, so none holds the accumulation buffer
    n7 = seven.shape().num_params()
    assert deepspeed_zero3.memory_bytes(replace(seven, batch=64), world=4)[0] == -(-n7 * 28 // 4)
    # 14B on an 80 GB H100: at batch 16 both fit; at batch 64 the whole model beside its activations does not, ZeRO-3's
    # gathered layers do
    h100 = replace(H200_X4, gpu_name="NVIDIA H100 80GB HBM3", gpu_mem_gib=79.2)
    assert preflight.plan_memory(zero2, h100)["fits"]
    plan = preflight.plan_memory(replace(zero2, batch=64, micro_batch=64), h100)
    assert not plan["fits"] and "GPU memory" in plan["reason"]
    assert preflight.plan_memory(replace(zero3, batch=64, micro_batch=64), h100)["fits"]


def test_superoffload_and_partial_offload_plan_their_state_where_deepspeed_keeps_it():
    """SuperOffload was killed by the kernel at 10 layers of the 14B width on a 128 GiB host where ZeRO-3 offload ran,
    and ran at 5 (issue 74, by hand): its host bound refuses the one and fits the other. Partial offload's GPU share
    (the first sub-groups, a layer each) holds 16 B/param on the GPU and 12 fewer on the host; where the GPU cannot
    hold it, the plan says GPU memory. Neither runs on CPU, nor SuperOffload under torchrun."""
    host_128 = replace(H200_X2, gpu_count=1, host_mem_gib=125.9, host_available_gib=122.0)
    ten = replace(_case("deepspeed"), num_layers=10, batch=96, micro_batch=96, device="cuda")
    superoffload = replace(ten, options={"super_offload": True})
    assert preflight.plan_memory(ten, host_128)["fits"]
    plan = preflight.plan_memory(superoffload, host_128)
    assert not plan["fits"] and "host memory" in plan["reason"]
    assert preflight.plan_memory(replace(superoffload, num_layers=5), host_128)["fits"]
    plain_host, plain_gpu = deepspeed_zero3.memory_bytes(ten)
    partial = replace(ten, options={"optimizer_ratio": 0.5})
    sub_groups = deepspeed_zero3.optimizer_sub_groups(partial)
    on_gpu = sub_groups[:deepspeed_zero3.gpu_sub_groups(0.5, len(sub_groups))]
    assert sum(sub_groups) == ten.shape().num_params() and len(sub_groups) > 10
    assert 0.4 < sum(on_gpu) / sum(sub_groups) < 0.6  # the ratio asked, to within a sub-group
    host, gpu = deepspeed_zero3.memory_bytes(partial)
    assert plain_host - host == 12 * sum(on_gpu) and gpu - plain_gpu == 16 * sum(on_gpu) + 8 * max(on_gpu)
    assert deepspeed_zero3.memory_bytes(replace(ten, options={"optimizer_ratio": 1.0})) == (plain_host, plain_gpu)
    plan = preflight.plan_memory(replace(partial, num_layers=48, options={"optimizer_ratio": 0.0}), H200_X4)
    assert not plan["fits"] and "GPU memory" in plan["reason"]
    for options, says in (({"super_offload": True}, "CUDA GPUs only"), ({"optimizer_ratio": 0.5}, "keeps a share")):
        on_cpu = replace(_case("deepspeed"), device="cpu", dtype="float32", options=options)
        assert says in preflight.plan_memory(on_cpu, H200_X2)["reason"]
    assert "one process" in deepspeed_zero3.refusal(superoffload, world=2)


def test_a_torn_last_line_does_not_swallow_the_next_record(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"status": "ok"}\n{"status": "ok", "cut sh')  # a runner killed mid-write
    append_jsonl(path, {"status": "oom"})
    with pytest.warns(UserWarning, match=r"records\.jsonl:2: skipped a line that is not JSON"):
        assert read_jsonl(path) == [{"status": "ok"}, {"status": "oom"}]


def test_a_case_of_n_ranks_runs_through_torchrun_and_one_rank_keeps_its_old_identity(tmp_path):
    suite = _suite(tmp_path, """hardware = "cpu-ci"
[[cases]]
systems = "megatrain"
models = "tiny"
ranks = [1, 2]
batch = 8""")
    one, two = suite.cases
    assert (one.config.ranks, two.config.ranks) == (1, 2) and "x2 ranks" in two.name and "ranks" not in one.name
    assert "ranks" not in one.config.to_dict()  # the ids of every case recorded before ranks existed hold
    assert one.case_id == _suite(tmp_path, 'hardware = "cpu-ci"\n[[cases]]\nsystems = "megatrain"\n'
                                           'models = "tiny"\nbatch = 8').cases[0].case_id
    assert "--ranks" not in bench_args(one.config)
    ranks_flag = bench_args(two.config).index("--ranks")
    assert bench_args(two.config)[ranks_flag + 1] == "2"
    assert launch_command(2)[1:6] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    assert launch_command(1)[1:] == ["-m", "megatrain", "bench"]


def test_a_case_of_n_ranks_is_planned_for_its_launch_and_refused_without_its_gpus():
    def plan(system, ranks, machine=H200_X4):
        case = CaseConfig(system=system, model="qwen2.5-7b", batch=64 * ranks, micro_batch=16, seq=1024,
                          device="cuda", dtype="bfloat16", ranks=ranks)
        return preflight.plan_case(case, machine)

    # MegaTrain's node holds one copy of the state (each rank adds its process and buffers); DeepSpeed's shards add
    # up to one copy too, plus a process per rank
    for system in ("megatrain", "deepspeed"):
        one, four = plan(system, 1), plan(system, 4)
        assert one["fits"] and four["fits"] and one["host_bytes"] < four["host_bytes"] < 1.2 * one["host_bytes"]
    assert "4 ranks need 4 GPUs; this machine has 2" in plan("megatrain", 4, H200_X2)["reason"]


def test_bench_refuses_ranks_its_launch_does_not_have(capsys):
    from megatrain.cli import main

    assert main(["bench", "--model", "tiny", "--ranks", "2"]) == 2
    assert "--ranks 2 but this launch has 1 process(es): start it with torchrun --nproc-per-node 2" in \
        capsys.readouterr().err


def test_the_trace_sums_the_pss_of_every_process_of_the_case(tmp_path):
    import time

    from megatrain.bench.trace import Sampler

    held = bytearray(256 * 2**20)  # touched pages of this process
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])  # in the case's process tree
    sampler = Sampler(tmp_path / "trace.json").start()
    time.sleep(1.2)
    summary = sampler.stop()
    child.wait()
    assert summary["node_processes"] >= 2 and summary["peak_node_pss_gib"] >= len(held) / 2**30


def test_a_run_resumes_only_on_the_same_code_uncommitted_changes_included(tmp_path, monkeypatch):
    """A checkout with uncommitted changes: the runner resumes the run of these very changes, not of others."""
    from megatrain.bench import env

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    subprocess.run(["git", "-C", str(tmp_path), "add", "code.py"], check=True)
    subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"],
                   check=True)
    monkeypatch.delenv("MEGATRAIN_COMMIT", raising=False)
    monkeypatch.setattr(env, "CHECKOUT", tmp_path)
    clean = {"commit": env.git_commit()[0], "dirty": False, "diff_sha256": env.git_diff_sha256()}
    assert env.same_code(clean) and clean["diff_sha256"] is None
    (tmp_path / "code.py").write_text("x = 2\n")
    edited = {**clean, "dirty": True, "diff_sha256": env.git_diff_sha256()}
    assert not env.same_code(clean), "a run of the clean tree does not resume under uncommitted changes"
    assert env.same_code(edited)
    (tmp_path / "code.py").write_text("x = 3\n")
    assert not env.same_code(edited), "nor a run of other uncommitted changes"
    assert not env.same_code({**edited, "diff_sha256": None}), "changes that cannot be read match nothing"


def test_a_commit_of_records_alone_is_the_same_code_and_an_edit_of_code_is_not(tmp_path, monkeypatch, request):
    """Records committed between two device calls (the documented way) changed the commit and a resumed suite started
    a new run: the code digest names the code on disk, whatever commit holds it."""
    from megatrain.bench import env

    def commit(message):
        subprocess.run(["git", "-C", str(tmp_path), "add", "-A"], check=True)
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                        message], check=True)

    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "megatrain").mkdir()
    (tmp_path / "megatrain" / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "records.jsonl").write_text("")
    commit("code")
    monkeypatch.delenv("MEGATRAIN_COMMIT", raising=False)
    monkeypatch.setattr(env, "CHECKOUT", tmp_path)
    request.addfinalizer(env.code_sha256.cache_clear)  # the checkout's own digest again after the test
    env.code_sha256.cache_clear()
    measured = {"commit": env.git_commit()[0], "dirty": False, "diff_sha256": None, "code_sha256": env.code_sha256()}
    (tmp_path / "results" / "records.jsonl").write_text('{"tflops": 1}\n')
    commit("records")
    env.code_sha256.cache_clear()
    assert env.git_commit()[0] != measured["commit"] and env.same_code(measured)
    assert env.same_code_as(measured, {"commit": "other", "dirty": True, "code_sha256": env.code_sha256()})
    (tmp_path / "megatrain" / "__pycache__").mkdir()
    (tmp_path / "megatrain" / "__pycache__" / "code.cpython-312.pyc").write_bytes(b"cache")
    env.code_sha256.cache_clear()
    assert env.same_code(measured), "a cache is not code"
    (tmp_path / "megatrain" / "code.py").write_text("x = 2\n")
    env.code_sha256.cache_clear()
    assert not env.same_code(measured), "uncommitted code is other code"
    commit("code again")
    env.code_sha256.cache_clear()
    assert not env.same_code(measured) and not env.same_code_as(measured, {"code_sha256": env.code_sha256()})
    # a file that cannot be read: no digest (every record still written), the commit rule decides
    unreadable, read_bytes = tmp_path / "megatrain" / "code.py", Path.read_bytes

    def read_or_refuse(path: Path) -> bytes:
        if path == unreadable:
            raise PermissionError(path)
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", read_or_refuse)
    env.code_sha256.cache_clear()
    assert env.code_sha256() is None and not env.same_code(measured)
    assert env.same_code({"commit": env.git_commit()[0], "dirty": False, "code_sha256": "a" * 64})


def test_a_record_names_the_version_that_runs_not_the_one_installed_beneath_it(monkeypatch):
    """A copy of transformers first on PYTHONPATH (a second version tried beside the installed one) shadows the
    installed package; the installed one's metadata named the other version (a walk under 5.17 recorded 5.24)."""
    import types

    from megatrain.bench import env

    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(__version__="5.17.0-shadowing"))
    assert env._version("transformers") == "5.17.0-shadowing"
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace())  # no version of its own: the metadata's
    assert env._version("transformers") != "5.17.0-shadowing"


def test_a_suite_case_may_name_a_config_json_or_a_checkpoint_folder_as_bench_does(tmp_path):
    """A model of a suite is what bench --model takes: a registry name, or a config.json or checkpoint folder (its
    shape alone, labelled by name and sha256); its path is relative to the suite file, and the case's bench command
    reads it there."""
    from megatrain.models.registry import HF_CONFIGS

    folder = tmp_path / "models" / "ckpt"
    folder.mkdir(parents=True)
    config = HF_CONFIGS["tiny-hf-gemma3"]
    (folder / "config.json").write_text(json.dumps(config))
    (tmp_path / "alone.json").write_text(json.dumps(config))
    suite = _suite(tmp_path, 'hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = ["models/ckpt", '
                             '"alone.json", "tiny"]\nnum_layers = 2\n')
    by_model = {c.config.model.split("@")[0]: c for c in suite.cases}
    assert set(by_model) == {"ckpt", "alone.json", "tiny"}
    folder_case, file_case = by_model["ckpt"], by_model["alone.json"]
    assert folder_case.model_path == str(folder.resolve()) and by_model["tiny"].model_path is None
    assert folder_case.config.shape().num_layers == 2  # the group's depth over the file's
    assert folder_case.config.model_shape == file_case.config.model_shape  # the same contents, the same shape
    args = bench_args(folder_case.config, model_path=folder_case.model_path)
    assert args[args.index("--model") + 1] == str(folder.resolve())
    (folder / "config.json").write_text(json.dumps({**config, "hidden_size": 48}))
    with pytest.raises(ValueError, match="changed since its suite was read"):  # the file changed since: another case
        bench_args(folder_case.config, model_path=folder_case.model_path)
    with pytest.raises(ValueError, match="nope.json"):
        (tmp_path / "nope.json").write_text("{")
        _suite(tmp_path, 'hardware = "cpu-ci"\n[[cases]]\nsystems = "native"\nmodels = "nope.json"\n')
