#!/usr/bin/python3
"""A multi-turn chat workload against a running Strata cluster (deploy/local/cluster.sh up).

For every turn it prints the time to first token, the prompt tokens served from the cache, the
bytes the prefill node shipped to the decode node (blocks, the full-precision window of the last
partial chunk, headers) against the prompt's KV at fp16, and which prefill and
decode nodes served it (read from the nodes' /metrics before and after the turn). Then it checks
every reply against single-process `strata generate` with the same codec (greedy): the cluster
must produce the same text. Exit status 1 on any mismatch or error.

  tools/cluster_demo.py --cluster DIR/cluster.json --strata build/tools/strata
Standard library only (Debian's /usr/bin/python3).
"""
import argparse
import json
import re
import subprocess
import sys
import time
import urllib.request

SYSTEM = (
    "You are the librarian of a small town by the sea. The library keeps maps of the coast, "
    "the logs of the fishing boats since the old harbour was built, letters between the "
    "lighthouse keepers, and a shelf of books about the weather. Visitors ask about tides, "
    "storms, shipwrecks and the families who lived on the cliffs. Answer briefly and kindly, "
    "and when you do not know, say which shelf might hold the answer. The reading room opens "
    "at nine and closes at five; children may borrow three books at a time; maps never leave "
    "the building. The lighthouse was built of granite from the quarry behind the church, and "
    "its lamp was first lit on a winter night when the harbour was full of boats sheltering "
    "from a gale."
)

CONVERSATIONS = [
    ["When does the reading room open?", "Can my daughter borrow the coast maps?",
     "Tell me about the lighthouse."],
    ["Who wrote the letters on the second shelf?", "Were there storms in the old logs?",
     "Where did the granite come from?"],
]


def render_llama3(messages):
    """The bundled model's chat template (Llama 3), as the router renders it."""
    out = ""
    for i, m in enumerate(messages):
        content = "<|start_header_id|>" + m["role"] + "<|end_header_id|>\n\n" + \
            m["content"].strip() + "<|eot_id|>"
        if i == 0:
            content = "<|begin_of_text|>" + content
        out += content
    return out + "<|start_header_id|>assistant<|end_header_id|>\n\n"


def scrape(address):
    """Prometheus text of http://address/metrics as {name{labels}: value}."""
    try:
        with urllib.request.urlopen("http://%s/metrics" % address, timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key, _, value = line.rpartition(" ")
        try:
            values[key] = float(value)
        except ValueError:
            pass
    return values


def metric_sum(values, name):
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))


def ok_requests(values, prefix):
    return sum(v for k, v in values.items()
               if k.startswith(prefix + "_requests_total") and 'result="ok"' in k)


def chat(base, model, messages, max_tokens):
    body = json.dumps({"model": model, "messages": messages, "max_tokens": max_tokens,
                       "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    ttft = None
    text = ""
    usage = None
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError("stream error: %s" % event["error"])
            for choice in event.get("choices", []):
                piece = choice.get("delta", {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.monotonic() - t0
                text += piece
            if event.get("usage"):
                usage = event["usage"]
    return text, usage, ttft if ttft is not None else time.monotonic() - t0


def solo(strata, spec, prompt, max_tokens):
    """`strata generate` with the cluster's codec: the reference output."""
    args = [strata, "generate", "--model", spec["model"], "--codec", spec["codec"],
            "--kv_chunk_tokens", str(spec["chunk_tokens"]), "--max_tokens", str(max_tokens),
            "--prompt", prompt]
    if spec.get("calibration"):
        args += ["--calibration", spec["calibration"]]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    assert out.startswith(prompt), "strata generate did not echo the prompt"
    return out[len(prompt):-1] if out.endswith("\n") else out[len(prompt):]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cluster", required=True, help="the cluster file")
    ap.add_argument("--strata", required=True, help="the strata binary (for the check)")
    ap.add_argument("--max_tokens", type=int, default=24)
    ap.add_argument("--store_metrics", default="", help="host:port of the store's /metrics")
    args = ap.parse_args()
    with open(args.cluster) as f:
        spec = json.load(f)
    base = "http://" + spec["router"]["http"]
    with urllib.request.urlopen(base + "/v1/models", timeout=5) as r:
        model = json.load(r)["data"][0]["id"]
    nodes = [n for n in spec["nodes"] if n.get("metrics")]
    with open(spec["model"] + "/config.json") as f:
        config = json.load(f)
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    # K and V of every layer at 2 bytes per element: what shipping the prompt's KV at fp16 costs.
    fp16_per_token = config["num_hidden_layers"] * kv_heads * head_dim * 2 * 2
    print("cluster: %s, codec %s, chunks of %d tokens, %d prefill + %d decode nodes" % (
        base, spec["codec"], spec["chunk_tokens"],
        sum(n["role"] == "prefill" for n in spec["nodes"]),
        sum(n["role"] == "decode" for n in spec["nodes"])))
    print("%-6s %-5s %7s %9s %8s %12s %12s %6s  %-10s %-10s" % (
        "conv", "turn", "prompt", "cached", "TTFT ms", "KV shipped", "fp16 KV", "ratio",
        "prefill", "decode"))
    failures = 0
    checks = []
    for c, turns in enumerate(CONVERSATIONS):
        messages = [{"role": "system", "content": SYSTEM}]
        for t, question in enumerate(turns):
            messages.append({"role": "user", "content": question})
            before = {n["id"]: scrape(n["metrics"]) for n in nodes}
            try:
                reply, usage, ttft = chat(base, model, messages, args.max_tokens)
            except Exception as e:  # noqa: BLE001 - report and count any failure
                print("conv %d turn %d: FAILED: %s" % (c, t, e))
                failures += 1
                break
            time.sleep(0.2)  # the decode node's Put and the metrics settle
            after = {n["id"]: scrape(n["metrics"]) for n in nodes}
            shipped = 0.0
            served = {"prefill": "?", "decode": "?"}
            for n in nodes:
                prefix = "strata_" + n["role"]
                if ok_requests(after[n["id"]], prefix) > ok_requests(before[n["id"]], prefix):
                    served[n["role"]] = n["id"]
                if n["role"] == "prefill":
                    shipped += metric_sum(after[n["id"]], "strata_prefill_bytes_shipped_total") - \
                        metric_sum(before[n["id"]], "strata_prefill_bytes_shipped_total")
            fp16 = (usage or {}).get("prompt_tokens", 0) * fp16_per_token
            cached = (usage or {}).get("prompt_tokens_details", {}).get("cached_tokens", 0)
            print("%-6d %-5d %7d %9d %8.1f %12d %12d %6s  %-10s %-10s" % (
                c, t, (usage or {}).get("prompt_tokens", 0), cached, ttft * 1e3, shipped, fp16,
                "%.2fx" % (fp16 / shipped) if shipped else "-", served["prefill"],
                served["decode"]))
            checks.append((c, t, render_llama3(messages), reply))
            messages.append({"role": "assistant", "content": reply})
    print("checking every reply against single-process `strata generate --codec %s` ..." %
          spec["codec"])
    for c, t, prompt, reply in checks:
        expected = solo(args.strata, spec, prompt, args.max_tokens)
        if expected != reply:
            failures += 1
            print("conv %d turn %d: MISMATCH\n  cluster: %r\n  solo:    %r" % (c, t, reply,
                                                                             expected))
    if failures:
        print("cluster demo: %d failure(s)" % failures)
        return 1
    print("cluster demo: ok: %d turns, every reply equals single-process generation" %
          len(checks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
