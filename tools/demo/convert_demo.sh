#!/usr/bin/env bash
# Turn the checkpoint train_demo.py or finetune_chat.py wrote (transformers layout, bf16) into the
# bundled demo model: MLX 4-bit (group 64, routers at 8 bits, mlx-lm's own
# converter), plus the tokenizer, in tools/demo/model/.
#
#   tools/demo/convert_demo.sh HF_DIR
set -euo pipefail
cd "$(dirname "$0")/../.."
hf="$1"
py=.venv/bin/python
[ -x "$py" ] || { python3 -m venv .venv && .venv/bin/pip install -q -r tools/oracle/requirements.txt; }
cp tools/demo/tokenizer/tokenizer.json tools/demo/tokenizer/tokenizer_config.json "$hf"/
# <|endoftext|> ends a text, <|im_end|> a chat turn.
echo '{"eos_token_id": [4096, 4098]}' > "$hf/generation_config.json"
rm -rf tools/demo/model
"$py" -m mlx_lm convert --hf-path "$hf" --mlx-path tools/demo/model -q --q-bits 4 --q-group-size 64
cp "$hf/training_log.json" tools/demo/model/ 2>/dev/null || true
rm -f tools/demo/model/README.md  # the model card mlx-lm writes; src/demo.rs lists the files it bundles
du -sh tools/demo/model
