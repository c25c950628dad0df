"""Packages a trained SmolLM2 drafter as `d3d-smollm2-135m-instruct` (src/d3d_hf/pretrained/) with its model card
(weights, config and card: no copy of the remote-code bundle, which exports write).

    python examples/ship_smollm2_drafter.py --run runs/train/smollm2-d3d-mixed --data runs/data/smollm2-mixed \
        --recipe examples/train_smollm2_drafter_mixed.sh --results FILE.json ...

The card is rendered from data: the training settings recorded by the run (trainer_state.json, the recipe) and the
benchmark JSON files given; nothing is typed in by hand.
"""

import argparse
import json
import shutil
from pathlib import Path

import d3d_hf  # noqa: F401
from d3d_hf.data import _prompt_counts
from d3d_hf.drafters import KNOWN_DRAFTERS, load_drafter
from d3d_hf.hub import DrafterCardData, result_from_benchmark
from d3d_hf.prompts import load_prompt_sources

NAME = "d3d-smollm2-135m-instruct"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True, help="output_dir of `d3d-hf train`")
    parser.add_argument("--results", nargs="*", default=[], help="`d3d-hf bench --output` files of this drafter")
    parser.add_argument("--data", default="runs/data/smollm2-stdlib", help="the `d3d-hf data` folder it trained on")
    parser.add_argument("--recipe", default="examples/train_smollm2_drafter.sh", help="the script that trained it")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing packaged drafter")
    args = parser.parse_args()

    run = Path(args.run)
    destination = KNOWN_DRAFTERS[NAME]
    if destination.exists() and not args.overwrite:
        raise SystemExit(f"{destination} exists; pass --overwrite to replace it")
    drafter = load_drafter(str(run))
    state = json.loads((run / "trainer_state.json").read_text())
    data_settings = json.loads((Path(args.data) / "generation_settings.json").read_text())
    # counted again from the sources (folders written before the math/chat sources counted those as files)
    counts = _prompt_counts(load_prompt_sources(data_settings["prompt_sources"], seed=data_settings.get("seed", 0)))
    sources = {
        "stdlib": f"instructions derived from the Python {(data_settings.get('stdlib') or {}).get('python_version')} "
        f"standard library ({counts.get('stdlib_kinds')})",
        "math": "templated grade-school math word problems (d3d_hf.prompts.math_word_problems)",
        "chat": "templated chat requests (d3d_hf.prompts.chat_instructions)",
        "file": "prompts from JSONL files",
    }
    described = "; ".join(f"{counts[k]} {text}" for k, text in sources.items() if counts.get(k))
    tau_curve = [(h["step"], round(h["tau"], 3)) for h in state["log_history"] if "tau" in h]
    losses = [h for h in state["log_history"] if "block_loss" in h]
    training = {
        "recipe": args.recipe,
        "train_mode": "block_adapter (rank 32, alpha 64; target layers frozen and shared)",
        "steps": state["global_step"],
        "train_runtime_s": next((round(h["train_runtime"]) for h in state["log_history"] if "train_runtime" in h),
                                None),
        "hardware": "2-core x86_64 CPU, 2 threads",
        "data": (
            f"`d3d-hf data --prompts {data_settings['prompt_sources']}`: {described}, answered by the target "
            f"({data_settings['decoding']}, {data_settings['dtype']}, "
            f"<= {data_settings['max_new_tokens']} new tokens); "
            "no evaluation prompt"
        ),
        "final_block_loss": round(losses[-1]["block_loss"], 3) if losses else None,
        "held_out_tau_by_step": tau_curve,
    }
    drafter.card_data = DrafterCardData(
        target_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        base_model="HuggingFaceTB/SmolLM2-135M-Instruct",
        datasets=[
            text
            for key, text in (
                ("stdlib", "Python 3.11 standard library (PSF licence), instructions by d3d_hf.data.stdlib_prompts"),
                ("math", "math word problems written from templates by d3d_hf.prompts.synthetic (this project)"),
                ("chat", "chat requests written from templates by d3d_hf.prompts.synthetic (this project)"),
            )
            if counts.get(key)
        ],
        training=training,
        results=[result_from_benchmark(json.loads(Path(p).read_text())) for p in args.results],
        license="apache-2.0",
    )
    if destination.exists():
        shutil.rmtree(destination)
    drafter.save_pretrained(destination)
    # inside the package the registered model_type loads it: keep weights, config and card only; every export
    # (`save_pretrained`, `push_to_hub`, `d3d-hf push`) writes the current bundle next to them again
    for bundle_file in destination.glob("*_d3d.py"):
        bundle_file.unlink()
    config_path = destination / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("auto_map", None)
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    print(f"packaged {NAME} in {destination} ({sum(f.stat().st_size for f in destination.iterdir()) / 2**20:.1f} MiB)")


if __name__ == "__main__":
    main()
