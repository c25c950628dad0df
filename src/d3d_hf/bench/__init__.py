"""Benchmark harness: runs decoding methods interleaved on the same prompts; metrics of docs/DESIGN.md section 6.

Methods (greedy decoding), one entry each in the registry `METHODS`:

- `target`: plain `target.generate` (the reference every other method is checked against).
- `pld`: transformers' prompt-lookup decoding, `target.generate(..., prompt_lookup_num_tokens=N)`: drafts are the
  tokens that followed the last earlier occurrence of the current n-gram in the sequence (no draft model).
- `ar-assist`: transformers' assisted generation with an autoregressive assistant of the same tokenizer,
  `target.generate(..., assistant_model=assistant)` (the assistant drafts up to its `num_assistant_tokens` tokens
  one forward each, stopping early below `assistant_confidence_threshold`; transformers' defaults unless the
  assistant's generation config sets them).
- `d3d`: `target.generate(..., assistant_model=drafter)` with synchronous D3D drafting.
- `d3d-async`: the same with `d3d_async=True` (packed successor drafting during verification, `--num-hypotheses`,
  `--reuse-on-miss`); reports the hit rate.

For each prompt the methods run one after the other (interleaved), so slow drifts of the machine hit all methods
alike. Every method runs on the same target object, so dtype and threads are the same.

**Batches** (`batch_size > 1`, `d3d-hf bench --batch-size N`): the prompts are taken `N` at a time (consecutive),
left-padded, and a method that decodes batches (`BenchMethod.batches`: `target`, transformers' batched greedy
decoding; `d3d` and its synchronous variants, D3D's batched loop) decodes each batch in one `generate` call; the
others (`pld`, `ar-assist`: transformers refuses an assistant or prompt lookup for a batch; `d3d-async`, `d3d-tree`:
D3D decodes them one sequence at a time) run the batch's prompts one after the other, and the table marks them "one
at a time". A run is then one batch: its tokens are all its sequences' generated tokens (each up to its eos), its
seconds the wall time of the batch (tokens/s of the whole batch), its rounds the target forwards of the batch, and
it matches the target when every sequence equals its `target` output.

What is measured, and how honestly:

- **tokens/s** and **speed-up**: new tokens over the wall time of the whole `generate` call (prefill included).
- **rounds**: target forwards. For `target` one per generated token; for the speculative methods one per
  verification round (the first round includes the prompt prefill).
- **tau**: new tokens / rounds, bonus token included.
- **draft / verify time per round** (speculative methods): the candidate generator of each call is instrumented
  (`RoundRecorder`) with the bundle's `RoundClock`, or its own clock is read when it keeps one (D3D's candidate
  generator does: one clock per round, never two): *draft* is the wall time inside `get_candidates` (pld: the
  n-gram lookup; ar-assist: the assistant's forwards, including its own prompt prefill in round 1; d3d: the draft
  pass); *verify* is the time from the end of
  `get_candidates` to `update_candidate_strategy`, i.e. the target's forward over the candidates plus
  transformers' acceptance bookkeeping (round 1 includes the target's prefill). Not in either: the work
  transformers does between rounds after `update_candidate_strategy` (model-kwargs update, stopping criteria);
  it is in tokens/s but not in draft + verify. For `target` no split is measured (0).
- **acceptance lengths**: tokens committed per round (`num_matches + 1`, after transformers' eos/length crop).
- **hit rate** (methods whose stats have `hits`, e.g. an asynchronous drafter): hits / rounds that followed a
  packed pass (`hits / (hits + reused + misses)`, the definition of `D3DGenerationStats.hit_rate`).
- **lossless match**: the output equals the `target` output token for token.

A new method is one `BenchMethod` passed to `register_method`: how to call `generate` (extra keyword arguments)
and how to read its per-round statistics after the call.
"""

from .methods import DEFAULT_METHODS, METHODS, BenchMethod, missing_resource, register_method, unknown_methods
from .methods import RESOURCE_HINTS as RESOURCE_HINTS
from .recording import RoundRecorder, RoundStats, d3d_round_stats
from .runner import run_benchmark
from .summary import PromptRun, environment_info, format_round_plans, format_table, merge_results, summarize
from .summary import _round_plan_summary as _round_plan_summary

__all__ = [
    "DEFAULT_METHODS",
    "METHODS",
    "BenchMethod",
    "PromptRun",
    "RoundRecorder",
    "RoundStats",
    "d3d_round_stats",
    "format_round_plans",
    "environment_info",
    "format_table",
    "merge_results",
    "missing_resource",
    "register_method",
    "run_benchmark",
    "summarize",
    "unknown_methods",
]
