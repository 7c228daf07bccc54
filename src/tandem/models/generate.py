"""Greedy decoding of chats with plain transformers `generate`, batched with left padding.

A reference decoder independent of tandem's inference engine: the SFT trainer's held-out
evaluation uses it to score its model without starting a server (`uv run evaluate` goes through
an inference server).
"""

import torch
from torch import nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase


@torch.inference_mode()
def greedy_completions(
    model: nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    chats: list[list[dict]],
    batch_size: int,
    max_new_tokens: int,
) -> list[str]:
    """The assistant's greedy answer to each chat, special tokens removed."""
    device = next(model.parameters()).device
    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    completions: list[str] = []
    try:
        for start in range(0, len(chats), batch_size):
            texts = [
                tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
                for chat in chats[start : start + batch_size]
            ]
            batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            out = model.generate(
                **batch,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                use_cache=True,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
            new_tokens = out[:, batch["input_ids"].shape[1] :]
            completions.extend(tokenizer.batch_decode(new_tokens, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = side
    return completions
