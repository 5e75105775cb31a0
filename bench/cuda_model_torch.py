#!/usr/bin/env python3
"""PyTorch at cuda_model_bench's shapes: the reference a user would otherwise write for an
8B-shaped Llama (32 layers, hidden 4096, 32 query heads over 8 KV heads, head dim 128, SwiGLU
14336, vocabulary 128256), random bf16 weights, bf16 KV in a static cache, attention by
scaled_dot_product_attention (enable_gqa), eager mode. With Hugging Face transformers installed
it times LlamaForCausalLM from the same config too (sdpa, StaticCache filled with random values);
without it, or with an API this script does not know, only the plain PyTorch model, saying why.

  - decode: one step at batch 1 / 16 / 64 x context 4k / 32k (shapes whose cache does not fit are
    skipped, saying so);
  - prefill: a 4k prompt at batch 1.
Medians of runs timed with CUDA events.

  bench/cuda_model_torch.py [--out DIR] [--runs N] [--quick]
Needs PyTorch with CUDA (the lent GPU machines have it; this one does not: it says so, exits 1).
"""
import argparse
import datetime
import json
import os
import sys


def time_hf(torch, dev, dt, timed, batches, contexts, runs, shape):
    """LlamaForCausalLM at `shape` with random bf16 weights made on the device: one decode step
    over a StaticCache filled with random values at each batch x context, and a 4k prefill
    (last token's logits only). Written for transformers 4.5x and 5.x's StaticCache."""
    from transformers import LlamaConfig, LlamaForCausalLM
    try:
        from transformers import StaticCache
    except ImportError:
        from transformers.cache_utils import StaticCache
    L, HS, H, KH, D, FF, V = shape
    cfg = LlamaConfig(vocab_size=V, hidden_size=HS, intermediate_size=FF, num_hidden_layers=L,
                      num_attention_heads=H, num_key_value_heads=KH, head_dim=D,
                      rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=131072,
                      attn_implementation="sdpa")
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dt)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    out = []
    for batch in batches:
        for context in contexts:
            cache_bytes = 2 * L * batch * KH * (context + 16) * D * 2
            if cache_bytes > torch.cuda.mem_get_info()[0] - (3 << 30):
                out.append(dict(batch=batch, context=context, fits=False))
                continue
            try:
                cache = StaticCache(config=cfg, max_batch_size=batch, max_cache_len=context + 16,
                                    device=dev, dtype=dt)
            except TypeError:
                cache = StaticCache(config=cfg, max_cache_len=context + 16)
            ids = torch.full((batch, 1), 1000, device=dev, dtype=torch.long)
            at = torch.tensor([context], device=dev)

            def step():
                return model(input_ids=ids, past_key_values=cache, cache_position=at,
                             use_cache=True)
            with torch.no_grad():
                step()  # a cache that makes its tensors on first use has them now
                tensors = list(getattr(cache, "key_cache", [])) + list(
                    getattr(cache, "value_cache", []))
                for layer in getattr(cache, "layers", []):
                    tensors += [t for t in (getattr(layer, "keys", None),
                                            getattr(layer, "values", None)) if t is not None]
                for t in tensors:
                    t.uniform_(-1, 1)  # never time on zeros
                ms = timed(step, runs)
            out.append(dict(batch=batch, context=context, fits=True, ms=ms,
                            tokens_per_s=batch / (ms * 1e-3)))
            del cache
            torch.cuda.empty_cache()
    prompt = torch.randint(0, V, (1, 4096), device=dev)
    with torch.no_grad():
        try:
            prefill_ms = timed(lambda: model(input_ids=prompt, use_cache=False, logits_to_keep=1),
                               max(3, runs // 3))
        except TypeError:
            prefill_ms = timed(lambda: model(input_ids=prompt, use_cache=False),
                               max(3, runs // 3))
    del model
    torch.cuda.empty_cache()
    return out, prefill_ms


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--runs", type=int, default=10)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("cuda_model_torch: no PyTorch here: nothing to measure", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("cuda_model_torch: no GPU here: nothing to measure", file=sys.stderr)
        return 1
    dev = torch.device("cuda")
    dt = torch.bfloat16
    L, HS, H, KH, D, FF, V = 32, 4096, 32, 8, 128, 14336, 128256
    torch.manual_seed(1)

    def timed(fn, runs):
        times = []
        for r in range(runs + 2):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            if r >= 2:
                times.append(a.elapsed_time(b))
        times.sort()
        return times[len(times) // 2]

    def mat(o, i):
        return (torch.rand(o, i, device=dev, dtype=dt) * 2 - 1) / i ** 0.5

    layers = [dict(wq=mat(H * D, HS), wk=mat(KH * D, HS), wv=mat(KH * D, HS), wo=mat(HS, H * D),
                   wg=mat(FF, HS), wu=mat(FF, HS), wd=mat(HS, FF)) for _ in range(L)]
    embed, head = mat(V, HS), mat(V, HS)
    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))

    def rms(x):
        return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)).to(dt)

    def rope(x, pos):  # x [B, heads, T, D], pos [T]
        ang = pos.float()[:, None] * inv[None, :]
        c, s = torch.cos(ang).to(dt), torch.sin(ang).to(dt)
        x1, x2 = x[..., : D // 2], x[..., D // 2:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    def forward(tokens, pos, ck, cv, causal):
        B, T = tokens.shape
        x = embed[tokens]
        end = int(pos[-1]) + 1
        for li, w in enumerate(layers):
            h = rms(x)
            q = (h @ w["wq"].T).view(B, T, H, D).transpose(1, 2)
            k = (h @ w["wk"].T).view(B, T, KH, D).transpose(1, 2)
            v = (h @ w["wv"].T).view(B, T, KH, D).transpose(1, 2)
            q, k = rope(q, pos), rope(k, pos)
            ck[li][:, :, pos] = k
            cv[li][:, :, pos] = v
            a = F.scaled_dot_product_attention(q, ck[li][:, :, :end], cv[li][:, :, :end],
                                               is_causal=causal, enable_gqa=True)
            x = x + a.transpose(1, 2).reshape(B, T, H * D) @ w["wo"].T
            h = rms(x)
            x = x + (F.silu(h @ w["wg"].T) * (h @ w["wu"].T)) @ w["wd"].T
        return (rms(x[:, -1]) @ head.T).argmax(-1)

    free = torch.cuda.mem_get_info()[0]
    rows = []
    batches, contexts = ([16], [32768]) if args.quick else ([1, 16, 64], [4096, 32768])
    for batch in batches:
        for context in contexts:
            cache_bytes = 2 * L * batch * KH * (context + 16) * D * 2
            if cache_bytes > torch.cuda.mem_get_info()[0] - (3 << 30):
                rows.append(dict(batch=batch, context=context, fits=False))
                continue
            ck = [torch.rand(batch, KH, context + 16, D, device=dev, dtype=dt) for _ in range(L)]
            cv = [torch.rand(batch, KH, context + 16, D, device=dev, dtype=dt) for _ in range(L)]
            tokens = torch.full((batch, 1), 1000, device=dev, dtype=torch.long)
            pos = torch.tensor([context], device=dev)
            with torch.no_grad():
                ms = timed(lambda: forward(tokens, pos, ck, cv, False), args.runs)
            rows.append(dict(batch=batch, context=context, fits=True, ms=ms,
                             tokens_per_s=batch / (ms * 1e-3)))
            del ck, cv
            torch.cuda.empty_cache()
    # Prefill: a 4k prompt.
    ck = [torch.empty(1, KH, 4096, D, device=dev, dtype=dt) for _ in range(L)]
    cv = [torch.empty(1, KH, 4096, D, device=dev, dtype=dt) for _ in range(L)]
    tokens = torch.randint(0, V, (1, 4096), device=dev)
    pos = torch.arange(4096, device=dev)
    with torch.no_grad():
        prefill_ms = timed(lambda: forward(tokens, pos, ck, cv, True), max(3, args.runs // 3))
    del ck, cv, layers, embed, head
    torch.cuda.empty_cache()
    hf = "transformers not installed: the plain PyTorch model only"
    hf_rows, hf_prefill_ms = [], None
    try:
        import transformers
        hf = "transformers %s: LlamaForCausalLM (sdpa, StaticCache) timed below" % (
            transformers.__version__)
        try:
            hf_rows, hf_prefill_ms = time_hf(torch, dev, dt, timed, batches, contexts, args.runs,
                                             (L, HS, H, KH, D, FF, V))
        except Exception as e:  # an API this script does not know: say so, keep the rest
            hf = "transformers %s: LlamaForCausalLM could not be timed (%s: %s)" % (
                transformers.__version__, type(e).__name__, str(e).splitlines()[0][:200])
    except ImportError:
        pass

    name = torch.cuda.get_device_name(0)
    date = datetime.date.today().isoformat()
    commit = os.environ.get("STRATA_COMMIT", "unknown")
    lines = ["cuda_model_torch: %s, torch %s, %s, commit %s" % (name, torch.__version__, date, commit),
             "8B shape, random bf16 weights, bf16 static KV cache, SDPA (enable_gqa), eager; " + hf,
             "", "%-6s %8s %10s %12s" % ("batch", "context", "time ms", "tokens/s")]
    for r in rows:
        if not r["fits"]:
            lines.append("%-6d %8d   does not fit" % (r["batch"], r["context"]))
        else:
            lines.append("%-6d %8d %10.3f %12.1f" % (r["batch"], r["context"], r["ms"],
                                                     r["tokens_per_s"]))
    lines.append("")
    lines.append("prefill of 4096 tokens: %.1f ms, %.0f tokens/s" % (prefill_ms,
                                                                    4096 / (prefill_ms * 1e-3)))
    if hf_rows:
        lines += ["", "Hugging Face LlamaForCausalLM, the same shape:",
                  "%-6s %8s %10s %12s" % ("batch", "context", "time ms", "tokens/s")]
        for r in hf_rows:
            if not r["fits"]:
                lines.append("%-6d %8d   does not fit" % (r["batch"], r["context"]))
            else:
                lines.append("%-6d %8d %10.3f %12.1f" % (r["batch"], r["context"], r["ms"],
                                                         r["tokens_per_s"]))
        if hf_prefill_ms:
            lines.append("prefill of 4096 tokens: %.1f ms, %.0f tokens/s" % (
                hf_prefill_ms, 4096 / (hf_prefill_ms * 1e-3)))
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        base = os.path.join(args.out, "cuda_model_torch-%s-%s-%s" % (name.replace(" ", "_"),
                                                                     date, commit))
        with open(base + ".txt", "w") as f:
            f.write(text)
        with open(base + ".json", "w") as f:
            json.dump(dict(device=name, torch=torch.__version__, date=date, commit=commit,
                           decode=rows, prefill_ms=prefill_ms, hf=hf, hf_decode=hf_rows,
                           hf_prefill_ms=hf_prefill_ms), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
