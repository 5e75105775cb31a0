#!/usr/bin/python3
"""Faults on separate hosts, each under a steady load of streaming clients.

Every process of a cluster runs on a host of its own (a network namespace joined to a bridge by
a veth pair, deploy/netns/hosts.sh); the clients run in the hub. One fresh cluster per fault:

  - a decode host stopped mid-stream (SIGSTOP, then SIGCONT),
  - a prefill host lost mid-transfer (its link down, then up),
  - the store host lost and back (kill -9, restarted on the same disk),
  - lossy, slow links (1 % loss and 20 ms delay on the prefill and decode hosts: tc netem, or
    where the kernel has none, nftables drops and a tbf-limited link; hosts.sh impair),
  - etcd lost (its host's link down past the nodes' lease TTL, then up).

Each test asserts what the clients saw (no client hangs past its timeout; who got an error or
was retried) and what the metrics counted, and records the figures (requests sent, failed,
retried, recovered; time to recover). With --results DIR they are written to
DIR/netns_faults-DATE-COMMIT.{json,md}.

  tests/cluster/netns_faults_test.py --build build [--hub NAME] [--results bench/results]
                                     [unittest args]
Needs root (network namespaces); prints a skip line and exits 0 without them. Standard library
only (Debian's /usr/bin/python3).
"""
import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request

HERE_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE_DIR))
spec = importlib.util.spec_from_file_location(
    "e2e", os.path.join(ROOT, "tests/e2e/cluster_e2e_test.py"))
e2e = importlib.util.module_from_spec(spec)
spec.loader.exec_module(e2e)

CODEC = "kivi:k4v4:g32"
CLIENT_TIMEOUT = 30.0  # a client gives up on a read after this long: that is a hang
RESULTS = {}           # fault -> figures
ETCD_HOST_ADDRESS = "10.77.0.2"  # the hub's own /24 (clusters use 10.77.B.* with B >= 1)


class Load:
    """`clients` threads, each streaming completions back to back until stop()."""

    def __init__(self, base, clients=4, max_tokens=32, prompt=None, temperature=0.0):
        self.base = base
        self.clients = clients
        self.max_tokens = max_tokens
        self.prompt = prompt or (lambda client, i: "%s (%d.%d)" % (
            e2e.PROMPTS[(client + i) % len(e2e.PROMPTS)], client, i))
        self.temperature = temperature
        self.records = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.threads = []

    def start(self):
        for c in range(self.clients):
            t = threading.Thread(target=self.run, args=(c,), daemon=True)
            t.start()
            self.threads.append(t)
        return self

    def stop(self):
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=CLIENT_TIMEOUT + 10)
        return sorted(self.records, key=lambda r: r["start"])

    def run(self, client):
        i = 0
        while not self.stopping.is_set():
            record = one_stream(self.base, self.prompt(client, i), self.max_tokens,
                                self.temperature)
            record["client"] = client
            with self.lock:
                self.records.append(record)
            i += 1
            if record["outcome"] != "ok":
                time.sleep(0.2)  # as a client would before its next try


def one_stream(base, prompt, max_tokens, temperature=0.0, salt=None):
    body = {"model": "strata-tiny", "prompt": prompt, "max_tokens": max_tokens,
            "temperature": temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if salt is not None:
        body["cache_salt"] = salt
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    r = {"start": time.monotonic(), "outcome": "broken", "tokens": 0, "text": "", "id": "",
         "first_token": None, "error": ""}
    try:
        with urllib.request.urlopen(req, timeout=CLIENT_TIMEOUT) as resp:
            for raw in resp:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    r["outcome"] = "ok" if r["outcome"] != "error" else "error"
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    r["outcome"] = "error"
                    r["error"] = event["error"].get("message", "")
                    continue
                r["id"] = event.get("id", r["id"])
                if event.get("usage"):
                    r["usage"] = event["usage"]
                for choice in event.get("choices", []):
                    if choice.get("text"):
                        if r["first_token"] is None:
                            r["first_token"] = time.monotonic()
                        r["tokens"] += 1
                        r["text"] += choice["text"]
    except urllib.error.HTTPError as err:
        r["outcome"] = "error"
        r["error"] = "HTTP %d" % err.code
    except socket.timeout:
        r["outcome"] = "hung"
    except OSError as err:
        r["outcome"] = "broken"
        r["error"] = str(err)
    r["end"] = time.monotonic()
    return r


def summarize(records, fault_at, healed_at, retried=0):
    """The figures of one fault: counts, and the time from the fault (or from its healing, for
    faults that last) until every request started from then on succeeded."""
    outcomes = {}
    for r in records:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    ok_from = None
    for r in records:
        if r["outcome"] != "ok":
            ok_from = None
        elif ok_from is None:
            ok_from = r["start"]
    after_fault = [r for r in records if r["start"] >= fault_at]
    return {
        "requests": len(records),
        "ok": outcomes.get("ok", 0),
        "failed": outcomes.get("error", 0) + outcomes.get("broken", 0),
        "hung": outcomes.get("hung", 0),
        "retried": int(retried),
        "failed_after_fault": sum(r["outcome"] != "ok" for r in after_fault),
        "longest_request_s": round(max((r["end"] - r["start"] for r in records), default=0), 2),
        "recovered_s_after_fault": None if ok_from is None else round(max(0.0, ok_from - fault_at), 2),
        "fault_lasted_s": round(healed_at - fault_at, 2),
        # What the clients that failed were told (distinct messages, at most three).
        "errors": sorted({r["error"][:160] for r in records if r["outcome"] != "ok"})[:3],
    }


def router_metric(c, name, label=""):
    return e2e.metric(e2e.scrape(c.base.replace("http://", "")), name, label)


def ns(c, name):
    return c.hosts()[name][0]


def wait_for(predicate, timeout, what):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError("not within %.0f s: %s" % (timeout, what))


def p50(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


class NetnsFaultTest(unittest.TestCase):
    def run(self, result=None):
        self.cluster = None
        super().run(result)

    def tearDown(self):
        if self.cluster is not None:
            result = self._outcome.result
            if any(t is self for t, _ in result.failures + result.errors):
                print(self.cluster.logs())
                with open(os.path.join(self.cluster.dir, "logs", "router.log")) as f:
                    print("== router.log: membership, health and refusals\n" + "".join(
                        line for line in f if any(w in line for w in (
                            "refused", "membership", "healthy", "joined", "left", "failed"))))
            self.cluster.down()

    def up(self, **kw):
        self.cluster = e2e.Cluster(CODEC, **kw)
        return self.cluster

    def test_decode_host_stopped_mid_stream(self):
        c = self.up(prefill=1, decode=2)
        retried0 = router_metric(c, "strata_router_retries_total")
        load = Load(c.base, clients=4, max_tokens=64).start()
        time.sleep(3)
        victim = c.pids()["decode-0"]
        fault_at = time.monotonic()
        os.kill(victim, signal.SIGSTOP)
        time.sleep(8)
        os.kill(victim, signal.SIGCONT)
        healed_at = time.monotonic()
        routed0 = router_metric(c, "strata_router_routed_total", 'decode="decode-0"')
        time.sleep(6)
        records = load.stop()
        retried = router_metric(c, "strata_router_retries_total") - retried0
        figures = summarize(records, fault_at, healed_at, retried)
        RESULTS["decode host stopped (SIGSTOP 8 s)"] = figures
        self.assertEqual(figures["hung"], 0, figures)
        # Streams on the stopped host end within the gRPC keepalive (about 4 s), not at a timeout.
        self.assertLess(figures["longest_request_s"], 15, figures)
        hit = [r for r in records if r["start"] < fault_at + 1 and r["end"] > fault_at
               and r["outcome"] != "ok"]
        self.assertGreater(len(hit) + figures["retried"], 0, "the fault touched no request")
        for r in hit:
            self.assertEqual(r["outcome"], "error", r)  # an error event, not a silent end
        # Once the router has seen the node stop (load polls, keepalive), requests succeed.
        late = [r for r in records if fault_at + 5 < r["start"]]
        self.assertTrue(late and all(r["outcome"] == "ok" for r in late), figures)
        # Continued, it is routed to again.
        self.assertGreater(
            router_metric(c, "strata_router_routed_total", 'decode="decode-0"'), routed0)

    def test_prefill_host_lost_mid_transfer(self):
        c = self.up(prefill=2, decode=1)
        retried0 = router_metric(c, "strata_router_retries_total")
        # Long prompts, never cached (a salt per request): every request spends its time in
        # prefill and transfer.
        counter = iter(range(10 ** 6))
        load = Load(c.base, clients=3, max_tokens=8,
                    prompt=lambda client, i: "Transfer %d.%d %d.%s" % (
                        client, i, next(counter), e2e.LONG * 5)).start()
        time.sleep(3)
        fault_at = time.monotonic()
        subprocess.run(["ip", "-n", ns(c, "prefill-0"), "link", "set", "eth0", "down"], check=True)
        time.sleep(8)
        subprocess.run(["ip", "-n", ns(c, "prefill-0"), "link", "set", "eth0", "up"], check=True)
        healed_at = time.monotonic()
        time.sleep(5)
        records = load.stop()
        retried = router_metric(c, "strata_router_retries_total") - retried0
        figures = summarize(records, fault_at, healed_at, retried)
        RESULTS["prefill host lost (link down 8 s)"] = figures
        self.assertEqual(figures["hung"], 0, figures)
        self.assertGreater(figures["retried"], 0, "no request was on prefill-0 at the fault")
        # Retried once elsewhere: the clients saw no error.
        self.assertEqual(figures["failed"], 0, figures)
        with open(os.path.join(c.dir, "logs", "router.log")) as f:
            log = f.read()
        self.assertIn("before the first token", log)
        self.assertIn("-retry1: routed", log)
        # The decode node freed the partial sequences of the first attempts.
        m = e2e.scrape(c.node("decode-0")["metrics"])

        def idle():
            m = e2e.scrape(c.node("decode-0")["metrics"])
            return (e2e.metric(m, "strata_decode_running") == 0 and
                    e2e.metric(m, "strata_decode_waiting") == 0 and
                    e2e.metric(m, "strata_decode_kv_bytes_in_use") == 0 and
                    e2e.metric(m, "strata_decode_kv_bytes_arrived") == 0)
        wait_for(idle, 10, "the decode node holds sequences after the load ended: %s" % m)

    def test_store_host_lost_and_back(self):
        c = self.up(prefill=1, decode=1)
        warm = "Kept on disk." + e2e.LONG * 3
        text, _, _ = e2e.complete(c, warm, 8)
        time.sleep(0.5)
        load = Load(c.base, clients=3, max_tokens=16,
                    prompt=lambda client, i: "%s%s (%d.%d)" % (
                        e2e.PROMPTS[i % 4], e2e.LONG, client, i)).start()
        time.sleep(3)
        fault_at = time.monotonic()
        os.kill(c.pids()["store"], signal.SIGKILL)
        time.sleep(5)
        store = e2e.restart_store(c)
        healed_at = time.monotonic()
        try:
            time.sleep(5)
            records = load.stop()
            figures = summarize(records, fault_at, healed_at)
            RESULTS["store host lost (kill -9, back after 5 s)"] = figures
            self.assertEqual(figures["hung"], 0, figures)
            self.assertEqual(figures["failed"], 0, figures)  # misses, not failures
            # Its disk tier is intact: the warm prefix hits again.
            _, usage, _ = e2e.complete(c, warm + text + " Next.", 8)
            self.assertGreater(usage["prompt_tokens_details"]["cached_tokens"], 0)
            store_metrics = e2e.scrape(c.store_metrics())
            self.assertEqual(e2e.metric(store_metrics, "strata_store_corruptions_total"), 0)
            self.assertEqual(e2e.metric(store_metrics, "strata_store_index_lost_blocks_total"), 0)
            decode = e2e.scrape(c.node("decode-0")["metrics"])
            self.assertEqual(e2e.metric(decode, "strata_decode_blocks_damaged_total"), 0)
            figures["warm_prefix_cached_tokens_after"] = usage["prompt_tokens_details"]["cached_tokens"]
        finally:
            store.kill()
            store.wait()

    def test_lossy_slow_links(self):
        c = self.up(prefill=1, decode=1)
        prompts = ["%s%s [%d]" % (e2e.PROMPTS[i % 4], e2e.LONG, i) for i in range(8)]

        def phase(salt):
            out = {}

            def one(i):
                out[i] = one_stream(c.base, prompts[i], 24, salt=salt)
            threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            return [out[i] for i in range(len(prompts))], time.monotonic() - t0

        # Rounds of a clean phase then a lossy one (each with salts of its own: no cache hits).
        # Another process loading the CPU only ever adds time, so each kind's best round is its
        # own cost: the lossy one's must be the higher.
        ttft = lambda rs: p50([r["first_token"] - r["start"] for r in rs])  # noqa: E731
        rounds, applied = [], ""
        for i in range(3):
            clean, clean_s = phase("clean-%d" % i)
            for host in ("prefill-0", "decode-0"):
                applied = subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "impair",
                                          ns(c, host), "1", "20"], check=True,
                                         capture_output=True, text=True).stdout.strip()
            try:
                lossy, lossy_s = phase("lossy-%d" % i)
            finally:
                for host in ("prefill-0", "decode-0"):
                    subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "heal",
                                    ns(c, host)])
            for a, b in zip(clean, lossy):
                self.assertEqual(a["outcome"], "ok", a)
                self.assertEqual(b["outcome"], "ok", b)
                self.assertEqual(a["text"], b["text"],
                                 "a transfer over the lossy link changed the output")
            rounds.append((clean, clean_s, lossy, lossy_s))
        decode = e2e.scrape(c.node("decode-0")["metrics"])
        self.assertEqual(e2e.metric(decode, "strata_decode_blocks_damaged_total"), 0)
        best_clean = min(ttft(r[0]) for r in rounds)
        best_lossy = min(ttft(r[2]) for r in rounds)
        everyone = [x for r in rounds for x in r[0] + r[2]]
        RESULTS["lossy, slow links (1% loss; 20 ms delay or a 20 Mbit/s link)"] = {
            "requests": len(everyone), "ok": sum(r["outcome"] == "ok" for r in everyone),
            "failed": sum(r["outcome"] != "ok" for r in everyone), "hung": 0, "retried": 0,
            "outputs_equal": True,
            "ttft_p50_clean_s": round(best_clean, 3), "ttft_p50_lossy_s": round(best_lossy, 3),
            "wall_clean_s": round(min(r[1] for r in rounds), 2),
            "wall_lossy_s": round(min(r[3] for r in rounds), 2),
            "rounds": len(rounds), "impairment": applied,
        }
        self.assertGreater(best_lossy, best_clean)  # slower, and nothing else

    def test_etcd_lost(self):
        hub = e2e.NETNS
        etcd_ns = "%s-etcd-%d" % (hub, os.getpid())
        subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "add", hub, etcd_ns,
                        ETCD_HOST_ADDRESS], check=True)
        etcd_dir = "/tmp/strata-netns-etcd-%d" % os.getpid()
        port = 2379
        client = "http://%s:%d" % (ETCD_HOST_ADDRESS, port)
        peer = "http://%s:%d" % (ETCD_HOST_ADDRESS, port + 1)
        etcd = subprocess.Popen(
            ["ip", "netns", "exec", etcd_ns, "etcd", "--data-dir", etcd_dir,
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", "default=" + peer, "--heartbeat-interval", "10",
             "--election-timeout", "100", "--log-level", "error"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        keys = KeysAt("%s:%d" % (ETCD_HOST_ADDRESS, port))
        try:
            wait_for(lambda: keys("/") is not None, 10, "etcd started")
            c = self.up(prefill=1, decode=2,
                        extra=["--etcd", "%s:%d" % (ETCD_HOST_ADDRESS, port), "--etcd-ttl", "2"])
            prefix = "/strata/%s/nodes/" % os.path.basename(c.dir)
            everyone = [prefix + n for n in ("decode-0", "decode-1", "prefill-0")]
            self.assertEqual(keys(prefix), everyone)
            load = Load(c.base, clients=3, max_tokens=24).start()
            time.sleep(3)
            fault_at = time.monotonic()
            subprocess.run(["ip", "-n", etcd_ns, "link", "set", "eth0", "down"], check=True)
            time.sleep(6)  # three lease TTLs: in etcd, every registration expires meanwhile
            subprocess.run(["ip", "-n", etcd_ns, "link", "set", "eth0", "up"], check=True)
            healed_at = time.monotonic()
            wait_for(lambda: keys(prefix) == everyone, 15, "the nodes registered again")
            reregistered_s = time.monotonic() - healed_at
            time.sleep(2)
            records = load.stop()
            figures = summarize(records, fault_at, healed_at)
            figures["reregistered_s_after_etcd_back"] = round(reregistered_s, 2)
            RESULTS["etcd lost (its link down 6 s, lease TTL 2 s)"] = figures
            self.assertEqual(figures["hung"], 0, figures)
            self.assertEqual(figures["failed"], 0, figures)  # served with the membership it had
            # The router follows etcd again: a node killed now leaves its routing.
            os.kill(c.pids()["decode-1"], signal.SIGKILL)
            wait_for(lambda: keys(prefix) == [prefix + "decode-0", prefix + "prefill-0"], 8,
                     "decode-1's registration expired")
            time.sleep(0.5)
            for p in e2e.PROMPTS:
                _, _, events = e2e.complete(c, p, 4, stream=True)
                self.assertEqual(e2e.routed_decode(c, json.loads(events[0])["id"]), "decode-0")
        finally:
            etcd.kill()
            etcd.wait()
            subprocess.run(["rm", "-rf", etcd_dir])
            subprocess.run([os.path.join(ROOT, "deploy/netns/hosts.sh"), "del", etcd_ns])


def KeysAt(address):  # noqa: N802 - a factory
    def keys(prefix):
        import base64
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        body = {"key": base64.b64encode(prefix.encode()).decode(),
                "range_end": base64.b64encode(end.encode()).decode(), "keys_only": True}
        try:
            _, r, _ = e2e.http_json("http://%s/v3/kv/range" % address, body, 2)
        except OSError:
            return None
        return sorted(base64.b64decode(kv["key"]).decode() for kv in r.get("kvs", []))
    return keys


def write_results(directory):
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                            capture_output=True, text=True).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    date = datetime.date.today().isoformat()
    cpu = ""
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    doc = {"date": date, "commit": commit + ("+dirty" if dirty else ""),
           "machine": "%s, %d cores, %s" % (cpu, os.cpu_count(), platform.platform()),
           "setup": "each process on a host of its own (network namespaces on one machine, "
                    "veth pairs to a bridge); codec %s; clients stream back to back; client "
                    "read timeout %.0f s; gRPC keepalive 2 s + 2 s" % (CODEC, CLIENT_TIMEOUT),
           "command": "tests/cluster/netns_faults_test.py --build build --results bench/results",
           "faults": RESULTS}
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, "netns_faults-%s-%s" % (date, commit))
    with open(base + ".json", "w") as f:
        json.dump(doc, f, indent=2)
    cols = ["requests", "ok", "failed", "hung", "retried", "failed_after_fault",
            "recovered_s_after_fault", "longest_request_s"]
    with open(base + ".md", "w") as f:
        f.write("# Faults on separate hosts under streaming load\n\n")
        f.write("%s, commit %s, %s.\n\n%s.\n\nCommand: `%s`\n\n" % (
            date, doc["commit"], doc["machine"], doc["setup"], doc["command"]))
        f.write("| fault | " + " | ".join(cols) + " |\n")
        f.write("|---|" + "---|" * len(cols) + "\n")
        for name, fig in RESULTS.items():
            f.write("| %s | %s |\n" % (name, " | ".join(str(fig.get(k, "")) for k in cols)))
        f.write("\nOther figures per fault:\n\n")
        for name, fig in RESULTS.items():
            extra = {k: v for k, v in fig.items() if k not in cols}
            f.write("- %s: %s\n" % (name, ", ".join("%s %s" % kv for kv in extra.items())))
    print("netns faults: figures in %s.{json,md}" % base)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--hub", default="strata-faults")
    ap.add_argument("--results", default="")
    args, rest = ap.parse_known_args()
    e2e.BUILD = os.path.abspath(args.build)
    e2e.enter_hub(args.hub)  # re-executes this script in the hub, or exits 0 with a skip
    e2e.NETNS, e2e.HERE = args.hub, e2e.HUB_ADDRESS
    program = unittest.main(argv=[sys.argv[0]] + rest, verbosity=2, exit=False)
    if args.results and RESULTS:
        write_results(os.path.abspath(args.results))
    sys.exit(0 if program.result.wasSuccessful() else 1)
