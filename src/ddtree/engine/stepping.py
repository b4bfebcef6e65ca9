"""The step: admit and prefill what fits, launch one round for the running requests, read back
and commit what the previous round committed (engine/inflight.py). A mixin of Engine: it uses the
engine's batch, blocks, worker, sizer and request tables."""

from __future__ import annotations

import time

import torch

from .batch import SlotSettings
from .inflight import Admission, Flight, copy_to_host, launch_copy
from .request import Request, StepOutput
from .scheduling import batch_requests, generation_params
from .timing import StageTimer


class Stepping:
    """Engine.step and what it calls; drain reads the round still in flight."""

    def drain(self) -> list[StepOutput]:
        """Wait for the round in flight (overlap) and commit what it committed; its outputs."""
        flight, self._inflight = self._inflight, None
        outputs = self._collect(flight) if flight is not None else []
        self._last_read = None  # the engine may sit idle now: the next interval is no round's cost
        return outputs

    def _live(self, request: Request) -> bool:
        return not request.finished and self._requests.get(request.id) is request

    # -- the step ------------------------------------------------------------------------------

    @torch.no_grad()
    def step(self) -> list[StepOutput]:
        """Admit and prefill what fits, then launch one round for every running request (the new
        ones included: every active slot of the batch takes part). Returns, per request, what it
        committed since the last step: with overlap, the round launched by the previous step (read
        while this step's round runs), else this step's. Finished requests have left the batch."""
        if self.sizer is not None and self.sizer.forced is None and self.sizer.failure is None \
                and not self._running and any(r.auto for r in self._waiting):
            self._measure_or_degrade()  # before the first "auto" round of these batches
        admitted = self._admit()
        if admitted is not None:
            self._last_read = None  # this step's prefill would count as the next read round's cost
        running = [r for _, r in sorted(self._running.items()) if r.remaining_tokens() > 0]  # not one whose prefill ends it
        launched = self._launch(running) if running else None
        if launched is not None and launched.irregular:
            self._last_read = None  # the interval read next holds this launch's eager round or capture
        ready, self._inflight = (self._inflight, launched) if self.overlap else (launched, None)
        outputs = {out.request_id: out for out in self._first_tokens(admitted)} if admitted is not None else {}
        for out in self._collect(ready) if ready is not None else []:
            first = outputs.get(out.request_id)
            if first is not None:  # prefilled in this step (no overlap): one output with both parts
                out = StepOutput(out.request_id, first.new_token_ids + out.new_token_ids,
                                 None if out.new_text is None else first.new_text + out.new_text,
                                 out.finished, out.finish_reason)
            outputs[out.request_id] = out
        return list(outputs.values())

    def _admit(self) -> Admission | None:
        """Prefill what fits; the first tokens stay on the device until _first_tokens."""
        new = []
        free_slots = sorted(set(range(self.max_batch)) - set(self._running))
        while self._waiting and free_slots and self.blocks.can_admit(self._waiting[0].worst_rows()):
            request = self._waiting.popleft()
            request.slot = free_slots.pop(0)
            self.blocks.admit(request.slot, request.worst_rows(), request.id)
            p = request.params
            self.worker.occupy(request.slot, SlotSettings(request.node_limit, request.mode == "chain", p.temperature,
                                                          p.top_k, p.top_p, p.seed, p.max_new_tokens))
            self._running[request.slot] = request
            new.append(request)
        if not new:
            return None
        for request in new:
            request.started = time.perf_counter()
            request.prefix_len = len(request.prompt_ids)
            request.awaiting_first = True
        self.blocks.reserve([(r.slot, len(r.prompt_ids), r.id) for r in new])
        sampled, filtered = generation_params([r.params for r in new])
        timer = StageTimer(self.device, self.time_stages)
        timer.start()
        first = self.worker.prefill(self.blocks.table, [r.slot for r in new], [r.prompt_ids for r in new], sampled,
                                    filtered)
        timer.mark("prefill")
        return Admission(new, *copy_to_host(first), timer)

    def _first_tokens(self, admitted: Admission) -> list[StepOutput]:
        """Commit the prefill's first tokens, waiting for it: called once the round after it is
        launched, so the device runs that round meanwhile (reading them at once left the device
        idle while the host then launched the round)."""
        tokens = admitted.tokens()
        seconds = admitted.timer.seconds().get("prefill", 0.0)
        outputs = []
        for request, token in zip(admitted.requests, tokens):
            request.awaiting_first = False
            if not self._live(request):
                continue  # aborted since its admission
            request.stats.stage_seconds["prefill"] += seconds
            outputs.append(self._emit(request, [token]))
        return outputs

    def _launch(self, requests: list[Request]) -> Flight:
        """Queue one round for `requests` on the device; returns without waiting for it."""
        # With a round in flight the host's prefix lengths may be one round behind: reserve for
        # the most that round can commit (BatchState.remaining keeps it within worst_rows).
        behind = self.max_depth + 1 if self._inflight is not None else 0
        closed = self._caller_waits_for_all and not self._waiting  # the slowest request's end counts
        plan = batch_requests(requests, self.limits, self.sizer, behind, closed)
        self.blocks.reserve([(r.slot, min(r.worst_rows(), r.prefix_len + behind + r.node_limit + 1), r.id)
                             for r in requests])
        timer = StageTimer(self.device, self.time_stages)
        timer.start()
        graphs = self.graphs
        before = (graphs.eager_rounds, graphs.captures) if graphs is not None else None
        result = self.worker.round(self.blocks.table[: plan.bucket], plan, timer)
        flight = launch_copy(result, requests, plan, timer)
        flight.irregular = before is not None and before != (graphs.eager_rounds, graphs.captures)
        return flight

    def _collect(self, flight: Flight) -> list[StepOutput]:
        """Commit what a launched round committed, for its requests still running."""
        result = flight.rows()  # the one wait for the device
        start = time.perf_counter()
        shape = (flight.plan.bucket, flight.plan.budget)
        previous = self._last_read
        steady = previous is not None and previous[1] == shape and not flight.irregular
        self._last_read = (start, shape, steady)
        seconds = flight.timer.seconds()
        outputs, auto, slots = [], [], []
        for request in flight.requests:
            if not self._live(request):
                continue  # it ended (or was aborted) after this round was launched
            row = result[request.slot]
            accepted = row[0]
            request.prefix_len += accepted
            kept = request.commit(row[1 : 1 + accepted])
            experts = row[2 + self.max_depth : 2 + self.max_depth + self.moe_layers] if flight.plan.experts else None
            request.stats.add_round(len(kept), min(request.node_limit, flight.plan.budget), seconds, experts)
            if request.auto:
                auto.append(request)
                slots.append(request.slot)  # before a finished request gives its slot up
            outputs.append(self._finish_or_stream(request, kept))
        if auto and flight.plan.paths and self.sizer.forced is None:
            self.sizer.learn(auto, slots, flight.array(), flight.plan, self.moe_layers)
        # One step's wall time: this read since the last one, when both rounds had one shape. After
        # a step of another shape the interval also holds that step's tail and the switch; an
        # eager round or a capture (CUDA graphs) is no step's cost either. A plain step needs two
        # before it of its shape: the host's work on a tree's many tokens outlasts one plain step.
        if auto and steady and (shape[1] > 0 or previous[2]):
            self.sizer.observe_step(*shape, start - previous[0])
        return outputs

    def _emit(self, request: Request, tokens: list[int]) -> StepOutput:
        kept = request.commit(tokens)
        return self._finish_or_stream(request, kept)

    def _finish_or_stream(self, request: Request, kept: list[int]) -> StepOutput:
        out = request.step_output(kept)
        if request.finished:
            self._release(request)
        return out
