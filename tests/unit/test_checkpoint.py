"""The one road from a checkpoint folder (megatrain.models.checkpoint) refuses a damaged checkpoint in one line, exit 2
at the CLI, naming the file and the tensor or field, for the generic path (transformers' own modules) as for the
hand-written one: missing, extra, non-float and misshapen tensors, an index whose shards lack tensors, damaged
config.json values and damaged safetensors files. Where the headers tell, before --out is claimed. And bench takes a
config.json or a checkpoint folder as its model. CPU, seconds: pytest tests/unit/test_checkpoint.py"""

import hashlib
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file, save_file  # noqa: E402
from train_helpers import SHAPE, hf_model, one_error, pretokenized, run_train  # noqa: E402

from megatrain.models.checkpoint import open_checkpoint  # noqa: E402
from megatrain.models.safetensors_files import INDEX_FILE, SINGLE_FILE  # noqa: E402

KINDS = ("llama", "seed_oss")  # a hand-written family, and one only transformers' own modules train


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Each kind's tiny checkpoint, in one file and in shards, and pre-tokenized data."""
    root = tmp_path_factory.mktemp("sources")
    torch.manual_seed(0)
    seed_oss = transformers.AutoModelForCausalLM.from_config(transformers.SeedOssConfig(**SHAPE, head_dim=16))
    seed_oss.save_pretrained(root / "seed_oss")
    seed_oss.save_pretrained(root / "seed_oss-sharded", max_shard_size="40KB")
    hf_model("llama", root / "llama")
    transformers.AutoModelForCausalLM.from_pretrained(root / "llama").save_pretrained(root / "llama-sharded",
                                                                                      max_shard_size="40KB")
    return root, pretokenized(root / "data.jsonl", rows=8)


def _tensors(edit):
    def damage(d):
        tensors = load_file(d / SINGLE_FILE)
        edit(tensors)
        save_file(tensors, d / SINGLE_FILE, metadata={"format": "pt"})
    return damage


def _config(**changes):
    def damage(d):
        config = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps({**config, **changes}))
    return damage


def _raw(edit):
    def damage(d):
        (d / SINGLE_FILE).write_bytes(edit((d / SINGLE_FILE).read_bytes()))
    return damage


def _shards_lack(count):
    """The index still names `count` tensors that its shards no longer hold."""
    def damage(d):
        weight_map = json.loads((d / INDEX_FILE).read_text())["weight_map"]
        for key in sorted(weight_map)[:count]:
            shard = d / weight_map[key]
            tensors = load_file(shard)
            del tensors[key]
            save_file(tensors, shard, metadata={"format": "pt"})
    return damage


DOWN = "model.layers.1.mlp.down_proj.weight"
NORM = "model.norm.weight"
SCENARIOS = {  # name: (damage, sharded source, what the one line says, whether the headers tell)
    "missing": (_tensors(lambda t: t.pop(DOWN)), False, DOWN, True),
    "shards lack 3": (_shards_lack(3), True, f"{INDEX_FILE} places tensor", True),
    "extra": (_tensors(lambda t: t.update({"model.layers.1.mlp.extra.weight": torch.zeros(3)})), False,
              "model.layers.1.mlp.extra.weight", False),
    "int32": (_tensors(lambda t: t.update({NORM: t[NORM].to(torch.int32)})), False, f"{NORM} is stored as int32",
              True),
    "bool": (_tensors(lambda t: t.update({NORM: t[NORM] > 0})), False, f"{NORM} is stored as bool", True),
    "wrong shape": (_tensors(lambda t: t.update({NORM: torch.ones(65)})), False, f"{NORM} has shape (65,)", True),
    "hidden 0": (_config(hidden_size=0), False, "config.json hidden_size=0 must be an integer >= 1", True),
    "hidden '64'": (_config(hidden_size="64"), False, 'config.json hidden_size="64" must be an integer', True),
    "hidden 64.5": (_config(hidden_size=64.5), False, "config.json hidden_size=64.5 must be an integer", True),
    "heads 0": (_config(num_attention_heads=0), False, "num_attention_heads=0 must be an integer >= 1", True),
    "heads 3": (_config(num_attention_heads=3), False, "", True),  # the kinds say it differently: below
    "negative width": (_config(intermediate_size=-5), False, "intermediate_size=-5 must be an integer >= 1", True),
    "negative depth": (_config(num_hidden_layers=-1), False, "num_hidden_layers=-1 must be an integer >= 1", True),
    "truncated": (_raw(lambda b: b[:len(b) // 2]), False, f"{SINGLE_FILE} is not a readable safetensors file", True),
    "empty": (_raw(lambda b: b""), False, f"{SINGLE_FILE} is not a readable safetensors file", True),
    "garbage header": (_raw(lambda b: b[:8] + b"garbage!" + b[16:]), False,
                       f"{SINGLE_FILE} is not a readable safetensors file", True),
    "huge header length": (_raw(lambda b: (2**62).to_bytes(8, "little") + b[8:]), False,
                           f"{SINGLE_FILE} is not a readable safetensors file", True),
}
# heads 3 of a width of 64: the hand-written model cannot divide it, so transformers' own modules are tried, whose
# config class refuses it (StrictDataclassClassValidationError); Seed-OSS's explicit head_dim makes q 48 wide
HEADS_3 = {"llama": "transformers refuses this llama config.json: StrictDataclassClassValidationError",
           "seed_oss": "model.layers.0.self_attn.o_proj.weight has shape (64, 64), the config implies (64, 48)"}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_damaged_checkpoint_is_refused_in_one_line_naming_what(sources, tmp_path, capsys, kind, scenario):
    root, data = sources
    damage, sharded, says, early = SCENARIOS[scenario]
    bad = tmp_path / "init"
    shutil.copytree(root / (f"{kind}-sharded" if sharded else kind), bad)
    damage(bad)
    assert run_train(bad, data, tmp_path / "run", steps=1) == 2
    line = one_error(capsys)
    assert (says or HEADS_3[kind]) in line and str(bad) in line, line
    if early:  # found before anything is claimed: the corrected command needs no --overwrite
        assert not (tmp_path / "run").exists()


def test_transformers_own_refusal_of_a_generic_config_is_one_line(sources, tmp_path):
    """A value only transformers' modules trip over (head_dim 0: a division by zero in its RoPE) is a ValueError
    naming the config, not a traceback."""
    root, _ = sources
    shutil.copytree(root / "seed_oss", tmp_path / "init")
    _config(head_dim=0)(tmp_path / "init")
    with pytest.raises(ValueError, match=r"init: transformers cannot build seed_oss from this config.json: "
                                         r"ZeroDivisionError"):
        open_checkpoint(tmp_path / "init")


@pytest.mark.parametrize("kind", KINDS)
def test_a_checkpoint_both_kinds_read_loads_every_weight_once(sources, kind):
    """The sharded and the single-file checkpoint of one model read the same weights through the road."""
    root, _ = sources
    one, shards = open_checkpoint(root / kind), open_checkpoint(root / f"{kind}-sharded")
    assert one.shape.kind == shards.shape.kind == ("handwritten" if kind == "llama" else "generic")
    a, b = dict(one.weights()), dict(shards.weights())
    assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_bench_takes_a_config_json_or_a_checkpoint_folder_and_names_its_hash(sources, capfd, monkeypatch):
    """bench --model PATH: a family we did not write, measured by its config.json alone (issue 62)."""
    from megatrain import cli

    root, _ = sources
    monkeypatch.setattr(cli.warnings, "formatwarning", cli.warnings.formatwarning)  # main() sets its own: undone after
    sha256 = hashlib.sha256((root / "seed_oss" / "config.json").read_bytes()).hexdigest()
    for model in (root / "seed_oss" / "config.json", root / "seed_oss"):
        assert cli.main(["bench", "--system", "megatrain", "--model", str(model), "--batch", "2", "--seq", "16",
                         "--steps", "1", "--json"]) == 0
        record = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
        assert record["status"] == "ok" and record["model"] == f"{model.name}@sha256:{sha256}"
        assert json.loads(record["config"]["model_shape"]["hf_json"])["model_type"] == "seed_oss"
