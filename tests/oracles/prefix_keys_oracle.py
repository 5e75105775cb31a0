#!/usr/bin/python3
"""Oracle for Strata's prefix keys: vLLM's chained block hash computed with CPython's own pickle
module and Debian's python3-cbor2, the serializers vLLM itself uses.

Reads cases from stdin, one a line, fields separated by spaces:
    ALGO B SEED_HEX LORA_HEX SALT_HEX TOKENS
ALGO is sha256 or sha256_cbor; *_HEX are UTF-8 texts in hex ("-" for empty); TOKENS is a
comma-separated list of token ids ("-" for none).

Writes two lines a case: the hex hashes of every full block (space separated; "-" if none), then
the hex of the exact bytes hashed for the first block (or of the seed when there is no block).
"""
import hashlib
import pickle
import sys

import cbor2


def serialize(algo, obj):
    if algo == "sha256":
        return pickle.dumps(obj, protocol=5)
    if algo == "sha256_cbor":
        return cbor2.dumps(obj, canonical=True)
    raise SystemExit(f"unknown algorithm {algo}")


def text(field):
    return "" if field == "-" else bytes.fromhex(field).decode("utf-8")


def main():
    for line in sys.stdin:
        algo, b, seed, lora, salt, tokens = line.split()
        b = int(b)
        seed, lora, salt = text(seed), text(lora), text(salt)
        tokens = [] if tokens == "-" else [int(t) for t in tokens.split(",")]
        parent = hashlib.sha256(serialize(algo, seed)).digest()
        first_bytes = serialize(algo, seed)
        hashes = []
        for i in range(len(tokens) // b):
            extra = []
            if lora:
                extra.append(lora)
            if i == 0 and salt:
                extra.append(salt)
            data = serialize(algo, (parent, tuple(tokens[i * b:(i + 1) * b]),
                                    tuple(extra) if extra else None))
            if i == 0:
                first_bytes = data
            parent = hashlib.sha256(data).digest()
            hashes.append(parent.hex())
        print(" ".join(hashes) if hashes else "-")
        print(first_bytes.hex())


if __name__ == "__main__":
    main()
