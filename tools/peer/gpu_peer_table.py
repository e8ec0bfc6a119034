"""The markdown table tools/peer/bench_gpu_peer.py prints for BENCHMARKS.md: the resident
comparison with llama.cpp, then the streamed one (our GPU and CPU backends)."""


def f1(x, nd=1):
    return "—" if x is None else f"{x:.{nd}f}"


def ratio(x, y):
    return "—" if not x or not y else f"**{x / y:.2f}x**"


def mib(b):
    return "—" if not b else f"{b / 2**20:,.0f}"


LABEL = {"A": "qwen3_moe (Qwen3-30B-A3B trunk)", "B": "qwen3_next (Qwen3-Next-80B-A3B trunk)"}


def table(a, meta, results):
    L = []
    L.append(f"slotstream `{meta['commit']}`, {meta['date']}; GPU: {meta['gpu']}, driver {meta['driver']}; "
             f"host: {meta['cpus']} cores; ours: `{meta['ours_backend']}`; llama.cpp: {meta['peer_build']} "
             f"({meta['peer_device']}). Prompt {meta['prompt_tokens']} tokens, {a.decode} decode passes; "
             f"llama-bench `-ngl 99 -p 256 -n {a.decode} -d {a.depth} -r {a.peer_reps}`"
             + (f", {min(a.peer_rounds, a.rounds)} runs alternating with ours (the median's figures)" if a.peer_rounds > 1 else "")
             + f"; ours: median of {a.rounds} runs. "
             f"Models: tools/synth.py --symmetric --mixer-out-scale {a.mixer_out_scale} --router-skew {a.router_skew}."
             + (" SMALL models (local test, not a measurement)." if a.small else ""))
    L.append("")
    res = [r for r in results if not r["streaming"]]
    if res:
        L.append(f"| all experts resident, {meta['prompt_tokens']}-token context | slotstream wgpu | llama.cpp Vulkan | ours / theirs |")
        L.append("|---|---:|---:|---:|")
        for r in res:
            o, p = r["ours_gpu"], r.get("peer", {})
            lab = LABEL.get(r["key"], r["key"]) + f", {r['experts']} experts"
            pd, pp, note = p.get("decode"), p.get("prefill"), ""
            if pd is None and p.get("decode_d0") is not None:
                pd, pp, note = p.get("decode_d0"), p.get("prefill_d0"), f" (theirs at depth 0: {p.get('partial', 'no depth run')})"
            L.append(f"| {lab}: decode tok/s (tg{a.decode} @ d{a.depth}){note} | {f1(o['decode'])} | {f1(pd)} | {ratio(o['decode'], pd)} |")
            runs = r.get("peer_decode_runs") or []
            if len(runs) > 1:
                mine = ", ".join(f1(g.get("decode")) for g in r["ours_gpu_runs"])
                L.append(f"| {lab}: decode tok/s of each run, alternating (theirs: median of {len(runs)} llama-bench runs above) | "
                         f"{mine} | {', '.join(f1(x) for x in runs)} | |")
            L.append(f"| {lab}: prefill tok/s (ours: the run's first {o['prompt_tokens']}-token prompt, cold; theirs: pp256 @ d{a.depth}, warm){note} | {f1(o['prefill'])} | {f1(pp)} | {ratio(o['prefill'], pp)} |")
            fp = r.get("first_prompt")
            if fp:
                L.append(f"| {lab}: first prompt of a fresh process after {a.idle:g} s idle, tok/s (ours: `run`; theirs: "
                         f"llama-bench `-p {a.n_prompt} -n 0 -r 1 --no-warmup`; median of {a.first_rounds}, alternating) | "
                         f"{f1(fp['ours'])} | {f1(fp['theirs'])} | {ratio(fp['ours'], fp['theirs'])} |")
            L.append(f"| {lab}: peak GPU memory MiB | {o['gpu_mib'] if o['gpu_mib'] is not None else '—'} | {p.get('gpu_mib') if p.get('gpu_mib') is not None else '—'} | |")
            L.append(f"| {lab}: peak host RSS MiB | {mib(o['rss_bytes'])} | {mib(p.get('rss_bytes'))} | |")
            if r.get("ours_cpu"):
                L.append(f"| {lab}: our CPU backend decode / prefill tok/s | {f1(r['ours_cpu'].get('decode'))} / {f1(r['ours_cpu'].get('prefill'))} | | |")
        L.append("")
    res = [r for r in results if r["streaming"]]
    if res:
        L.append(f"| streamed: 64 experts per layer, pool 16 per layer (25%) | "
                 + " | ".join(LABEL.get(r["key"][:-2], r["key"]) for r in res) + " |")
        L.append("|---|" + "---:|" * len(res))
        rows = [
            ("GPU decode tok/s", lambda r: f1(r["ours_gpu"]["decode"], 3)),
            ("CPU decode tok/s (same pool)", lambda r: f1((r.get("ours_cpu") or {}).get("decode"), 3)),
            ("GPU / CPU decode", lambda r: ratio(r["ours_gpu"]["decode"], (r.get("ours_cpu") or {}).get("decode"))),
            ("decode tok/s of each run, GPU; CPU (they alternate, and which goes first)",
             lambda r: "; ".join(", ".join(f1(x.get("decode"), 3) for x in runs)
                                 for runs in (r["ours_gpu_runs"], r.get("ours_cpu_runs")) if runs)),
            ("reads GB/s while in flight (the disk's rate in each run), median GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('busy_read_gbs'), 2)} / {f1((r.get('ours_cpu') or {}).get('busy_read_gbs'), 2)}"),
            ("decode tok/s per GB/s of that rate (the disk's drift taken out), median GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('decode_per_busy_gbs'), 3)} / {f1((r.get('ours_cpu') or {}).get('decode_per_busy_gbs'), 3)} = "
             + ratio(r["ours_gpu"].get("decode_per_busy_gbs"), (r.get("ours_cpu") or {}).get("decode_per_busy_gbs"))),
            ("ms per decoded token beside the reads, GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('beside_reads_ms'))} / {f1((r.get('ours_cpu') or {}).get('beside_reads_ms'))}"),
            ("read wait ms per decoded token, GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('wait_ms'))} / {f1((r.get('ours_cpu') or {}).get('wait_ms'))}"),
            ("of which writing experts into slots, ms, GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('write_ms'))} / {f1((r.get('ours_cpu') or {}).get('write_ms'))}"),
            ("ms per decoded token with no expert read in flight, GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('disk_idle_ms'))} / {f1((r.get('ours_cpu') or {}).get('disk_idle_ms'))}"),
            ("ms per decoded token from each MoE layer's last read landing to its compute handed over (tail), GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('tail_ms'))} / {f1((r.get('ours_cpu') or {}).get('tail_ms'))}"),
            ("ms per decoded token from a MoE layer's call to the next layer's reads going out (lead), GPU / CPU",
             lambda r: f"{f1(r['ours_gpu'].get('lead_ms'))} / {f1((r.get('ours_cpu') or {}).get('lead_ms'))}"),
            ("decode hit rate", lambda r: f1(100 * r["ours_gpu"]["decode_hit_rate"], 1) + "%" if r["ours_gpu"].get("decode_hit_rate") is not None else "—"),
            ("MB read per decoded token", lambda r: f1((r["ours_gpu"].get("decode_bytes_per_token") or 0) / 1e6, 1)),
            ("expert reads GB/s (ours, decode)", lambda r: f1(r["ours_gpu"].get("decode_read_gbs"), 2)),
            ("disk O_DIRECT GB/s (4 MiB x 16)", lambda r: f1(r.get("disk_read_gbs"), 2)),
            ("disk-bound limit tok/s", lambda r: f1(r.get("disk_limit_tps"))),
            ("GPU decode / disk-bound limit", lambda r: ratio(r["ours_gpu"]["decode"], r.get("disk_limit_tps"))),
            ("GPU prefill tok/s", lambda r: f1(r["ours_gpu"]["prefill"])),
            ("peak GPU memory MiB / host RSS MiB", lambda r: f"{r['ours_gpu']['gpu_mib'] if r['ours_gpu']['gpu_mib'] is not None else '—'} / {mib(r['ours_gpu']['rss_bytes'])}"),
        ]
        if any(r.get("peer") for r in res):
            rows.append(("llama.cpp Vulkan, all 64 resident: decode / prefill tok/s",
                         lambda r: f"{f1(r['peer'].get('decode'))} / {f1(r['peer'].get('prefill'))}" if r.get("peer") else "—"))
        for lab, fn in rows:
            L.append(f"| {lab} | " + " | ".join(fn(r) for r in res) + " |")
        L.append("")
    t = [f"{r['key']}: synth {r.get('synth_s', 0)} s" + (f", GGUF {r['convert_s']} s" if r.get("convert_s") else "") for r in results]
    L.append(f"Time on the machine: {meta['elapsed_s']:.0f} s in all ({'; '.join(t)}).")
    return "\n".join(L)
