"""`ddtree generate`: stream completions from a target + drafter pair, then their statistics;
`ddtree profile`: measure the pair's round costs into a JSON table (`--round-costs`); `ddtree plan`:
how the pair fits on N GPUs."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from .arguments import (Parser, UsageError, add_pair_arguments, at_least_zero, at_least_zero_int, budget,
                        cache_line, check_before_loading, load_engine, positive, probability, seed, stop_string,
                        weights_line)

MEASURED_LENGTH = 1024  # what the round-cost stand-ins run in (engine/profiling.py: 256 + 657 tokens)
STAGE_ORDER = ("prefill", "draft", "topk", "build", "verify", "accept", "commit", "round")


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    parser = Parser(prog="ddtree", description="DDTree speculative decoding for MLA mixture-of-experts models.")
    parser.add_argument("--version", action="version", version=f"ddtree {__version__}")
    commands = parser.add_subparsers(dest="command", parser_class=Parser, metavar="{generate,serve,profile,plan}")
    gen = commands.add_parser("generate", help="complete prompts, streaming the text as it is committed")
    gen.add_argument("prompts", nargs="+", help="prompt texts (tokenized with the target's tokenizer); - reads "
                     "one prompt from standard input (its final newline dropped), or one per line with --lines")
    gen.add_argument("--lines", action="store_true", help="with -: each non-empty line of standard input is a prompt")
    add_pair_arguments(gen, sized_to_prompts=True)
    gen.add_argument("--mode", choices=("ar", "chain", "ddtree"), default="ddtree",
                     help="ar: plain decoding; chain: DFlash's argmax chain; ddtree: a tree a round")
    gen.add_argument("--budget", type=budget, default="auto",
                     help="tree nodes per round (ddtree), or auto: chosen each round by measured cost")
    gen.add_argument("--round-costs", default=None, help="a round-cost table from `ddtree profile` "
                     "(default: the one kept from an earlier run for this pair and device, else measured "
                     "before the first round and kept)")
    gen.add_argument("--fresh-costs", action="store_true", help="measure the round costs again, not the kept table")
    gen.add_argument("--temperature", type=at_least_zero, default=0.0, help="0: greedy")
    gen.add_argument("--top-p", type=probability, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--top-k", type=at_least_zero_int, default=0, help="0: no top-k cut")
    gen.add_argument("--seed", type=seed, default=None, help="sampling seed (default: a fresh one, reported)")
    gen.add_argument("--max-new-tokens", type=positive(int), default=128, help="tokens to generate per prompt")
    gen.add_argument("--stop", type=stop_string, action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt instead of text")
    from .plan_command import add_plan_command
    from .profile_command import add_profile_command
    from .server.command import add_serve_command

    add_serve_command(commands)
    add_profile_command(commands)
    add_plan_command(commands)
    parser.epilog = "Errors are one line on stderr; DDTREE_TRACEBACK=1 shows the traceback instead."
    parser.commands = commands.choices  # name -> its parser: unrecognized flags are named against it
    return parser


def unrecognized(parser, command: str | None, extra: list[str]) -> str:
    """One line for flags no parser took, with the closest flag of `command` when one is close."""
    import difflib

    sub = parser.commands.get(command, parser)
    flags = [flag for action in sub._actions for flag in action.option_strings]
    close = [difflib.get_close_matches(word.split("=")[0], flags, n=1) for word in extra if word.startswith("-")]
    hint = "; did you mean " + ", ".join(match[0] for match in close if match) + "?" if any(close) else ""
    return f"{sub.prog}: error: unrecognized arguments: {' '.join(extra)}{hint}"


def _stats_line(out, sampled: bool) -> str:
    s = out.stats
    stages = ", ".join(f"{name} {s.stage_seconds[name] * 1e3:.1f}" for name in STAGE_ORDER
                       if name != "round" or s.stage_seconds[name])  # round: graph replays, when on
    trees = sum(n > 0 for n in s.tree_sizes)
    sizes = f", tree rounds {trees} (mean size {sum(s.tree_sizes) / max(1, trees):.1f})" if s.rounds else ""
    seeded = f", seed {out.seed}" if sampled else ""  # the seed that replays it (--seed)
    return (f"[{out.request_id}] {len(out.token_ids)} tokens, finish {out.finish_reason}{seeded}, {s.rounds} "
            f"rounds{sizes}, mean acceptance length {s.mean_acceptance_length:.2f}, {s.tokens_per_s:.1f} tokens/s; "
            f"ms per stage: {stages}")


def _record(out) -> dict:
    s = out.stats
    return {"request_id": out.request_id, "text": out.text, "token_ids": out.token_ids,
            "finish_reason": out.finish_reason, "seed": out.seed,
            "stats": {"rounds": s.rounds, "acceptance_lengths": s.acceptance_lengths,
                      "mean_acceptance_length": s.mean_acceptance_length, "tokens_per_s": s.tokens_per_s,
                      "stage_seconds": s.stage_seconds, "experts_touched": s.experts_touched,
                      "tree_sizes": s.tree_sizes}}


def generate(args) -> None:
    from .engine import SamplingParams
    from .engine.heap import frozen_heap

    _log_engine_events()

    size_to_prompts(args)
    engine = load_engine(args, round_costs=args.round_costs, kept_costs="fresh" if args.fresh_costs else "use")
    if engine.tokenizer is None:
        raise ValueError(f"{args.target or 'the demo pair'} has no tokenizer: text prompts cannot be encoded")
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_new_tokens=args.max_new_tokens, stop=tuple(args.stop or ()))
    ids = []
    for number, prompt in enumerate(args.prompts, 1):
        try:
            ids.append(engine.add_request(prompt, params, mode=args.mode, budget=args.budget))
        except ValueError as err:  # too long for --max-model-len, say: the user's to fix
            raise UsageError(f"prompt {number}: {err}") from None
    print(f"ddtree: {cache_line(engine)}", file=sys.stderr, flush=True)  # after the prompts passed their checks
    print(f"ddtree: {weights_line(engine)}", file=sys.stderr, flush=True)
    # All prompts run as one batch; the text streams in prompt order (later prompts are shown
    # from a buffer once the ones before them have finished).
    buffered = {rid: "" for rid in ids}
    done: set[str] = set()
    shown = 0

    def show() -> None:
        nonlocal shown
        while shown < len(ids):
            rid = ids[shown]
            if not args.json and buffered[rid]:
                sys.stdout.write(buffered[rid])
                sys.stdout.flush()
                buffered[rid] = ""
            if rid not in done:
                return
            out = engine.take_result(rid)
            if args.json:
                print(json.dumps(_record(out)), flush=True)
            else:
                sys.stdout.write("\n")
                print(_stats_line(out, args.temperature > 0), file=sys.stderr, flush=True)
            shown += 1
            if shown < len(ids) and not args.json:
                sys.stdout.write(args.prompts[shown])

    if not args.json:
        sys.stdout.write(args.prompts[0])
    with frozen_heap():  # the loaded pair out of the collections its steps trigger
        while engine.has_unfinished():
            for out in engine.step():
                buffered[out.request_id] += out.new_text or ""
                if out.finished:
                    done.add(out.request_id)
            show()
    show()


def read_prompts(args) -> None:
    """Replace a "-" prompt by standard input: the whole text (less one final newline), or with
    --lines each non-empty line; an error when it holds no prompt or --lines comes without -."""
    if "-" not in args.prompts:
        if args.lines:
            raise UsageError("--lines reads prompts from standard input: give - as the prompt")
        return
    if args.prompts != ["-"]:
        raise UsageError("- (standard input) must be the only prompt")
    text = sys.stdin.read()
    prompts = [line for line in text.splitlines() if line.strip()] if args.lines else [text.removesuffix("\n")]
    if not any(p.strip() for p in prompts):
        raise UsageError("standard input held no prompt")
    args.prompts = prompts


def size_to_prompts(args) -> None:
    """generate's defaults: a batch of the prompts' count (at most 32) and requests as long as the
    longest prompt (counted with the target's tokenizer) plus --max-new-tokens, within the model's
    positions (and at least 1024 tokens): the KV cache then holds what the command needs, not a
    server's share of memory. With the demo pair, a warning on stderr when a request runs past
    the window it was trained on."""
    if args.max_batch is None:
        args.max_batch = min(len(args.prompts), 32)
    if args.max_model_len is not None and args.target is not None:
        return
    from .demo import demo_pair
    from .engine.loading import load_tokenizer

    target = Path(args.target or demo_pair()[0])
    tokenizer = load_tokenizer(target, args.trust_remote_code)
    if tokenizer is None:
        return  # the engine says that text prompts need a tokenizer
    config = json.loads((target / "config.json").read_text()) if (target / "config.json").is_file() else {}
    longest = max(len(tokenizer(p)["input_ids"]) for p in args.prompts)
    trained = (config.get("rope_scaling") or {}).get("original_max_position_embeddings")
    positions = config.get("max_position_embeddings", 8192)
    room = min(positions, args.max_model_len or positions)  # past it the engine's one-line error says all
    if args.target is None and trained and trained < longest + args.max_new_tokens <= room:
        sys.stderr.write(f"ddtree generate: warning: the demo pair was trained on {trained}-token windows; a request "
                         f"of {longest} prompt tokens + {args.max_new_tokens} new runs past it and may come out "
                         f"garbled\n")
    if args.max_model_len is None:
        limit = min(positions, 8192)
        # at least MEASURED_LENGTH: room for the round-cost measurement's stand-ins to keep running
        args.max_model_len = min(max(longest + args.max_new_tokens, MEASURED_LENGTH), limit)


def _quiet_transformers() -> None:
    """transformers' own warnings (a prompt past the tokenizer's model_max_length, say) would print
    before ddtree's one-line error or in the middle of the streamed text; ddtree checks lengths
    against max_model_len itself."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.set_verbosity_error()


class _Stderr(logging.StreamHandler):
    """A handler that writes to sys.stderr as it is at each record, not as it was when made."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _):
        pass


def _log_engine_events() -> None:
    """The engine's own progress lines (round-cost measurement, CUDA-graph captures) to stderr,
    beside the statistics."""
    log = logging.getLogger("ddtree.engine")
    if not any(isinstance(h, _Stderr) for h in log.handlers):
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("ddtree: %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sys.stderr.write(unrecognized(parser, args.command, extra) + "\n")
        return 2
    if args.command is None:  # a bare `ddtree`: what there is to do
        parser.print_help(sys.stderr)
        return 2
    if args.drafter is not None and args.target is None:  # generate and serve
        sys.stderr.write(f"ddtree {args.command}: error: --drafter needs --target DIR (without both: the demo pair)\n")
        return 2
    mode = getattr(args, "mode", "ddtree")  # profile has none: it needs the drafter
    if args.target is not None and mode != "ar" and args.drafter is None and args.command != "plan":
        if args.command == "profile":
            sys.stderr.write("ddtree profile: error: profiling measures tree rounds: name --drafter DIR with --target\n")
        else:
            sys.stderr.write(f"ddtree {args.command}: error: --mode {mode} needs --drafter DIR (or use --mode ar)\n")
        return 2
    problem = check_before_loading(args)
    if problem is not None:
        sys.stderr.write(f"ddtree {args.command}: error: {problem}\n")
        return 2
    from .engine.kept_costs import share_with_triton

    share_with_triton()  # before any kernel compiles; serve's engine-core process inherits it
    _quiet_transformers()
    try:
        if args.command == "generate":
            read_prompts(args)
            generate(args)
        elif args.command == "serve":
            from .server.command import serve

            return serve(args)
        elif args.command == "profile":
            from .profile_command import profile

            profile(args)
        elif args.command == "plan":
            from .plan_command import plan

            plan(args)
    except KeyboardInterrupt:
        return 130
    except UsageError as err:  # the user's to fix, found past argument parsing: as argparse's own
        sys.stderr.write(f"ddtree {args.command}: error: {err}\n")
        return 2
    except (ValueError, OSError, NotImplementedError, RuntimeError, KeyError) as err:
        if os.environ.get("DDTREE_TRACEBACK"):
            raise
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        print(f"ddtree: error: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
