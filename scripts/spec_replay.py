#!/usr/bin/env python
"""Replay greedy answers through prompt lookup's policies offline: how many tokens a target step
each would give if a verify step cost C plain steps.

    python scripts/spec_replay.py                      # the default model, on any device
    python scripts/spec_replay.py --model M.gguf --rows 6 --new-tokens 256 --prompt-len 768

Greedy speculation emits the plain answer, so the answer alone decides what every round would
accept: this generates each prompt set's answers once (scripts/bench.py's --prompt-set prompts),
then replays the proposer (`speculative.NGram`'s match rule) and adaptive k's pauses
(`SpecTuning`'s rule) in Python, for each k, min_n and verify cost. Each figure is plain steps'
time over the policy's, a row's tokens after the first counted alike: its speed-up were a verify
step to cost exactly C plain steps and the rest nothing. docs/decisions/speculative.md#when-it-runs
holds a run's figures.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
from pathlib import Path


def proposal(seq: list[int], last: int, k: int, min_n: int, max_n: int) -> list[int]:
    """NGram's drafts at the pending token seq[last]: after the latest earlier occurrence of the
    longest tail of n in [min_n, max_n] tokens."""
    best = -1
    for n in range(1, min(max_n, last + 1) + 1):
        tail = seq[last - n + 1:last + 1]
        found = next((i for i in range(last - 1, n - 2, -1) if seq[i - n + 1:i + 1] == tail), -1)
        if found < 0:  # no longer tail matches either
            break
        if n >= min_n:
            best = found
    return [] if best < 0 else seq[best + 1:min(best + 1 + k, last + 1)]


def replay(prompt: list[int], answer: list[int], k: int, min_n: int, max_n: int, cost: float,
           tuning=None) -> float:
    """Plain steps' time over the policy's for one answer (tuning None: a fixed k, no pauses)."""
    seq, t, time = prompt + answer, 0, 0.0
    r, mean, resume, pause, probe = 0, 0.0, 0, tuning and tuning.min_pause, True
    while t < len(answer) - 1:
        drafts = proposal(seq, len(prompt) + t, k, min_n, max_n)
        if drafts and (tuning is None or r >= resume):
            n = 0
            while n < len(drafts) and t + 1 + n < len(answer) and drafts[n] == answer[t + 1 + n]:
                n += 1
            t, time = t + n + 1, time + cost
            if tuning is not None:
                mean = n + 1 if probe else tuning.decay * mean + (1 - tuning.decay) * (n + 1)
                pays = mean >= tuning.verify_cost
                resume = 0 if pays else r + 1 + pause
                pause = tuning.min_pause if pays else min(2 * pause, tuning.max_pause)
                probe = not pays
        else:
            t, time = t + 1, time + 1
        r += 1
    return (len(answer) - 1) / time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a checkpoint (default: jaxllm's default model)")
    p.add_argument("--rows", type=int, default=6, help="prompts a set")
    p.add_argument("--prompt-len", type=int, default=768)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--costs", default="1.15,1.5,2", help="verify step costs to replay, in plain steps")
    p.add_argument("--first", type=int, default=0, help="replay only each answer's first tokens (0: all)")
    args = p.parse_args(argv)

    import jaxllm
    from jaxllm.engine.speculative import NGram, SpecTuning
    spec = importlib.util.spec_from_file_location("bench", Path(__file__).resolve().parent / "bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    params = jaxllm.load(args.model, dtype="float32")
    tok = jaxllm.load_tokenizer(args.model)
    answers = {}
    for name in bench.PROMPT_SETS:
        prompts = bench.prompt_set(name, tok, args.rows, args.prompt_len)
        out = jaxllm.generate(params, prompts, max_new_tokens=args.new_tokens)
        answers[name] = [(prompt, [int(x) for x in out.tokens[b][:int(out.lengths[b])]][:args.first or None])
                         for b, prompt in enumerate(prompts)]
    tuning, max_n = SpecTuning(), NGram().max_n
    print(f"tuning: {tuning}; max_n {max_n}")
    for cost in (float(c) for c in args.costs.split(",")):
        for k, min_n in itertools.product((3, 5, 7), (1, 2, 3)):
            for policy in (None, tuning):
                mean = {name: sum(replay(pr, an, k, min_n, max_n, cost, policy) for pr, an in rows) / len(rows)
                        for name, rows in answers.items()}
                print(f"cost {cost} k {k} min_n {min_n} {'adaptive' if policy else 'fixed   '}: "
                      + " ".join(f"{name} {x:.2f}x" for name, x in mean.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
