"""The engine is a library: it imports no benchmark harness, no case and no system; `train` and `bench` both sit on the
library and neither imports the other; running cases, suites and training imports neither the analysis nor the
performance model (those read records and may import bench and the library);
the package has no import cycles; every system is one SystemSpec in one registry, with typed options.
CPU, seconds: pytest tests/unit/test_boundaries.py"""

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from megatrain import preflight
from megatrain.config import CaseConfig
from megatrain.data import make_batches
from megatrain.engine.config import MegaTrainOptions
from megatrain.options import CommonOptions
from megatrain.probe import Machine
from megatrain.systems import SYSTEMS, Registered, SystemSpec, build_system, parse_options, system_spec
from megatrain.train.checkpoint import state_bytes

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = ("megatrain.engine", "megatrain.optim", "megatrain.models", "megatrain.memory", "megatrain.options",
           "megatrain.run_config", "megatrain.config", "megatrain.data", "megatrain.flags", "megatrain.preflight",
           "megatrain.probe", "megatrain.tokenizer", "megatrain.checked_files")
# the protocol and the registry (and the wing's face, which hands them on): library; the systems beside it are not
REGISTRY = ("megatrain.systems_registry", "megatrain.systems")
SYSTEMS_WING = "megatrain.systems."  # MegaTrain's adapter and every peer, each imported only when a case names it
HARNESS = ("megatrain.bench", "megatrain.checks", "megatrain.analysis", "megatrain.perf_model", "megatrain.hardware",
           "megatrain.cli")
RUNNING = (*LIBRARY, *REGISTRY, "megatrain.bench", "megatrain.train", "megatrain.hardware")
ANALYSIS = ("megatrain.analysis", "megatrain.perf_model")


def _library(name: str) -> bool:
    return name.startswith(LIBRARY) or name in REGISTRY


def _modules() -> dict[str, Path]:
    files = ROOT.glob("megatrain/**/*.py")
    names = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in files}
    return {n.removesuffix(".__init__"): p for n, p in names.items()}


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run, function-level ones included; an `if TYPE_CHECKING:` block never runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif not (isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING"):
            yield from _import_nodes(child)


def _imported_names(path: Path) -> set[str]:
    """The modules a file imports, and for `from M import x` also M.x (x may be a module)."""
    names = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
        elif isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
    return names


def _import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its file (function-level imports included)."""
    modules = _modules()
    return {name: {t for t in _imported_names(path) if t in modules and t != name} for name, path in modules.items()}


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep]
            if dep not in state and (found := visit(dep, [*path, dep])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def test_the_package_has_no_import_cycles():
    assert _cycle(_import_graph()) is None


def test_the_library_modules_import_no_harness_and_no_system():
    graph = _import_graph()
    for name, deps in graph.items():
        if _library(name):
            assert not [d for d in deps if d.startswith((*HARNESS, SYSTEMS_WING))], name


def test_the_engine_knows_no_case_and_no_registry():
    """The engine trains an EngineConfig; megatrain.systems.megatrain builds one for a case."""
    for name, deps in _import_graph().items():
        if name.startswith("megatrain.engine"):
            assert not [d for d in deps if d.startswith(("megatrain.config", *REGISTRY))], name


def test_train_and_bench_sit_on_the_library_and_neither_imports_the_other():
    """Nor does a system import either: train and bench both run systems (a system's load_state opens its files
    through megatrain.checked_files, below them all)."""
    forbidden = {"megatrain.train": ("megatrain.bench",), "megatrain.bench": ("megatrain.train",),
                 **dict.fromkeys((*LIBRARY, *REGISTRY), ("megatrain.bench", "megatrain.train"))}
    for name, deps in _import_graph().items():
        top = next((t for t in forbidden if name == t or name.startswith(t + ".")), None)
        if top is not None:
            assert not [d for d in deps if d.startswith(forbidden[top])], name


def test_running_cases_suites_and_training_imports_neither_analysis_nor_the_performance_model():
    graph = _import_graph()
    for name, deps in graph.items():
        if name.startswith(RUNNING):
            assert not [d for d in deps if d.startswith(ANALYSIS)], name


def test_the_engine_models_and_optim_never_import_a_system_or_deepspeed():
    modules = _modules()
    for name, path in modules.items():
        if name.startswith(("megatrain.engine", "megatrain.models", "megatrain.optim")):
            imported = _imported_names(path)
            assert not [m for m in imported if m.startswith(SYSTEMS_WING) or m.split(".")[0] == "deepspeed"], name
            if name.startswith("megatrain.optim"):  # the optimizer knows its own settings, not the cases or systems
                # (it says its kernel's compile through the build's log, which imports nothing of ours)
                assert not [m for m in imported if m in modules and not m.startswith("megatrain.optim")
                            and m != "megatrain.build_log"], name


def test_training_with_the_engine_loads_neither_the_harness_nor_another_system():
    """Nor the compiler where nothing compiles: importing torch._dynamo is ~1.3 s of every such process (a bench case,
    a rank), and the models once imported it where they decorated the experts' eager loop."""
    code = f"""
import sys
from megatrain.config import CaseConfig
from megatrain.data import make_batches
from megatrain.systems import build_system
case = CaseConfig(system="megatrain", model="tiny", batch=2, seq=8, steps=1)
system = build_system(case)
system.step(*make_batches(case, case.shape().vocab_size).batch_at(0))
system.close()
print(" ".join(m for m in sys.modules if m.startswith({HARNESS!r} + ("deepspeed",))
               or m.startswith("megatrain.systems.") and m != "megatrain.systems.megatrain" or m == "torch._dynamo"))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""


def test_planning_every_system_imports_no_deepspeed():
    """DeepSpeed loads only when a DeepSpeed system is built: its spec, options and estimates need none of it. Nor
    does torch's compiler load (the suite runner, `models` and `report` plan and read models, ~1.3 s)."""
    code = """
import sys
from megatrain.config import CaseConfig
from megatrain.preflight import plan_case
from megatrain.probe import Machine
from megatrain.systems import SYSTEMS
from megatrain.train.checkpoint import state_bytes
machine = Machine(cpu="test", cpu_cores=2, host_mem_gib=64.0, host_available_gib=64.0)
for system in SYSTEMS:
    case = CaseConfig(system=system, model="tiny")
    plan_case(case, machine), state_bytes(case)
print(" ".join(m for m in sys.modules if m.startswith("deepspeed") or m == "torch._dynamo"))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ""


def test_every_system_is_one_spec_with_typed_options():
    assert set(SYSTEMS) == {"megatrain", "native", "deepspeed", "fsdp", "torchao", "paper"}
    for system in SYSTEMS:
        spec = system_spec(system)
        assert isinstance(spec, SystemSpec) and issubclass(spec.options, CommonOptions), system
    assert parse_options("megatrain", {"resident_layers": 3, "offload_activations": True}) == \
        MegaTrainOptions(resident_layers=3, offload_activations=True)
    assert parse_options("deepspeed", {}).optimizer is None
    assert parse_options("fsdp", {"host_mem_gib": 100}).host_mem_gib == 100
    with pytest.raises(ValueError, match="unknown system 'nativ'; choose one of: megatrain, paper, native, deepspeed, "
                                         "fsdp, torchao"):
        CaseConfig(system="nativ")


def test_a_system_added_with_one_registry_entry_is_known_everywhere(monkeypatch):
    """tests/unit/fake_system.py's SPEC registered under a new name: the case, its options, the pre-flight, the
    checkpoint size and the build all find it through the registry alone."""
    monkeypatch.setitem(SYSTEMS, "failing", Registered("fake_system:SPEC"))
    case = CaseConfig(system="failing", model="tiny", batch=2, seq=8, steps=1, options={"mlp_chunk_tokens": 4})
    assert case.opts.mlp_chunk_tokens == 4
    with pytest.raises(ValueError, match="failing has no option 'resident_layers' \\(an option of megatrain\\)"):
        CaseConfig(system="failing", options={"resident_layers": 1})
    native = CaseConfig(system="native", model="tiny", batch=2, seq=8, steps=1)
    machine = Machine(cpu="test", cpu_cores=2, host_mem_gib=64.0, host_available_gib=64.0)
    assert preflight.plan_case(case, machine) == preflight.plan_case(native, machine)
    assert state_bytes(case) == state_bytes(native)
    system = build_system(case)
    assert type(system).__name__ == "FailingSystem"
    system.step(*make_batches(case, case.shape().vocab_size).batch_at(0))
    system.close()


@pytest.mark.parametrize("system,given,message", [
    ("megatrain", {"ofload_activations": True}, "megatrain has no option 'ofload_activations'; its options: "),
    ("fsdp", {"mlp_chunk_tokens": 8}, "fsdp has no option 'mlp_chunk_tokens' (an option of megatrain, native, "
                                      "torchao)"),
    ("megatrain", {"offload_activations": "maybe"}, "offload_activations='maybe': expected true or false or an "
                                                    "integer or 'auto'"),
    ("megatrain", {"offload_activations": 1.5}, "offload_activations=1.5: expected true or false"),
    ("megatrain", {"offload_activations": -1}, "offload_activations must be true, false, 'auto' or a layer count"),
    ("megatrain", {"resident_layers": True}, "resident_layers=True: expected an integer or 'auto'"),
    ("native", {"mlp_chunk_tokens": -1}, "mlp_chunk_tokens must be >= 0"),
    ("deepspeed", {"optimizer": "sgd"}, "expected 'cpu_adam' or 'torch_adamw' or null"),
    ("deepspeed", {"zero_stage": 1}, "zero_stage=1: expected 2 or 3"),
    ("deepspeed", {"zenflow": True}, "zenflow=true extends ZeRO-Offload: add --option zero_stage=2"),
    ("deepspeed", {"super_offload": True, "zero_stage": 2}, "super_offload=true is a ZeRO-3 optimizer"),
    ("deepspeed", {"cpuadam_cores_perc": 0.5}, "add --option super_offload=true"),
    ("deepspeed", {"super_offload": True, "cpuadam_cores_perc": 1.0}, "cpuadam_cores_perc must be > 0 and < 1"),
    ("deepspeed", {"optimizer_ratio": 1.5}, "optimizer_ratio is the share of the optimizer stepped on the host, 0 to"),
    ("deepspeed", {"optimizer_ratio": 0.5, "zero_stage": 2}, "(partial optimizer offload) is ZeRO-3's alone"),
    ("deepspeed", {"optimizer_ratio": 0.5, "super_offload": True}, "run one of them"),
    ("deepspeed", {"offload_param": False, "zero_stage": 2}, "option offload_param=false is ZeRO-3's"),
    ("deepspeed", {"offload_param": False, "super_offload": True}, "offload_param=false and super_offload=true"),
    ("fsdp", {"prefetch_layers": -1}, "prefetch_layers counts the layers each one prefetches"),
    ("megatrain", {"weight_slots": 3}, "weight_slots=3: expected 1 or 2"),
    ("megatrain", {"forward_graph": "inference"}, "forward_graph='inference': expected 'no-grad' or 'training'"),
    ("megatrain", {"host_mem_gib": 0}, "host_mem_gib must be > 0"),
])
def test_unknown_keys_and_bad_values_are_refused_with_the_valid_keys(system, given, message):
    with pytest.raises(ValueError) as info:
        parse_options(system, given)
    assert message in str(info.value)
