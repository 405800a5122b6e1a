"""The host memory bandwidth probe and the host optimizer's achieved rate in the engine's metrics. CPU only, ~5 s:
pytest tests/unit/test_host_bandwidth.py"""

import pytest

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


def test_engine_metrics_report_the_host_optimizer_rate_in_bytes():
    metrics = train("megatrain", steps=2, model="tiny", batch=1, seq=8)[2]
    per_param = adamw_traffic_bytes_per_param(state_bytes_per_param(4, "mixed"))  # fp32 on CPU: 28
    assert metrics["host_optim_bytes_per_param"] == per_param == 28
    assert metrics["host_optim_gbs"] == pytest.approx(metrics["host_optim_gparams_s"] * 28)
    assert metrics["host_optim_gparams_s"] > 0
