"""The host memory bandwidth probe (native and torch) and the host optimizer's achieved rate in the engine's metrics.
CPU only (the native probe with a C++ compiler), ~10 s: pytest tests/unit/test_host_bandwidth.py"""

import os

import pytest

from megatrain.optim import fused
from megatrain.optim.state_bytes import adamw_traffic_bytes_per_param, state_bytes_per_param
from megatrain.probe import Machine, host_mem_bandwidth_gbs

from engine_helpers import train  # isort: skip


def test_the_probe_measures_each_stream_kernel_per_thread_count():
    rates = host_mem_bandwidth_gbs(numel=2**22, repeats=1, max_threads=5)
    assert rates["threads"] == [1, 2, 4, 5]
    for kind in ("read", "write", "copy", "triad"):
        assert len(rates[kind]) == 4 and all(r > 0 for r in rates[kind]), kind
    machine = Machine(cpu="x", cpu_cores=5, host_mem_gib=1.0, host_available_gib=1.0, host_mem_gbs=rates)
    assert machine.host_mem_peak_gbs("copy") == max(rates["copy"])
    assert Machine.from_dict(machine.to_dict()) == machine
    assert Machine(cpu="x", cpu_cores=5, host_mem_gib=1.0, host_available_gib=1.0).host_mem_peak_gbs() is None
    older = Machine(cpu="x", cpu_cores=5, host_mem_gib=1.0, host_available_gib=1.0,
                    host_mem_gbs={k: v for k, v in rates.items() if k != "update"})
    assert older.host_mem_peak_gbs("update") is None  # a torch or older probe has no update kind


@pytest.mark.skipif(not fused.available(), reason="no C++ compiler for the native probe")
def test_the_native_probe_measures_each_kind_per_thread_count_and_at_least_a_tenth_of_torch():
    numel = 2**23  # 32 MiB per array, three of them: past this machine's last-level cache
    native = host_mem_bandwidth_gbs(numel=numel, repeats=2, max_threads=2)
    torch_ = host_mem_bandwidth_gbs(numel=numel, repeats=2, max_threads=2, native=False)
    assert (native["host_mem_probe"], torch_["host_mem_probe"]) == ("native", "torch")
    assert native["threads"] == torch_["threads"] == [1, 2]
    for kind in ("read", "write", "write_nt", "copy", "triad", "update"):
        assert len(native[kind]) == 2 and all(r > 0 for r in native[kind]), kind
    if os.cpu_count() >= 2:  # shared cores: the same order of magnitude, not a ratio
        for kind in ("read", "write", "copy", "triad"):
            assert max(native[kind]) > 0.1 * max(torch_[kind]), kind


def test_machine_records_say_which_probe_measured_and_older_ones_still_load():
    machine = Machine(cpu="x", cpu_cores=2, host_mem_gib=1.0, host_available_gib=1.0,
                      host_mem_gbs={"threads": [1], "triad": [10.0]}, host_mem_probe="native")
    record = machine.to_dict()
    assert record["host_mem_probe"] == "native" and Machine.from_dict(record) == machine
    del record["host_mem_probe"]  # a record from before the field
    assert Machine.from_dict(record).host_mem_probe is None


def test_engine_metrics_report_the_host_optimizer_rate_in_bytes():
    metrics = train("megatrain", steps=2, model="tiny", batch=1, seq=8)[2]
    per_param = adamw_traffic_bytes_per_param(state_bytes_per_param(4, "mixed"))  # fp32 on CPU: 28
    assert metrics["host_optim_bytes_per_param"] == per_param == 28
    assert metrics["host_optim_gbs"] == pytest.approx(metrics["host_optim_gparams_s"] * 28)
    assert metrics["host_optim_gparams_s"] > 0
