"""Why asynchronous D3D cannot hide its packed pass on a small CPU: one round's pieces, alone and overlapped.

Times, on the real target (SmolLM2-135M-Instruct) and the shipped drafter, at a mid-generation context:

* `sync draft`: the synchronous draft pass (one committed token + a block of B masks), the critical path of a
  synchronous round;
* `verify`: the target's forward over a B-token block with its cache (the verification forward);
* `packed`: the packed successor pass over a (B-token chain + H blocks), the pass d3d-async overlaps with `verify`;
* `overlapped`: `packed` submitted to a worker thread while the caller runs `verify` (what d3d-async does each
  round), with the per-piece times under contention and the time until both are done;

for several splits of torch's intra-op threads between the caller (target) and the worker (drafter), the knob
`d3d_worker_threads` sets. Medians over `--repeats` runs, milliseconds.

    python benchmarks/cpu_threads.py --dtype bfloat16 --hypotheses 1 4 16
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import time

import torch
from transformers import DynamicCache

from d3d_hf import D3DCache
from d3d_hf.drafters import load_drafter
from d3d_hf.prompts import encode_prompt, load_prompts
from d3d_hf.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--hypotheses", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--splits", nargs="+", default=["2/2", "2/1", "1/1"], help="caller/worker torch threads")
    parser.add_argument("--context", type=int, default=200, help="tokens appended to the first HumanEval prompt")
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    dtype = getattr(torch, args.dtype)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype=dtype)
    drafter = load_drafter("d3d-smollm2-135m-instruct", dtype=dtype)
    drafter.attach_target_weights(target)
    block_size = drafter.config.block_size
    ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
    ids = torch.cat([ids, ids[:, -args.context :]], dim=1)  # a context as long as a round in mid-generation
    context = ids.shape[1]
    target_cache = DynamicCache(config=target.config)
    target(ids, past_key_values=target_cache, use_cache=True)
    drafter_cache = D3DCache()
    drafter.draft_logits(ids[:, :-1], drafter_cache)
    block = ids[:, -block_size:]  # stands in for [bonus, d1..d_{B-1}] under verification
    print(f"{args.dtype}, context {context} tokens, block size {block_size}; medians of {args.repeats}, ms")

    def verify() -> float:
        start = time.perf_counter()
        target(block, past_key_values=target_cache, use_cache=True)
        target_cache.crop(-block_size)
        return time.perf_counter() - start

    def sync_draft() -> float:
        start = time.perf_counter()
        drafter.draft_logits(ids[:, -1:], drafter_cache)
        drafter_cache.crop(context - 1)
        return time.perf_counter() - start

    def packed(threads: int, lengths: list[int], guesses: list[int]) -> float:
        torch.set_num_threads(threads)  # on the worker thread only
        start = time.perf_counter()
        drafter.packed_draft_logits(block, drafter_cache, lengths, guesses)
        return time.perf_counter() - start

    pool = concurrent.futures.ThreadPoolExecutor(1)

    def median_ms(times) -> float:
        return 1e3 * statistics.median(times)

    for hypotheses in args.hypotheses:
        lengths = [1 + (3 * h) % block_size for h in range(hypotheses)]
        guesses = [int(ids[0, 5 + h]) for h in range(hypotheses)]
        print(f"\n{hypotheses} hypotheses (packed pass over {block_size + hypotheses * block_size} tokens)")
        print("| caller/worker threads | sync draft | verify | packed | overlapped: verify | packed | both done |")
        print("|---|---|---|---|---|---|---|")
        for split in args.splits:
            caller, worker = (int(x) for x in split.split("/"))
            torch.set_num_threads(caller)
            for _ in range(2):  # warm-up
                verify(), sync_draft(), pool.submit(packed, worker, lengths, guesses).result()
            alone_verify = median_ms(verify() for _ in range(args.repeats))
            alone_draft = median_ms(sync_draft() for _ in range(args.repeats))
            alone_packed = median_ms(
                pool.submit(packed, worker, lengths, guesses).result() for _ in range(args.repeats)
            )
            verifies, packs, rounds = [], [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                future = pool.submit(packed, worker, lengths, guesses)
                verifies.append(verify())
                packs.append(future.result())
                rounds.append(time.perf_counter() - start)
            print(
                f"| {split} | {alone_draft:.1f} | {alone_verify:.1f} | {alone_packed:.1f} | {median_ms(verifies):.1f} "
                f"| {median_ms(packs):.1f} | {median_ms(rounds):.1f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
