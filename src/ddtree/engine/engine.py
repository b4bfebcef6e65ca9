"""Engine: requests in, committed tokens out. add_request / step / abort underneath, generate on top
(engine/generate.py).

One step (engine/stepping.py) admits waiting requests that fit (a free slot, pages for their
worst case), prefills them, and launches one round for every running request; with overlap (the
default) it then reads the previous step's round, so the host's work on committed tokens runs
while the device computes (engine/inflight.py). The host waits for one small copy per round; everything else stays on the
device.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from pathlib import Path

import torch

from ..models import Drafter, Target
from ..ops.policy import KernelPolicy
from ..tree.types import MAX_TRITON_BUDGET
from .batch import BatchState
from .costs import RoundCosts, pair_signature
from .generate import OfflineGeneration
from .graphs import RoundGraphs, graphs_wanted
from .inflight import Flight
from .kept_costs import keep_table, kept_table
from .loading import default_num_pages, drafter_capacity, load_pair, resolve_device
from .pages import BlockManager, KVCacheFull, pages_for
from .profiling import buckets_up_to, prepare_auto_rounds
from .request import Request, RequestOutput, node_limit_for
from .round import RoundContext
from .sampling import SamplingParams
from .scheduling import PlanLimits
from .sizing import DEFAULT_TREE_SIZES, tree_sizer
from .stepping import Stepping
from .worker import Worker

log = logging.getLogger("ddtree.engine")


class Engine(Stepping, OfflineGeneration):
    def __init__(self, target: Target, drafter: Drafter | None = None, tokenizer=None, *, max_batch: int = 32,
                 max_model_len: int | None = None, num_pages: int | None = None, page_size: int = 64,
                 max_budget: int = 256, prefill_chunk: int = 512,
                 stop_token_ids: tuple[int, ...] = (), time_stages: bool = True, cuda_graphs: bool | None = None,
                 overlap: bool = True, tree_sizes: tuple[int, ...] = DEFAULT_TREE_SIZES,
                 round_costs: RoundCosts | str | Path | None = None, kept_costs: str = "use", relay=None):
        """target / drafter: loaded models on one device (drafter None: only mode "ar").
        max_model_len: prompt + new tokens per request (default min(max_position_embeddings, 8192));
        num_pages: latent-cache pages of page_size slots (default: sized from memory);
        max_budget: the largest tree budget a request may ask for; prefill_chunk: prompt rows per
        request per prefill forward.
        cuda_graphs: replay each round shape from a CUDA graph (engine/graphs.py). None (default):
        on for a bf16 model on a Hopper or Blackwell GPU, off otherwise; True: required (an error
        off CUDA or off bf16); False: eager rounds, for debugging (graphs' gain:
        benchmarks/results/engine_round-moonlight-16b-a3b-nvidia-h200.md).
        overlap: read a round's committed tokens back while the next round runs (engine/inflight.py):
        a step returns what the previous round committed. False: each step waits for its own round.
        tree_sizes: the sizes a budget="auto" round may verify (those <= max_budget; plain steps
        too); round_costs: the measured cost table (engine/costs.py, or a JSON path from `ddtree
        profile`; None: measured when first needed, engine/profiling.py).
        kept_costs: without round_costs, "use" the table kept from an earlier engine of this pair
        on this device and keep what is measured (engine/kept_costs.py), "fresh": measure again
        and keep it, "off": neither read nor write the kept tables.
        relay: with tensor parallelism, rank 0's parallel.relay.Relay, which sends every device
        call to the other ranks (parallel/launch.py builds it; None: one process or a follower).
        The engine freezes the models it is given (requires_grad False on every weight)."""
        self.target, self.drafter, self.tokenizer = target, drafter, tokenizer
        # Serving never differentiates: without this, every cache write from a weight that
        # requires grad chains an autograd graph through the caches and keeps each round's
        # activations alive (memory grew by gigabytes per generate call).
        for model in (target, drafter):
            if model is not None:
                model.requires_grad_(False)
        self.device = target.embed_tokens.weight.device
        cfg = target.cfg
        self.max_batch, self.page_size, self.prefill_chunk = max_batch, page_size, prefill_chunk
        self.max_model_len = max_model_len or min(cfg.max_position_embeddings, 8192)
        if not 1 <= max_budget <= MAX_TRITON_BUDGET:
            raise ValueError(f"max_budget must be in [1, {MAX_TRITON_BUDGET}], got {max_budget}")
        self.max_budget = max_budget
        self.max_depth = drafter.cfg.block_size - 1 if drafter is not None else 0
        width = pages_for(self.max_model_len + max(max_budget, self.max_depth) + 1, page_size)
        num_pages = target.shard.agree(num_pages or default_num_pages(target, page_size, max_batch * width, self.device))
        self.blocks = BlockManager(num_pages, page_size, max_batch, width)
        self.caches = target.new_cache(num_pages, page_size)
        capacity = drafter_capacity(self.max_model_len, prefill_chunk, self.max_depth)
        self.state = BatchState(max_batch, width, self.device, drafter, capacity)
        moe_layers = [i for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i)]
        self.ctx = RoundContext(target, drafter, self.caches, page_size, num_pages,
                                drafter.cfg.target_layer_ids if drafter is not None else (), cfg.n_routed_experts)
        self.moe_layers = len(moe_layers)
        self.stop_token_ids = frozenset(stop_token_ids)
        self.time_stages, self.overlap = time_stages, overlap
        self._inflight: Flight | None = None  # the round launched and not yet read (overlap)
        # when the last round's result came back, its (bucket, size), whether the one before had it; None: after a gap
        self._last_read: tuple[float, tuple[int, int], bool] | None = None
        use = graphs_wanted(cuda_graphs, self.device, target.embed_tokens.weight.dtype)
        self.graphs = RoundGraphs(self.ctx, self.state, self.max_depth) if use else None
        self.worker = Worker(self.ctx, self.state, self.graphs, self.max_depth, prefill_chunk, relay)
        self.limits = PlanLimits(max_batch, self.max_depth, cfg.vocab_size, self.moe_layers > 0,
                                 self.state.drafter.keys[0].shape[1] if drafter is not None else 0, use)
        self.signature = pair_signature(target, drafter, self.device, use, page_size, overlap)
        self.sizer = tree_sizer(tree_sizes, max_budget, self.max_depth, round_costs, self.signature) if drafter else None
        if kept_costs not in ("use", "fresh", "off"):
            raise ValueError(f'kept_costs must be "use", "fresh" or "off", got {kept_costs!r}')
        self.kept_costs = kept_costs if self.sizer is not None and round_costs is None else "off"
        if self.kept_costs == "use" and (kept := kept_table(self.signature)) is not None:
            self.sizer.add_costs(kept)
        self._waiting: deque[Request] = deque()
        self._caller_waits_for_all = False  # generate: the whole batch's end counts (TreeSizer.choose's closed)
        self._running: dict[int, Request] = {}  # slot -> request
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.ranks = None  # a tensor-parallel rank 0's handle on the others (from_pretrained)

    @classmethod
    def from_pretrained(cls, target_dir: str | Path | None = None, drafter_dir: str | Path | None = None, *, device=None,
                        dtype: torch.dtype | None = None, trust_remote_code: bool = False,
                        kernels: KernelPolicy = KernelPolicy(), tensor_parallel: int = 1, **engine_args) -> "Engine":
        """Load target (+ tokenizer, + stop tokens) and drafter from Hugging Face directories.
        With neither directory named, the demo pair shipped in the package (ddtree.demo).
        device defaults to CUDA when present; dtype to bf16 on CUDA, float32 on the CPU; kernels:
        the models' kernel policy (ops/policy.py: "auto" by default). tensor_parallel: ranks to
        split the target over (parallel/: heads, experts, vocabulary); this process is rank 0 and
        starts the others (GPU r on CUDA, gloo processes on the CPU); close() releases them."""
        if target_dir is None:
            if drafter_dir is not None:
                raise ValueError("a drafter directory was given without its target directory")
            from ..demo import demo_pair

            target_dir, drafter_dir = demo_pair()
        if tensor_parallel == 1:
            target, drafter, tokenizer, stops = load_pair(target_dir, drafter_dir, device, dtype, trust_remote_code,
                                                          kernels)
            engine_args.setdefault("stop_token_ids", stops)  # an explicit () means: no end-of-text tokens
            return cls(target, drafter, tokenizer, **engine_args)
        from ..parallel.launch import start_ranks

        device = resolve_device(device)
        load = dict(target_dir=target_dir, drafter_dir=drafter_dir, dtype=dtype, trust_remote_code=trust_remote_code,
                    policy=kernels)
        ranks = start_ranks(tensor_parallel, device, load, dict(engine_args), cls)
        try:
            target, drafter, tokenizer, stops = load_pair(**load, device="cuda:0" if device.type == "cuda" else device,
                                                          shard=ranks.shard)
            engine_args.setdefault("stop_token_ids", stops)
            engine = cls(target, drafter, tokenizer, relay=ranks.relay, **engine_args)
        except BaseException:
            ranks.release()
            raise
        engine.ranks = ranks
        return engine

    def close(self) -> None:
        """Release a tensor-parallel engine's other ranks (nothing to do in one process); the
        engine runs no step after."""
        if self.ranks is not None:
            self.drain()
            self.ranks.release()

    def measure_round_costs(self, max_requests: int | None = None, **options) -> RoundCosts:
        """Measure what the cost table lacks for batches of up to max_requests (default max_batch)
        requests, and capture the round graphs of the buckets it already had, on an engine with
        nothing running (engine/profiling.py: options; queued requests wait); returns the table,
        which budget="auto" rounds use from then on."""
        if self.sizer is None:
            raise ValueError("round costs are for tree sizes: this engine has no drafter")
        queued, self._waiting = self._waiting, deque()
        try:
            measured = prepare_auto_rounds(self, buckets_up_to(max_requests or self.max_batch, self.max_batch), **options)
        finally:
            self._waiting.extendleft(reversed(queued))
        if measured and self.kept_costs != "off" and (path := keep_table(self.sizer.costs, self.signature)) is not None:
            log.info("round costs kept in %s for the next engine of this pair on this device", path)
        return self.sizer.costs

    def unmeasured_buckets(self, max_requests: int | None = None) -> list[int]:
        """The batch buckets of up to max_requests (default max_batch) requests that the cost
        table lacks: what measure_round_costs would measure."""
        return self.sizer.unmeasured(buckets_up_to(max_requests or self.max_batch, self.max_batch))

    def _measure_or_degrade(self) -> None:
        try:
            self.measure_round_costs(len(self._waiting))
        except (ValueError, RuntimeError) as err:  # a cache too small for the stand-ins, say
            self.sizer.failure = str(err)
            log.warning("round costs could not be measured (%s); budget auto takes the smallest tree until a "
                        "table is given (Engine(round_costs=...), ddtree profile)", err)

    # -- requests ------------------------------------------------------------------------------

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the target directory has no tokenizer: pass prompts as lists of token ids")
            return list(self.tokenizer(prompt)["input_ids"])
        ids = list(prompt)
        vocab = self.target.cfg.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids):
            raise ValueError(f"token ids must be ints in [0, {vocab})")
        return ids

    def node_limit(self, mode: str, budget: int | str) -> int:
        """The most tree nodes a round may verify for a request of `mode` and `budget` (what
        admission reserves beyond the root), after checking both."""
        return node_limit_for(mode, budget, self.max_budget, self.max_depth,
                              self.sizer.largest if self.sizer is not None else None)

    @property
    def request_capacity(self) -> int:
        """The most cache slots one request can hold: its block table's width, or the whole cache."""
        return min(self.blocks.num_pages, self.blocks.table.shape[1]) * self.page_size

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None, *, mode: str = "ddtree",
                    budget: int | str = "auto", request_id: str | None = None, detokenize: bool = True) -> str:
        """Queue a request; returns its id. Everything is checked here, before it can take a slot.
        budget (mode ddtree): tree nodes per round, or "auto": the engine chooses each round's size
        by what each size measurably delivers per second (engine/sizing.py), plain steps included.
        detokenize=False: its outputs carry token ids only (new_text None) and stop strings are the
        caller's (a server's HTTP process decodes and cuts them, server/outputs.py)."""
        params = (params or SamplingParams()).with_seed()
        if not detokenize and params.stop:
            raise ValueError("stop strings need the engine's text: pass detokenize=True, or find them in the "
                             "decoded text yourself")
        node_limit = self.node_limit(mode, budget)
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self.stop_token_ids)
        request = Request(request_id, ids, params, mode, budget, node_limit, stops, self.tokenizer if detokenize else None)
        worst = request.worst_rows()
        if pages_for(worst, self.page_size) * self.page_size > self.request_capacity:
            raise KVCacheFull(f"request {request_id} may need {pages_for(worst, self.page_size)} KV pages "
                              f"({worst} slots of {self.page_size}); the cache has num_pages={self.blocks.num_pages}")
        if self.target.cfg.n_routed_experts:
            request.stats.experts_touched = []
        self._requests[request_id] = request
        self._waiting.append(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request now, whatever its state: its slot and pages are free before this returns
        (a finished request's result, not yet taken, is discarded)."""
        request = self._requests.pop(request_id, None)
        if request is None:
            raise KeyError(f"no request {request_id!r}")
        if request.slot is not None:
            self._release(request)
        elif not request.finished:
            self._waiting.remove(request)

    def request_state(self, request_id: str) -> str:
        """"waiting" (queued, no slot yet), "running" (holds a slot and pages) or "finished"
        (its result awaits take_result); KeyError for an id the engine does not hold."""
        request = self._requests.get(request_id)
        if request is None:
            raise KeyError(f"no request {request_id!r}")
        if request.finished:
            return "finished"
        return "waiting" if request.slot is None else "running"

    def _release(self, request: Request) -> None:
        self._running.pop(request.slot)
        self.blocks.free(request.slot)
        self.worker.vacate(request.slot)
        request.slot = None

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished(self) -> bool:
        """Requests waiting or running. A round in flight needs no step of its own: every request
        it still owes tokens to holds its slot (is running) until they have been read."""
        return bool(self._running or self._waiting)

    @property
    def inflight(self) -> bool:
        """A round was launched and its result not read yet (overlap)."""
        return self._inflight is not None

    # -- results ------------------------------------------------------------------------------

    def take_result(self, request_id: str) -> RequestOutput:
        """The output of a finished request; the engine forgets it afterwards."""
        request = self._requests.get(request_id)
        if request is None or not request.finished:
            raise KeyError(f"no finished request {request_id!r}")
        return self._requests.pop(request_id).result()

