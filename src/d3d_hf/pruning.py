"""Progressive layer pruning of D3D drafters by acceptance length (arXiv 2611.06425; docs/DESIGN.md section 4).

Packed drafting costs more than drafting one block, so D3D removes the drafter layers that matter least for
acceptance: measure tau on calibration prompts with each remaining layer removed, drop the layer whose removal
costs least, repeat until a layer budget or a tau-retention floor.

What makes this affordable: in greedy decoding the target's continuation of a prompt does not depend on the drafter
(lossless), so it is generated once per calibration prompt and every candidate drafter is scored against it with
`offline_acceptance`, which replays the synchronous decoding loop (the drafter's real `draft_logits` path, its own
KV cache, the same draft-length and eos rules as `D3DCandidateGenerator`) without running the target. In float32
its tau equals the tau of `target.generate(..., assistant_model=drafter)` exactly (tested).

`truncate_block_adapters` prunes the other way: it lowers the rank of every block adapter to its best
approximation of that rank (truncated SVD), which costs little acceptance on the shipped drafter and makes the draft
pass cheaper (fewer adapter bytes; held-out tau by rank: benchmarks/results/rank/).

Candidates are evaluated in place (`layer_subset` swaps the decoder layer list, nothing is copied); the state of a
run (continuations, baseline, every step with every candidate's tau) is written atomically to `pruning_state.json`
after each step, so an interrupted run resumes where it stopped and reaches the same result.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from .adapter_rank import expand_block_adapters, truncate_block_adapters
from .modeling import D3DForDiffusionDrafting
from .modeling.drafting_d3d import D3DCache
from .utils import write_json_atomic

STATE_FILE = "pruning_state.json"
PATH_FILE = "pruning_path.json"
PLOT_FILE = "pruning_curve.png"


@dataclass
class AcceptanceResult:
    """Offline replay of greedy D3D decoding against a fixed target continuation.

    Attributes:
        rounds (`int`): target verification forwards the real run would make.
        new_tokens (`int`): committed tokens (the continuation's length).
        acceptance_lengths (`list[int]`): tokens committed per round.
        draft_seconds (`float`): summed wall time of the drafter passes, seconds.
        draft_passes (`int`): drafter passes made.
    """

    rounds: int = 0
    new_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    draft_seconds: float = 0.0
    draft_passes: int = 0

    @property
    def tau(self) -> float:
        """Committed tokens per target forward."""
        return self.new_tokens / self.rounds if self.rounds else 0.0

    def __add__(self, other: AcceptanceResult) -> AcceptanceResult:
        return AcceptanceResult(
            rounds=self.rounds + other.rounds,
            new_tokens=self.new_tokens + other.new_tokens,
            acceptance_lengths=self.acceptance_lengths + other.acceptance_lengths,
            draft_seconds=self.draft_seconds + other.draft_seconds,
            draft_passes=self.draft_passes + other.draft_passes,
        )


@torch.no_grad()
def offline_acceptance(
    drafter: D3DForDiffusionDrafting,
    prompt_ids: Sequence[int],
    continuation: Sequence[int],
    max_new_tokens: int,
    eos_token_ids: Sequence[int] = (),
) -> AcceptanceResult:
    """Replays greedy synchronous D3D decoding of `prompt_ids` against the target's own greedy `continuation`.

    Each round drafts `min(B - 1, max_length - cur_len - 1)` tokens with `drafter.draft_logits` (argmax, cut after
    the first eos id, as `D3DCandidateGenerator` does), accepts the longest prefix equal to the continuation and
    commits it plus the target's next token, exactly as `target.generate(..., assistant_model=drafter,
    do_sample=False)` would when the target produces `continuation` (which it does in float32: lossless).

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter (weights attached when it shares its target's).
        prompt_ids (`Sequence[int]`): the encoded prompt.
        continuation (`Sequence[int]`): the target's greedy output after the prompt (at most `max_new_tokens`).
        max_new_tokens (`int`): the generation budget the continuation was made with.
        eos_token_ids (`Sequence[int]`): eos ids of the generation config.

    Returns:
        `AcceptanceResult`.

    Raises:
        ValueError: if the prompt is empty or the continuation is longer than `max_new_tokens`; for a drafter over
            the target's cache (`shares_target_cache`), whose passes need the target's cache.
    """
    if not prompt_ids:
        raise ValueError("The prompt is empty.")
    if getattr(drafter.config, "shares_target_cache", False):
        raise ValueError(
            "This drafter attends to the target's cache (`shares_target_cache=True`), which an offline replay does "
            "not have: measure its acceptance with the target in the loop (`benchmarks/trl/compare_tau.py`, or "
            "`target.generate(..., assistant_model=drafter)`)."
        )
    if len(continuation) > max_new_tokens:
        raise ValueError(f"The continuation has {len(continuation)} tokens, more than max_new_tokens={max_new_tokens}.")
    device = drafter.model.embed_tokens.weight.device
    sequence = list(prompt_ids)
    max_length = len(prompt_ids) + max_new_tokens
    eos = set(int(e) for e in eos_token_ids)
    block_size = drafter.config.block_size
    cache = D3DCache()
    result = AcceptanceResult()
    produced = 0
    while produced < len(continuation):
        num_drafts = min(block_size - 1, max_length - len(sequence) - 1)
        accepted = 0
        if num_drafts > 0:
            committed = torch.tensor([sequence[cache.get_seq_length() :]], device=device)
            start = time.perf_counter()
            drafts = drafter.draft_logits(committed, cache)[0, :num_drafts].argmax(dim=-1).tolist()
            result.draft_seconds += time.perf_counter() - start
            result.draft_passes += 1
            for k, token in enumerate(drafts):
                if token in eos:
                    drafts = drafts[: k + 1]
                    break
            for token, expected in zip(drafts, continuation[produced:], strict=False):
                if token != expected:
                    break
                accepted += 1
        committed_now = min(accepted + 1, len(continuation) - produced)
        sequence.extend(continuation[produced : produced + committed_now])
        produced += committed_now
        result.rounds += 1
        result.new_tokens += committed_now
        result.acceptance_lengths.append(committed_now)
    return result


@contextlib.contextmanager
def layer_subset(drafter: D3DForDiffusionDrafting, keep: Sequence[int]) -> Iterator[D3DForDiffusionDrafting]:
    """Temporarily runs `drafter` with only its decoder layers `keep` (indices into the current layer list, in
    order); the layers are the same modules (no copy), renumbered for the KV cache, and restored on exit.

    Raises:
        ValueError: if `keep` is empty, unsorted, repeats or is out of range.
    """
    layers = drafter.model.layers
    keep = list(keep)
    if not keep or keep != sorted(set(keep)) or keep[0] < 0 or keep[-1] >= len(layers):
        raise ValueError(f"`keep` must be increasing layer indices in [0, {len(layers)}), got {keep}.")
    indices = [layer.self_attn.layer_idx for layer in layers]
    drafter.model.layers = nn.ModuleList([layers[i] for i in keep])
    for new_index, layer in enumerate(drafter.model.layers):
        layer.self_attn.layer_idx = new_index
    try:
        yield drafter
    finally:
        drafter.model.layers = layers
        for layer, index in zip(layers, indices, strict=True):
            layer.self_attn.layer_idx = index


def pruned_drafter(drafter: D3DForDiffusionDrafting, keep: Sequence[int]) -> D3DForDiffusionDrafting:
    """A new drafter holding only the decoder layers `keep` of `drafter` (weights copied), with every per-layer
    config field updated: `num_hidden_layers`, `source_layer_ids` (the target layers the kept layers came from),
    `pruned_layer_ids` (indices of the kept layers in the unpruned drafter; composed over repeated pruning) and
    `block_lora_full_layers` (the kept layers among the full-rank ones).

    A drafter that shares its target's weights gets them attached again from the same target.

    Raises:
        ValueError: as `layer_subset`.
    """
    keep = list(keep)
    config = copy.deepcopy(drafter.config)
    source = drafter.config.source_layer_ids or list(range(drafter.config.num_hidden_layers))
    earlier = getattr(drafter.config, "pruned_layer_ids", None) or list(range(drafter.config.num_hidden_layers))
    with layer_subset(drafter, keep):
        state = {k: v.detach().clone() for k, v in drafter.state_dict().items()}
    config.num_hidden_layers = len(keep)
    config.source_layer_ids = [source[i] for i in keep]
    config.pruned_layer_ids = [earlier[i] for i in keep]
    # the full-rank adapters are on the last layers, and stay on the kept ones among them, which stay last
    full = getattr(drafter.config, "block_lora_full_layers", 0)
    config.block_lora_full_layers = sum(i >= drafter.config.num_hidden_layers - full for i in keep)
    pruned = D3DForDiffusionDrafting(config).to(dtype=next(drafter.parameters()).dtype)
    pruned.load_state_dict(state, strict=True)
    pruned.card_data = getattr(drafter, "card_data", None)
    if drafter.config.shares_target_weights and drafter._attached_target is not None:
        pruned.attach_target_weights(drafter._attached_target)
    return pruned.eval()


@dataclass
class PruningStep:
    """One step of the pruning path (step 0 is the unpruned drafter).

    Attributes:
        step (`int`): 0 for the baseline, then 1, 2, ...
        num_layers (`int`): layers after this step.
        removed_layer (`int`, *optional*): index, in the unpruned drafter, of the layer removed at this step.
        kept_layers (`list[int]`): indices, in the unpruned drafter, of the layers kept.
        tau (`float`): calibration tau after this step.
        tau_retention (`float`): `tau / baseline tau`.
        draft_ms (`float`): mean wall time of one drafter pass (one block) during the calibration replay, ms.
        candidates (`dict[str, float]`): tau with each candidate layer removed (key: unpruned index), before any
            fine-tuning of this step.
        tau_before_finetune (`float`, *optional*): with fine-tuning, the calibration tau of the pruned drafter before
            it was fine-tuned (`tau` is after); `None` without.
        finetune_seconds (`float`, *optional*): wall time of this step's fine-tuning, seconds; `None` without.
    """

    step: int
    num_layers: int
    removed_layer: int | None
    kept_layers: list[int]
    tau: float
    tau_retention: float
    draft_ms: float
    candidates: dict[str, float] = field(default_factory=dict)
    tau_before_finetune: float | None = None
    finetune_seconds: float | None = None


def _calibration_acceptance(drafter, calibration, max_new_tokens, eos_ids) -> AcceptanceResult:
    total = AcceptanceResult()
    for prompt_ids, continuation in calibration:
        total = total + offline_acceptance(drafter, prompt_ids, continuation, max_new_tokens, eos_ids)
    return total


def _fingerprint(drafter: D3DForDiffusionDrafting) -> str:
    """A short checksum of the drafter's weights (to refuse resuming a run made with another drafter)."""
    total = sum(float(p.detach().double().abs().sum()) for p in drafter.parameters())
    return f"{total:.6e}"


def target_continuations(target, prompts_ids: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[int]]:
    """The target's greedy continuation of each prompt (`target.generate`, batch size 1), as token lists."""
    out = []
    for ids in tqdm(prompts_ids, desc="target continuations", leave=False):
        input_ids = torch.tensor([list(ids)], device=target.device)
        generated = target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False
        )
        out.append(generated[0, input_ids.shape[1] :].tolist())
    return out


def _step_folder(step: int) -> str:
    return f"step-{step:02d}"


def _finetuned_step(state_path: Path | None, step: PruningStep, target) -> D3DForDiffusionDrafting:
    """The fine-tuned drafter a resumed run saved at `step`.

    Raises:
        FileNotFoundError: if it is not there (no `state_dir`, or the folder was removed).
    """
    from .drafters import load_drafter

    folder = None if state_path is None else state_path.parent / _step_folder(step.step)
    if folder is None or not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"Resuming a fine-tuned pruning run at step {step.step} needs the drafter it saved to {folder}: restore "
            "that folder, or start over in an empty state_dir."
        )
    drafter = load_drafter(str(folder), dtype=_step_dtype(folder))
    if drafter.config.shares_target_weights:
        drafter.attach_target_weights(target)
    return drafter


def _step_dtype(folder: Path) -> torch.dtype:
    """The dtype a saved step was written in (its config's `dtype`, else float32)."""
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    return getattr(torch, str(name).replace("torch.", ""))


def prune_drafter(
    drafter: D3DForDiffusionDrafting,
    target,
    prompts_ids: Sequence[Sequence[int]],
    *,
    num_layers: int | None = None,
    min_tau_retention: float | None = None,
    max_new_tokens: int = 128,
    state_dir: str | os.PathLike | None = None,
    progress: bool = True,
    finetune: Callable[[D3DForDiffusionDrafting, int], D3DForDiffusionDrafting] | None = None,
) -> tuple[D3DForDiffusionDrafting, list[PruningStep]]:
    """Progressive greedy layer pruning by calibration tau (arXiv 2611.06425, section 3.3; docs/DESIGN.md section
    4): at each step, measure tau with each remaining layer removed, remove the layer whose removal costs least,
    optionally fine-tune the pruned drafter (the paper's recipe), and repeat.

    Args:
        drafter (`D3DForDiffusionDrafting`): the drafter to prune (not modified).
        target (`PreTrainedModel`): its target; generates the calibration continuations once (and provides the
            weights of a `shares_target_weights` drafter).
        prompts_ids (`Sequence[Sequence[int]]`): encoded calibration prompts (keep them disjoint from evaluation
            sets).
        num_layers (`int`, *optional*): stop at this many layers.
        min_tau_retention (`float`, *optional*): stop before a step whose tau would fall below this fraction of the
            unpruned drafter's tau (e.g. 0.99).
        max_new_tokens (`int`, defaults to 128): length of the calibration continuations.
        state_dir (`str` or `os.PathLike`, *optional*): folder for `pruning_state.json`, written after every step;
            an existing state made with the same drafter shape, prompts, budget and dtype is resumed (and may be
            continued with a lower `num_layers` or `min_tau_retention`), a different one raises.
        progress (`bool`, defaults to `True`): tqdm progress bars.
        finetune (`Callable[[D3DForDiffusionDrafting, int], D3DForDiffusionDrafting]`, *optional*): called after
            each removal with the pruned drafter (a copy, in train-ready float weights of the drafter's dtype) and
            the step number; returns the fine-tuned drafter, which the next step prunes (e.g.
            `trainer_finetune(...)`). Its tau is measured again after fine-tuning, and `min_tau_retention` applies
            to that tau. With a `state_dir`, each fine-tuned drafter is saved to `state_dir/step-NN/`, from which an
            interrupted run resumes. Without it (default), candidates are scored in place and nothing is trained.

    Returns:
        `(pruned_drafter, path)`: the pruned drafter (`pruned_drafter(...)`; with `finetune`, the last fine-tuned
        drafter) and the `PruningStep`s.

    Raises:
        ValueError: if neither or both stopping rules are given, `num_layers` is out of `[1, layers)`,
            `min_tau_retention` is out of `(0, 1]`, there are no prompts, or a saved state has other settings
            (including whether it fine-tunes).
        FileNotFoundError: resuming a fine-tuned run whose last step's `state_dir/step-NN/` drafter is missing.
    """
    total_layers = drafter.config.num_hidden_layers
    if (num_layers is None) == (min_tau_retention is None):
        raise ValueError("Give exactly one of `num_layers` and `min_tau_retention`.")
    if num_layers is not None and not 1 <= num_layers < total_layers:
        raise ValueError(f"`num_layers` must be in [1, {total_layers - 1}] for a {total_layers}-layer drafter.")
    if min_tau_retention is not None and not 0.0 < min_tau_retention <= 1.0:
        raise ValueError(f"`min_tau_retention` must be in (0, 1], got {min_tau_retention}.")
    if not prompts_ids:
        raise ValueError("Pruning needs at least one calibration prompt.")
    if drafter.config.shares_target_weights and drafter._attached_target is not target:
        drafter.attach_target_weights(target)
    eos_ids = target.generation_config.eos_token_id
    eos_ids = [] if eos_ids is None else ([eos_ids] if isinstance(eos_ids, int) else list(eos_ids))
    settings = {  # what must match to resume (the stopping rule may change: a run can be continued further)
        "total_layers": total_layers,
        "max_new_tokens": max_new_tokens,
        "prompts": [list(map(int, p)) for p in prompts_ids],
        "block_size": drafter.config.block_size,
        "dtype": str(next(drafter.parameters()).dtype),
        "drafter_fingerprint": _fingerprint(drafter),
        "finetune": finetune is not None,
    }
    state_path = Path(state_dir) / STATE_FILE if state_dir is not None else None
    state = None
    if state_path is not None and state_path.exists():
        state = json.loads(state_path.read_text(encoding="utf-8"))
        state["settings"].setdefault("finetune", False)  # a state written before fine-tuning existed
        if state["settings"] != settings:
            raise ValueError(
                f"{state_path} holds a pruning run with other settings (drafter, prompts, budget or dtype); use "
                "another output folder or delete it to start over."
            )
    if state is None:
        continuations = target_continuations(target, prompts_ids, max_new_tokens)
        state = {"settings": settings, "continuations": continuations, "steps": []}
    calibration = list(zip(settings["prompts"], state["continuations"], strict=True))
    steps = [PruningStep(**s) for s in state["steps"]]

    def save() -> None:
        if state_path is not None:
            state_path.parent.mkdir(parents=True, exist_ok=True)
            state["steps"] = [asdict(s) for s in steps]
            write_json_atomic(state_path, state)

    if not steps:
        base = _calibration_acceptance(drafter, calibration, max_new_tokens, eos_ids)
        draft_ms = 1e3 * base.draft_seconds / max(base.draft_passes, 1)
        steps.append(PruningStep(0, total_layers, None, list(range(total_layers)), base.tau, 1.0, draft_ms))
        save()
    baseline = steps[0].tau
    # a resumed run that went further than asked now: keep the steps this stopping rule allows
    while len(steps) > 1 and (
        (num_layers is not None and steps[-2].num_layers <= num_layers)
        or (min_tau_retention is not None and steps[-1].tau_retention < min_tau_retention)
    ):
        steps.pop()
    # the drafter the next step prunes, and the unpruned index of each of its layers
    model, origin = drafter, list(range(total_layers))
    if finetune is not None and len(steps) > 1:
        model, origin = _finetuned_step(state_path, steps[-1], target), steps[-1].kept_layers
    while True:
        current = steps[-1]
        kept = current.kept_layers
        if num_layers is not None and len(kept) <= num_layers:
            break
        if len(kept) == 1:
            break
        position = {layer: origin.index(layer) for layer in kept}
        scores: dict[int, AcceptanceResult] = {}
        bar = tqdm(kept, desc=f"step {len(steps)}: {len(kept)} layers", disable=not progress, leave=False)
        for layer in bar:
            with layer_subset(model, [position[i] for i in kept if i != layer]):
                scores[layer] = _calibration_acceptance(model, calibration, max_new_tokens, eos_ids)
            bar.set_postfix(layer=layer, tau=f"{scores[layer].tau:.3f}")
        # least harmful layer; ties go to the deeper layer (later layers refine, earlier ones feed every other)
        best = max(kept, key=lambda i: (scores[i].tau, i))
        remaining = [i for i in kept if i != best]
        result, before, seconds = scores[best], None, None
        if finetune is not None:
            start = time.perf_counter()
            tuned = finetune(pruned_drafter(model, [position[i] for i in remaining]), len(steps)).eval()
            seconds = time.perf_counter() - start
            before, result = result.tau, _calibration_acceptance(tuned, calibration, max_new_tokens, eos_ids)
        retention = result.tau / baseline if baseline else 0.0
        if min_tau_retention is not None and retention < min_tau_retention:
            break
        steps.append(
            PruningStep(
                step=len(steps),
                num_layers=len(remaining),
                removed_layer=best,
                kept_layers=remaining,
                tau=result.tau,
                tau_retention=retention,
                draft_ms=1e3 * result.draft_seconds / max(result.draft_passes, 1),
                candidates={str(i): scores[i].tau for i in kept},
                tau_before_finetune=before,
                finetune_seconds=seconds,
            )
        )
        if finetune is not None:
            model, origin = tuned, remaining
            if state_path is not None:
                tuned.save_pretrained(state_path.parent / _step_folder(len(steps) - 1))
        save()
    if model is not drafter:  # the last fine-tuned drafter
        return model, steps
    return pruned_drafter(drafter, steps[-1].kept_layers), steps


def trainer_finetune(
    train_dataset, args, *, target=None, processing_class=None, **trainer_kwargs
) -> Callable[[D3DForDiffusionDrafting, int], D3DForDiffusionDrafting]:
    """A `finetune` for `prune_drafter` that trains each pruned drafter with `D3DTrainer` (the paper's pruning recipe
    fine-tunes after every removal).

    Args:
        train_dataset (`datasets.Dataset`): what `D3DTrainer` takes (e.g. `d3d-hf data` rows; never an evaluation
            set: the trainer refuses them).
        args (`D3DTrainingConfig`): the fine-tuning of one step (`max_steps`, `learning_rate`, `train_mode`, ...).
            Step N trains in `args.output_dir/step-NN/` (checkpoints there resume an interrupted step); `args` is
            not changed.
        target (`PreTrainedModel`, *optional*): the target, for distillation (`distill_weight > 0` on a drafter
            with its own committed path) and for a drafter that shares its weights.
        processing_class (*optional*): the target's tokenizer.
        **trainer_kwargs: passed on to `D3DTrainer`.

    Returns:
        `finetune(drafter, step) -> drafter`: trains `drafter` (a PEFT-trained one is returned merged).

    Raises:
        ValueError: as `D3DTrainer` raises them, when a step starts.
    """

    def finetune(drafter: D3DForDiffusionDrafting, step: int) -> D3DForDiffusionDrafting:
        from .training import D3DTrainer
        from .training.checkpoints import last_complete_checkpoint

        step_args = copy.copy(args)
        step_args.output_dir = os.path.join(args.output_dir, _step_folder(step))
        if drafter.config.shares_target_weights and target is not None:
            drafter.attach_target_weights(target)
        trainer = D3DTrainer(
            drafter, step_args, train_dataset=train_dataset, processing_class=processing_class, target=target,
            **trainer_kwargs,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=last_complete_checkpoint(Path(step_args.output_dir)))
        model = trainer.model
        tuned = model.merge_and_unload() if hasattr(model, "merge_and_unload") else trainer.drafter
        tuned.__dict__.pop("forward", None)  # TRL binds its fused-head forward to the model it trains
        return tuned

    return finetune


def plot_pruning_path(steps: Sequence[PruningStep], path: str | os.PathLike) -> None:
    """Saves a matplotlib PNG of calibration tau and draft latency per block against the layer count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [s.num_layers for s in steps]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(layers, [s.tau for s in steps], "o-", color="tab:blue", label="tau (calibration)")
    ax.set_xlabel("drafter layers")
    ax.set_ylabel("tau", color="tab:blue")
    ax.invert_xaxis()
    other = ax.twinx()
    other.plot(layers, [s.draft_ms for s in steps], "s--", color="tab:red", label="draft ms / block")
    other.set_ylabel("draft latency per block (ms)", color="tab:red")
    ax.set_title("Progressive layer pruning")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = [
    "AcceptanceResult",
    "PruningStep",
    "layer_subset",
    "offline_acceptance",
    "plot_pruning_path",
    "prune_drafter",
    "pruned_drafter",
    "target_continuations",
    "trainer_finetune",
    "expand_block_adapters",
    "truncate_block_adapters",
]
