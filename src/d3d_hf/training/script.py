"""`d3d-hf train`: what to train on (`D3DTrainScriptArguments`), loading the data, training and saving.

The command line is TRL's (`trl.TrlParser`): every `D3DTrainScriptArguments` and `D3DTrainingConfig` field (so every
`trl.SFTConfig` and `transformers.TrainingArguments` field) is a flag, spelled with underscores as TRL and
transformers document them (`--max_steps`) or with dashes like the other `d3d-hf` subcommands (`--max-steps`; both
are accepted), and `--config FILE.yaml` reads any of them from a YAML mapping (flags given too override it).
"""

from __future__ import annotations

import glob
import gzip
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from ..modeling import D3DForDiffusionDrafting
from .checkpoints import last_complete_checkpoint
from .config import D3DTrainingConfig
from .trainer import D3DTrainer, check_adapter_request


@dataclass
class D3DTrainScriptArguments:
    r"""
    What `d3d-hf train` trains on (the `D3DTrainingConfig` fields say how).

    Args:
        target (`str`): the target model (a known name such as `smollm2-135m-instruct`, a folder or a hub id).
        data (`str`): the training rows: a folder written by `d3d-hf data` (its `dataset/` subfolder or the folder
            itself; any `datasets.save_to_disk` folder), or JSON / JSONL files (a path, a glob such as
            `runs/data/x/shards/*.jsonl`, or comma-separated paths) read with `datasets.load_dataset("json", ...)`:
            `d3d-hf data` shards, or any dataset TRL's `SFTTrainer` takes (`messages`, `prompt` + `completion`,
            a text field).
        drafter (`str`, *optional*): start from this drafter folder instead of initialising from the target.
        num_layers (`int`, *optional*): layers copied from the target when initialising, its first ones (default:
            all).
        layer_ids (`str`, *optional*): instead of `num_layers`, the target layers a new drafter copies, in order,
            comma-separated (`"0,6,12,18,24,29"`: a shallow drafter spread over the target's depth).
        init_block_size (`int`, defaults to 16): block size of a newly initialised drafter.
        shares_target_weights (`bool`, defaults to `True`): a newly initialised drafter references the target's
            weights and saves only its own (valid with `train_mode="block_adapter"`; ignored otherwise).
        draft_vocab_size (`int`, *optional*): a newly initialised standalone drafter (`shares_target_weights=False`)
            gets a draft vocabulary (FR-Spec, arXiv 2502.14856): its LM head covers only the `draft_vocab_size` ids
            most frequent in the training rows' responses, plus the target's eos ids (`d3d_hf.drafters.
            draft_vocabulary`); default the full vocabulary.
        shares_target_cache (`bool`, defaults to `False`): a newly initialised standalone drafter attends to the
            target's cached keys and values of the layers it copies (`D3DConfig.shares_target_cache`: query-only
            layers over the target's cache); it trains with `ar_loss_weight=0`.
        reads_target_hidden_state (`bool`, defaults to `False`): with `shares_target_cache`, the new drafter's anchor
            also reads the target's last hidden state before it (`D3DConfig.reads_target_hidden_state`, EAGLE's
            feature).
        hidden_state_init (`str`, defaults to `"zeros"`): with `reads_target_hidden_state`, how the state's projection
            starts (`from_autoregressive`'s `hidden_state_init`: `zeros` or `identity`).
        dtype (`str`, defaults to `"float32"`): dtype of the target (and shared weights) during training.
        target_dtype (`str`, *optional*): dtype of the target's no-grad forward for a standalone drafter (its cache,
            hidden state and distillation targets), when it should differ from `dtype`: e.g. `bfloat16` while the
            drafter trains in float32 (on an AMD EPYC with avx512_bf16, one thread, that forward over 4 rows of 450
            tokens took 2.9 s in bf16 and 5.2 s in float32; it is most of a step for a drafter over the target's
            cache). The drafter is initialised from the
            target in `dtype` first. Default: `dtype`. Refused for a drafter that shares the target's weights.
        tau_holdout (`int`, defaults to 4): rows held out of training (the last ones) whose prompts measure tau
            every `tau_eval_steps` (a conversational row's prompt is its messages before the last assistant turn).
        max_samples (`int`, *optional*): train on the first `max_samples` rows that are not held out (the held-out
            rows stay the dataset's last `tau_holdout`, so runs of a learning curve share them); default all.
        skip_samples (`int`, defaults to 0): leave out the first `skip_samples` of those rows, so that a run continued
            from a drafter trained on them (`drafter`) sees only rows it has not seen; `max_samples` then counts from
            there.
        threads (`int`, *optional*): torch CPU threads.
        overwrite (`bool`, defaults to `False`): allow a non-empty `output_dir` without resuming.
    """

    target: str = field(metadata={"help": "Target model name, folder or hub id."})
    data: str = field(metadata={"help": "`d3d-hf data` folder, or JSON/JSONL file(s) (path, glob, comma-separated)."})
    drafter: str | None = field(default=None, metadata={"help": "Start from this drafter folder."})
    num_layers: int | None = field(default=None, metadata={"help": "Layers of a new drafter (default all)."})
    layer_ids: str | None = field(
        default=None, metadata={"help": "Target layers a new drafter copies, comma-separated (e.g. 0,6,12,18,24,29)."}
    )
    init_block_size: int = field(default=16, metadata={"help": "Block size of a new drafter."})
    shares_target_weights: bool = field(default=True, metadata={"help": "New drafter references target weights."})
    dtype: str = field(default="float32", metadata={"help": "Training dtype of the target."})
    target_dtype: str | None = field(
        default=None, metadata={"help": "Dtype of a standalone drafter's no-grad target forward (default: dtype)."}
    )
    draft_vocab_size: int | None = field(
        default=None, metadata={"help": "A new standalone drafter's LM head covers the N most frequent answer ids."}
    )
    shares_target_cache: bool = field(
        default=False, metadata={"help": "New standalone drafter attends to the target's cache of its layer_ids."}
    )
    reads_target_hidden_state: bool = field(
        default=False, metadata={"help": "With shares_target_cache: the anchor reads the target's last hidden state."}
    )
    hidden_state_init: str = field(
        default="zeros", metadata={"help": "How the state's projection starts: zeros or identity (scaled)."}
    )
    tau_holdout: int = field(default=4, metadata={"help": "Rows held out for tau evaluation."})
    max_samples: int | None = field(
        default=None, metadata={"help": "Train on the first N rows after --skip_samples (learning curves)."}
    )
    skip_samples: int = field(
        default=0, metadata={"help": "Leave out the first N rows (continue a drafter on rows it has not seen)."}
    )
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads."})
    overwrite: bool = field(default=False, metadata={"help": "Allow a non-empty output_dir without resuming."})

    # the flags that only shape a drafter initialised from the target: refused, unless at their defaults, with `drafter`
    _NEW_DRAFTER_FLAGS = (
        "num_layers",
        "layer_ids",
        "init_block_size",
        "shares_target_weights",
        "draft_vocab_size",
        "shares_target_cache",
        "reads_target_hidden_state",
        "hidden_state_init",
    )

    def __post_init__(self):
        """Checks the values before anything loads.

        Raises:
            ValueError: naming the flag, for `num_layers` or `threads` below 1, `init_block_size` below 2 (training
                needs a mask), `tau_holdout` below 0, a `dtype` or `target_dtype` other than float32, bfloat16,
                float16, a `hidden_state_init` other than zeros or identity, or `reads_target_hidden_state` without
                `shares_target_cache`; or, with `drafter`, a flag that only shapes a new drafter (`_NEW_DRAFTER_FLAGS`:
                `num_layers`, `layer_ids`, `init_block_size`, ...) set to other than its default.
        """
        if self.hidden_state_init not in ("zeros", "identity"):
            raise ValueError(f"--hidden_state_init must be zeros or identity, got {self.hidden_state_init!r}.")
        if self.reads_target_hidden_state and not self.shares_target_cache:
            raise ValueError(
                "--reads_target_hidden_state true needs --shares_target_cache true: only a drafter over the target's "
                "cache reads its hidden state."
            )
        names = (("num_layers", 1), ("init_block_size", 2), ("tau_holdout", 0), ("threads", 1), ("max_samples", 1))
        names = (*names, ("skip_samples", 0))
        for name, low in (*names, ("draft_vocab_size", 1)):
            value = getattr(self, name)
            if value is None and name in ("num_layers", "threads", "max_samples", "draft_vocab_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"--{name} must be a whole number >= {low}, got {value!r}.")
        if self.layer_ids is not None:
            if self.num_layers is not None:
                raise ValueError("Pass --num_layers or --layer_ids, not both.")
            try:
                ids = [int(i) for i in str(self.layer_ids).split(",")]
            except ValueError:
                ids = []
            if not ids or any(i < 0 for i in ids):
                raise ValueError(
                    f"--layer_ids must be comma-separated layer indices such as 0,6,12, got {self.layer_ids!r}."
                )
        for name in ("dtype", "target_dtype"):
            value = getattr(self, name)
            if value is not None and value not in ("float32", "bfloat16", "float16"):
                raise ValueError(f"--{name} must be float32, bfloat16 or float16, got {value!r}.")
        if self.drafter:
            new_drafter_flags = [
                f"--{f.name}"
                for f in fields(self)
                if f.name in self._NEW_DRAFTER_FLAGS and getattr(self, f.name) != f.default
            ]
            if new_drafter_flags:
                raise ValueError(
                    f"--drafter {self.drafter} trains a saved drafter, whose shape comes with it; "
                    f"{', '.join(new_drafter_flags)} shape only a new drafter initialised from the target: drop them, "
                    "or drop --drafter to initialise a new one."
                )


def continued_card_data(script: D3DTrainScriptArguments, saved, config: D3DTrainingConfig, num_train: int):
    """The card data of a drafter trained on from a saved one (`--drafter`), before the run adds its own settings.

    It records where the weights came from (`continued_from`: the saved drafter, with the steps and recipe its own
    card recorded), an adapter rank grown by this run, and the rows trained on; the target and the datasets its card
    named carry over. Measured results never do: they were measured on the saved weights, not on these.

    Args:
        script (`D3DTrainScriptArguments`): the run's script arguments (`drafter`, `data`, `skip_samples`).
        saved (`D3DConfig`): the saved drafter's configuration.
        config (`D3DTrainingConfig`): the run's settings (`block_lora_rank`).
        num_train (`int`): the number of training rows, after `skip_samples`.

    Returns:
        `d3d_hf.hub.DrafterCardData`.
    """
    from ..drafters import resolve_drafter
    from ..hub import DrafterCardData, load_card_data

    folder = resolve_drafter(script.drafter)
    previous = load_card_data(folder) if Path(folder).is_dir() else None
    origin = script.drafter
    earlier = (previous.training or {}) if previous is not None else {}
    if earlier:
        recorded = [f"{earlier['steps']} steps" if "steps" in earlier else None, earlier.get("recipe")]
        recorded = [r for r in recorded if r]
        origin += f" (its card: {', '.join(recorded)})" if recorded else ""
    training = {"continued_from": origin}
    rank = config.block_lora_rank
    if config.train_mode == "block_adapter" and rank is not None and rank > saved.block_lora_rank > 0:
        training["adapter_rank"] = f"grown from {saved.block_lora_rank} to {rank} (expand_block_adapters)"
    first = script.skip_samples
    training["training_rows"] = f"{script.data}: rows {first}-{first + num_train - 1}"
    return DrafterCardData(
        target_model=previous.target_model if previous is not None else None,
        base_model=previous.base_model if previous is not None else None,
        datasets=[*(previous.datasets if previous is not None else []), script.data],
        training=training,
        license=previous.license if previous is not None else None,
    )


def load_training_dataset(path: str):
    """Loads training rows: the shards of a `d3d-hf data` folder, a `datasets.save_to_disk` folder (`path` or
    `path/dataset`), or JSON / JSONL files (`path` a file, a glob, or comma-separated files) through
    `datasets.load_dataset("json")`.

    A `d3d-hf data` folder is always read from its shards, in shard order, whether or not its run has finished and
    written `dataset/` (which lists the requested prompts in prompt order, another order): the shards are what is
    committed, so `--max_samples N` and `--tau_holdout` name the same rows on every machine, before and after the
    run ends.

    Returns:
        `datasets.Dataset` (the `train` split of a saved `DatasetDict`).

    Raises:
        FileNotFoundError: if `path` is neither a saved dataset nor existing JSON / JSONL files.
        ValueError: if every JSON / JSONL file is empty or blank (empty ones among others are skipped).
    """
    from datasets import Dataset, DatasetDict, load_dataset, load_from_disk

    from ..data import SHARDS_DIR, load_generated_rows

    if (Path(path) / SHARDS_DIR).is_dir() and any((Path(path) / SHARDS_DIR).glob("shard-*")):
        return Dataset.from_list(load_generated_rows(path))  # finished, in progress, or committed as shards only
    for candidate in (Path(path) / "dataset", Path(path)):
        if (candidate / "dataset_info.json").exists() or (candidate / "state.json").exists():
            dataset = load_from_disk(str(candidate))
        elif (candidate / "dataset_dict.json").exists():
            dataset = load_from_disk(str(candidate))
        else:
            continue
        return dataset["train"] if isinstance(dataset, DatasetDict) else dataset
    files = sorted(f for part in path.split(",") for f in glob.glob(part.strip()) if Path(f).is_file())
    if files and all(f.endswith((".json", ".jsonl", ".json.gz", ".jsonl.gz")) for f in files):
        # `datasets`' JSON reader fails on an empty file with a bare StopIteration: skip those, refuse if all are
        held = [f for f in files if _holds_text(f)]
        if not held:
            raise ValueError(
                f"{', '.join(files)} {'holds' if len(files) == 1 else 'hold'} no rows (empty or blank): write one JSON "
                "object per line (e.g. {\"messages\": [...]} or {\"prompt\": ..., \"completion\": ...}), or pass "
                "the folder `d3d-hf data --output` wrote."
            )
        return load_dataset("json", data_files=held, split="train")
    raise FileNotFoundError(
        f"No dataset at {path}: pass a folder written by `d3d-hf data --output {path}` (or `save_to_disk`), or "
        "JSON/JSONL files (a path, a glob like 'runs/data/x/shards/*.jsonl', or comma-separated paths)."
    )


def _holds_text(file: str) -> bool:
    """Whether a JSON / JSONL file (gzip-compressed if its name ends in .gz) holds anything but whitespace."""
    with (gzip.open if file.endswith(".gz") else open)(file, "rb") as f:
        return any(line.strip() for line in f)


def _tau_prompt(row: dict, tokenizer) -> list[int]:
    """The prompt ids of a held-out row: `prompt_ids`, a chat `prompt`, the messages before the last assistant
    turn, or a plain `prompt` string."""
    if "prompt_ids" in row:
        return list(row["prompt_ids"])
    messages = row.get("prompt") if isinstance(row.get("prompt"), list) else None
    if messages is None and isinstance(row.get("messages"), list):
        turns = list(row["messages"])
        last = max((i for i, m in enumerate(turns) if m.get("role") == "assistant"), default=len(turns))
        messages = turns[:last]
    if messages:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)
    if isinstance(row.get("prompt"), str):
        return tokenizer(row["prompt"], add_special_tokens=False)["input_ids"]
    raise ValueError(
        f"Cannot measure tau on a row with columns {sorted(row)}: give rows with `prompt_ids`, `prompt` or "
        "`messages`, or pass --tau_eval_steps 0."
    )


def train_drafter(script: D3DTrainScriptArguments, config: D3DTrainingConfig) -> D3DForDiffusionDrafting:
    """Runs `d3d-hf train`: loads target, data and drafter, trains, saves the drafter to `config.output_dir`.

    Returns:
        The trained `D3DForDiffusionDrafting` (block adapters saved as they are; PEFT adapters as
        `peft_save_merged` says, see `D3DTrainer.save_model`).

    Raises:
        FileExistsError: if `output_dir` is non-empty and neither resuming nor `overwrite`.
        ValueError: if the dataset is too small for the hold-out, shared weights are asked with a mode that
            trains them, or a `target_dtype` other than `dtype` for a drafter that shares the target's weights.
    """
    from ..drafters import load_drafter
    from ..targets import load_target

    if script.threads:
        torch.set_num_threads(script.threads)
    output = Path(config.output_dir)
    resume = config.resume_from_checkpoint
    if resume in ("auto", "true", "True", True):
        resume = last_complete_checkpoint(output)  # never a checkpoint whose save was interrupted
    if output.exists() and any(output.iterdir()) and not resume and not script.overwrite:
        raise FileExistsError(
            f"{output} is not empty: pass --resume_from_checkpoint auto to continue a run there, or --overwrite."
        )
    if config.tau_eval_steps and script.tau_holdout < 1:
        raise ValueError("--tau_eval_steps measures tau on the --tau_holdout rows: pass --tau_holdout 1 or more.")
    dataset = load_training_dataset(script.data)  # the data and the drafter's config are checked before the target
    if len(dataset) <= script.tau_holdout:
        raise ValueError(
            f"The dataset has {len(dataset)} rows; need more than --tau_holdout {script.tau_holdout} (the last rows, "
            "held out to measure tau): add rows, or pass --tau_holdout 0 to train on every row without measuring it."
        )
    saved_config = None
    if script.drafter:
        from ..drafters import load_drafter_config

        saved_config = load_drafter_config(script.drafter)
        check_adapter_request(saved_config, config)
    num_train = len(dataset) - script.tau_holdout - script.skip_samples
    if num_train < 1:
        raise ValueError(
            f"--skip_samples {script.skip_samples} leaves no rows to train on: the dataset has "
            f"{len(dataset) - script.tau_holdout} rows outside the hold-out; pass fewer, or generate more data."
        )
    if script.max_samples is not None:
        if script.max_samples > num_train:
            raise ValueError(
                f"--max_samples {script.max_samples} is more than the {num_train} rows outside the hold-out"
                + (f" after --skip_samples {script.skip_samples}" if script.skip_samples else "")
                + f": pass at most {num_train}, or generate more data."
            )
        num_train = script.max_samples
    train_rows = dataset.select(range(script.skip_samples, script.skip_samples + num_train))
    target, tokenizer = load_target(script.target, dtype=script.dtype)  # after every check that needs no target
    held_out = [dataset[i] for i in range(len(dataset) - script.tau_holdout, len(dataset))]
    tau_prompts = (
        [torch.tensor([_tau_prompt(row, tokenizer)], dtype=torch.long) for row in held_out]
        if config.tau_eval_steps
        else None
    )

    if script.drafter:
        drafter = load_drafter(script.drafter, dtype=script.dtype)
        if drafter.config.shares_target_weights:
            drafter.attach_target_weights(target)
        drafter.card_data = continued_card_data(script, saved_config, config, num_train)
    else:
        shares = script.shares_target_weights and config.train_mode == "block_adapter"
        vocab_ids = None
        if script.draft_vocab_size is not None:
            if shares:
                raise ValueError(
                    "--draft_vocab_size needs a standalone drafter: pass --shares_target_weights false (and "
                    "--train_mode full), since a drafter that shares the target's weights uses its full LM head."
                )
            from ..drafters import draft_vocabulary

            eos = target.generation_config.eos_token_id
            vocab_ids = draft_vocabulary(
                (row["response_ids"] for row in train_rows if "response_ids" in row),
                script.draft_vocab_size,
                target.config.vocab_size,
                always=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            )
        drafter = D3DForDiffusionDrafting.from_autoregressive(
            target,
            num_layers=script.num_layers,
            layer_ids=None if script.layer_ids is None else [int(i) for i in str(script.layer_ids).split(",")],
            block_size=script.init_block_size,
            source_model=script.target,
            target_model=script.target,
            shares_target_weights=shares,
            draft_vocab_ids=vocab_ids,
            shares_target_cache=script.shares_target_cache,
            reads_target_hidden_state=script.reads_target_hidden_state,
            hidden_state_init=script.hidden_state_init,
        )
    if drafter.config.shares_target_weights and config.train_mode != "block_adapter":
        raise ValueError("A drafter that shares the target's weights can only train with train_mode=block_adapter.")
    if script.target_dtype not in (None, script.dtype):
        if drafter.config.shares_target_weights:
            raise ValueError(
                f"--target_dtype {script.target_dtype} differs from --dtype {script.dtype}, but this drafter shares "
                "the target's weights, so both run in one dtype: drop --target_dtype, or set --dtype instead."
            )
        target.to(getattr(torch, script.target_dtype))  # the drafter owns copies, made in `dtype` above
    trainer = D3DTrainer(
        drafter,
        config,
        train_dataset=train_rows,
        processing_class=tokenizer,
        target=target,
        tau_prompts=tau_prompts,
    )
    trainer.train(resume_from_checkpoint=resume)
    trainer.save_model(str(output))
    trainer.save_state()
    return drafter


def main(argv: list[str] | None = None) -> int:
    """`d3d-hf train`: every `D3DTrainScriptArguments` and `D3DTrainingConfig` field as `--name value` or
    `--name-with-dashes value`, and `--config FILE.yaml` (`trl.TrlParser`; module docstring).

    Raises:
        ValueError, FileNotFoundError, FileExistsError: as `train_drafter` (the CLI prints them as one line).
    """
    import sys

    from trl import TrlParser

    parser = TrlParser((D3DTrainScriptArguments, D3DTrainingConfig), prog="d3d-hf train")
    script, config = parser.parse_args_and_config(args=list(sys.argv[1:] if argv is None else argv))
    train_drafter(script, config)
    return 0


__all__ = ["D3DTrainScriptArguments", "load_training_dataset", "main", "train_drafter"]
