"""How well the batched plan predicts its rounds (issue 28): per round source and batch size, the tokens and seconds the
adaptive plan expected of the round it chose (`BatchedRounds._rate_options`, after the learned `BatchedCosts`)
against what the round committed and took (its draft pass plus its verification), and the same-process plain
batched step for scale.

Greedy, the shipped drafter, SmolLM2-135M-Instruct, left-padded batches of consecutive prompts. The first batch
warms up (calibration, learned costs) and is not counted. Run it alone:

    python benchmarks/batched_plan_accuracy.py --prompts mt-bench --limit 20 --batch-size 4 --dtype bfloat16 \
        [--output FILE.md]
"""

from __future__ import annotations

import argparse
import collections
import time

import torch
from _common import emit
from d3d_hf.modeling import batched_decoding_d3d
from d3d_hf.modeling.calibration_d3d import cpu_model

from d3d_hf.drafters import load_drafter
from d3d_hf.prompts import encode_prompt, load_prompts
from d3d_hf.targets import load_target


class PlanRecorder:
    """Wraps `BatchedRounds._rate_options`, `BatchedRounds._decide` and `BatchedRounds.verify` (restored by `close`)
    to record, per round, the chosen option's predicted tokens and seconds and the round's committed tokens and
    measured seconds."""

    def __init__(self) -> None:
        self.rounds: list[tuple[str, int, float, float, int, float]] = []
        rounds_cls = batched_decoding_d3d.BatchedRounds
        self._saved = (rounds_cls._rate_options, rounds_cls._decide, rounds_cls.verify)
        rate_options, decide, verify = self._saved
        recorder = self

        def recording_rate_options(rounds, limits, lookups):
            rounds.rated_options = rate_options(rounds, limits, lookups)
            return rounds.rated_options

        def recording_decide(rounds, limits, lookups):
            rounds.rated_options = []
            source, count, uses = decide(rounds, limits, lookups)
            chosen = [o for o in rounds.rated_options if o[2] == source and o[3] == count]
            rounds.recorded_option = chosen[0] if chosen else None
            return source, count, uses

        def recording_verify(rounds, plans, do_sample):
            start = time.perf_counter()
            results = verify(rounds, plans, do_sample)
            seconds = time.perf_counter() - start
            option = getattr(rounds, "recorded_option", None)
            if option is not None and not rounds.prefill:
                rate, predicted, source = option[0], option[1], option[2]
                drafted = rounds.draft_seconds if source == "drafter" and rounds.draft_seconds else 0.0
                committed = sum(n + 1 for _, n, _, _ in results)
                recorder.rounds.append(
                    (source, len(rounds.active), rate * predicted, predicted, committed, seconds + drafted)
                )
            rounds.recorded_option, rounds.draft_seconds = None, None
            return results

        rounds_cls._rate_options, rounds_cls._decide = recording_rate_options, recording_decide
        rounds_cls.verify = recording_verify

    def close(self) -> None:
        rounds_cls = batched_decoding_d3d.BatchedRounds
        rounds_cls._rate_options, rounds_cls._decide, rounds_cls.verify = self._saved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="mt-bench")
    parser.add_argument("--offset", type=int, default=0)
    parser.add_argument("--limit", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--drafter", default="d3d-smollm2-135m-instruct", help="shipped name or folder")
    parser.add_argument("--output", help="also write the table to this markdown file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=args.dtype, device="cpu")
    drafter = load_drafter(args.drafter, dtype=getattr(torch, args.dtype))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prompts = load_prompts(args.prompts)[args.offset : args.offset + args.limit]
    encoded = [encode_prompt(tokenizer, p).reshape(-1) for p in prompts]
    batches = [encoded[i : i + args.batch_size] for i in range(0, len(encoded), args.batch_size)]
    kw = dict(do_sample=False, max_new_tokens=args.max_new_tokens, pad_token_id=pad)
    recorder = PlanRecorder()
    step_seconds, step_tokens = 0.0, 0
    try:
        for index, batch in enumerate(batches):
            width = max(len(ids) for ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for row, ids in enumerate(batch):
                input_ids[row, width - len(ids) :], mask[row, width - len(ids) :] = ids, 1
            if index == 0:
                target.generate(input_ids, attention_mask=mask, assistant_model=drafter, **kw)
                recorder.rounds.clear()
                continue
            start = time.perf_counter()
            out = target.generate(input_ids, attention_mask=mask, **kw)
            step_seconds += time.perf_counter() - start
            step_tokens += int((out[:, width:] != pad).sum())
            target.generate(input_ids, attention_mask=mask, assistant_model=drafter, **kw)
    finally:
        recorder.close()
    by = collections.defaultdict(lambda: [0, 0.0, 0.0, 0, 0.0])
    for source, batch, tokens, seconds, committed, measured in recorder.rounds:
        row = by[source, batch]
        row[0] += 1
        row[1] += tokens
        row[2] += seconds
        row[3] += committed
        row[4] += measured
    lines = [
        f"Batched plan against its rounds: {args.prompts} {args.offset}-{args.offset + args.limit - 1}, batches of "
        f"{args.batch_size}, {args.max_new_tokens} new tokens, {args.dtype}, {args.threads} threads, {cpu_model()}; "
        f"the first batch a warm-up. Target-only batched `generate` on the same batches: "
        f"{step_tokens / max(step_seconds, 1e-9):.1f} tokens/s.",
        "",
        "| source | sequences | rounds | tokens/round expected | tokens/round committed | ms/round expected | "
        "ms/round measured | tokens/s expected | tokens/s measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (source, batch), (n, tokens, seconds, committed, measured) in sorted(by.items()):
        lines.append(
            f"| {source} | {batch} | {n} | {tokens / n:.2f} | {committed / n:.2f} | {1e3 * seconds / n:.1f} | "
            f"{1e3 * measured / n:.1f} | {tokens / seconds:.1f} | {committed / measured:.1f} |"
        )
    emit(lines, args.output)


if __name__ == "__main__":
    main()
