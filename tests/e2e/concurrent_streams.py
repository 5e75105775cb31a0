#!/usr/bin/python3
"""Sends N concurrent sampled, streamed completions of T tokens to a running cluster's router and
counts how many completed, ended early (EOS), stalled past the timeout or failed: a quick load
check by hand. (It reproduced issue 21's stall: bytes that form no UTF-8 character, sent in a
protobuf string, failed to parse at the router and stalled their stream; the e2e suite's
test_sampled_long_streams_all_finish_with_well_formed_text guards it now.)

  tests/e2e/concurrent_streams.py --base http://127.0.0.1:8000 --streams 16 --tokens 128
Exit status 1 when any stream stalled or failed.
"""
import argparse
import collections
import concurrent.futures
import json
import sys
import urllib.request


def one(base, i, tokens, timeout):
    body = {"model": "strata-tiny", "prompt": "tide storm harbour lamp " * 40 + " %d" % i,
            "max_tokens": tokens, "temperature": 1.0, "seed": 1, "stream": True,
            "cache_salt": "s-%d" % i, "stream_options": {"include_usage": True}}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    received = 0
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if line == "data: [DONE]":
                    return "completed" if received >= tokens else "ended early (EOS)"
                if line.startswith("data: ") and '"finish_reason":null' in line:
                    received += 1
    except TimeoutError:
        return "stalled after %d tokens" % received
    except OSError as e:
        return "failed: %s" % e
    return "no [DONE]"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=60)
    a = ap.parse_args()
    with concurrent.futures.ThreadPoolExecutor(a.streams) as pool:
        results = list(pool.map(lambda i: one(a.base, i, a.tokens, a.timeout), range(a.streams)))
    counts = collections.Counter(r if not r.startswith("stalled") else "stalled" for r in results)
    for r in results:
        if r.startswith(("stalled", "failed", "no ")):
            print(r)
    print(dict(counts))
    return 0 if all(r == "completed" or r.startswith("ended") for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
