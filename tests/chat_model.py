"""A tiny random Llama with a small byte-level BPE tokenizer and a ChatML template (eos = pad =
<|im_end|>), saved in from_pretrained layout: the chat tests' base model (SmolLM2 is far too slow to
train in a test)."""

from __future__ import annotations

from pathlib import Path

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIALS = ["<|im_start|>", "<|im_end|>"]


def tiny_chat_model(out: Path, texts: list[str], vocab: int = 400, hidden: int = 48, seed: int = 0) -> Path:
    """Train the tokenizer on `texts`, build the model with seeded random weights, save both to `out`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    rust = Tokenizer(models.BPE())
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    rust.decoder = decoders.ByteLevel()
    rust.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|im_end|>", pad_token="<|im_end|>",
                                  bos_token=None, additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                         tie_word_embeddings=True)
    model = LlamaForCausalLM(config)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def chat_texts(rows: list[dict]) -> list[str]:
    """The text of synthetic chat rows, for the tokenizer's training."""
    return [m["content"] for r in rows for m in r["messages"]] + ["user", "assistant", "system"]
