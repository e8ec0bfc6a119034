"""Golden outputs of a fixture, computed by mlx-lm in float32.

For each prompt: the logits of the last prompt position, 32 greedy tokens
(argmax, no EOS stopping) decoded with mlx-lm's own KV/recurrent cache, and
the smallest top-1/top-2 logit gap seen while choosing them.  A debug section
holds the hidden state of the last short-prompt position after every decoder
layer, so a reimplementation can find the first layer where it diverges.

Every golden is cross-checked before it is written:
* the manual layer-by-layer run reproduces the model's own logits;
* greedy ids equal the argmax of one cache-free forward over prompt+generated;
* MoE router decisions are not near-ties (smallest k-th vs (k+1)-th router
  logit gap is reported), so float noise cannot flip which experts are used.
"""

from importlib.metadata import version
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm import load
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import make_prompt_cache
from tokenizers import Tokenizer

GREEDY_TOKENS = 32

# Taken from the project corpus (/work/shared/corpus): the opening of
# Moby-Dick (stdlib_mobydick.txt; note the UTF-8 em-dashes), and Hamlet's
# soliloquy as printed in shakespeare.txt.
PROMPTS = [
    ("short", "Call me Ishmael. Some years ago—never mind how long precisely—"),
    (
        "long",
        "Ham.\n"
        "To be, or not to be,--that is the question:--\n"
        "Whether 'tis nobler in the mind to suffer\n"
        "The slings and arrows of outrageous fortune\n"
        "Or to take arms against a sea of troubles,\n"
        "And by opposing end them?--To die,--to sleep,--\n"
        "No more; and by a sleep to say we end\n"
        "The heartache, and the thousand natural shocks\n"
        "That flesh is heir to,--'tis a consummation\n"
        "Devoutly to be wish'd. To die,--to sleep;--\n"
        "To sleep! perchance to dream:--ay, there's the rub;\n"
        "For in that sleep of death what dreams may come,\n"
        "When we have shuffled off this mortal coil,\n"
        "Must give us pause: there's the respect\n"
        "That makes calamity of so long life;\n",
    ),
]


def oracle_string() -> str:
    return f"mlx-lm {version('mlx-lm')} / mlx {version('mlx')}, float32"


def to_float32(model: nn.Module) -> None:
    """Cast every floating parameter (incl. quantization scales/biases) to f32."""
    model.set_dtype(mx.float32)
    for name, p in tree_flatten(model.parameters()):
        if mx.issubdtype(p.dtype, mx.floating) and p.dtype != mx.float32:
            raise RuntimeError(f"{name} is still {p.dtype} after set_dtype(float32)")


def f32_list(a) -> list:
    """JSON-friendly floats: shortest decimal that round-trips the f32 value."""
    return [float(str(x)) for x in np.asarray(a, dtype=np.float32).reshape(-1)]


def top2_margin(logits: np.ndarray) -> float:
    top = np.sort(logits)[-2:]
    return float(top[1] - top[0])


class RouterRecorder(nn.Module):
    """Wraps a MoE router Linear and keeps the router logits it produced."""

    def __init__(self, inner: nn.Module, top_k: int, sink: list):
        super().__init__()
        self.inner = inner
        self._top_k = top_k
        self._sink = sink

    def __call__(self, x):
        y = self.inner(x)
        self._sink.append((np.array(y.astype(mx.float32)), self._top_k))
        return y


def run_layers(model, ids: list):
    """Layer-by-layer, cache-free forward that mirrors the model's __call__.

    Returns (logits [L, V], per-layer last-position hidden states, router logs).
    """
    inner = model.model
    router_log = []
    wrapped = []
    for layer in inner.layers:
        mlp = layer.mlp
        if "gate" in mlp and hasattr(mlp, "top_k"):
            wrapped.append((mlp, mlp.gate))
            mlp.gate = RouterRecorder(mlp.gate, mlp.top_k, router_log)
    try:
        h = inner.embed_tokens(mx.array(ids)[None])
        attn_mask = create_attention_mask(h, None)
        ssm_mask = create_ssm_mask(h, None)
        per_layer = []
        for layer in inner.layers:
            mask = ssm_mask if getattr(layer, "is_linear", False) else attn_mask
            h = layer(h, mask, None)
            mx.eval(h)
            per_layer.append(np.array(h[0, -1]))
        h = inner.norm(h)
        # Vision-language checkpoints keep the head under `language_model`.
        head = getattr(model, "language_model", model)
        logits = head.lm_head(h) if hasattr(head, "lm_head") else inner.embed_tokens.as_linear(h)
        logits = np.array(logits[0])
    finally:
        for mlp, gate in wrapped:
            mlp.gate = gate
    return logits, per_layer, router_log


def min_router_gap(router_log) -> float:
    """Smallest gap between the k-th and (k+1)-th router logit over all tokens."""
    gap = np.inf
    for logits, k in router_log:
        s = np.sort(logits.reshape(-1, logits.shape[-1]), axis=-1)
        gap = min(gap, float(np.min(s[:, -k] - s[:, -k - 1])))
    return gap


def greedy_with_cache(model, prompt_ids: list, n: int):
    cache = make_prompt_cache(model)
    logits = model(mx.array(prompt_ids)[None], cache=cache)[0, -1]
    last_logits = np.array(logits)
    step_logits, out, margins = [], [], []
    cur = last_logits
    for i in range(n):
        tok = int(np.argmax(cur))
        out.append(tok)
        margins.append(top2_margin(cur))
        step_logits.append(cur)
        if i + 1 < n:
            cur = np.array(model(mx.array([[tok]]), cache=cache)[0, -1])
    return last_logits, out, margins, np.stack(step_logits)


def compute_goldens(fixture_dir: Path, name: str, log=print) -> dict:
    model, hf_tokenizer = load(str(fixture_dir))
    to_float32(model)
    tok = Tokenizer.from_file(str(fixture_dir / "tokenizer.json"))

    cases, report = [], {}
    debug = {}
    for case, text in PROMPTS:
        ids = tok.encode(text, add_special_tokens=False).ids
        hf_ids = hf_tokenizer.encode(text, add_special_tokens=False)
        if list(hf_ids) != ids:
            raise RuntimeError(f"{name}/{case}: transformers and tokenizers encode differently")
        if tok.decode(ids) != text:
            raise RuntimeError(f"{name}/{case}: tokenizer does not round-trip the prompt")

        last_logits, gen, margins, step_logits = greedy_with_cache(model, ids, GREEDY_TOKENS)

        # Cache-free check over prompt + generated (minus the last token).
        full_ids = ids + gen[:-1]
        full_logits = np.array(model(mx.array(full_ids)[None])[0])
        tail = full_logits[len(ids) - 1 :]
        roundtrip = [int(i) for i in np.argmax(tail, axis=-1)]
        if roundtrip != gen:
            raise RuntimeError(f"{name}/{case}: cached greedy {gen} != cache-free argmax {roundtrip}")
        cache_vs_full = float(np.max(np.abs(tail - step_logits)))

        manual_logits, per_layer, router_log = run_layers(model, full_ids)
        manual_diff = float(np.max(np.abs(manual_logits - full_logits)))
        if manual_diff > 1e-5:
            raise RuntimeError(f"{name}/{case}: manual layer run differs from model by {manual_diff}")
        if case == "short":
            _, short_layers, _ = run_layers(model, ids)
            debug["short_layer_outputs"] = [f32_list(h) for h in short_layers]

        cases.append(
            {
                "name": case,
                "prompt_text": text,
                "prompt_ids": ids,
                "last_logits": f32_list(last_logits),
                "greedy_ids": gen,
                "min_greedy_margin": float(str(np.float32(min(margins)))),
            }
        )
        report[case] = {
            "prompt_tokens": len(ids),
            "min_greedy_margin": min(margins),
            "min_router_gap": min_router_gap(router_log) if router_log else None,
            "max_abs_cache_vs_full": cache_vs_full,
        }
        log(f"[golden] {name}/{case}: {report[case]}")

    golden = {"oracle": oracle_string(), "model": name, "cases": cases, "debug": debug}
    return golden, report
