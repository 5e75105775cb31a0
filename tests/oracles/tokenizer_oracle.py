#!/usr/bin/python3
"""Oracle for Strata's C++ tokenizer: encodes texts with the Python byte-level BPE of
tools/train_model.py, whose pre-tokenizer runs the tokenizer.json regex in the `regex` module
(real look-ahead, which RE2 lacks and the C++ side emulates).

  tokenizer_oracle.py TOKENIZER_JSON < texts.json > ids.json   (a JSON list in, a list of id lists out)
"""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
import train_model  # noqa: E402


def main():
    tj = json.load(open(sys.argv[1], encoding="utf-8"))
    vocab = tj["model"]["vocab"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in tj["model"]["merges"]]
    pattern = tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"]
    train_model.PRETOKENIZE = pattern
    tok = train_model.Tokenizer(vocab, merges)
    texts = json.load(sys.stdin)
    json.dump([tok.encode(t) for t in texts], sys.stdout)


if __name__ == "__main__":
    main()
