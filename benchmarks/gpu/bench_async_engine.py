"""Asynchronous vs synchronous D3D engine on a randomly initialised ~1B-parameter target, with forced acceptance.

A random target accepts nothing a real drafter proposes, so the drafter here is an *oracle*: a real
`D3DForDiffusionDrafting` (its forward passes, KV cache and packed successor passes all run and cost what they
cost) whose returned logits are replaced by the target's own greedy continuation, so that each round accepts
exactly `--accept` drafts (the next position gets a wrong first choice and the right token as second choice, which
is the async bonus guess). `--guess right|wrong` makes every packed hypothesis' bonus guess right (every round a hit)
or wrong (every round a miss). Output is always checked against target-only greedy decoding.

    python benchmarks/gpu/bench_async_engine.py OUTPUT_DIR [--overwrite]        # on a CUDA GPU
    python benchmarks/gpu/bench_async_engine.py OUTPUT_DIR --tiny --device cpu  # smoke test of the script

Writes `async_engine.json` and `async_engine.md` (tokens/s, speed-up over the target, tau, hit rate, per-round
draft/verify ms) into OUTPUT_DIR. Needs d3d_hf installed (transformers >= 5.24).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from d3d_hf import D3DForDiffusionDrafting


class OracleDrafter(D3DForDiffusionDrafting):
    """Runs the real drafter computation, then returns logits that make each round accept `accept` drafts."""

    reference: list[int] = []
    accept = 0
    wrong_guess = False

    def _forced(self, context_length: int, rows: int, device) -> torch.Tensor:
        logits = torch.full((rows, self.config.vocab_size), -30.0, device=device)
        for j in range(rows):
            position = context_length + j
            right = self.reference[position] if position < len(self.reference) else 0
            if j < self.accept or j == rows - 1:
                logits[j, right] = 30.0
            else:  # rejected: a wrong first choice, the right token second (the bonus guess)
                logits[j, (right + 1) % self.config.vocab_size] = 30.0
                logits[j, right] = 20.0
        return logits

    def draft_logits(self, committed_ids, cache, num_masks=None):
        context = cache.get_seq_length() + committed_ids.shape[1]
        logits = super().draft_logits(committed_ids, cache, num_masks)
        return self._forced(context, logits.shape[1], logits.device)[None].to(logits.dtype)

    def packed_draft_logits(self, chain_ids, cache, hypothesis_chain_lengths, bonus_guesses):
        if self.wrong_guess:
            bonus_guesses = [(g + 7) % self.config.vocab_size for g in bonus_guesses]
        packed = super().packed_draft_logits(chain_ids, cache, hypothesis_chain_lengths, bonus_guesses)
        prefix = cache.get_seq_length()
        rows = self.config.block_size
        packed.logits = torch.stack(
            [self._forced(prefix + m + 1, rows, packed.logits.device) for m in hypothesis_chain_lengths]
        ).to(packed.logits.dtype)
        return packed


def build(args):
    if args.tiny:
        config = LlamaConfig(
            vocab_size=512,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
        )
    else:  # ~1.1B parameters, Llama layout
        config = LlamaConfig(
            vocab_size=32000,
            hidden_size=2048,
            intermediate_size=5632,
            num_hidden_layers=22,
            num_attention_heads=32,
            num_key_value_heads=4,
            max_position_embeddings=8192,
        )
    config.eos_token_id = None
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    target = LlamaForCausalLM(config).to(device=args.device, dtype=dtype).eval()
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0
    drafter = OracleDrafter.from_autoregressive(target, num_layers=args.drafter_layers, block_size=args.block_size)
    drafter = drafter.to(device=args.device, dtype=dtype).eval()
    return target, drafter


def timed_generate(target, ids, drafter=None, **options):
    config = GenerationConfig(max_new_tokens=ARGS.max_new_tokens, do_sample=False, **options)
    if ids.is_cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, generation_config=config)
    if ids.is_cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def main() -> None:
    output = Path(ARGS.output)
    if output.exists() and any(output.iterdir()) and not ARGS.overwrite:
        raise SystemExit(f"{output} is not empty; pass --overwrite")
    if ARGS.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("No CUDA device: this benchmark times GPU execution (use --tiny --device cpu to smoke-test).")
    output.mkdir(parents=True, exist_ok=True)
    target, drafter = build(ARGS)
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, target.config.vocab_size, (1, ARGS.prompt_length), generator=generator).to(ARGS.device)
    timed_generate(target, ids)  # warm-up
    reference, _ = timed_generate(target, ids)
    drafter.reference = reference[0].tolist()
    new_tokens = reference.shape[1] - ids.shape[1]
    rows = []
    for accept in ARGS.accept:
        drafter.accept = accept
        settings = [("target", None, {})] + [("d3d", None, {})]
        for guess in ("right", "wrong"):
            for h in ARGS.hypotheses:
                settings.append((f"d3d-async H={h} guess={guess}", guess, dict(d3d_async=True, d3d_num_hypotheses=h)))
        for name, guess, options in settings:
            drafter.wrong_guess = guess == "wrong"
            times = []
            for _ in range(ARGS.repeats):
                out, seconds = timed_generate(target, ids, None if name == "target" else drafter, **options)
                if not torch.equal(out, reference):
                    raise SystemExit(f"{name}, accept={accept}: output differs from target-only decoding")
                times.append(seconds)
            seconds = sorted(times)[len(times) // 2]
            stats = drafter.last_generation_stats if name != "target" else None
            rows.append(
                {
                    "accept": accept,
                    "method": name,
                    "seconds": seconds,
                    "tokens_per_second": new_tokens / seconds,
                    "tau": stats.tau if stats else 1.0,
                    "hit_rate": stats.hit_rate if stats else None,
                    "draft_ms": 1e3 * sum(stats.draft_seconds) / stats.rounds if stats else None,
                    "verify_ms": 1e3 * sum(stats.verify_seconds) / stats.rounds if stats else None,
                }
            )
            base = next(r for r in rows if r["accept"] == accept and r["method"] == "target")
            rows[-1]["speedup"] = rows[-1]["tokens_per_second"] / base["tokens_per_second"]
            print(json.dumps(rows[-1]), flush=True)
    environment = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if ARGS.device == "cuda" else "cpu",
        "python": platform.python_version(),
        "target_parameters": sum(p.numel() for p in target.parameters()),
        "drafter_parameters": sum(p.numel() for p in drafter.parameters()),
    }
    (output / "async_engine.json").write_text(
        json.dumps({"settings": vars(ARGS), "environment": environment, "rows": rows}, indent=2)
    )
    lines = ["| accept | method | tokens/s | speed-up | tau | hit rate | draft ms | verify ms |", "|" + "---|" * 8]
    for r in rows:
        hit = "" if r["hit_rate"] is None else f"{r['hit_rate']:.2f}"
        draft = "" if r["draft_ms"] is None else f"{r['draft_ms']:.2f}"
        verify = "" if r["verify_ms"] is None else f"{r['verify_ms']:.2f}"
        lines.append(
            f"| {r['accept']} | {r['method']} | {r['tokens_per_second']:.1f} | {r['speedup']:.2f}x | "
            f"{r['tau']:.2f} | {hit} | {draft} | {verify} |"
        )
    (output / "async_engine.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("output")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tiny", action="store_true", help="a tiny model (smoke test of the script)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--drafter-layers", type=int, default=4, help="drafter = the target's first N layers")
    parser.add_argument("--accept", type=lambda s: [int(x) for x in s.split(",")], default=[0, 3, 7, 15])
    parser.add_argument("--hypotheses", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16])
    parser.add_argument("--prompt-length", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    ARGS = parser.parse_args()
    main()
