"""`ddtree plan`: how a model pair fits on N GPUs, read from its config.json files (nothing loaded):
weights per rank, the drafter, the KV cache the rest holds (parallel/memory_plan.py)."""

from __future__ import annotations

from .arguments import UsageError, positive


def add_plan_command(commands):
    p = commands.add_parser("plan", help="how a model pair fits on N GPUs: weights per rank, the drafter, the KV "
                            "cache (from config.json alone)")
    p.add_argument("--target", required=True, help="target model directory (its config.json is all that is read)")
    p.add_argument("--drafter", help="DFlash drafter directory (config.json)")
    p.add_argument("--tensor-parallel", type=positive(int), default=1, help="GPUs the target is split over")
    p.add_argument("--gpu-memory", type=positive(float), default=None, metavar="GIB",
                   help="memory of each GPU in GiB (default: this machine's first CUDA device's)")
    p.add_argument("--max-model-len", type=positive(int), default=None,
                   help="prompt + completion tokens per request (default: the model's positions, at most 8192)")
    p.add_argument("--max-batch", type=positive(int), default=32, help="requests in the running batch")
    p.add_argument("--page-size", type=positive(int), default=64, help="KV cache slots per page")
    p.add_argument("--max-budget", type=positive(int), default=256, help="the largest tree budget a request may ask")
    return p


def gpu_bytes(args) -> int:
    """--gpu-memory, else the local CUDA device's memory (checking --tensor-parallel against the
    devices there); a UsageError when neither can say."""
    if args.gpu_memory is not None:
        return int(args.gpu_memory * 2**30)
    import torch

    if not torch.cuda.is_available():
        raise UsageError("no CUDA device here: pass --gpu-memory GIB, the memory of each GPU to plan for")
    count = torch.cuda.device_count()
    if args.tensor_parallel > count:
        raise UsageError(f"--tensor-parallel {args.tensor_parallel}: this machine has {count} CUDA devices "
                         "(pass --gpu-memory GIB to plan for another machine)")
    return torch.cuda.get_device_properties(0).total_memory


def plan(args) -> None:
    from .models.config import TargetConfig
    from .models.drafter_config import DrafterConfig, check_pair
    from .parallel.memory_plan import plan_memory

    memory = gpu_bytes(args)
    target = TargetConfig.from_pretrained(args.target)
    drafter = None
    if args.drafter is not None:
        drafter = DrafterConfig.from_pretrained(args.drafter).for_target(target)
        check_pair(target, drafter)
    result = plan_memory(target, drafter, args.tensor_parallel, memory, page_size=args.page_size,
                         max_model_len=args.max_model_len, max_batch=args.max_batch, max_budget=args.max_budget)
    print("\n".join(result.lines()))
