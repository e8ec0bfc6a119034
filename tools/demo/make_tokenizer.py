#!/usr/bin/env python3
"""Train the demo model's byte-level BPE tokenizer on the corpus (deterministic).

    python3 tools/demo/make_tokenizer.py --corpus ../shared/corpus --out tools/demo/tokenizer

Writes tokenizer.json and tokenizer_config.json (with a ChatML chat template,
which finetune_chat.py teaches the model).
"""
import argparse
import json
import os

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
FILES = ["shakespeare.txt", "stdlib_mobydick.txt", "stdlib_sotu.txt"]
# ChatML, as Qwen's models use; the demo is fine-tuned on it (finetune_chat.py)
# and ends a reply with <|im_end|>.
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", default=os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "corpus"))
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "tokenizer"))
    p.add_argument("--vocab", type=int, default=4096)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=a.vocab,
        min_frequency=2,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([os.path.join(a.corpus, f) for f in FILES], trainer)
    tok.add_special_tokens(SPECIALS)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    ids = {s: tok.token_to_id(s) for s in SPECIALS}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "model_max_length": 4096,
        "chat_template": TEMPLATE,
    }
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    print(json.dumps({"vocab": tok.get_vocab_size(), "specials": ids}))


if __name__ == "__main__":
    main()
