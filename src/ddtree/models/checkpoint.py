"""Checkpoints: a target or drafter built from a Hugging Face model directory, streaming tensors
shard by shard, and written back as one (the inverse: DeepseekV3's tensor names, routed experts as
one gate / up / down tensor each, the `model.` prefix, so transformers' DeepseekV3ForCausalLM reads
the same directory; shards under max_shard_bytes, with an index when there is more than one).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..ops.policy import KernelPolicy
from ..parallel.checkpoint_parts import expert_range, tensor_part
from ..parallel.shard import SINGLE, Shard
from . import expert_weights
from .config import TargetConfig, text_config
from .drafter import Drafter
from .drafter_config import DrafterConfig, check_pair
from .int4_order import interleave_int4_experts
from .layers import MoE, inv_freq_and_factor
from .target import Target

_LAYER = re.compile(r"layers\.(\d+)\.")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_TENSORS = {"weight_packed": torch.int32, "weight_shape": None}  # kept as stored (any int for the shape)


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint, from its index when sharded."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise FileNotFoundError(f"checkpoint {path} is missing shard(s) {missing} listed in its index")
        return [path / n for n in names]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def checkpoint_tensors(path: Path, dtype: torch.dtype, skip=lambda name: False, part=lambda name: None):
    """Yield (name, tensor) over every shard, one tensor at a time (no full copy of the model in
    host memory): float tensors in `dtype`, INT4 words and shapes (models/quant.py) as stored;
    names for which `skip` is true are never read; `part(name)`: the index to read of that tensor
    (a tensor-parallel rank's rows or columns; None: all of it); other storage is refused by name."""
    for shard in shard_files(path):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            for name in f.keys():
                if skip(name):
                    continue
                index = part(name)
                tensor = f.get_tensor(name) if index is None else f.get_slice(name)[index]
                kind = name.rsplit(".", 1)[-1]
                if kind in _INT_TENSORS and not tensor.is_floating_point():
                    yield name, tensor
                    continue
                if tensor.dtype not in _FLOAT_DTYPES:
                    raise NotImplementedError(f"checkpoint tensor {name} is {tensor.dtype}: only 16- and 32-bit float "
                                              "weights and INT4 routed experts (compressed-tensors' pack-quantized) "
                                              "are supported")
                yield name, tensor.to(dtype)


def _materialize(module: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """Uninitialized storage on `device` for a module built on the meta device, allocated in
    `dtype` at once (casting after allocating would peak at float32: 216 GB for 4 of Kimi K2's layers)."""
    return module.to(dtype).to_empty(device=device)


def _empty_target(cfg: TargetConfig, dtype: torch.dtype, device, policy: KernelPolicy, shard: Shard = SINGLE) -> Target:
    with torch.device("meta"):
        model = Target(cfg, policy, shard)
    model = _materialize(model, dtype, device)
    model.inv_freq = inv_freq_and_factor(cfg)[0].to(device)  # stays float32, unlike the weights
    model.fuse_input_projections()  # before any weight is copied in: one GEMM reads each layer's input
    return model


def _place(
    model: Target, params: dict[str, torch.nn.Parameter], cfg: TargetConfig, name: str, tensor: torch.Tensor, loaded: set[str]
) -> None:
    """Copy one checkpoint tensor (its name without the text prefix) into the model, checking its
    shape; raises naming the tensor."""
    key = name.removeprefix("model.")
    expert = expert_weights.EXPERT_TENSOR.fullmatch(key)
    if expert:
        layer = int(expert[1])
        moe = model.layers[layer].mlp
        if not isinstance(moe, MoE):
            raise ValueError(f"unexpected checkpoint tensor {name} (layer {layer} has no routed experts)")
        expert_weights.place(moe, cfg, name, expert, tensor)
        loaded.add(name)
        return
    if key.endswith((".weight_packed", ".weight_scale", ".weight_shape")):
        raise NotImplementedError(f"checkpoint tensor {name}: only the routed experts may be INT4 "
                                  "(compressed-tensors' pack-quantized); this Linear must be 16-bit")
    assign(params, key, name, tensor)
    loaded.add(key)


def assign(params: dict[str, torch.nn.Parameter], key: str, name: str, tensor: torch.Tensor) -> None:
    """Copy checkpoint tensor `name` into params[key], checking that it exists and its shape."""
    if key not in params:
        raise ValueError(f"unexpected checkpoint tensor {name} (no such parameter in the model)")
    param = params[key]
    if param.shape != tensor.shape:
        raise ValueError(f"checkpoint tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


def random_target(
    cfg: TargetConfig, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu", seed: int = 0,
    std: float = 0.02, policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE
) -> Target:
    """A target with random weights made directly on `device` (no host copy, no checkpoint), for
    benchmarks at real shapes: norms 1, router bias 0, every other weight N(0, std^2); shard: the
    part one rank holds (parallel/shard.py)."""
    model = init_random(_empty_target(cfg, dtype, device, policy, shard), seed=seed, std=std)
    return interleave_int4_experts(model).eval()


@torch.no_grad()
def init_random(model: torch.nn.Module, *, seed: int = 0, std: float = 0.02) -> torch.nn.Module:
    """Fill a model's weights in place, on their device, with random_target's distributions
    (norms 1, router bias 0, every other weight N(0, std^2)); returns the model."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif name.endswith("e_score_correction_bias"):
            p.zero_()
        elif name.endswith("_packed"):  # INT4 experts: random words, so every 4-bit value is uniform in [-8, 7]
            p.copy_(torch.randint(-2**31, 2**31, p.shape, generator=gen, device=p.device, dtype=torch.int64).to(torch.int32))
        elif name.endswith("_scale"):  # ... times a scale that gives them the other weights' std (4.6: [-8, 7]'s)
            p.uniform_(0.5 * std / 4.6, 1.5 * std / 4.6, generator=gen)
        else:
            p.normal_(0.0, std, generator=gen)
    return model


def load_drafter(
    path: str | Path, target: Target, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None,
    policy: KernelPolicy = KernelPolicy()
) -> Drafter:
    """A DFlash drafter for `target` (pair checked first; target layers by DFlash's rule where its
    config names none), streamed like load_target.

    dtype and device default to the target's: the drafter reads the target's embeddings and
    hidden states and feeds its lm_head, so it must live where the target does. policy: its
    norms' kernel policy (ops/policy.py).
    """
    path = Path(path)
    cfg = DrafterConfig.from_pretrained(path).for_target(target.cfg)
    check_pair(target.cfg, cfg)
    weight = target.embed_tokens.weight
    dtype = dtype or weight.dtype
    device = device or weight.device
    with torch.device("meta"):
        model = Drafter(cfg, policy)
    model = _materialize(model, dtype, device)
    model.fuse_input_projections()  # before any weight is copied in: one GEMM for each MLP's gate and up
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    shared = ("embed_tokens.weight", "lm_head.weight")  # the drafter uses the target's
    for name, tensor in checkpoint_tensors(path, dtype, skip=lambda name: name.removeprefix("model.") in shared):
        key = name.removeprefix("model.")
        assign(params, key, name, tensor)
        loaded.add(key)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"drafter checkpoint {path} lacks {len(missing)} tensor(s), first: {missing[:3]}")
    return model.eval()


def _skipped(name: str, cfg: TargetConfig, prefix: str, experts: range) -> bool:
    """Tensors the target does not use: anything outside the text model (a multimodal wrapper's
    vision tower and projector), multi-token-prediction layers past num_hidden_layers, cached
    rotary tables, and the routed experts other ranks hold."""
    if not name.startswith(prefix):
        return True
    layer = _LAYER.search(name)
    if (layer is not None and int(layer[1]) >= cfg.num_hidden_layers) or name.endswith("rotary_emb.inv_freq"):
        return True
    expert = expert_weights.EXPERT_TENSOR.fullmatch(name.removeprefix(prefix).removeprefix("model."))
    return expert is not None and int(expert[2]) not in experts


def load_target(path: str | Path, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                policy: KernelPolicy = KernelPolicy(), shard: Shard = SINGLE) -> Target:
    """Build the target from config.json and fill it from the checkpoint's safetensors shards.

    Tensors are read one at a time (no full copy of the model in host memory), checked against the
    expected shape and copied into place; anything missing or unexpected is an error naming it.
    A multimodal wrapper's text model (Kimi K2.5 / K2.6) is read from its text_config and prefixed
    weights, the rest never read; INT4 routed experts are kept packed (models/quant.py).
    policy: every layer's kernel policy (ops/policy.py); shard: the part this process holds and
    reads (parallel/shard.py: its heads, columns, vocabulary rows and experts, nothing else).
    """
    path = Path(path)
    cfg = TargetConfig.from_pretrained(path)
    _, prefix = text_config(json.loads((path / "config.json").read_text()))
    model = _empty_target(cfg, dtype, device, policy, shard)
    experts = expert_range(cfg, shard)
    params = dict(model.named_parameters())
    expected = {n for n in params if ".mlp.w_" not in n}  # the stacked routed experts: by their own names
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    loaded: set[str] = set()
    part = lambda name: tensor_part(cfg, shard, name.removeprefix(prefix).removeprefix("model."))  # noqa: E731
    for name, tensor in checkpoint_tensors(path, dtype, skip=lambda name: _skipped(name, cfg, prefix, experts), part=part):
        _place(model, params, cfg, name.removeprefix(prefix), tensor, loaded)
    missing = sorted((expected | expert_weights.expected_names(cfg, experts)) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensor(s), first: {missing[:3]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return interleave_int4_experts(model).eval()


# -- writing ----------------------------------------------------------------------------------


def target_tensors(model: Target) -> dict[str, torch.Tensor]:
    """Every tensor of the target under its DeepseekV3 checkpoint name; tied lm_head omitted."""
    cfg = model.cfg
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".mlp.w_" in name:  # the stacked routed experts: per expert below
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            raise ValueError("the config ties lm_head to embed_tokens but the model's lm_head is a separate tensor")
        out[name if name == "lm_head.weight" else f"model.{name}"] = param.detach()
    if not cfg.tie_word_embeddings and "lm_head.weight" not in out:  # a tied module that the config calls untied
        out["lm_head.weight"] = model.lm_head.weight.detach()
    for i, layer in enumerate(model.layers):
        if isinstance(layer.mlp, MoE):
            out.update(expert_weights.checkpoint_tensors_of(layer.mlp, i, cfg))
    return out


def write_shards(tensors: dict[str, torch.Tensor], path: str | Path, dtype: torch.dtype, max_shard_bytes: int) -> list[str]:
    """Save tensors (cast to dtype, on the CPU) as safetensors shards of at most max_shard_bytes,
    replacing any earlier weights in path; returns the shard file names. One shard is
    model.safetensors, several get an index."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    # An earlier save's shards or index would be read instead of (or mixed with) these weights.
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        t = t.to("cpu", dtype if t.is_floating_point() else t.dtype).contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if nbytes > max_shard_bytes:
            raise ValueError(f"tensor {name} ({nbytes} bytes) is larger than max_shard_bytes={max_shard_bytes}")
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        names = ["model.safetensors"]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        weight_map = {n: file for file, shard in zip(names, shards) for n in shard}
        total = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
        (path / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    for file, shard in zip(names, shards):
        save_file(shard, str(path / file), metadata={"format": "pt"})
    return names


def save_target(model: Target, config: dict, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                max_shard_bytes: int = 15 << 20) -> None:
    """Write config.json (the given Hugging Face config dict) and the weights in dtype."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards(target_tensors(model), path, dtype, max_shard_bytes)


def save_drafter(model: Drafter, config: dict, path: str | Path, *, dtype: torch.dtype = torch.bfloat16,
                 max_shard_bytes: int = 15 << 20) -> None:
    """Write a DFlash drafter: config.json and its own weights (embeddings and lm_head are the target's)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    write_shards({n: p.detach() for n, p in model.named_parameters()}, path, dtype, max_shard_bytes)
