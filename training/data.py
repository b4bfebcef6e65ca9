"""Token windows for training and evaluation, drawn from a uint16 token file."""

from __future__ import annotations

import numpy as np
import torch


class TokenWindows:
    """Random windows of seq_len tokens (seeded), or every disjoint window in order."""

    def __init__(self, path, seq_len: int, seed: int = 0):
        self.tokens = torch.from_numpy(np.load(path).astype(np.int64))
        if len(self.tokens) <= seq_len:
            raise ValueError(f"{path} holds {len(self.tokens)} tokens, fewer than one window of {seq_len}")
        self.seq_len = seq_len
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, size: int, device=None) -> torch.Tensor:
        """int64 [size, seq_len + 1]: inputs and the next-token labels shifted by one."""
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (size,), generator=self.generator)
        rows = starts[:, None] + torch.arange(self.seq_len + 1)
        return self.tokens[rows].to(device, non_blocking=True)

    def ordered(self, size: int, limit_tokens: int | None = None, device=None):
        """Disjoint windows from the start, in batches of `size`, up to limit_tokens tokens."""
        count = (len(self.tokens) - 1) // self.seq_len
        if limit_tokens is not None:
            count = min(count, max(1, limit_tokens // self.seq_len))
        for first in range(0, count, size):
            starts = torch.arange(first, min(first + size, count)) * self.seq_len
            rows = starts[:, None] + torch.arange(self.seq_len + 1)
            yield self.tokens[rows].to(device, non_blocking=True)
