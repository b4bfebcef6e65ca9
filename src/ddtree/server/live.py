"""A request the scheduler holds, from its acceptance to its last chunk: what it has produced so
far, and the usage its chunks carry (as plain tuples in jobs.Usage's field order: an engine core
builds no objects per token)."""

from __future__ import annotations

from dataclasses import dataclass

from .jobs import Handle, Job


@dataclass
class Live:
    job: Job
    handle: Handle
    prompt_tokens: int
    accepted_at: float
    started: bool = False  # had its first output: admitted into the batch
    produced: int = 0
    rounds: int = 0  # outputs after the first (the prefill's): its rounds, about

    def record(self, count: int) -> None:
        """One output of `count` tokens: the first (the prefill's) starts the request, each later one is a round."""
        if self.started:
            self.rounds += 1
        self.started = True
        self.produced += count

    @property
    def sampled(self) -> bool:
        """Whether its tokens are drawn (temperature > 0): greedy draws no noise, so its usage names no seed."""
        return bool(self.job.sampling.get("temperature"))

    def usage_so_far(self) -> tuple:
        """The usage of a chunk before the last: its rounds counted here, the mean acceptance from them."""
        acceptance = (self.produced - 1) / self.rounds if self.rounds else 0.0
        return self._usage(self.rounds, acceptance, self.job.sampling.get("seed"))

    def final_usage(self, result) -> tuple:
        """The usage of the last chunk: rounds and acceptance by the engine's statistics (its Result)."""
        return self._usage(result.stats.rounds, result.stats.mean_acceptance_length, result.seed)

    def _usage(self, rounds: int, acceptance: float, seed) -> tuple:
        job = self.job
        return (self.prompt_tokens, self.produced, job.mode, job.budget if job.mode == "ddtree" else None, rounds,
                acceptance, seed if self.sampled else None)
