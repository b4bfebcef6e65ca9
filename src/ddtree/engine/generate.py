"""`generate`: a whole batch of prompts to their finished outputs, as a loop over the engine's
add_request / step / take_result (the same three the server drives)."""

from __future__ import annotations

from .request import RequestOutput
from .scheduling import per_prompt_params


class OfflineGeneration:
    """Engine's offline entry point (a mixin: it calls add_request, abort, step and take_result)."""

    def generate(self, prompts: list, max_new_tokens=128, mode: str = "ddtree", budget="auto", temperature=0.0,
                 top_p=1.0, top_k=0, seed=None, stop=None, *, progress: bool = False) -> list[RequestOutput]:
        """Generate for every prompt (strings, or lists of token ids); any setting may be a list
        with one value per prompt. budget: tree nodes per round, or "auto" (the engine chooses each
        round; on an idle engine without a cost table, the first step measures the batches the
        queued prompts can form). Returns one RequestOutput per prompt, in order."""
        per_request = per_prompt_params(len(prompts), max_new_tokens=max_new_tokens, temperature=temperature,
                                                top_p=top_p, top_k=top_k, seed=seed, stop=stop)
        modes = mode if isinstance(mode, list) else [mode] * len(prompts)
        budgets = budget if isinstance(budget, list) else [budget] * len(prompts)
        if len(modes) != len(prompts) or len(budgets) != len(prompts):
            raise ValueError(f"mode and budget lists must have one entry per prompt ({len(prompts)})")
        ids = []
        try:
            for prompt, params, m, b in zip(prompts, per_request, modes, budgets):
                ids.append(self.add_request(prompt, params, mode=m, budget=b))
        except Exception:
            for request_id in ids:  # all or nothing: no half-queued batch is left behind
                self.abort(request_id)
            raise
        bar = _progress(len(ids)) if progress else None
        pending = set(ids)
        self._caller_waits_for_all = True
        try:
            while pending:
                for out in self.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            for request_id in ids:  # nothing of this call stays queued or running after it failed
                try:
                    self.abort(request_id)
                except KeyError:
                    pass
            raise
        finally:
            self._caller_waits_for_all = False
        if bar is not None:
            bar.close()
        return [self.take_result(request_id) for request_id in ids]


def _progress(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")
