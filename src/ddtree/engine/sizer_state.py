"""What a TreeSizer (engine/sizing.py) has learned and holds between rounds, as plain data."""

from __future__ import annotations

from dataclasses import dataclass, field

from .acceptance import AcceptanceLedger
from .costs import StepCorrection


@dataclass(frozen=True)
class HeldChoice:
    """A size chosen in full, for the batch `key` (bucket, floor, closed, auto requests, one about
    to end): 0 holds until the plain run's probe (probe False: a closed batch skips it, and its
    plain steps set nothing aside); a tree holds `rounds_left` more rounds, with the next larger
    size it explores and (plain rate, its rate) for the plain-burst check."""

    key: tuple
    size: int
    larger: int | None = None
    rounds_left: int = 0
    rates: tuple[float, float] | None = None
    probe: bool = True


@dataclass
class SizerState:
    """What a TreeSizer has learned, as one object (a benchmark keeps one per configuration).

    ledger: tokens per size; correction: real step costs over the table's; rounds: tree rounds
    chosen (the exploration clock); plain_steps: plain steps since the last tree; wait: plain steps
    before the next probe; burst: (size, steps still to run) of an exploration under way;
    plain_tried: bucket -> `rounds` at its last plain burst; held: the last choice made in full,
    kept without choosing again while its batch stays as it was (TreeSizer.choose); explore_at:
    `rounds` at which a tree round next takes the next larger size, explore_gap: the rounds
    between two such, explored: the size the last one took, until a full choice judged it;
    explore_learned: whether a round of that size has been read into the ledger since (with
    overlap the next choice comes before the explored round is read)."""

    ledger: AcceptanceLedger
    wait: float
    explore_at: int
    explore_gap: int
    correction: StepCorrection = field(default_factory=StepCorrection)
    rounds: int = 0
    plain_steps: int = 0
    burst: tuple[int, int] | None = None
    plain_tried: dict[int, int] = field(default_factory=dict)
    held: HeldChoice | None = None
    explored: int | None = None
    explore_learned: bool = False

    def judge_exploration(self, chosen: int, first_gap: int, most_gap: int) -> None:
        """A tree size chosen in full after an exploration: if the explored size (or a larger one)
        won, explore every first_gap rounds again; if not, half as often as before (every
        most_gap at most)."""
        if self.explored is None or not self.explore_learned:
            return  # nothing explored, or its round not yet read: its evidence is not in
        gap = first_gap if chosen >= self.explored else min(2 * self.explore_gap, most_gap)
        self.explore_at += gap - self.explore_gap
        self.explore_gap, self.explored, self.explore_learned = gap, None, False
