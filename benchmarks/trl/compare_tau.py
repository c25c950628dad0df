"""Held-out tau of two drafters of the same target, same prompts, same settings (issue 16: the recipe on the TRL
trainer against the shipped drafter). A full block of drafts every round (`d3d_num_drafts="full"`, no prompt lookup,
chain verification), greedy, float32, so tau is the drafter's acceptance; lossless checked on every prompt. With
`--tree-budget N`, each round verifies a tree of `N` draft nodes built from the same full-block pass instead
(`d3d_tree_budget=N`): at `N = B - 1` its verification has the rows of a full chain, so the two taus compare what one
verification of that width commits.

    python benchmarks/trl/compare_tau.py --drafters d3d-smollm2-135m-instruct runs/train/smollm2-d3d \
        --prompts humaneval --offset 20 --limit 10 --max-new-tokens 128 --output benchmarks/results/trl/tau.json
"""

import argparse
import json
import platform
from pathlib import Path

import torch
from transformers import GenerationConfig

from d3d_hf.drafters import load_drafter
from d3d_hf.prompts import load_prompts
from d3d_hf.prompts.prompt import encode_prompt
from d3d_hf.targets import load_target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--drafters", nargs="+", required=True, help="shipped names or folders")
    parser.add_argument("--prompts", default="humaneval")
    parser.add_argument("--offset", type=int, default=20)
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (tau is the same up to rounding)")
    parser.add_argument("--output", required=True)
    parser.add_argument("--tree-budget", type=int, default=None, help="verify a tree of N drafts (default: a chain)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target("smollm2-135m-instruct", dtype="float32", device=args.device)
    drafters = {name: load_drafter(name).to(args.device) for name in args.drafters}
    prompts = load_prompts(args.prompts)[args.offset : args.offset + args.limit]
    tree = {} if args.tree_budget is None else {"d3d_tree_budget": args.tree_budget}
    config = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, d3d_num_drafts="full",
                              d3d_prompt_lookup=False, **tree)
    totals = {name: {"new_tokens": 0, "rounds": 0, "lossless": 0, "per_prompt": []} for name in drafters}
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt).to(args.device)
        reference = target.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False)
        for name, drafter in drafters.items():
            out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                  generation_config=config)
            stats = drafter.last_generation_stats
            total = totals[name]
            total["new_tokens"] += stats.new_tokens
            total["rounds"] += stats.rounds
            total["lossless"] += int(torch.equal(out, reference))
            total["per_prompt"].append(round(stats.tau, 3))
    result = {
        "command": "python benchmarks/trl/compare_tau.py " + " ".join(
            ["--drafters", *args.drafters, "--prompts", args.prompts, "--offset", str(args.offset), "--limit",
             str(args.limit), "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
             "--device", args.device, "--output", args.output]
            + ([] if args.tree_budget is None else ["--tree-budget", str(args.tree_budget)])),
        "verification": "chain" if args.tree_budget is None else f"tree of {args.tree_budget} nodes",
        "machine": platform.processor() or platform.machine(),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "prompts": f"{args.prompts}[{args.offset}:{args.offset + args.limit}]",
        "tau": {name: t["new_tokens"] / t["rounds"] for name, t in totals.items()},
        "lossless": {name: t["lossless"] / len(prompts) for name, t in totals.items()},
        "per_prompt_tau": {name: t["per_prompt"] for name, t in totals.items()},
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("tau", "lossless")}, indent=2))


if __name__ == "__main__":
    main()
