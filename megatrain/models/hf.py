"""Hugging Face Qwen2/Llama checkpoints: config translation, sharded safetensors save and lazy load.

Our parameter names are HF's without the `model.` prefix (`lm_head.weight` is the same in both), so
translation is a prefix. Configs that need code we do not have (RoPE scaling, sliding-window
attention, MLP or output-projection biases, other activations) are refused, never approximated.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatrain.models.config import ModelConfig
from megatrain.models.transformer import Transformer

SUPPORTED_MODEL_TYPES = ("qwen2", "llama")
_ARCHITECTURES = {"qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
_DEFAULT_MAX_POSITIONS = {"qwen2": 32768, "llama": 2048}
REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def hf_name(name: str) -> str:
    return name if name == "lm_head.weight" else "model." + name


def our_name(hf: str) -> str:
    return hf if hf == "lm_head.weight" else hf.removeprefix("model.")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _read_json(file: Path):
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from None


def read_hf_config(path: str | Path) -> dict:
    """The config.json of a checkpoint directory; ValueError naming the directory when it or the file is missing
    or not a JSON object."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: no such directory")
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    hf = _read_json(path / "config.json")
    if not isinstance(hf, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object")
    return hf


def check_hf_checkpoint(path: str | Path) -> ModelConfig:
    """The shape of the checkpoint in directory `path`, its config read and translated and its weight files found,
    without reading a tensor; a ValueError, starting with the path, names what is missing or unsupported."""
    hf = read_hf_config(path)
    try:
        cfg = config_from_hf(hf)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    _weight_files(Path(path))
    return cfg


def config_from_hf(hf: Mapping) -> ModelConfig:
    """Our ModelConfig from a Hugging Face config.json dict (model_type 'qwen2' or 'llama').

    Reads both the transformers 4.x layout (top-level rope_theta, rope_scaling) and the 5.x one
    (rope_parameters). Raises ValueError for any setting our model does not implement.
    """
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported; our MLP is SwiGLU with silu")
    if hf.get("rope_scaling") is not None:
        raise ValueError(f"rope_scaling={hf['rope_scaling']} is not supported; only plain RoPE is implemented")
    rope = hf.get("rope_parameters") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_parameters with rope_type {rope_type!r} are not supported; "
                         "only plain RoPE (rope_type 'default') is implemented")
    if hf.get("use_sliding_window"):
        raise ValueError("use_sliding_window=true is not supported; our attention is full causal attention")
    sliding = [t for t in hf.get("layer_types") or [] if t != "full_attention"]
    if sliding:
        raise ValueError(f"layer_types {sorted(set(sliding))} are not supported; only 'full_attention' is")
    if hf.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported; our MLP projections have no bias")
    if model_type == "llama" and hf.get("attention_bias"):
        # Llama's attention_bias also puts a bias on o_proj, which our attention does not have.
        raise ValueError("llama attention_bias=true is not supported: it adds an o_proj bias our model lacks")
    if hf.get("attention_dropout", 0.0):
        warnings.warn(f"attention_dropout={hf['attention_dropout']} is ignored: our attention has no dropout",
                      stacklevel=2)
    missing = [k for k in REQUIRED_KEYS if k not in hf]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    return ModelConfig(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim") or 0,
        qkv_bias=model_type == "qwen2",
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=hf.get("max_position_embeddings", _DEFAULT_MAX_POSITIONS[model_type]),
    )


def config_to_hf(cfg: ModelConfig, model_type: str = "qwen2", dtype: torch.dtype = torch.float32) -> dict:
    """A config.json dict that transformers (4.x and 5.x) loads into the same architecture.

    Args:
        cfg: our model shape.
        model_type: 'qwen2' (q/k/v biases) or 'llama' (no biases); must agree with cfg.qkv_bias.
        dtype: the dtype the weights are stored in (config's torch_dtype / dtype field).
    """
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type == "qwen2" and not cfg.qkv_bias:
        raise ValueError("Qwen2 always has q/k/v biases but cfg.qkv_bias is False; save with model_type='llama'")
    if model_type == "llama" and cfg.qkv_bias:
        raise ValueError("Llama's attention_bias would add an o_proj bias; a model with qkv_bias saves as 'qwen2'")
    hf = {
        "architectures": [_ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.rms_norm_eps,
        # 4.x reads the top-level rope_theta, 5.x rope_parameters; both say the same.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        # 4.x reads torch_dtype, 5.x dtype.
        "torch_dtype": _dtype_name(dtype),
        "dtype": _dtype_name(dtype),
    }
    if model_type == "qwen2":
        hf.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    else:
        hf.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    return hf


def _expected_shapes(cfg: ModelConfig) -> dict[str, torch.Size]:
    """Our parameter names (in module order) and shapes, from a model on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    return {name: p.shape for name, p in model.state_dict().items()}


def _check_names(names, expected, what: str) -> None:
    missing, unexpected = sorted(set(expected) - set(names)), sorted(set(names) - set(expected))
    if missing or unexpected:
        raise ValueError(f"{what} does not match: missing {missing}, unexpected {unexpected}")


def _plan_shards(sizes: dict[str, int], max_shard_bytes: int) -> list[list[str]]:
    """Greedy split of names (in order) into shards of at most max_shard_bytes; a bigger tensor gets its own."""
    shards: list[list[str]] = [[]]
    shard_bytes = 0
    for name, nbytes in sizes.items():
        if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
            shards.append([])
            shard_bytes = 0
        shards[-1].append(name)
        shard_bytes += nbytes
    return shards


@torch.no_grad()
def save_hf_checkpoint(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor], cfg: ModelConfig,
                       out_dir: str | Path, model_type: str = "qwen2", max_shard_bytes: int = 5 * 2**30,
                       dtype: torch.dtype | None = None) -> list[Path]:
    """Write a Hugging Face checkpoint: config.json and safetensors shards (plus an index if several).

    Only one shard is copied at a time (to CPU, dtype and contiguity), so saving from a model or
    from host tiles needs at most one shard of extra memory.

    Args:
        model_or_state_dict: our Transformer, or a mapping of our parameter names to tensors.
        cfg: the model's shape; names and shapes are checked against it.
        out_dir: directory to create or overwrite files in.
        model_type: 'qwen2' or 'llama' (see config_to_hf).
        max_shard_bytes: largest shard file in bytes (a single larger tensor gets a shard of its own).
        dtype: dtype to store; None keeps each tensor's dtype.

    Returns:
        paths of the weight files written.
    """
    if isinstance(model_or_state_dict, torch.nn.Module):
        state = model_or_state_dict.state_dict()
    else:  # read one tensor at a time: a mapping may assemble each on access (DeepSpeed's gathered weights)
        state = model_or_state_dict
    expected = _expected_shapes(cfg)
    _check_names(state.keys(), expected, "state dict vs model config")
    sizes = {}
    for name, shape in expected.items():
        tensor = state[name]
        if tensor.shape != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, the config implies {tuple(shape)}")
        sizes[name] = tensor.numel() * (dtype or tensor.dtype).itemsize
        del tensor
    shards = _plan_shards(sizes, max_shard_bytes)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(cfg, model_type, dtype or state["embed_tokens.weight"].dtype)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    files = [SINGLE_FILE] if len(shards) == 1 else [
        f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    weight_map = {}
    for file, names in zip(files, shards, strict=True):
        tensors = {hf_name(n): state[n].detach().to("cpu", dtype or state[n].dtype).contiguous() for n in names}
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
        (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    # A previous save's single file or index would point loaders at stale weights.
    (out_dir / (SINGLE_FILE if len(files) > 1 else INDEX_FILE)).unlink(missing_ok=True)
    return [out_dir / f for f in files]


def _weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, the single file first as transformers looks for it."""
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    if (path / INDEX_FILE).exists():
        weight_map = _read_json(path / INDEX_FILE)["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    raise ValueError(f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE}; only safetensors checkpoints are read")


def iter_hf_tensors(path: str | Path, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(our name, tensor) of a checkpoint directory, read one tensor at a time from its safetensors files (a
    stored buffer such as rotary_emb.inv_freq and a tied model's stored head are left out, as transformers does)."""
    path = Path(path)
    tied = config_from_hf(read_hf_config(path)).tie_embeddings
    for file in _weight_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                if key.endswith("rotary_emb.inv_freq") or (tied and key == "lm_head.weight"):
                    continue
                tensor = f.get_tensor(key)
                yield our_name(key), tensor if dtype is None else tensor.to(dtype)


@torch.no_grad()
def copy_named_weights(targets: Mapping[str, torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy each (name, tensor) of `named` into targets[name], one at a time (a checkpoint never whole in memory).
    A name the targets lack, a shape that differs, or a target left without a tensor is refused by name."""
    seen = set()
    for name, tensor in named:
        if name not in targets:
            raise ValueError(f"weight {name!r} is not a parameter of this model")
        if tuple(tensor.shape) != tuple(targets[name].shape):
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, this model's is {tuple(targets[name].shape)}")
        targets[name].copy_(tensor)
        seen.add(name)
    if missing := sorted(set(targets) - seen):
        raise ValueError(f"weights missing: {missing}")


@torch.no_grad()
def load_hf_checkpoint(path: str | Path, device: torch.device | str = "cpu",
                       dtype: torch.dtype | None = None) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face Qwen2/Llama checkpoint directory into our config and parameter names.

    Args:
        path: directory with config.json and model.safetensors or model.safetensors.index.json + shards.
        device: where the tensors are materialised.
        dtype: cast every tensor to this dtype; None keeps the stored dtypes.
    """
    path = Path(path)
    cfg = config_from_hf(read_hf_config(path))
    state = {name: t.to(device) for name, t in iter_hf_tensors(path, dtype)}
    _check_names(state, _expected_shapes(cfg), f"checkpoint {path} vs its config.json")
    return cfg, state


def load_into_model(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """Copy state_dict into model; raises ValueError naming any missing or unexpected parameter."""
    _check_names(state_dict, model.state_dict(), "state dict vs model")
    model.load_state_dict(state_dict, strict=True)
