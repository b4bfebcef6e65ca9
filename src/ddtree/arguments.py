"""The commands' arguments: value parsers that name what was wrong in one line, the pair flags
that generate, serve and profile share, and the checks that need no model."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class DefaultsShown(argparse.HelpFormatter):
    """--help names each option's default, unless its text already says it or there is none."""

    def _get_help_string(self, action):
        text = action.help or ""
        unset = action.default is None or action.default is False or action.default == argparse.SUPPRESS
        if "default" in text or unset or not action.option_strings:
            return text
        return f"{text} (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message):  # one line, no usage dump
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        sys.exit(2)


def positive(kind):
    def parse(text):
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error
    return parse


def at_least_zero(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def at_least_zero_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


for _parse in (at_least_zero, probability):
    _parse.__name__ = "float"  # argparse names the type in its error
at_least_zero_int.__name__ = "int"


class UsageError(Exception):
    """A mistake in what the user asked, found after argument parsing: one line, exit 2."""


MAX_SEED = 2**63 - 1


def seed(text: str) -> int:
    value = int(text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be in [0, {MAX_SEED}], got {text}")
    return value


def stop_string(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


seed.__name__ = "int"
stop_string.__name__ = "str"


def budget(text: str):
    """A --budget value: "auto" or a positive int."""
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f'must be "auto" or an int > 0, got {text}')
    return value


def warm_modes(text: str) -> list[tuple[str, int | str | None]]:
    """A --warm-modes value as (mode, budget) pairs: "ar", "chain", "ddtree:N" or "ddtree:auto",
    comma separated, repeats dropped; "none": no pair (nothing warmed)."""
    if text.strip() == "none":
        return []
    modes = []
    for entry in (e.strip() for e in text.split(",")):
        mode, _, value = entry.partition(":")
        if mode in ("ar", "chain") and not value:
            pair = (mode, None)
        elif mode == "ddtree" and (value == "auto" or (value.isdigit() and int(value) > 0)):
            pair = (mode, value if value == "auto" else int(value))
        else:
            raise argparse.ArgumentTypeError(f"{entry!r} is none of ar, chain, ddtree:auto, ddtree:N (N > 0), or "
                                             "'none' alone")
        if pair not in modes:
            modes.append(pair)
    return modes


def add_pair_arguments(p: argparse.ArgumentParser, sized_to_prompts: bool = False) -> None:
    """--target / --drafter and how to load them: shared by generate, serve and profile.
    sized_to_prompts (generate): the batch and the request length default to what the prompts need."""
    p.add_argument("--target", help="target model directory (config.json + safetensors); "
                   "default: the demo pair shipped in the package (a small Python coder and its drafter)")
    p.add_argument("--drafter", help="DFlash drafter directory (needed for modes chain / ddtree with --target)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default: bfloat16 on CUDA, float32 on the CPU")
    if sized_to_prompts:
        p.add_argument("--max-batch", type=positive(int), default=None,
                       help="requests in the running batch (default: the prompts' count, at most 32)")
        p.add_argument("--max-model-len", type=positive(int), default=None, help="prompt + completion tokens per "
                       "request (default: the longest prompt + --max-new-tokens, at least 1024, within the model's positions)")
    else:
        p.add_argument("--max-batch", type=positive(int), default=None,
                       help=f"requests in the running batch (default: {SERVING_BATCH['cuda']} on CUDA, "
                       f"{SERVING_BATCH['cpu']} on the CPU)")
        p.add_argument("--max-model-len", type=positive(int), default=None, help="prompt + completion tokens per "
                       "request (default: the model's positions, at most 8192)")
    p.add_argument("--num-pages", type=positive(int), default=None, help="KV cache pages (default: sized from memory)")
    p.add_argument("--page-size", type=positive(int), default=64, help="KV cache slots per page")
    p.add_argument("--max-budget", type=positive(int), default=256,
                   help="the largest tree budget a request may ask (auto's sizes, 1 to 64, stay within it)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the tokenizer's own code (Kimi K2)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay rounds from CUDA graphs (default: on for bf16 on Hopper / Blackwell; "
                        "--no-cuda-graphs to debug)")
    p.add_argument("--tensor-parallel", type=positive(int), default=1,
                   help="split the target over this many GPUs (heads, experts, vocabulary; one process each, "
                        "started by this one); on the CPU, that many gloo processes")


# serve's and profile's default batch: a CPU steps a batch of 32 slowly, measures its round costs
# for minutes at start-up and holds its KV cache in host memory
SERVING_BATCH = {"cuda": 32, "cpu": 8}


def serving_batch(device: str | None) -> int:
    """--max-batch's default for serve and profile on `device` (None: CUDA when present)."""
    import torch

    kind = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    return SERVING_BATCH[kind]


def check_before_loading(args) -> str | None:
    """What is wrong with the arguments that needs no model to find (the device, the directories,
    a budget past --max-budget), as one line; None when nothing is."""
    device = getattr(args, "device", None)
    if device is not None:
        from .engine.loading import resolve_device

        try:
            resolve_device(device)
        except ValueError as err:
            return f"--{err}"  # "device x: ..." becomes "--device x: ...", naming the flag
    ranks = getattr(args, "tensor_parallel", 1)
    if ranks > 1 and getattr(args, "gpu_memory", None) is None:  # plan --gpu-memory: for another machine
        import torch

        on_cuda = device is None and torch.cuda.is_available() or device is not None and device.startswith("cuda")
        if on_cuda and ranks > torch.cuda.device_count():
            return f"--tensor-parallel {ranks}: this machine has {torch.cuda.device_count()} CUDA devices"
    for flag in ("target", "drafter"):
        path = getattr(args, flag, None)
        if path is not None and not Path(path).is_dir():
            return f"--{flag} {path}: no such directory"
        if path is not None and not (Path(path) / "config.json").is_file():
            return f"--{flag} {path}: no config.json there (a Hugging Face model directory holds one)"
    costs = getattr(args, "round_costs", None)
    if costs is not None and not Path(costs).is_file():
        return f"--round-costs {costs}: no such file"
    budget_ = getattr(args, "budget", None)
    if isinstance(budget_, int) and budget_ > args.max_budget:
        return f"--budget {budget_} is above --max-budget {args.max_budget} (raise --max-budget to allow it)"
    for mode, value in getattr(args, "warm_modes", None) or ():
        if mode != "ar" and args.target is not None and args.drafter is None:
            name = mode if value is None else f"{mode}:{value}"
            return f"--warm-modes {name}: needs --drafter DIR (or warm ar only)"
        if isinstance(value, int) and value > args.max_budget:
            return f"--warm-modes ddtree:{value} is above --max-budget {args.max_budget}"
    return None


def cache_line(engine) -> str:
    """What the KV cache holds, for the start-up line."""
    pages, size = engine.blocks.num_pages, engine.page_size
    mib = sum(c.numel() * c.element_size() for c in engine.caches) / 2**20
    requests = f"{engine.max_batch} request" + ("s" if engine.max_batch > 1 else "")
    return (f"KV cache of {pages} pages x {size} slots ({pages * size} tokens, {mib:.0f} MiB) for up to "
            f"{requests} of {engine.max_model_len} tokens")


def weights_line(engine) -> str:
    """What the weights take on each device, for the start-up line after cache_line's."""
    from .parallel.memory_plan import parameter_bytes, readable

    dtype = engine.target.embed_tokens.weight.dtype
    world = engine.target.shard.world
    where = f" on each of {world} ranks" if world > 1 else ""
    target = readable(sum(parameter_bytes(engine.target, dtype).values()))
    drafter = "" if engine.drafter is None else f", drafter {readable(sum(parameter_bytes(engine.drafter, dtype).values()))}"
    return f"weights: target {target}{where}{drafter} (ddtree plan computes this before loading)"


def load_engine(args, **engine_args):
    """The Engine that add_pair_arguments' flags describe; what the user's directories or
    --round-costs file hold that cannot be loaded is a UsageError (exit 2)."""
    import torch

    from .engine import Engine

    try:
        return Engine.from_pretrained(
            args.target, args.drafter, device=args.device, dtype=getattr(torch, args.dtype) if args.dtype else None,
            trust_remote_code=args.trust_remote_code, max_batch=args.max_batch, max_model_len=args.max_model_len,
            num_pages=args.num_pages, page_size=args.page_size, max_budget=args.max_budget,
            cuda_graphs=args.cuda_graphs, tensor_parallel=args.tensor_parallel, **engine_args)
    except (ValueError, KeyError, NotImplementedError, FileNotFoundError) as err:
        raise UsageError(err.args[0] if isinstance(err, KeyError) and err.args else str(err)) from err
