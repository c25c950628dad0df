"""Ships the equal-budget autoregressive assistant (`ar-smollm2-135m-instruct`, for `d3d-hf bench --methods
ar-assist --assistant ar-smollm2-135m-instruct`) from the folder examples/train_ar_assistant.sh exported.

Only what training changed is stored (the 6 layers and the final norm, in bfloat16): the embeddings and tied LM head
stayed frozen at SmolLM2-135M-Instruct's, and `d3d_hf.assistants.load_assistant` takes them from the target.

    python examples/ship_ar_assistant.py [runs/smollm2-ar-assistant]
"""

import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from d3d_hf.assistants import KNOWN_ASSISTANTS, load_assistant, save_layers_only
from d3d_hf.targets import load_target

TARGET = "smollm2-135m-instruct"
NAME = "ar-smollm2-135m-instruct"

CARD = """# {name}

The equal-budget autoregressive baseline of `d3d-smollm2-135m-instruct`: the first {layers} of
SmolLM2-135M-Instruct's 30 layers, every layer weight trained with the next-token loss on the same target-distilled
data and for the same {steps} steps of 4 sequences as the shipped D3D drafter (`examples/train_ar_assistant.sh`).
Stored without its embeddings (frozen at the target's during training; `d3d_hf.assistants.load_assistant` takes them
from the target), weights in bfloat16.

    d3d-hf bench --drafter d3d-smollm2-135m-instruct --methods target,ar-assist,d3d \\
      --assistant {name} --prompts humaneval --limit 5
"""


def main() -> None:
    source = Path(sys.argv[1] if len(sys.argv) > 1 else "runs/smollm2-ar-assistant")
    target, _ = load_target(TARGET)
    assistant = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    folder = save_layers_only(assistant, KNOWN_ASSISTANTS[NAME], TARGET, target, overwrite=True)
    layers = assistant.config.num_hidden_layers
    (folder / "README.md").write_text(CARD.format(name=NAME, layers=layers, steps=700), encoding="utf-8")
    shipped = load_assistant(NAME, target=target)
    ids = torch.tensor([[1, 504, 3458, 30, 1041, 28, 338, 1009]])
    with torch.no_grad():
        agree = (shipped(ids).logits.argmax(-1) == assistant(ids).logits.argmax(-1)).float().mean().item()
    size = sum(p.stat().st_size for p in folder.iterdir()) / 2**20
    print(f"shipped {NAME} to {folder}: {size:.1f} MiB, top-1 agreement with the float32 export {agree:.0%}")


if __name__ == "__main__":
    main()
