#!/usr/bin/python3
"""End-to-end tests of a Strata cluster: real processes (strata-store, strata-prefill,
strata-decode, strata-router) on loopback, started by deploy/local/cluster.sh, driven through the
OpenAI-compatible HTTP API with real HTTP clients.

  tests/e2e/cluster_e2e_test.py --build build [--netns HUB] [unittest args, e.g. -k Reuse]
With --netns (root), every process of a cluster runs on a host of its own (a network namespace,
deploy/netns/hosts.sh) and the tests run in the hub namespace HUB: blocks, gRPC and HTTP cross
veth links instead of loopback.
Standard library only (Debian's /usr/bin/python3).
"""
import argparse
import concurrent.futures
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import unittest
import urllib.error
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.path.join(ROOT, "build")
MODEL = os.path.join(ROOT, "models", "strata-tiny")
CHUNK = 32
NETNS = ""           # --netns: the hub namespace the tests run in ("" on loopback)
HERE = "127.0.0.1"   # the address processes the tests start themselves listen on

PROMPTS = [
    "The lighthouse keeper wrote in his log that the storm",
    "Once upon a time, in a village by the sea, there lived",
    "The old map showed a path from the church to the quarry, and",
    "In the morning the fishing boats left the harbour while",
]
LONG = (" The library keeps maps of the coast, the logs of the fishing boats since the old "
        "harbour was built, letters between the lighthouse keepers, and a shelf of books about "
        "the weather. Visitors ask about tides, storms, shipwrecks and the families who lived on "
        "the cliffs.")


def free_port_base():
    """A base port with free ports above it (cluster.sh uses base .. base+60, and with
    --host-stores and --shared-tier base+100.., base+150.., base+200.. and Redis's bus +10000).

    Below Linux's ephemeral range (32768-60999, /proc/sys/net/ipv4/ip_local_port_range), where
    the kernel picks the source ports of outgoing connections: a fixed port there can be taken
    by any process's connection between this check and the server's bind (a decode node's
    metrics port was, once). The shared tier's Redis ports (base+200.., their cluster bus
    +10000) stay below it too."""
    for _ in range(50):
        base = random.randrange(10000, 22000, 100)
        ok = True
        for p in (base, base + 1, base + 10, base + 11, base + 20, base + 21, base + 30,
                  base + 31, base + 40, base + 41, base + 50, base + 51, base + 60,
                  base + 101, base + 151, base + 200, base + 205, base + 10200, base + 10205):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free ports")


class Cluster:
    """A cluster started by deploy/local/cluster.sh in a temporary folder."""

    def __init__(self, codec, prefill=1, decode=1, calibration="", kv_budget="256M",
                 max_batch=32, chunk=None, extra=(), env=None, tls=False):
        """tls: mutual TLS and the cluster token (cluster.sh --tls, certificates in DIR/certs),
        HTTPS at the router (`base`, verified against `ca`); else every process is --insecure."""
        self.dir = tempfile.mkdtemp(prefix="strata-e2e.")
        self.ca = os.path.join(self.dir, "certs", "ca.crt") if tls else None
        self.codec = codec
        self.calibration = calibration
        self.port_base = free_port_base()
        self.http_port = self.port_base + 60
        args = [os.path.join(ROOT, "deploy/local/cluster.sh"), "up", "--dir", self.dir,
                "--codec", codec, "--chunk", str(chunk or CHUNK), "--prefill", str(prefill),
                "--decode", str(decode), "--port-base", str(self.port_base),
                "--http-port", str(self.http_port), "--kv-budget", kv_budget,
                "--max-batch", str(max_batch)]
        if calibration:
            args += ["--calibration", calibration]
        if NETNS:
            args += ["--netns", NETNS]
        if tls:
            args += ["--tls", os.path.join(self.dir, "certs")]
        args += list(extra)
        env = dict(os.environ, STRATA_BUILD_DIR=BUILD, **(env or {}))
        r = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
        if r.returncode != 0:
            raise RuntimeError("cluster up failed:\n" + r.stdout + r.stderr + self.logs())
        with open(os.path.join(self.dir, "cluster.json")) as f:
            self.spec = json.load(f)
        self.base = "%s://%s" % ("https" if tls else "http", self.spec["router"]["http"])
        # What verifies the router's HTTPS (None over plain HTTP).
        self.ssl = ssl.create_default_context(cafile=self.ca) if tls else None

    def router_metrics(self):
        """The router's metrics (on its HTTP port: HTTPS with tls)."""
        return scrape(self.base, self.ssl)

    def pids(self):
        out = {}
        with open(os.path.join(self.dir, "pids")) as f:
            for line in f:
                name, pid = line.split()
                out[name] = int(pid)
        return out

    def store_metrics(self):
        host, port = self.spec["store"].rsplit(":", 1)
        return "%s:%d" % (host, int(port) + 1)

    def hosts(self):
        """Where each process runs, as cluster.sh wrote it: name -> (namespace or "-", address)."""
        out = {}
        with open(os.path.join(self.dir, "hosts")) as f:
            for line in f:
                name, ns, address = line.split()
                out[name] = (ns, address)
        return out

    def address_of(self, name):
        """The address process `name` (store, store-1, redis, decode-0, ...) listens on."""
        return self.hosts()[name][1]

    def on_host(self, name, argv):
        """`argv` as it runs on the host of process `name` (store, router, decode-0, ...)."""
        if not NETNS:
            return list(argv)
        return ["ip", "netns", "exec", self.hosts()[name][0]] + list(argv)

    def node(self, node_id):
        return next(n for n in self.spec["nodes"] if n["id"] == node_id)

    def logs(self):
        text = ""
        logdir = os.path.join(self.dir, "logs")
        if os.path.isdir(logdir):
            for name in sorted(os.listdir(logdir)):
                with open(os.path.join(logdir, name), errors="replace") as f:
                    lines = f.readlines()
                text += "\n== %s (last 15 lines)\n%s" % (name, "".join(lines[-15:]))
        return text

    def down(self):
        subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "down", "--dir", self.dir],
                       capture_output=True, timeout=60)
        shutil.rmtree(self.dir, ignore_errors=True)


def http_json(url, body=None, timeout=60, method=None, context=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, json.load(r), dict(r.headers)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e), dict(e.headers)


def complete(cluster, prompt, max_tokens=16, stream=False, salt=None, timeout=120, **extra):
    """A /v1/completions request; returns (text, usage, events). Raises on an error event."""
    body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    if salt is not None:
        body["cache_salt"] = salt
    body.update(extra)
    if not stream:
        status, resp, _ = http_json(cluster.base + "/v1/completions", body, timeout,
                                    context=cluster.ssl)
        if status != 200:
            raise RuntimeError("HTTP %d: %s" % (status, resp))
        return resp["choices"][0]["text"], resp["usage"], None
    req = urllib.request.Request(cluster.base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text, usage, events = "", None, []
    with urllib.request.urlopen(req, timeout=timeout, context=cluster.ssl) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            events.append(data)
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError("stream error: %s" % event["error"])
            for c in event.get("choices", []):
                text += c.get("text", "")
            if event.get("usage"):
                usage = event["usage"]
    return text, usage, events


def solo(codec, prompt, max_tokens, calibration="", flags=()):
    """Single-process `strata generate` with the same codec and chunk size (greedy unless `flags`
    say otherwise, e.g. --temperature, --seed, the penalties)."""
    args = [os.path.join(BUILD, "tools/strata"), "generate", "--model", MODEL, "--codec", codec,
            "--kv_chunk_tokens", str(CHUNK), "--max_tokens", str(max_tokens), "--prompt", prompt]
    args += list(flags)
    if calibration:
        args += ["--calibration", calibration]
    out = subprocess.run(args, check=True, capture_output=True, text=True, timeout=120).stdout
    assert out.startswith(prompt)
    out = out[len(prompt):]
    return out[:-1] if out.endswith("\n") else out


def scrape(address, context=None):
    """The metrics at HOST:PORT over HTTP, or at a URL (https://... with `context`)."""
    url = address if "://" in address else "http://" + address
    with urllib.request.urlopen(url + "/metrics", timeout=5, context=context) as r:
        text = r.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            values[key] = float(value)
    return values


def metric(values, name, label=""):
    return sum(v for k, v in values.items()
               if (k == name or k.startswith(name + "{")) and label in k)


_calibrations = {}


def calibration_for(codec):
    """A calibration made here, on the bundled model's calibration text (seconds)."""
    if codec not in _calibrations:
        path = os.path.join(tempfile.mkdtemp(prefix="strata-calib."), "calib.json")
        subprocess.run([os.path.join(BUILD, "tools/strata"), "calibrate", "--model", MODEL,
                        "--codec", codec, "--kv_chunk_tokens", str(CHUNK), "--text",
                        os.path.join(MODEL, "calibration.txt"), "--context", "256",
                        "--windows", "1", "--out", path],
                       check=True, capture_output=True, timeout=600)
        _calibrations[codec] = path
    return _calibrations[codec]


class CodecTest(unittest.TestCase):
    """Greedy output through the cluster equals single-process generation, token for token
    (compared as text), streaming and not, for every codec family."""

    def check_codec(self, codec, needs_calibration=False):
        calibration = calibration_for(codec) if needs_calibration else ""
        cluster = Cluster(codec, calibration=calibration)
        try:
            for i, prompt in enumerate(PROMPTS[:2]):
                prompt = prompt + LONG  # several chunks: blocks, not only the window
                expected = solo(codec, prompt, 20, calibration)
                text, usage, _ = complete(cluster, prompt, 20, stream=(i % 2 == 0))
                self.assertEqual(text, expected, "codec %s prompt %d" % (codec, i))
                self.assertEqual(usage["completion_tokens"] <= 20, True)
        except Exception:
            print(cluster.logs())
            raise
        finally:
            cluster.down()

    def test_fp16(self):
        self.check_codec("fp16")

    def test_kivi(self):
        self.check_codec("kivi:k2v2:g32")

    def test_gear(self):
        self.check_codec("gear:k2v2:g32:r4:s2")

    def test_zipcache(self):
        self.check_codec("zipcache:k2v2:h4:s10")

    def test_skvq_calibrated(self):
        self.check_codec("skvq:k2v2:g16", needs_calibration=True)

    def test_strata_mix_calibrated(self):
        self.check_codec("strata:b3", needs_calibration=True)


class ClusterTest(unittest.TestCase):
    """One 2-prefill, 2-decode cluster for the reuse, batching, fault and API tests."""

    @classmethod
    def setUpClass(cls):
        cls.codec = "kivi:k4v4:g32"
        cls.cluster = Cluster(cls.codec, prefill=2, decode=2)

    @classmethod
    def tearDownClass(cls):
        cls.cluster.down()

    def run(self, result=None):
        failures = len(result.failures) + len(result.errors) if result else 0
        out = super().run(result)
        if result and len(result.failures) + len(result.errors) > failures:
            print(self.cluster.logs())
        return out

    def test_second_turn_hits_the_first_turns_prefix_and_salts_never_share(self):
        c = self.cluster
        first = "Turn one." + LONG * 2
        text, usage, _ = complete(c, first, 12, salt="tenant-a")
        self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
        time.sleep(0.5)  # the Puts land after the reply
        second = first + text + " And then?"
        _, usage2, _ = complete(c, second, 12, salt="tenant-a")
        cached = usage2["prompt_tokens_details"]["cached_tokens"]
        self.assertGreater(cached, 0)
        self.assertEqual(cached % CHUNK, 0)
        self.assertLess(cached, usage2["prompt_tokens"])
        # Another tenant's salt: the same text finds nothing.
        _, usage3, _ = complete(c, second, 12, salt="tenant-b")
        self.assertEqual(usage3["prompt_tokens_details"]["cached_tokens"], 0)

    def test_prefix_stored_by_one_prefill_node_is_reused_by_the_other(self):
        # Two routers over the same nodes, each seeing one prefill node: the second request must
        # go to the other node and still hit what the first stored.
        c = self.cluster
        routers = []
        try:
            for keep in ("prefill-0", "prefill-1"):
                spec = json.loads(json.dumps(c.spec))
                spec["nodes"] = [n for n in spec["nodes"]
                                 if n["role"] == "decode" or n["id"] == keep]
                # Each router is up before the next port is picked, and the ports differ: a
                # second router given the first one's port failed to listen while the first
                # answered its health checks and took both requests (CI, once).
                port = free_port_base()
                while any(base.endswith(":%d" % port) for _, base in routers):
                    port = free_port_base()
                spec["router"]["http"] = "127.0.0.1:%d" % port
                path = os.path.join(c.dir, "only-%s.json" % keep)
                with open(path, "w") as f:
                    json.dump(spec, f)
                with open(os.path.join(c.dir, "logs", "router-%s.log" % keep), "w") as log:
                    p = subprocess.Popen([os.path.join(BUILD, "router/strata-router"),
                                          "--cluster", path, "--insecure"], stdout=log,
                                         stderr=subprocess.STDOUT)
                routers.append((p, "http://127.0.0.1:%d" % port))
                wait_healthy(routers[-1][1])
                self.assertIsNone(p.poll(), "router for %s exited; see its log" % keep)
            prompt = "Shared prefix across nodes." + LONG * 2
            first = CompleteAt(routers[0][1], prompt, 8)
            before = scrape(c.node("prefill-1")["metrics"])
            time.sleep(0.5)
            second = CompleteAt(routers[1][1], prompt + " More.", 8)
            self.assertEqual(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertGreater(second["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            # The node counts the request once its blocks are shipped and its new chunks Put to
            # the store, which can take seconds after the client's reply on a loaded machine.
            deadline = time.time() + 30
            while True:
                after = scrape(c.node("prefill-1")["metrics"])
                if metric(after, "strata_prefill_cached_tokens_total") > \
                        metric(before, "strata_prefill_cached_tokens_total") or \
                        time.time() > deadline:
                    break
                time.sleep(0.1)
            self.assertGreater(metric(after, "strata_prefill_cached_tokens_total"),
                               metric(before, "strata_prefill_cached_tokens_total"))
        finally:
            for p, _ in routers:
                p.terminate()
                p.wait(timeout=30)

    def test_32_concurrent_streams_each_equal_their_solo_output(self):
        c = self.cluster
        prompts = ["%s (%d)%s" % (PROMPTS[i % len(PROMPTS)], i, LONG if i % 3 == 0 else "")
                   for i in range(32)]
        alone = [complete(c, p, 12, salt="batch")[0] for p in prompts]
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            together = list(pool.map(lambda p: complete(c, p, 12, stream=True, salt="batch")[0],
                                     prompts))
        self.assertEqual(together, alone)
        # The decode nodes batched: some step ran more than one sequence.
        batched = sum(metric(scrape(c.node(d)["metrics"]), "strata_decode_batch_size_sum")
                      for d in ("decode-0", "decode-1"))
        steps = sum(metric(scrape(c.node(d)["metrics"]), "strata_decode_batch_size_count")
                    for d in ("decode-0", "decode-1"))
        self.assertGreater(batched / max(steps, 1), 1.0)

    def test_penalties_and_min_p_equal_single_process_generation(self):
        c = self.cluster
        prompt = PROMPTS[1] + LONG
        fields = {"presence_penalty": 0.4, "frequency_penalty": 0.6, "repetition_penalty": 1.3}
        flags = ["--%s=%s" % (k, v) for k, v in fields.items()]
        plain = solo(self.codec, prompt, 24)
        greedy = solo(self.codec, prompt, 24, flags=flags)
        self.assertNotEqual(greedy, plain, "the penalties changed nothing: a weak test")
        for stream in (False, True):
            text, _, _ = complete(c, prompt, 24, stream=stream, salt="pen", **fields)
            self.assertEqual(text, greedy, "stream=%s" % stream)
        # Sampled: the prefill node draws the first token and the decode node the rest, with the
        # request's seed; min_p and the penalties apply on both.
        sampled = dict(fields, temperature=0.9, seed=11, min_p=0.05)
        want = solo(self.codec, prompt, 24, flags=flags + ["--temperature=0.9", "--seed=11",
                                                             "--min_p=0.05"])
        for stream in (False, True):
            text, _, _ = complete(c, prompt, 24, stream=stream, salt="pen-s", **sampled)
            self.assertEqual(text, want, "sampled, stream=%s" % stream)

    def test_n_choices_share_one_computation_of_the_prompt(self):
        c = self.cluster
        prompt = PROMPTS[3] + LONG * 2
        prefills = ("prefill-0", "prefill-1")
        before = sum(metric(scrape(c.node(p)["metrics"]), "strata_prefill_cached_tokens_total")
                     for p in prefills)
        body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0.9,
                "seed": 5, "n": 3, "cache_salt": "choices"}
        status, resp, _ = http_json(c.base + "/v1/completions", body)
        self.assertEqual(status, 200, resp)
        self.assertEqual([ch["index"] for ch in resp["choices"]], [0, 1, 2])
        # Choice i is sampled with seed 5 + i: each equals single-process generation with it.
        for i, ch in enumerate(resp["choices"]):
            self.assertEqual(ch["text"], solo(self.codec, prompt, 10, flags=[
                "--temperature=0.9", "--seed=%d" % (5 + i)]), "choice %d" % i)
        self.assertEqual(len({ch["text"] for ch in resp["choices"]}), 3)
        usage = resp["usage"]
        self.assertEqual(usage["completion_tokens"], 30)
        # The prompt was computed once: choices 1 and 2 adopted its full chunks.
        tokens = usage["prompt_tokens"]
        after = sum(metric(scrape(c.node(p)["metrics"]), "strata_prefill_cached_tokens_total")
                    for p in prefills)
        self.assertEqual(after - before, 2 * ((tokens - 1) // CHUNK) * CHUNK)
        # Streaming chat, greedy: two choices, told apart by index, each the solo output.
        body = {"model": "strata-tiny", "messages": [{"role": "user", "content": "Tell me"}],
                "max_tokens": 6, "temperature": 0, "n": 2, "stream": True,
                "stream_options": {"include_usage": True}}
        req = urllib.request.Request(c.base + "/v1/chat/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        texts, finishes, usage = {}, {}, None
        with urllib.request.urlopen(req, timeout=60) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                for ch in ev.get("choices", []):
                    texts[ch["index"]] = texts.get(ch["index"], "") + \
                        ch["delta"].get("content", "")
                    if ch["finish_reason"]:
                        finishes[ch["index"]] = ch["finish_reason"]
                if ev.get("usage"):
                    usage = ev["usage"]
        self.assertEqual(sorted(finishes), [0, 1])
        self.assertEqual(texts[0], texts[1])
        self.assertEqual(usage["completion_tokens"], 12)

    def test_logprobs_and_echo_as_openai_and_lm_eval_use_them(self):
        c = self.cluster
        prompt = PROMPTS[2] + LONG
        body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0,
                "logprobs": 3, "cache_salt": "lp"}
        status, resp, _ = http_json(c.base + "/v1/completions", body)
        self.assertEqual(status, 200, resp)
        choice = resp["choices"][0]
        lp = choice["logprobs"]
        self.assertEqual(choice["text"], solo(self.codec, prompt, 12))
        n = resp["usage"]["completion_tokens"]
        self.assertEqual(len(lp["tokens"]), n)
        self.assertEqual(len(lp["token_logprobs"]), n)
        for tok, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            self.assertLessEqual(logprob, 0)
            self.assertEqual(len(top), 3)
            values = list(top.values())
            self.assertEqual(values, sorted(values, reverse=True))
            # Greedy: the generated token is the most likely one.
            self.assertAlmostEqual(values[0], logprob, places=5)
            self.assertIn(tok, top)
        self.assertEqual("".join(lp["tokens"]), choice["text"])
        # Streaming gives the same logprobs, a token per event.
        streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
        _, _, events = complete(c, prompt, 12, stream=True, salt="lp", logprobs=3)
        for e in events:
            if e == "[DONE]":
                continue
            ev = json.loads(e)
            for ch in ev.get("choices", []):
                if ch.get("logprobs"):
                    for k in streamed:
                        streamed[k] += ch["logprobs"][k]
        self.assertEqual(streamed["tokens"], lp["tokens"])
        self.assertEqual(streamed["token_logprobs"], lp["token_logprobs"])
        self.assertEqual(streamed["text_offset"], lp["text_offset"])
        # lm-evaluation-harness's loglikelihood: echo the prompt with its tokens' logprobs. The
        # generated text sent back as part of a prompt gets (nearly) the logprobs it was
        # generated with: prefill and decode compute the same model over the same blocks.
        body = {"model": "strata-tiny", "prompt": prompt + choice["text"], "max_tokens": 1,
                "temperature": 0, "logprobs": 1, "echo": True, "cache_salt": "lp"}
        status, echoed, _ = http_json(c.base + "/v1/completions", body)
        self.assertEqual(status, 200, echoed)
        e = echoed["choices"][0]
        self.assertTrue(e["text"].startswith(prompt + choice["text"]))
        elp = e["logprobs"]
        prompt_tokens = echoed["usage"]["prompt_tokens"]
        self.assertEqual(len(elp["tokens"]), prompt_tokens + 1)
        self.assertIsNone(elp["token_logprobs"][0])  # nothing predicts the first token
        self.assertIsNone(elp["top_logprobs"][0])
        self.assertEqual(elp["text_offset"][0], 0)
        tail = elp["token_logprobs"][prompt_tokens - n:prompt_tokens]
        self.assertEqual(elp["tokens"][prompt_tokens - n:prompt_tokens], lp["tokens"])
        for a, b in zip(tail, lp["token_logprobs"]):
            self.assertAlmostEqual(a, b, delta=0.05)
        # Chat: logprobs true with top_logprobs, content entries with bytes.
        body = {"model": "strata-tiny", "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 5, "temperature": 0, "logprobs": True, "top_logprobs": 2}
        status, chat, _ = http_json(c.base + "/v1/chat/completions", body)
        self.assertEqual(status, 200, chat)
        content = chat["choices"][0]["logprobs"]["content"]
        self.assertEqual(len(content), chat["usage"]["completion_tokens"])
        for entry in content:
            self.assertEqual(len(entry["top_logprobs"]), 2)
            self.assertEqual(bytes(entry["bytes"]).decode("utf-8", "replace"), entry["token"])
        self.assertEqual(b"".join(bytes(e["bytes"]) for e in content).decode(),
                         chat["choices"][0]["message"]["content"])

    def test_sampled_long_streams_all_finish_with_well_formed_text(self):
        # Sampling at temperature 1 makes the byte-level model emit bytes that form no UTF-8
        # character. They once reached the gRPC stream as an ill-formed protobuf string, which the
        # router could not parse: the stream stalled. Every stream must finish, with exactly
        # max_tokens tokens (ignore_eos), the same text as the same seed unstreamed, and any
        # ill-formed bytes shown as U+FFFD.
        c = self.cluster

        def one(i):
            extra = {"temperature": 1.0, "seed": 100 + i, "ignore_eos": True}
            prompt = "%s (%d)" % (PROMPTS[i % len(PROMPTS)], i)
            streamed, usage, events = complete(c, prompt, 128, stream=True, salt="sampled-%d" % i,
                                               timeout=60, **extra)
            unstreamed = complete(c, prompt, 128, salt="sampled-%d" % i, timeout=60, **extra)[0]
            return streamed, usage, events, unstreamed

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
        replaced = 0
        for streamed, usage, events, unstreamed in results:
            self.assertEqual(events[-1], "[DONE]")
            self.assertEqual(usage["completion_tokens"], 128)
            self.assertEqual(streamed, unstreamed)
            replaced += streamed.count("\ufffd")
        self.assertGreater(replaced, 0, "no stream exercised ill-formed bytes; pick other seeds")

    def test_the_dashboard_uses_only_metrics_the_processes_export(self):
        # deploy/monitoring/grafana-strata.json against what the router, a prefill node, a decode
        # node and the store serve on /metrics (metric families, from their TYPE lines).
        c = self.cluster
        complete(c, PROMPTS[0], 4)
        store_metrics = c.store_metrics()
        exported = set()
        for address in (c.base.replace("http://", ""), c.node("prefill-0")["metrics"],
                        c.node("decode-0")["metrics"], store_metrics):
            with urllib.request.urlopen("http://%s/metrics" % address, timeout=5) as r:
                for line in r.read().decode().splitlines():
                    if line.startswith("# TYPE "):
                        exported.add(line.split()[2])
        with open(os.path.join(ROOT, "deploy/monitoring/grafana-strata.json")) as f:
            dashboard = json.load(f)
        used = set()
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                used.update(re.findall(r"strata_[a-z0-9_]+", target["expr"]))
        self.assertGreater(len(used), 20)
        missing = sorted(u for u in used
                         if u not in exported and re.sub(r"_(bucket|sum|count)$", "", u)
                         not in exported)
        self.assertEqual(missing, [], "the dashboard uses metrics nobody exports")

    def test_streams_end_with_done_and_usage(self):
        text, usage, events = complete(self.cluster, PROMPTS[0], 8, stream=True)
        self.assertEqual(events[-1], "[DONE]")
        self.assertEqual(usage["completion_tokens"], 8)
        self.assertGreater(usage["prompt_tokens"], 0)
        self.assertEqual(text, complete(self.cluster, PROMPTS[0], 8)[0])

    def test_layers_stream_to_the_decode_node_while_later_layers_compute(self):
        # Observed, not assumed: the prefill node counts requests whose decode node acknowledged
        # (held) layer-0 blocks before the last layer was computed.
        c = self.cluster
        def early():
            return sum(metric(scrape(c.node(p)["metrics"]), "strata_prefill_streamed_early_total")
                       for p in ("prefill-0", "prefill-1"))
        before = early()
        for i in range(3):
            complete(c, "Streaming %d." % i + LONG * 12, 2, salt="stream-%d" % i)
        self.assertGreater(early(), before)

    def test_bad_requests_get_openai_errors(self):
        base = self.cluster.base + "/v1/completions"
        cases = [
            ({"model": "nope", "prompt": "x"}, 404, "model"),
            ({"model": "strata-tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
            ({"model": "strata-tiny", "prompt": "x", "max_tokens": 4000}, 400, "max_tokens"),
            ({"model": "strata-tiny", "prompt": "word " * 3000, "max_tokens": 4}, 400, "prompt"),
            ({"model": "strata-tiny", "prompt": 7}, 400, "prompt"),
        ]
        for body, code, field in cases:
            status, resp, _ = http_json(base, body)
            self.assertEqual(status, code, body)
            self.assertIn("error", resp)
            self.assertIn(field, json.dumps(resp["error"]), body)
        req = urllib.request.Request(base, data=b"{not json", method="POST",
                                     headers={"Content-Type": "application/json"})
        with self.assertRaises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        self.assertEqual(e.exception.code, 400)

    def test_curl_streams(self):
        if shutil.which("curl") is None:
            self.skipTest("curl is not installed (scripts/setup.sh installs it)")
        body = json.dumps({"model": "strata-tiny", "prompt": PROMPTS[1], "max_tokens": 6,
                           "stream": True, "temperature": 0})
        out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                              self.cluster.base + "/v1/completions"], capture_output=True,
                             text=True, timeout=60).stdout
        self.assertTrue(out.rstrip().endswith("data: [DONE]"), out)
        self.assertIn('"text"', out)


def openai_node_client():
    """A folder with the `openai` npm package installed (build/e2e-node), or None and why."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        return None, "Node.js/npm are not installed"
    prefix = os.path.join(BUILD, "e2e-node")
    if not os.path.isdir(os.path.join(prefix, "node_modules", "openai")):
        os.makedirs(prefix, exist_ok=True)
        r = subprocess.run(["npm", "install", "--prefix", prefix, "--no-audit", "--no-fund",
                            "openai@4"], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            return None, "npm could not install the openai package: " + r.stderr[-300:]
    return prefix, ""


def burst_one(base, prompt, salt, max_tokens, timeout=300):
    """One greedy streamed completion. ("ok", text) when it streamed to [DONE]; ("429",
    Retry-After) when refused before any byte; else ("error", what happened) — an HTTP error
    other than 429, an error event after the 200, a stream without [DONE], or a timeout."""
    body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "cache_salt": salt}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    text = ""
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return "ok", text
                event = json.loads(line[6:])
                if "error" in event:
                    return "error", "error event after the 200: %s" % event["error"]
                for c in event.get("choices", []):
                    text += c.get("text", "")
        return "error", "no [DONE] after %r" % text
    except urllib.error.HTTPError as e:
        if e.code == 429:
            return "429", e.headers.get("Retry-After")
        return "error", "HTTP %d: %s" % (e.code, e.read()[:300])
    except OSError as e:
        return "error", "%s after %r" % (e, text)


class OverloadTest(unittest.TestCase):
    """A burst far above what the cluster can serve: every request either completes with the
    output it has alone or is refused with 429 before its first byte; none times out or fails
    after its 200, and afterwards the cluster holds nothing."""

    def test_a_burst_far_above_capacity_completes_or_gets_429_before_any_byte(self):
        # Small batches (8 running + 32 waiting per decode node) keep the capacity well below
        # the burst on any machine: 2 x 40 requests held at once against 300 arriving together.
        c = Cluster("kivi:k4v4:g32", prefill=2, decode=2, max_batch=8)
        try:
            prompts = ["%s (%d)%s" % (PROMPTS[i % len(PROMPTS)], i, LONG if i % 2 else "")
                       for i in range(6)]
            alone = [complete(c, p, 32, salt="alone-%d" % i)[0] for i, p in enumerate(prompts)]
            n = 300
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                results = list(pool.map(
                    lambda i: burst_one(c.base, prompts[i % len(prompts)], "burst-%d" % i, 32),
                    range(n)))
            errors = [(i, what) for i, (kind, what) in enumerate(results) if kind == "error"]
            self.assertEqual(errors, [], "requests that neither completed nor got a 429")
            done = [i for i, (kind, _) in enumerate(results) if kind == "ok"]
            refused = [what for kind, what in results if kind == "429"]
            print("burst of %d: %d completed, %d refused with 429" % (n, len(done), len(refused)))
            for i in done:
                self.assertEqual(results[i][1], alone[i % len(prompts)], "request %d" % i)
            self.assertGreater(len(refused), 0, "the burst never reached the cluster's limits")
            self.assertGreaterEqual(len(done), 40, "the cluster served too little of the burst")
            for retry_after in refused:
                self.assertIsNotNone(retry_after)
                self.assertGreaterEqual(int(retry_after), 1)
            router = scrape(c.base.replace("http://", ""))
            self.assertEqual(metric(router, "strata_router_rejected_total"), len(refused))
            self.assertEqual(metric(router, "strata_router_retries_total"), 0)
            # Afterwards nothing is held: no request in flight, no KV, empty queues.
            deadline = time.monotonic() + 30
            while True:
                router = scrape(c.base.replace("http://", ""))
                decode = [scrape(c.node(d)["metrics"]) for d in ("decode-0", "decode-1")]
                prefill = [scrape(c.node(p)["metrics"]) for p in ("prefill-0", "prefill-1")]
                held = (metric(router, "strata_router_in_flight") +
                        sum(metric(m, "strata_decode_running") + metric(m, "strata_decode_waiting")
                            + metric(m, "strata_decode_kv_bytes_in_use")
                            + metric(m, "strata_decode_kv_bytes_arrived") for m in decode) +
                        sum(metric(m, "strata_prefill_queued_tokens") for m in prefill))
                if held == 0 or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            self.assertEqual(held, 0, "the cluster still holds requests or KV after the burst")
            # And it still serves.
            self.assertEqual(complete(c, prompts[0], 32, salt="after")[0], alone[0])
        except BaseException:
            print(c.logs())
            raise
        finally:
            c.down()

    def test_a_client_timeout_is_honoured_by_every_node(self):
        c = Cluster("kivi:k4v4:g32", prefill=1, decode=1)
        try:
            prompt = PROMPTS[0] + LONG * 3
            body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": 1500,
                    "temperature": 0, "ignore_eos": True}
            req = urllib.request.Request(
                c.base + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "X-Request-Timeout": "0.5"})
            t0 = time.monotonic()
            with self.assertRaises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=60)
            self.assertEqual(e.exception.code, 504)
            self.assertLess(time.monotonic() - t0, 10)
            # The decode node gave the request up too: nothing runs there afterwards.
            deadline = time.monotonic() + 10
            while metric(scrape(c.node("decode-0")["metrics"]), "strata_decode_running") > 0:
                self.assertLess(time.monotonic(), deadline, "the decode node still runs it")
                time.sleep(0.1)
            req2 = urllib.request.Request(
                c.base + "/v1/completions", data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json", "X-Request-Timeout": "soon"})
            with self.assertRaises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req2, timeout=60)
            self.assertEqual(e.exception.code, 400)
            self.assertIn("X-Request-Timeout", json.load(e.exception)["error"]["message"])
        except BaseException:
            print(c.logs())
            raise
        finally:
            c.down()


class TenantTest(unittest.TestCase):
    def test_api_keys_gate_the_api_and_tenants_never_share_a_prefix(self):
        keys = os.path.join(tempfile.mkdtemp(prefix="strata-keys."), "keys.txt")
        with open(keys, "w") as f:
            f.write("sk-team-a-0123456789abcdef team-a\nsk-team-b-0123456789abcdef team-b\n")
        c = Cluster("kivi:k4v4:g32", extra=["--router-flag", "--api_keys=" + keys])
        try:
            def ask(key, prompt):
                body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": 4,
                        "temperature": 0}
                headers = {"Content-Type": "application/json"}
                if key:
                    headers["Authorization"] = "Bearer " + key
                req = urllib.request.Request(c.base + "/v1/completions",
                                             data=json.dumps(body).encode(), headers=headers)
                try:
                    with urllib.request.urlopen(req, timeout=60) as r:
                        return r.status, json.load(r)
                except urllib.error.HTTPError as e:
                    return e.code, json.load(e)

            status, err = ask("", PROMPTS[0])
            self.assertEqual(status, 401)
            self.assertEqual(err["error"]["code"], "invalid_api_key")
            self.assertEqual(ask("sk-team-z-0123456789abcdef", PROMPTS[0])[0], 401)
            prompt = "Tenants." + LONG * 2
            a1 = ask("sk-team-a-0123456789abcdef", prompt)[1]
            time.sleep(0.5)  # its blocks reach the store and the router's index
            a2 = ask("sk-team-a-0123456789abcdef", prompt + " More.")[1]
            b1 = ask("sk-team-b-0123456789abcdef", prompt + " More.")[1]
            self.assertEqual(a1["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertGreater(a2["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            # The same text from another tenant: nothing of team-a's is found.
            self.assertEqual(b1["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(b1["choices"][0]["text"], a2["choices"][0]["text"])
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()
            shutil.rmtree(os.path.dirname(keys), ignore_errors=True)


HUB_ADDRESS = "10.77.0.1"  # deploy/netns/hosts.sh's hub


def enter_hub(hub):
    """Runs this script again inside namespace `hub` (made if missing), unless it is there."""
    if os.environ.get("STRATA_E2E_IN_HUB") == hub:
        return
    check = subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "check"],
                           capture_output=True, text=True)
    if check.returncode != 0:
        # CTest reads this line (SKIP_REGULAR_EXPRESSION): the suite needs root and namespaces.
        print("skipped, no network namespaces: " + check.stderr.strip())
        sys.exit(0)
    subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "hub", hub], check=True)
    env = dict(os.environ, STRATA_E2E_IN_HUB=hub)
    r = subprocess.run(["ip", "netns", "exec", hub, sys.executable] + sys.argv, env=env)
    subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "gc", hub])
    sys.exit(r.returncode)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Etcd:
    """A throwaway etcd (Debian's etcd-server) on free loopback ports."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="strata-etcd.")
        self.port = free_port()
        peer = "http://127.0.0.1:%d" % free_port()
        client = "http://%s:%d" % (HERE, self.port)
        self.address = "%s:%d" % (HERE, self.port)
        self.proc = subprocess.Popen(
            ["etcd", "--data-dir", self.dir, "--listen-client-urls", client,
             "--advertise-client-urls", client, "--listen-peer-urls", peer,
             "--initial-advertise-peer-urls", peer, "--initial-cluster", "default=" + peer,
             "--heartbeat-interval", "10", "--election-timeout", "100", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            if self.keys("/") is not None:
                return
            time.sleep(0.1)
        raise RuntimeError("etcd did not start")

    def keys(self, prefix):
        """The keys under `prefix` (its JSON gateway), or None when etcd does not answer."""
        import base64
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = {"key": base64.b64encode(prefix.encode()).decode(),
                "range_end": base64.b64encode(end.encode()).decode(), "keys_only": True}
        try:
            status, r, _ = http_json("http://%s/v3/kv/range" % self.address, body, 2)
        except OSError:
            return None
        return sorted(base64.b64decode(kv["key"]).decode() for kv in r.get("kvs", []))

    def down(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@unittest.skipIf(shutil.which("etcd") is None, "skipped: no etcd (scripts/setup.sh installs it)")
class MembershipTest(unittest.TestCase):
    def test_nodes_register_in_etcd_and_the_router_follows_them(self):
        etcd = Etcd()
        c = None
        try:
            c = Cluster("kivi:k4v4:g32", prefill=1, decode=2,
                        extra=["--etcd", etcd.address, "--etcd-ttl", "2"])
            prefix = "/strata/%s/nodes/" % os.path.basename(c.dir)
            self.assertEqual(etcd.keys(prefix), [prefix + n for n in
                                                 ("decode-0", "decode-1", "prefill-0")])
            self.assertIsInstance(complete(c, PROMPTS[0], 4)[0], str)
            # kill -9: no deregistration; the lease (2 s, renewed at 1 s) expires.
            os.kill(c.pids()["decode-0"], signal.SIGKILL)
            t0 = time.monotonic()
            while etcd.keys(prefix) != [prefix + "decode-1", prefix + "prefill-0"]:
                self.assertLess(time.monotonic() - t0, 8, "decode-0's registration outlived it")
                time.sleep(0.1)
            time.sleep(0.5)  # the router's membership and pool catch up
            for p in PROMPTS:
                _, _, events = complete(c, p, 4, stream=True)
                self.assertEqual(routed_decode(c, json.loads(events[0])["id"]), "decode-1")
            # Back: it registers again, and the router routes to it.
            env = dict(os.environ, STRATA_BUILD_DIR=BUILD)
            r = subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "restart",
                                "decode-0", "--dir", c.dir], capture_output=True, text=True,
                               env=env, timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            self.assertIn(prefix + "decode-0", etcd.keys(prefix))
            time.sleep(1.0)
            served_by = set()
            for i in range(12):
                _, _, events = complete(c, "%s (%d)" % (PROMPTS[i % 4], i), 4, stream=True)
                served_by.add(routed_decode(c, json.loads(events[0])["id"]))
            self.assertIn("decode-0", served_by)
            # A decode node the cluster file does not list joins through etcd alone.
            port = free_port()
            with open(os.path.join(c.dir, "logs", "decode-9.log"), "w") as log:
                extra = subprocess.Popen(
                    [os.path.join(BUILD, "decode_node/strata-decode"), "--cluster",
                     os.path.join(c.dir, "cluster.json"), "--node", "decode-9", "--listen",
                     "%s:%d" % (HERE, port), "--metrics", "off", "--etcd",
                     etcd.address, "--etcd_prefix", prefix[:-len("nodes/")],
                     "--etcd_ttl_s", "2", "--insecure"], stdout=log, stderr=subprocess.STDOUT)
            try:
                t0 = time.monotonic()
                while prefix + "decode-9" not in (etcd.keys(prefix) or []):
                    self.assertLess(time.monotonic() - t0, 30, "decode-9 never registered")
                    time.sleep(0.1)
                time.sleep(1.0)
                served_by = set()
                for i in range(16):
                    _, _, events = complete(c, "%s [%d]" % (PROMPTS[i % 4], i), 4, stream=True)
                    served_by.add(routed_decode(c, json.loads(events[0])["id"]))
                self.assertIn("decode-9", served_by)
            finally:
                extra.terminate()
                extra.wait(timeout=30)
            t0 = time.monotonic()  # a clean stop deregisters at once
            while prefix + "decode-9" in (etcd.keys(prefix) or []):
                self.assertLess(time.monotonic() - t0, 2, "decode-9 did not deregister")
                time.sleep(0.05)
        except Exception:
            if c is not None:
                print(c.logs())
            raise
        finally:
            if c is not None:
                c.down()
            etcd.down()

    def test_stores_register_in_etcd_and_a_node_finds_its_hosts_store(self):
        # Stores register under stores/ (strata-store --etcd) and the router lists one no node
        # names; a prefill node the file does not list, started with --store host, is refused
        # while two stores share its host, then finds the one left and serves with it; a store
        # that stops leaves etcd at once.
        etcd = Etcd()
        c = None
        try:
            c = Cluster("kivi:k4v4:g32", prefill=1, decode=1, extra=["--etcd", etcd.address])
            base = "/strata/%s/" % os.path.basename(c.dir)
            host, port = c.spec["store"].rsplit(":", 1)
            store_key = base + "stores/store-%s-%s" % (host.replace(":", "-"), port)
            self.assertEqual(etcd.keys(base + "stores/"), [store_key])
            sp = free_port()
            with open(os.path.join(c.dir, "logs", "store-9.log"), "w") as log:
                store9 = subprocess.Popen(
                    [os.path.join(BUILD, "kvstore/strata-store"), "--listen", "%s:%d" % (HERE, sp),
                     "--ram_bytes", "64M", "--metrics_port", "-1", "--etcd", etcd.address,
                     "--etcd_prefix", base, "--etcd_ttl_s", "2", "--store_id", "store-9",
                     "--insecure"], stdout=log, stderr=subprocess.STDOUT)
            t0 = time.monotonic()
            while True:
                with open(os.path.join(c.dir, "logs", "router.log")) as f:
                    if "store store-9 at %s:%d registered in etcd" % (HERE, sp) in f.read():
                        break
                self.assertLess(time.monotonic() - t0, 15, "the router never listed store-9")
                time.sleep(0.1)

            def prefill9():
                return [os.path.join(BUILD, "prefill_node/strata-prefill"), "--cluster",
                        os.path.join(c.dir, "cluster.json"), "--node", "prefill-9", "--listen",
                        "%s:%d" % (HERE, free_port()), "--metrics", "off", "--etcd",
                        etcd.address, "--etcd_prefix", base, "--etcd_ttl_s", "2", "--store",
                        "host", "--insecure"]
            def serves_with(store_id):
                with open(os.path.join(c.dir, "logs", "prefill-9.log"), "w") as log:
                    extra = subprocess.Popen(prefill9(), stdout=log, stderr=subprocess.STDOUT)
                try:
                    t0 = time.monotonic()
                    while base + "nodes/prefill-9" not in (etcd.keys(base + "nodes/") or []):
                        self.assertLess(time.monotonic() - t0, 40, "prefill-9 never registered")
                        time.sleep(0.1)
                    with open(os.path.join(c.dir, "logs", "prefill-9.log")) as f:
                        self.assertIn("--store host: using store %s " % store_id, f.read())
                finally:
                    extra.terminate()
                    extra.wait(timeout=30)

            if host == HERE:
                # On one host (loopback) the cluster's store and store-9 share it: refused.
                refused = subprocess.run(prefill9(), capture_output=True, text=True, timeout=60)
                self.assertNotEqual(refused.returncode, 0)
                self.assertIn("several stores are registered on host",
                              refused.stdout + refused.stderr)
            else:
                # On netns hosts store-9 is the only store on the test's own host.
                serves_with("store-9")
            store9.terminate()
            store9.wait(timeout=30)
            self.assertEqual(etcd.keys(base + "stores/"), [store_key])  # left at once
            if host == HERE:
                serves_with(store_key.rsplit("/", 1)[1])
            os.kill(c.pids()["store"], signal.SIGTERM)
            t0 = time.monotonic()
            while etcd.keys(base + "stores/"):
                self.assertLess(time.monotonic() - t0, 10, "the store did not deregister")
                time.sleep(0.05)
        except Exception:
            if c is not None:
                print(c.logs())
            raise
        finally:
            if c is not None:
                c.down()
            etcd.down()


class DrainTest(unittest.TestCase):
    def test_a_drained_decode_node_hands_its_streams_off_and_leaves(self):
        # decode-0 is told to leave (cluster.sh drain: SIGTERM) while it streams four long
        # greedy sequences; with a 1 s drain timeout they are still running then, so it Puts their
        # chunks in the store and hands them off; the router continues each on decode-1 from the
        # store. Clients see one unbroken stream each, of every token they asked for.
        c = Cluster("kivi:k4v4:g32", prefill=1, decode=2,
                    extra=["--node-flag", "--drain_timeout_s=1"])
        try:
            n = 600
            prompts = ["%s (%d)%s" % (PROMPTS[i % 4], i, LONG) for i in range(4)]
            out = {}

            def one(i):
                out[i] = complete(c, prompts[i], n, stream=True, ignore_eos=True, timeout=300)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            for _ in range(100):  # until decode-0 runs some of them
                if metric(scrape(c.node("decode-0")["metrics"]), "strata_decode_running") > 0:
                    break
                time.sleep(0.1)
            env = dict(os.environ, STRATA_BUILD_DIR=BUILD)
            r = subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "drain",
                                "decode-0", "--dir", c.dir], capture_output=True, text=True,
                               env=env, timeout=150)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            # Meanwhile and after, new requests go to decode-1.
            _, _, events = complete(c, PROMPTS[0] + " After the drain.", 4, stream=True)
            self.assertEqual(routed_decode(c, json.loads(events[0])["id"]), "decode-1")
            for t in threads:
                t.join(timeout=300)
            for i in range(len(prompts)):
                text, usage, events = out[i]
                self.assertEqual(events[-1], "[DONE]")
                self.assertEqual(usage["completion_tokens"], n)
                self.assertGreater(len(text), 0)
            m = scrape(c.base.replace("http://", ""))
            self.assertGreater(metric(m, "strata_router_handoffs_total"), 0)
            with open(os.path.join(c.dir, "logs", "router.log")) as f:
                log = f.read()
            self.assertIn("is draining and handed the request off", log)
            resumed = re.findall(r"-resume1: routed .*?decode=(\S+) .*?cached=(\d+)", log)
            self.assertTrue(resumed, "no continuation was routed")
            for decode, cached in resumed:
                self.assertEqual(decode, "decode-1")
                self.assertGreater(int(cached), 0, "the continuation found none of its KV stored")
            with open(os.path.join(c.dir, "logs", "decode-0.log")) as f:
                self.assertIn("handed off", f.read())
            self.assertNotIn(c.pids()["decode-0"], running_pids())
            outputs = [(prompts[i], out[i][0]) for i in range(len(prompts))]
            # Greedy decoding continued from the store gives what one node would have given.
            for p, text in outputs:
                self.assertEqual(text, solo("kivi:k4v4:g32", p, n))
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()


def running_pids():
    return {int(d) for d in os.listdir("/proc") if d.isdigit()}


class OpenAIClientTest(unittest.TestCase):
    def test_official_openai_node_client(self):
        prefix, why = openai_node_client()
        if prefix is None:
            self.skipTest(why)
        c = Cluster("kivi:k4v4:g32")
        try:
            script = os.path.join(prefix, "openai_client_test.mjs")
            shutil.copy(os.path.join(ROOT, "tests/e2e/openai_client_test.mjs"), script)
            r = subprocess.run(["node", script, c.base], capture_output=True, text=True,
                               timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr + c.logs())
            self.assertIn("openai client: ok", r.stdout)
            penalized = json.loads(r.stdout.split("penalized: ", 1)[1].splitlines()[0])
            prompt = "The lighthouse keeper wrote in his log that the storm"
            self.assertEqual(penalized, solo("kivi:k4v4:g32", prompt, 24, flags=[
                "--presence_penalty=0.4", "--frequency_penalty=0.6", "--repetition_penalty=1.3"]))
        finally:
            c.down()


class FaultTest(unittest.TestCase):
    """kill -9 of a decode node mid-stream and of the store, each on a fresh cluster."""

    def test_decode_node_killed_mid_stream_gives_an_error_and_is_avoided(self):
        c = Cluster("kivi:k4v4:g32", prefill=1, decode=2)
        try:
            body = json.dumps({"model": "strata-tiny", "prompt": PROMPTS[2] + LONG,
                               "max_tokens": 1500, "temperature": 1.0, "seed": 3,
                               "stream": True}).encode()
            req = urllib.request.Request(c.base + "/v1/completions", data=body,
                                         headers={"Content-Type": "application/json"})
            t0 = time.monotonic()
            got_error = False
            tokens = 0
            with urllib.request.urlopen(req, timeout=30) as r:
                for raw in r:
                    line = raw.decode().strip()
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        got_error = True
                        break
                    tokens += 1
                    if tokens == 3:
                        victim = routed_decode(c, event["id"])
                        os.kill(c.pids()[victim], signal.SIGKILL)
                        killed_at = time.monotonic()
            self.assertTrue(got_error, "the stream ended without an error event")
            self.assertLess(time.monotonic() - killed_at, 10)
            self.assertLess(time.monotonic() - t0, 30)
            # The router stops choosing the dead node: every later request succeeds.
            time.sleep(1.5)
            for p in PROMPTS:
                text, _, _ = complete(c, p, 4)
                self.assertIsInstance(text, str)
            # Restarted (cluster.sh restart: same flags; its UCX transport on a fresh port), it
            # is back in routing within the poll interval and serves requests.
            env = dict(os.environ, STRATA_BUILD_DIR=BUILD)
            r = subprocess.run([os.path.join(ROOT, "deploy/local/cluster.sh"), "restart", victim,
                                "--dir", c.dir], capture_output=True, text=True, env=env,
                               timeout=60)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            time.sleep(1.5)
            served_by = set()
            for i in range(12):
                _, _, events = complete(c, "%s (%d)" % (PROMPTS[i % 4], i), 4, stream=True)
                served_by.add(routed_decode(c, json.loads(events[0])["id"]))
            self.assertIn(victim, served_by)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()

    def test_blocks_damaged_in_transit_are_refused_and_sent_again(self):
        # The fault tests' decode binary (strata-decode-faulty: the decode node with a failpoint)
        # flips a byte of the first copy of every 5th block after UCX
        # delivered it: the receiver refuses it (CRC-32C), the prefill node sends it again, and
        # the output is the undamaged one.
        c = Cluster("kivi:k4v4:g32", prefill=1, decode=1,
                    extra=["--decode-bin", os.path.join(BUILD, "tests/e2e/strata-decode-faulty"),
                           "--decode-flag", "--damage_received_blocks=5"])
        try:
            prompt = PROMPTS[1] + LONG * 2
            text, _, _ = complete(c, prompt, 12, salt="damaged")
            self.assertEqual(text, solo("kivi:k4v4:g32", prompt, 12))
            damaged = resends = 0
            for _ in range(30):  # the decode node refreshes its counters every 0.5 s
                damaged = metric(scrape(c.node("decode-0")["metrics"]),
                                 "strata_decode_blocks_damaged_total")
                resends = metric(scrape(c.node("prefill-0")["metrics"]),
                                 "strata_prefill_block_resends_total")
                if damaged > 0:
                    break
                time.sleep(0.1)
            self.assertGreater(damaged, 0)
            self.assertGreaterEqual(resends, damaged)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()

    def test_prefill_nodes_own_tiers_serve_their_prefixes_with_the_store_gone(self):
        # Each prefill node keeps its own RAM tier in front of the store and serves it (Store
        # service) on its gRPC port; the router watches it and sends a prompt to the node that
        # holds its prefix. With the store killed, the second turn still hits, on that node.
        c = Cluster("kivi:k4v4:g32", prefill=2, decode=1, extra=["--prefill-local-ram", "64M"])
        try:
            for _ in range(50):
                with open(os.path.join(c.dir, "logs", "router.log")) as f:
                    if f.read().count("has its own tier") == 2:
                        break
                time.sleep(0.1)
            prompt = "Own tiers." + LONG * 2
            text, _, events = complete(c, prompt, 8, stream=True, salt="own-tier")
            first = routed_decode(c, json.loads(events[0])["id"], "prefill")
            time.sleep(1.0)  # the node's block events reach the router
            os.kill(c.pids()["store"], signal.SIGKILL)
            _, usage, events = complete(c, prompt + text + " Next.", 8, stream=True,
                                        salt="own-tier")
            self.assertGreater(usage["prompt_tokens_details"]["cached_tokens"], 0)
            self.assertEqual(routed_decode(c, json.loads(events[0])["id"], "prefill"), first)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()

    def test_a_decode_nodes_own_tier_resumes_preempted_sequences_with_the_store_gone(self):
        # A KV budget the router fills with two sequences by its estimate, which their full-
        # precision windows outgrow as they generate: one is preempted and resumed. With the store
        # killed, only the decode node's own tier can hold it meanwhile; outputs equal
        # strata generate's.
        c = Cluster("kivi:k4v4:g32", prefill=1, decode=1, kv_budget="200K",
                    extra=["--decode-local-ram", "64M"])
        try:
            os.kill(c.pids()["store"], signal.SIGKILL)
            prompts = ["%s (%d)%s" % (PROMPTS[i], i, LONG) for i in range(2)]
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                texts = list(pool.map(lambda p: complete(c, p, 60, stream=True)[0], prompts))
            for p, t in zip(prompts, texts):
                self.assertEqual(t, solo("kivi:k4v4:g32", p, 60))
            time.sleep(0.6)  # the node refreshes its counters every 0.5 s
            m = scrape(c.node("decode-0")["metrics"])
            self.assertGreater(metric(m, "strata_decode_preemptions_total"), 0)
            self.assertEqual(metric(m, "strata_decode_resumed_total"),
                             metric(m, "strata_decode_preemptions_total"))
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()

    def test_store_killed_means_misses_not_failures_and_a_restart_keeps_the_disk_tier(self):
        c = Cluster("kivi:k4v4:g32", prefill=1, decode=1)
        try:
            prompt = "Store restarts." + LONG * 2
            text, _, _ = complete(c, prompt, 8)
            time.sleep(0.5)
            # A clean restart: the next turn still hits (the disk tier kept the blocks).
            store_pid = c.pids()["store"]
            os.kill(store_pid, signal.SIGTERM)
            wait_exit(store_pid)
            store = restart_store(c)
            time.sleep(1.5)  # clients reconnect within their backoff (1 s)
            _, usage, _ = complete(c, prompt + text + " Next.", 8)
            self.assertGreater(usage["prompt_tokens_details"]["cached_tokens"], 0)
            # kill -9: requests recompute (a miss) and succeed.
            store.kill()
            store.wait()
            _, usage, _ = complete(c, prompt + " Without the store.", 8)
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()


@unittest.skipIf(shutil.which("redis-server") is None,
                 "skipped: no redis-server (scripts/setup.sh installs it)")
class SharedTierTest(unittest.TestCase):
    """A store per host (cluster.sh --host-stores) over one shared tier on a Redis Cluster."""

    def test_a_prefix_computed_on_one_host_is_reused_on_another_through_the_shared_tier(self):
        self.reuse_across_hosts(tls=False)

    def test_the_same_over_tls_and_auth_to_redis(self):
        # cluster.sh --tls --shared-tier: Redis serves TLS only, with client certificates and a
        # password; every process reaches it with --shared_tier_tls*.
        self.reuse_across_hosts(tls=True)

    def reuse_across_hosts(self, tls):
        # Host 0 runs prefill-0 and the cluster's store, host 1 prefill-1 and store-1. The first
        # request is computed on one host; that host's prefill node is then killed, so the same
        # prompt is served on the other host, whose own store never saw it: its store finds the
        # chunks in the shared tier and promotes them, and the request gets every cached token
        # one store would give (all chunks but the one holding the last prompt token).
        c = Cluster("kivi:k4v4:g32", prefill=2, decode=2, tls=tls,
                    extra=["--shared-tier", "3", "--host-stores"])
        try:
            if tls:  # Redis answers no plain connection (so the tier below did run over TLS)
                plain = subprocess.run(["redis-cli", "-h", c.address_of("redis"), "-p",
                                        str(c.port_base + 200), "PING"],
                                       capture_output=True, text=True, timeout=10)
                self.assertNotIn("PONG", plain.stdout)
            stores = {0: c.store_metrics(), 1: "%s:%d" % (c.address_of("store-1"), c.port_base + 151)}
            self.assertEqual(c.node("prefill-1")["store"],
                             "%s:%d" % (c.address_of("store-1"), c.port_base + 101))
            self.assertNotIn("store", c.node("prefill-0"))
            prompt = "Across hosts." + LONG * 2
            _, usage, events = complete(c, prompt, 8, stream=True, salt="hosts")
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
            first = routed_decode(c, json.loads(events[0])["id"], "prefill")
            first_host = int(first.rsplit("-", 1)[1])
            other = "prefill-%d" % (1 - first_host)
            # The first host's store wrote the chunks through (the Puts land after the reply):
            # until its count of blocks written through holds still.
            wait_write_through(stores[first_host])
            os.kill(c.pids()[first], signal.SIGKILL)
            wait_exit(c.pids()[first])
            wait_router_drops(c, first)
            before = scrape(stores[1 - first_host])
            _, usage, events = complete(c, prompt, 8, stream=True, salt="hosts")
            self.assertEqual(routed_decode(c, json.loads(events[0])["id"], "prefill"), other)
            n = usage["prompt_tokens"]
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"],
                             (n - 1) // CHUNK * CHUNK)
            after = scrape(stores[1 - first_host])
            self.assertGreater(metric(after, "strata_store_shared_hits_total"),
                               metric(before, "strata_store_shared_hits_total"))
            # The router asked the shared tier as it routed (the first request).
            self.assertGreater(metric(c.router_metrics(),
                                      "strata_router_shared_tier_probes_total"), 0)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()


    def test_a_redis_master_killed_under_load_fails_no_request(self):
        # A steady stream of requests, each prompt computed then reused, with the store writing
        # every new block through to the shared tier and the router probing it per request. A
        # Redis master is killed a third of the way in: its replica takes over (the cluster's
        # node timeout is 2 s) while new blocks keep being written. No request may fail, and each
        # prompt's second answer must equal its first (greedy): no wrong byte served. Errors,
        # retries and misses during the failover are allowed, and counted.
        c = Cluster("kivi:k4v4:g32", extra=["--shared-tier", "3"])
        try:
            ports = [c.port_base + 200 + i for i in range(6)]

            def redis(port, *args):
                return subprocess.run(["redis-cli", "-h", c.address_of("redis"), "-p", str(port)] +
                                      list(args),
                                      capture_output=True, text=True, timeout=10).stdout

            deadline = time.time() + 30
            while not all("master_link_status:up" in redis(p, "INFO", "replication")
                          for p in ports if "role:slave" in redis(p, "INFO", "replication")):
                self.assertLess(time.time(), deadline, "the replicas did not come up")
                time.sleep(0.2)
            masters = [i for i, p in enumerate(ports)
                       if "role:master" in redis(p, "INFO", "replication")]
            self.assertEqual(len(masters), 3)
            prompts = ["Failover %d." % (n // 2) + LONG * 2 for n in range(24)]
            answers = {}
            errors = []
            done = []

            def load():
                for n in range(24):
                    prompt = prompts[n]
                    try:
                        text, usage, _ = complete(c, prompt, 8, stream=True, salt="failover")
                        answers.setdefault(prompt, []).append(text)
                        done.append(usage["prompt_tokens_details"]["cached_tokens"])
                    except Exception as e:  # every failure is the test's failure
                        errors.append("request %d: %r" % (n, e))

            t = threading.Thread(target=load)
            t.start()
            deadline = time.time() + 120
            while len(done) + len(errors) < 8:
                self.assertLess(time.time(), deadline, "the load did not start")
                time.sleep(0.05)
            victim = "redis-%d" % masters[0]
            os.kill(c.pids()[victim], signal.SIGKILL)
            wait_exit(c.pids()[victim])
            t.join(timeout=600)
            self.assertFalse(t.is_alive(), "the load did not finish")
            self.assertEqual(errors, [])
            self.assertEqual(len(done), 24)
            for prompt, texts in answers.items():
                self.assertEqual(len(set(texts)), 1, "a prompt got different answers: %r" % texts)
            # The replica took over: the cluster is whole again.
            survivor = ports[masters[1]]
            deadline = time.time() + 30
            while "cluster_state:ok" not in redis(survivor, "CLUSTER", "INFO"):
                self.assertLess(time.time(), deadline, "the cluster did not recover")
                time.sleep(0.2)
            # Reused prompts were cached (the store serves them; the tier is behind it).
            self.assertGreater(sum(1 for n in done if n > 0), 0)
            store = scrape(c.store_metrics())
            router = c.router_metrics()
            seen = {name: metric(store, "strata_store_shared_%s_total" % name)
                    for name in ("puts", "put_errors", "retries", "io_errors", "redirections")}
            seen["router_probe_errors"] = metric(router, "strata_router_shared_tier_errors_total")
            print("shared tier across the failover: %s" % seen)
            # The writes did meet the failover (else this test proved nothing).
            self.assertGreater(seen["put_errors"] + seen["retries"] + seen["io_errors"] +
                               seen["redirections"], 0, seen)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()


class StoreHostLostTest(unittest.TestCase):
    """A store host lost: its nodes read the shared tier instead (cluster.sh --shared-tier, the
    nodes' --shared_tier), and recompute only what nobody has; no request fails."""

    def test_a_node_whose_store_is_gone_finds_the_prefix_in_the_shared_tier(self):
        # Host 0 runs prefill-0 and the cluster's store, host 1 prefill-1 and store-1. The first
        # request is computed on one host and written through to the shared tier. Then that
        # host's prefill node and the other host's store are killed: the same prompt is served by
        # the other host's prefill node, whose store no longer answers; it finds the chunks in
        # the shared tier itself.
        c = Cluster("kivi:k4v4:g32", prefill=2, decode=2,
                    extra=["--shared-tier", "3", "--host-stores"])
        try:
            stores = {0: c.store_metrics(), 1: "%s:%d" % (c.address_of("store-1"), c.port_base + 151)}
            prompt = "Lost store." + LONG * 2
            _, usage, events = complete(c, prompt, 8, stream=True, salt="lost")
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
            first = routed_decode(c, json.loads(events[0])["id"], "prefill")
            first_host = int(first.rsplit("-", 1)[1])
            other = "prefill-%d" % (1 - first_host)
            wait_write_through(stores[first_host])
            lost_store = "store" if first_host == 1 else "store-1"
            for name in (first, lost_store):
                os.kill(c.pids()[name], signal.SIGKILL)
                wait_exit(c.pids()[name])
            wait_router_drops(c, first)
            text, usage, events = complete(c, prompt, 8, stream=True, salt="lost")
            self.assertEqual(routed_decode(c, json.loads(events[0])["id"], "prefill"), other)
            self.assertTrue(text)
            n = usage["prompt_tokens"]
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"],
                             (n - 1) // CHUNK * CHUNK)
            with open(os.path.join(c.dir, "logs", other + ".log")) as f:
                self.assertIn("while it cannot answer, shared tier on", f.read())
            # A prompt nobody computed: recomputed whole, and it still succeeds.
            text, usage, _ = complete(c, "Never seen." + LONG, 8, stream=True, salt="lost")
            self.assertTrue(text)
            self.assertEqual(usage["prompt_tokens_details"]["cached_tokens"], 0)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()


def wait_write_through(store_metrics, timeout=30):
    """Until the store at `store_metrics` has written blocks through to the shared tier and its
    count holds still (the Puts land after the reply)."""
    deadline = time.time() + timeout
    last = -1
    while True:
        puts = metric(scrape(store_metrics), "strata_store_shared_puts_total")
        if puts > 0 and puts == last:
            return
        if time.time() > deadline:
            raise AssertionError("the write-through did not settle")
        last = puts
        time.sleep(0.5)


def wait_router_drops(c, node, timeout=30):
    """Until the router counts `node` unhealthy."""
    deadline = time.time() + timeout
    while metric(c.router_metrics(), "strata_router_node_healthy",
                 'node="%s"' % node) != 0:
        if time.time() > deadline:
            raise AssertionError("the router still counts %s" % node)
        time.sleep(0.1)


def https_json(url, body, context, timeout=60):
    """(status, parsed JSON) of a request over HTTPS verified by `context` (GET without body)."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


class TlsTest(unittest.TestCase):
    """Mutual TLS between every process and the cluster token on every gRPC call (cluster.sh
    --tls: certificates by scripts/make_certs.sh), HTTPS at the router."""

    def test_https_chat_over_mutual_tls_and_what_the_cluster_refuses(self):
        c = Cluster("kivi:k4v4:g32", tls=True)
        try:
            certs = os.path.dirname(c.ca)
            ctx = ssl.create_default_context(cafile=c.ca)
            self.assertTrue(c.base.startswith("https://"), c.base)
            for name in ("store", "prefill-0", "decode-0", "router"):
                with open(os.path.join(c.dir, "logs", name + ".log")) as f:
                    log = f.read()
                self.assertIn("mutual TLS", log, name)
                self.assertNotIn("--insecure", log, name)
            # A chat completion over HTTPS; the same conversation again finds its prefix in the
            # store: the prefill node's Lookup, Put and Get crossed mutual TLS with the token.
            messages = [{"role": "user", "content": PROMPTS[0] + LONG * 2}]
            body = {"model": "strata-tiny", "messages": messages, "max_tokens": 6,
                    "temperature": 0}
            status, first = https_json(c.base + "/v1/chat/completions", body, ctx)
            self.assertEqual(status, 200, first)
            self.assertTrue(first["choices"][0]["message"]["content"])
            time.sleep(0.5)  # the Puts land after the reply
            status, second = https_json(c.base + "/v1/chat/completions", body, ctx)
            self.assertEqual(status, 200, second)
            self.assertGreater(second["usage"]["prompt_tokens_details"]["cached_tokens"], 0)
            stored = scrape(c.store_metrics())
            self.assertGreater(metric(stored, "strata_store_puts_total"), 0)
            # Plain HTTP to the HTTPS port: the handshake fails and the connection is closed.
            with self.assertRaises((urllib.error.URLError, ConnectionError, OSError)) as plain:
                urllib.request.urlopen(c.base.replace("https://", "http://") + "/health",
                                       timeout=10).read()
            self.assertNotIsInstance(plain.exception, urllib.error.HTTPError)
            # A client that does not trust the cluster's CA refuses the router's certificate.
            with self.assertRaises(urllib.error.URLError) as untrusted:
                urllib.request.urlopen(c.base + "/health", timeout=10,
                                       context=ssl.create_default_context())
            self.assertIsInstance(untrusted.exception.reason, ssl.SSLCertVerificationError)
            # A second router with the cluster's certificate but another token: every gRPC call
            # it makes is refused (UNAUTHENTICATED), so it never finds a healthy node.
            wrong = os.path.join(c.dir, "wrong.token")
            with open(wrong, "w") as f:
                f.write("0123456789abcdef" * 4 + "\n")
            port = free_port()
            with open(os.path.join(c.dir, "logs", "router-wrong-token.log"), "w") as log:
                p = subprocess.Popen(
                    [os.path.join(BUILD, "router/strata-router"), "--cluster",
                     os.path.join(c.dir, "cluster.json"), "--listen", "%s:%d" % (HERE, port),
                     "--tls_cert", os.path.join(certs, "node.crt"),
                     "--tls_key", os.path.join(certs, "node.key"), "--tls_ca", c.ca,
                     "--cluster_token_file", wrong,
                     "--http_tls_cert", os.path.join(certs, "router-http.crt"),
                     "--http_tls_key", os.path.join(certs, "router-http.key")],
                    stdout=log, stderr=subprocess.STDOUT)
            try:
                # (its address need not be in the certificate's SANs: only the CA is checked)
                probe = ssl.create_default_context(cafile=c.ca)
                probe.check_hostname = False
                detail = ""
                end = time.monotonic() + 20
                while "wrong cluster token" not in detail and time.monotonic() < end:
                    time.sleep(0.2)
                    try:
                        status, health = https_json("https://%s:%d/health" % (HERE, port), None,
                                                    probe, timeout=2)
                        detail = json.dumps(health)
                    except (OSError, ValueError):
                        continue
                self.assertNotEqual(status, 200)
                self.assertIn("UNAUTHENTICATED", detail)
                self.assertIn("wrong cluster token", detail)
                self.assertNotIn("0123456789abcdef", detail)
            finally:
                p.terminate()
                p.wait(timeout=20)
            # Without a choice of security a process refuses to start, naming both options.
            r = subprocess.run([os.path.join(BUILD, "kvstore/strata-store"), "--listen",
                                "127.0.0.1:0", "--metrics_port", "-1"],
                               capture_output=True, text=True, timeout=30)
            self.assertEqual(r.returncode, 2, r.stderr)
            self.assertIn("--insecure", r.stderr)
            self.assertIn("--tls_cert", r.stderr)
        except Exception:
            print(c.logs())
            raise
        finally:
            c.down()


class DeviceTest(unittest.TestCase):
    """--device cuda on the node binaries, which open the CUDA plugin (lib/libstrata_cuda.so,
    model/cuda_plugin.h): where it cannot serve (no plugin in a build without nvcc, no GPU here,
    a plugin that is not there), each node stops at start saying why and what to use, instead of
    running on the CPU unasked; a bad GPU flag is named."""

    def run_node(self, spec, binary, node, *flags):
        return subprocess.run([os.path.join(BUILD, binary), "--cluster", spec, "--node", node,
                               "--insecure", "--metrics", "off", "--device", "cuda", *flags],
                              capture_output=True, text=True, timeout=60)

    def test_nodes_asked_for_a_gpu_they_cannot_use_stop_saying_why(self):
        gpu_here = subprocess.run(["sh", "-c", "nvidia-smi -L"],
                                  capture_output=True).returncode == 0
        plugin = os.path.join(BUILD, "lib", "libstrata_cuda.so")
        with tempfile.TemporaryDirectory() as d:
            spec = os.path.join(d, "cluster.json")
            with open(spec, "w") as f:
                json.dump({"model": MODEL, "codec": "kivi:k4v4:g32", "chunk_tokens": 64,
                           "store": "127.0.0.1:1",
                           "nodes": [{"id": "p", "role": "prefill", "grpc": "127.0.0.1:1"},
                                     {"id": "d", "role": "decode", "grpc": "127.0.0.1:1",
                                      "transport": "127.0.0.1:1"}]}, f)
            for binary, node in (("prefill_node/strata-prefill", "p"),
                                 ("decode_node/strata-decode", "d")):
                # The build's own plugin: opened (the same build), then no GPU to run on.
                if os.path.exists(plugin):
                    if not gpu_here:
                        r = self.run_node(spec, binary, node)
                        self.assertNotEqual(r.returncode, 0, r.stderr)
                        self.assertIn("no usable GPU", r.stderr)
                else:
                    r = self.run_node(spec, binary, node)
                    self.assertNotEqual(r.returncode, 0, r.stderr)
                    self.assertIn("no CUDA plugin at " + plugin, r.stderr)
                # A plugin named where there is none.
                r = self.run_node(spec, binary, node, "--cuda_plugin",
                                  os.path.join(d, "libstrata_cuda.so"))
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("device cuda:0: no CUDA plugin at " +
                              os.path.join(d, "libstrata_cuda.so"), r.stderr)
                self.assertIn("--device cpu", r.stderr)
                # Bad GPU flags, before anything is opened.
                r = self.run_node(spec, binary, node, "--gpu_kv_bytes", "lots")
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("--gpu_kv_bytes: 'lots'", r.stderr)
                r = self.run_node(spec, binary, node, "--gpu_max_sequences", "0")
                self.assertEqual(r.returncode, 2, r.stderr)
                self.assertIn("--gpu_max_sequences: 0", r.stderr)


def routed_decode(c, request_id, role="decode"):
    """The decode (or prefill) node the router chose for `request_id` (its routing log line)."""
    with open(os.path.join(c.dir, "logs", "router.log")) as f:
        for line in f:
            if "[%s] routed" % request_id in line:
                return re.search(r"%s=([^\s,;)]+)" % role, line).group(1)
    raise RuntimeError("no routing line for " + request_id)


def restart_store(c):
    store_host, store_port = c.spec["store"].rsplit(":", 1)
    store_port = int(store_port)
    with open(os.path.join(c.dir, "logs", "store-restarted.log"), "w") as log:
        p = subprocess.Popen(c.on_host("store", [
            os.path.join(BUILD, "kvstore/strata-store"), "--listen", c.spec["store"],
            "--ram_bytes", "512M", "--disk_path", os.path.join(c.dir, "store"), "--disk_bytes",
            "4G", "--metrics_host", store_host, "--metrics_port", str(store_port + 1),
            "--insecure"]),
            stdout=log, stderr=subprocess.STDOUT)
    with open(os.path.join(c.dir, "pids"), "a") as f:
        f.write("store-restarted %d\n" % p.pid)
    for _ in range(100):
        with socket.socket() as s:
            if s.connect_ex((store_host, store_port)) == 0:
                return p
        time.sleep(0.1)
    raise RuntimeError("the store did not restart")


def wait_exit(pid, timeout=20):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise RuntimeError("pid %d did not exit" % pid)


def wait_healthy(base, timeout=20):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError("%s is not healthy" % base)


def CompleteAt(base, prompt, max_tokens):  # noqa: N802 - reads as a request
    status, resp, _ = http_json(base + "/v1/completions",
                                {"model": "strata-tiny", "prompt": prompt,
                                 "max_tokens": max_tokens, "temperature": 0})
    if status != 200:
        raise RuntimeError("HTTP %d: %s" % (status, resp))
    return resp


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=BUILD)
    ap.add_argument("--netns", default="", help="run every process on a host of its own")
    args, rest = ap.parse_known_args()
    BUILD = os.path.abspath(args.build)
    if args.netns:
        enter_hub(args.netns)  # re-executes this script in the hub, or exits 0 with a skip
        NETNS, HERE = args.netns, HUB_ADDRESS
    unittest.main(argv=[sys.argv[0]] + rest, verbosity=2)
