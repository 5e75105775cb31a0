#!/usr/bin/env python3
"""Redis's own CPU per 1 MiB GET against per 1 MiB HGET (the shared tier's read: one hash per
chunk), on one redis-server on loopback that this script starts and stops, over plain TCP or, with
--tls, TLS only (a P-256 CA and server certificate made here with openssl): 64 string keys and 64
one-field hashes of the same random MiB, read in pipelines of 8 by one client, GET and HGET
alternating three times. Prints the server's CPU microseconds per read (utime + stime from /proc)
and the reads per second.

  python3 bench/redis_get_hget_cpu.py [--port 7391] [--tls] [--rcvbuf BYTES]

--rcvbuf: the client socket's receive buffer (SO_RCVBUF; default 8 MiB, 0: the kernel's own,
autotuned). --pexpire: each read followed by a PEXPIRE of its key in the same pipeline (the shared
tier renews a chunk's TTL so). --drain_pause_us N: the client pauses N microseconds after each
receive (at most 64 KiB), as a client busy elsewhere drains a node's replies late.
"""
import argparse
import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=7391)
    ap.add_argument("--tls", action="store_true")
    ap.add_argument("--rcvbuf", type=int, default=8 << 20)
    ap.add_argument("--pexpire", action="store_true")
    ap.add_argument("--drain_pause_us", type=int, default=0)
    args = ap.parse_args()
    if shutil.which("redis-server") is None:
        raise SystemExit("redis_get_hget_cpu: no redis-server (scripts/setup.sh installs it)")
    work = tempfile.mkdtemp(prefix="redis-get-hget-")
    pidfile = os.path.join(work, "r.pid")
    listen = ["--port", str(args.port)]
    context = None
    if args.tls:
        ca, cert, key = (os.path.join(work, n) for n in ("ca.pem", "server.pem", "server.key"))
        ca_key = os.path.join(work, "ca.key")
        csr = os.path.join(work, "server.csr")
        for cmd in (
                ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", ca_key],
                ["openssl", "req", "-x509", "-new", "-key", ca_key, "-subj", "/CN=bench-ca",
                 "-days", "1", "-out", ca],
                ["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", key],
                ["openssl", "req", "-new", "-key", key, "-subj", "/CN=127.0.0.1", "-out", csr],
                ["openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
                 "-CAcreateserial", "-days", "1", "-out", cert]):
            subprocess.run(cmd, check=True, capture_output=True)
        listen = ["--port", "0", "--tls-port", str(args.port), "--tls-cert-file", cert,
                  "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
        context = ssl.create_default_context(cafile=ca)
        context.check_hostname = False
    subprocess.run(["redis-server", *listen, "--save", "", "--appendonly", "no",
                    "--daemonize", "yes", "--pidfile", pidfile, "--dir", work,
                    "--logfile", os.path.join(work, "r.log")], check=True)
    try:
        for _ in range(50):
            if os.path.exists(pidfile):
                break
            time.sleep(0.1)
        pid = int(open(pidfile).read())
        run(args.port, pid, context, args.rcvbuf, args.pexpire, args.drain_pause_us)
    finally:
        if os.path.exists(pidfile):
            subprocess.run(["kill", open(pidfile).read().strip()], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def run(port, pid, context, rcvbuf, pexpire, drain_pause_us):
    def cpu():
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

    def enc(*argv):
        out = b"*%d\r\n" % len(argv)
        for a in argv:
            a = a.encode() if isinstance(a, str) else a
            out += b"$%d\r\n" % len(a) + a + b"\r\n"
        return out

    s = None
    for _ in range(50):  # the server may take a moment to listen
        try:
            s = socket.create_connection(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.1)
    if s is None:
        raise SystemExit("redis_get_hget_cpu: the server does not answer")
    if rcvbuf > 0:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    if context is not None:
        s = context.wrap_socket(s, server_hostname="127.0.0.1")
    size = 1 << 20
    buf = memoryview(bytearray(16 << 20))

    def read_bytes(need):
        got = 0
        while got < need:
            k = s.recv_into(buf, min(len(buf), 64 << 10) if drain_pause_us > 0 else len(buf))
            if drain_pause_us > 0:
                time.sleep(drain_pause_us / 1e6)
            if k == 0:
                raise SystemExit("redis_get_hget_cpu: the server closed the connection")
            got += k

    value = os.urandom(size)
    for i in range(64):
        s.sendall(enc("SET", "k%d" % i, value))
        read_bytes(5)  # +OK\r\n
        s.sendall(enc("HSET", "h%d" % i, "f", value))
        read_bytes(4)  # :1\r\n
    reply = size + len(b"$%d\r\n" % size) + 2 + (len(b":1\r\n") if pexpire else 0)
    pipeline, batches = 8, 250
    for _ in range(3):
        for kind in ("GET", "HGET"):
            c0, t0 = cpu(), time.time()
            for b in range(batches):
                keys = [(b * pipeline + j) % 64 for j in range(pipeline)]
                cmds = []
                for k in keys:
                    cmds.append(enc("GET", "k%d" % k) if kind == "GET" else enc("HGET", "h%d" % k, "f"))
                    if pexpire:
                        cmds.append(enc("PEXPIRE", ("k%d" if kind == "GET" else "h%d") % k, "3600000"))
                s.sendall(b"".join(cmds))
                read_bytes(pipeline * reply)
            ops = batches * pipeline
            print(f"{kind:5s} server {(cpu() - c0) / ops * 1e6:6.0f} us per read  "
                  f"{ops / (time.time() - t0):6.0f} reads/s", flush=True)


if __name__ == "__main__":
    main()
