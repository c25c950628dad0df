"""Plain helpers shared by the tests (no hub access needed): tiny random Llama- and Qwen3-style targets, prompts,
word-level tokenizers, perturbed drafters, a crashing safetensors writer. Fixtures are in conftest.py.

Importable without d3d_hf (the remote-code tests import it in a process where `import d3d_hf` fails): d3d_hf is
imported inside the helpers that need it.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

FAMILIES = ("llama", "qwen3")


def tiny_target(family: str = "llama", vocab_size: int = 97, seed: int = 0, num_layers: int = 3, sharpen: float = 1.0):
    """A random causal LM; `sharpen` scales the LM head so that next-token distributions are peaky."""
    torch.manual_seed(seed)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **common))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=16, tie_word_embeddings=False, **common))
    else:
        raise ValueError(family)
    if sharpen != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(sharpen)
    return model.eval()


def random_prompt(length: int = 7, vocab_size: int = 97, seed: int = 0) -> torch.LongTensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, length), generator=g)


def tiny_tokenizer(vocab_size: int = 97):
    """A word-level fast tokenizer over the tokens `t0 .. t{vocab_size-1}` (id i is `ti`; 0 unk/pad, 1 bos, 2 eos)
    whose chat template joins the message contents: `"t5 t9"` encodes to `[5, 9]`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1", eos_token="t2")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def word_tokenizer(size: int = 90):
    """A word-level fast tokenizer of `size` ids (0 `<pad>`, 1 `<s>`, 2 `</s>`, 3 `<unk>`, then `w4 ..`), built
    offline, without a chat template. 90 ids: fewer than the 97 embedding rows of `tiny_target`, as Qwen3 (151669
    tokens, 151936 rows)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def perturbed_drafter(target, block_size, adapter_rank=4, seed=0, scale=0.02):
    """A full-copy drafter of `target` with rank-`adapter_rank` block adapters, every weight then moved by `scale`
    times N(0, 1) noise (seeded with `seed`): it drafts like the target, but not always."""
    from d3d_hf import D3DForDiffusionDrafting

    drafter = D3DForDiffusionDrafting.from_autoregressive(target, block_size=block_size)
    drafter.add_block_adapter(adapter_rank)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(scale * torch.randn_like(p))
    return drafter


def weight_sharing_drafter(target, block_size, adapter_rank=4, seed=0, scale=0.5):
    """A drafter on all of `target`'s own layers (`shares_target_weights`, weights attached) with rank-`adapter_rank`
    block adapters whose `lora_B` and mask embedding are set to `scale` times N(0, 1) noise (seeded with `seed`), so
    that its block rows differ from the target's (fresh adapters would leave them unchanged): the kind of drafter
    fused successor drafting runs on."""
    from d3d_hf import D3DForDiffusionDrafting

    drafter = D3DForDiffusionDrafting.from_autoregressive(
        target, block_size=block_size, shares_target_weights=True, block_lora_rank=adapter_rank
    )
    drafter.attach_target_weights(target)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "lora_B" in name or "mask_embedding" in name:
                p.copy_(scale * torch.randn_like(p))
    return drafter.eval()


def crash_safetensors_writer(monkeypatch):
    """Makes transformers' safetensors writer write half a file, then fail (a process killed mid-write)."""
    import transformers.modeling_utils

    real = transformers.modeling_utils.safe_save_file

    def half_then_crash(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(f.seek(0, 2) // 2)
        raise KeyboardInterrupt("killed while writing the weights")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", half_then_crash)


def chi_square_p_value(counts: torch.Tensor, exact: torch.Tensor, n: int) -> float:
    """p-value of a chi-square goodness-of-fit test of `counts` (n samples over the outcomes) against the exact
    probabilities `exact`; outcomes expected fewer than 5 times are pooled into one cell (dropped if still < 5)."""
    expected = exact * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return float(1 - torch.special.gammainc(torch.tensor((len(obs) - 1) / 2.0), chi2 / 2.0))


def target_cache_batch(length: int = 14, anchors=(5, 9), block_size: int = 4, seed: int = 0) -> dict:
    """A one-row collator-style batch for `target_cache_losses`: random ids, blocks at `anchors`, all masked."""
    ids = random_prompt(length, seed=seed)
    return {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "response_start": torch.tensor([3]),
        "anchors": torch.tensor([list(anchors)]),
        "block_masked": torch.ones(1, len(anchors), block_size - 1, dtype=torch.bool),
    }


def target_cache_block_logits(drafter, batch: dict, block_size: int, target) -> torch.Tensor:
    """The block logits `target_cache_losses` scores for `batch`, `(num_blocks, block_size, vocab)`: the drafter's
    forward output, caught on its way to the loss."""
    from d3d_hf.training.objective import target_cache_losses

    captured = {}
    original = drafter.forward

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        captured["logits"] = out.logits
        return out

    drafter.forward = spy
    try:
        with torch.no_grad():
            target_cache_losses(drafter, batch, block_size, gamma=7.0, target=target)
    finally:
        del drafter.forward
    return captured["logits"].view(batch["anchors"].shape[1], block_size, -1)
