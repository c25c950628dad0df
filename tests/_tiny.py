"""Tiny random Llama- and Qwen3-style targets and a word-level tokenizer for them (no hub access needed)."""

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
