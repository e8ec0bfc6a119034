#!/usr/bin/env python3
"""Replays a routing trace against expert-pool eviction policies and prints each one's decode
hit rate (the share of decoded tokens' expert uses already in a slot).

The trace comes from the product: SLOTSTREAM_ROUTING_TRACE=FILE slotstream run ... with a pool
smaller than the model (--experts-per-layer N) writes one line per streaming MoE call,
`layer tokens id,id:n,...` (the call's distinct experts; `:n` where n > 1 of the call's tokens
chose it). The policies:

  clock     a reference bit per slot, set when its expert is needed (the product's old policy)
  lru       least recently needed
  counts:H  per expert, the count of calls that needed it, each call halved after H tokens
            (H=0: never halved); the lowest count gives up its slot (the product's `calls:H`)
  tokens:H  the product's default (`frequency:H`): counts:H, but a call adds to an expert's
            count the number of its tokens that chose it, not 1 (a prompt's routing then says
            how often each expert is chosen); traces written before 2026-12-07 lack the
            numbers, so there it equals counts:H
  optimum   Belady: the expert needed again furthest ahead (knows the future; a bound)
  future:W  the fewest uses in the next W tokens (knows the future: a bound on what any
            estimate of experts' rates, counts among them, could reach)
  next:H    counts:H, but a victim is never one of the next call's experts while another can
            go (a perfect guess of the next MoE layer kept in the pool: what such a guard could gain)

As in the product, a call's own experts keep their slots and empty slots go first.

    python3 tools/peer/eviction_sim.py TRACE --per-layer 16 [--half-lives 16,64,256,0] [--tokens] [--next] [--future 128,512]
"""
import argparse
import math
from collections import Counter, OrderedDict


def load(path):
    calls = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            parts = line.split()
            if len(parts) not in (2, 3):
                raise SystemExit(f"{path}:{n}: expected 'layer tokens id,id,...', got {line.strip()!r}")
            uses = [x.split(":") for x in parts[2].split(",")] if len(parts) == 3 else []
            ids = [int(u[0]) for u in uses]
            calls.append((int(parts[0]), int(parts[1]), ids, [int(u[1]) if len(u) > 1 else 1 for u in uses]))
    return calls


def replay(calls, experts, slots, layers, policy, half_life=64.0, keep_next=False, window=0):
    """Decode hits and misses of `policy` over `calls` with `slots` slots (`window`: future's tokens)."""
    keyed = [(tokens, [layer * experts + e for e in ids]) for layer, tokens, ids, _ in calls]
    chose = [dict(zip(keys, n)) for (_, keys), (_, _, _, n) in zip(keyed, calls)]
    ahead = window * layers  # future: the calls after this one that its counts look at
    coming = Counter(k for _, keys in keyed[1:1 + ahead] for k in keys)
    hits = misses = 0
    held = OrderedDict()  # key -> policy state (recency order for lru)
    clock_slots, referenced, hand = [], [], 0
    score, now = {}, 0.0
    rate = math.log(2) / half_life if half_life else 0.0
    next_use = []
    if policy == "optimum":
        later = {}
        for i in range(len(keyed) - 1, -1, -1):
            next_use.append({k: later.get(k, math.inf) for k in keyed[i][1]})
            for k in keyed[i][1]:
                later[k] = i
        next_use.reverse()
    for i, (tokens, keys) in enumerate(keyed):
        now += tokens / layers
        present = {k for k in keys if k in held}
        missed = [k for k in keys if k not in present]
        if tokens == 1:
            hits += len(present)
            misses += len(missed)
        own = set(keys)
        upcoming = set(keyed[i + 1][1]) if keep_next and i + 1 < len(keyed) else set()
        if policy == "clock":
            for k in present:
                referenced[held[k]] = True
            pinned = {held[k] for k in present}
            for k in missed[: max(0, slots - len(pinned))]:
                if len(clock_slots) < slots:
                    s = len(clock_slots)
                    clock_slots.append(None)
                    referenced.append(False)
                else:
                    while True:
                        s, hand = hand, (hand + 1) % slots
                        if s in pinned:
                            continue
                        if referenced[s]:
                            referenced[s] = False
                            continue
                        break
                    del held[clock_slots[s]]
                pinned.add(s)
                clock_slots[s] = k
                held[k] = s
                referenced[s] = True
            continue
        if policy in ("counts", "tokens"):
            for k in keys:
                old = score.get(k)
                count = math.exp(old - now * rate) if old is not None else 0.0
                score[k] = math.log(count + (chose[i][k] if policy == "tokens" else 1.0)) + now * rate
        if policy == "lru":
            for k in keys:  # in the call's order, so that ties fall the same way each run
                if k in present:
                    held.move_to_end(k)
        for k in missed:
            if len(held) >= slots:
                free = [c for c in held if c not in own]
                free = [c for c in free if c not in upcoming] or free
                if not free:
                    continue
                if policy == "lru":
                    victim = free[0]
                elif policy in ("counts", "tokens"):
                    victim = min(free, key=lambda c: score[c])
                elif policy == "future":
                    victim = min(free, key=lambda c: coming[c])
                else:
                    victim = max(free, key=lambda c: held[c])
                del held[victim]
            held[k] = next_use[i][k] if policy == "optimum" else True
        if policy == "optimum":
            for k in present:
                held[k] = next_use[i][k]
        if policy == "future":  # slide the window one call on
            coming.subtract(keyed[i + 1][1] if i + 1 < len(keyed) else [])
            coming.update(keyed[i + 1 + ahead][1] if i + 1 + ahead < len(keyed) else [])
    return hits, misses


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--per-layer", type=int, required=True, help="slots per MoE layer (the pool is this times the layers)")
    ap.add_argument("--experts", type=int, help="experts per layer (default: the largest id in the trace plus one)")
    ap.add_argument("--half-lives", default="16,64,256,0", help="counts' half-lives in tokens, 0 for none")
    ap.add_argument("--next", action="store_true", help="also next:H for each half-life")
    ap.add_argument("--tokens", action="store_true", help="also tokens:H for each half-life")
    ap.add_argument("--future", default="", help="also future:W for each of these windows, in tokens")
    a = ap.parse_args()
    calls = load(a.trace)
    if not calls:
        raise SystemExit(f"{a.trace} holds no calls: was the pool smaller than the model?")
    layers = max(c[0] for c in calls) + 1
    experts = a.experts or max((max(c[2]) for c in calls if c[2]), default=0) + 1
    slots = a.per_layer * layers
    decode = sum(1 for c in calls if c[1] == 1)
    print(f"{a.trace}: {len(calls)} calls ({decode} decode), {layers} MoE layers, {experts} experts each, {slots} slots")
    half_lives = [float(h) for h in a.half_lives.split(",")]
    runs = [("clock", None, False), ("lru", None, False)] + [("counts", h, False) for h in half_lives]
    runs += [("counts", h, True) for h in half_lives if a.next] + [("tokens", h, False) for h in half_lives if a.tokens]
    runs += [("future", int(w), False) for w in a.future.split(",") if w] + [("optimum", None, False)]
    for policy, h, keep_next in runs:
        if policy == "future":
            hits, misses = replay(calls, experts, slots, layers, policy, window=h)
            name = f"future:{h}"
        else:
            hits, misses = replay(calls, experts, slots, layers, policy, h or 0.0, keep_next)
            name = policy if h is None else f"{'next' if keep_next else policy}:{h:g}"
        print(f"  {name:12} decode hits {100 * hits / max(1, hits + misses):5.1f}%  ({hits} hits, {misses} misses)")


if __name__ == "__main__":
    main()
