#!/usr/bin/python3
"""Trains Strata's bundled model: a small Llama-architecture language model on English text that
a Debian machine already has (package documentation and manual pages), with a byte-level BPE
tokenizer trained by this script on the same text, and exports it in the Hugging Face layout
(config.json, model.safetensors, tokenizer.json) that model/ loads.

Deterministic given --seed: the corpus is read in sorted order, the held-out split is chosen by a
hash of each document's path, the tokenizer and the model are trained with fixed seeds.

Runs on Debian's python3-torch (CPU) or on a GPU's PyTorch when one is present (--device cuda).

  /usr/bin/python3 tools/train_model.py --out models/strata-tiny --minutes 60
  /usr/bin/python3 tools/train_model.py --out /tmp/m --preset smoke --steps 20   # pipeline check
  # The second model: data prepared here (no PyTorch needed), trained where a GPU is
  # (scripts/second_model.sh runs both halves).
  /usr/bin/python3 tools/train_model.py --out build/strata-small-data --preset strata-small \
      --prepare-only
  /usr/bin/python3 tools/train_model.py --out OUT --preset strata-small \
      --data build/strata-small-data --device cuda --minutes 8 --dtype BF16

Outputs in --out: config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
heldout.txt (the held-out split, never trained on), fixture.safetensors (token ids and PyTorch
logits for a few held-out sequences, for the C++ logits test), train_log.json (loss curve, tokens
seen, held-out perplexity), README.md (the model card).
"""
import argparse
import collections
import contextlib
import gzip
import hashlib
import json
import math
import os
import re
import struct
import sys
import time
import unicodedata

# ---------------------------------------------------------------------------------------------
# Corpus: Debian's documentation and manual pages.

DOC_ROOT = "/usr/share/doc"
MAN_ROOT = "/usr/share/man"
INFO_ROOT = "/usr/share/info"
# Generated command references (tens of thousands of near-identical pages) that would drown the
# prose: the Google Cloud SDK ships one man page per gcloud subcommand.
SKIP_MAN = re.compile(r"/(gcloud|bq|gsutil)[-_.]")


def _read_maybe_gz(path, limit=2 << 20):
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read(limit)
    except OSError:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


_ROFF_ESCAPES = re.compile(r"\\f[BIRPH0-9]|\\f\(..|\\f\[[^\]]*\]|\\s[+-]?\d|\\[&|^%:]|\\\(em|\\\(en")


def _strip_roff(text):
    """Turns man(7)/mdoc(7) source into plain text: drops requests and comments, keeps the
    argument text of font macros, removes inline escapes."""
    out = []
    for line in text.splitlines():
        if line.startswith(".\\\"") or line.startswith("'\\\"") or line.startswith(".\\}"):
            continue
        if line.startswith("."):
            parts = line.split(None, 1)
            macro = parts[0]
            if macro in (".B", ".I", ".BR", ".IR", ".RB", ".RI", ".BI", ".IB", ".SH", ".SS",
                         ".Nm", ".Nd", ".Sh", ".Ss", ".It", ".Dl", ".Em", ".Ar", ".Fl", ".Pa"):
                if len(parts) > 1:
                    out.append(parts[1].replace('"', ""))
            elif macro in (".PP", ".P", ".LP", ".TP", ".IP", ".Pp", ".br", ".sp"):
                out.append("")
            continue
        out.append(line)
    text = "\n".join(out)
    text = _ROFF_ESCAPES.sub("", text)
    text = text.replace("\\-", "-").replace("\\e", "\\").replace("\\ ", " ")
    return text


def _clean(text):
    text = text.replace("\r\n", "\n").replace("\t", "    ")
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def _strip_info(text):
    """GNU info: drop the node separators (0x1f) and the "File: ... Node: ..." header lines."""
    out = []
    for line in text.split("\n"):
        if "\x1f" in line or "\x7f" in line or line.startswith(("File: ", "Tag Table:", "* Menu:")):
            continue
        out.append(line)
    return "\n".join(out)


def _prose_fraction(text):
    """Share of the text in lines that read like sentences (6+ words, mostly letters)."""
    n = 0
    for line in text.splitlines():
        if len(line.split()) >= 6 and \
                sum(c.isalpha() or c == " " for c in line) > 0.85 * len(line):
            n += len(line)
    return n / max(1, len(text))


def _english_enough(text):
    if len(text) < 400:
        return False
    letters = sum(c.isalpha() for c in text)
    ascii_letters = sum(("a" <= c <= "z") or ("A" <= c <= "Z") for c in text)
    return letters > 0.55 * len(text) * 0.8 and ascii_letters > 0.9 * letters


def collect_corpus(max_bytes):
    """(path, text) for every usable document, sorted by path, up to max_bytes in total."""
    paths = []
    for root in (DOC_ROOT, INFO_ROOT, MAN_ROOT):
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames.sort()
            if root == MAN_ROOT and not re.search(r"/man[1-8]$", dirpath):
                continue  # English pages only (translations live in man/<lang>/)
            for name in sorted(filenames):
                if name.startswith(("changelog", "copyright", "NEWS.Debian")):
                    continue
                path = os.path.join(dirpath, name)
                if root == MAN_ROOT and SKIP_MAN.search(path):
                    continue
                paths.append(path)
    docs, total = [], 0
    for path in paths:
        is_man = path.startswith(MAN_ROOT)
        is_info = path.startswith(INFO_ROOT)
        if is_info and not re.search(r"\.info(-\d+)?(\.gz)?$", path):
            continue
        if not is_man and not is_info and \
                not re.search(r"(README|\.txt|\.md|\.rst)(\.gz)?$", path, re.I):
            continue
        text = _read_maybe_gz(path)
        if text is None:
            continue
        if is_man:
            text = _strip_roff(text)
        if is_info:
            text = _strip_info(text)
        text = _clean(text)
        if not _english_enough(text) or _prose_fraction(text) < 0.5:
            continue
        docs.append((path, text))
        total += len(text)
        if total >= max_bytes:
            break
    return docs


GCIDE = "/usr/share/dictd/gcide.dict.dz"  # Debian's dict-gcide: Webster's 1913 + WordNet
_GCIDE_MARKUP = re.compile(r"<[^>]{1,40}>|\{[^}]{0,40}\}")


def gcide_docs(piece_bytes=1 << 16):
    """The GCIDE dictionary (dictzip is gzip) as documents of about piece_bytes each, cut between
    entries and named GCIDE#n (so that the held-out split takes whole pieces)."""
    if not os.path.exists(GCIDE):
        return []
    with gzip.open(GCIDE, "rb") as f:
        text = f.read().decode("utf-8", errors="replace")
    text = _GCIDE_MARKUP.sub("", text)
    start = text.find("\n\nA\n")  # the first entry, after the database's own header
    entries = text[start if start >= 0 else 0:].split("\n\n")
    docs, cur, n = [], [], 0
    for e in entries:
        cur.append(e)
        n += len(e) + 2
        if n >= piece_bytes:
            docs.append((f"{GCIDE}#{len(docs)}", _clean("\n\n".join(cur))))
            cur, n = [], 0
    if cur:
        docs.append((f"{GCIDE}#{len(docs)}", _clean("\n\n".join(cur))))
    return docs


CORPORA = {
    # Package documentation, manual and info pages (the bundled strata-tiny's).
    "debian-docs": ("docs",),
    # The same, then the GCIDE dictionary (dict-gcide) and whatever other documentation the
    # packages scripts/setup_training.sh installs put under /usr/share/doc (python3-doc's reST
    # sources, read as docs): a wider vocabulary than software documentation alone.
    "debian-docs+dict": ("docs", "gcide"),
}


def collect(corpus, max_bytes):
    """(path, text) of `corpus` (a CORPORA key), up to max_bytes: each source in order gets an
    equal share of what is left, so that a later source is not crowded out."""
    docs, total = [], 0
    sources = CORPORA[corpus]
    for i, source in enumerate(sources):
        share = (max_bytes - total) // (len(sources) - i)
        if share <= 0:
            break
        if source == "docs":
            part = collect_corpus(share)
        else:
            part, n = [], 0
            for path, text in gcide_docs():
                if n >= share:
                    break
                part.append((path, text))
                n += len(text)
        docs += part
        total += sum(len(t) for _, t in part)
    return docs


def is_heldout(path, fraction):
    h = int.from_bytes(hashlib.sha256(path.encode()).digest()[:8], "little")
    return (h % 10000) < fraction * 10000


# ---------------------------------------------------------------------------------------------
# Byte-level BPE (the GPT-2 / Llama-3 scheme, saved in Hugging Face tokenizer.json format).

# Llama-3's pre-tokenizer pattern; model/ implements it with RE2 (plus the lookahead by hand).
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
               r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable Unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(texts, vocab_size, specials):
    """Classic BPE over pre-tokenized words: repeatedly merge the most frequent adjacent pair
    (ties: the lexicographically smallest pair). A heap with lazy invalidation keeps each merge
    cheap. Returns (vocab: token -> id, merges: [(a, b)])."""
    import heapq
    import regex  # Debian's python3-regex: \p{L} classes as in tokenizer.json
    pat = regex.compile(PRETOKENIZE)
    b2u = bytes_to_unicode()
    words = collections.Counter()
    for text in texts:
        for piece in pat.findall(text):
            words["".join(b2u[b] for b in piece.encode("utf-8"))] += 1
    vocab = {}
    for b in range(256):  # the byte alphabet, in byte order
        vocab[b2u[b]] = len(vocab)
    word_syms = {w: tuple(w) for w in words}
    pair_counts = collections.Counter()
    pair_words = collections.defaultdict(set)
    for w, c in words.items():
        s = word_syms[w]
        for a, b in zip(s, s[1:]):
            pair_counts[(a, b)] += c
            pair_words[(a, b)].add(w)
    heap = [(-c, p) for p, c in pair_counts.items()]
    heapq.heapify(heap)
    merges = []
    target = vocab_size - len(specials)
    while len(vocab) < target and heap:
        neg, pair = heapq.heappop(heap)
        if pair_counts.get(pair, 0) != -neg:
            continue  # stale entry
        if -neg < 2:
            break
        a, b = pair
        merged = a + b
        merges.append((a, b))
        vocab[merged] = len(vocab)
        changed = set()
        for w in list(pair_words[pair]):
            s = word_syms[w]
            c = words[w]
            for x, y in zip(s, s[1:]):
                pair_counts[(x, y)] -= c
                pair_words[(x, y)].discard(w)
                changed.add((x, y))
            out, i = [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(merged)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            s = tuple(out)
            word_syms[w] = s
            for x, y in zip(s, s[1:]):
                pair_counts[(x, y)] += c
                pair_words[(x, y)].add(w)
                changed.add((x, y))
        for p in changed:
            c = pair_counts.get(p, 0)
            if c <= 0:
                pair_counts.pop(p, None)
                pair_words.pop(p, None)
            else:
                heapq.heappush(heap, (-c, p))
        pair_counts.pop(pair, None)
        pair_words.pop(pair, None)
    for sp in specials:
        vocab[sp] = len(vocab)
    return vocab, merges


class Tokenizer:
    """Encoder for the trained BPE (the same algorithm model/ implements in C++)."""

    def __init__(self, vocab, merges):
        import regex
        self.pat = regex.compile(PRETOKENIZE)
        self.vocab = vocab
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.b2u = bytes_to_unicode()
        self.u2b = {u: b for b, u in self.b2u.items()}
        self.inv = {i: t for t, i in vocab.items()}
        self.cache = {}

    def _bpe(self, word):
        if word in self.cache:
            return self.cache[word]
        syms = list(word)
        while len(syms) > 1:
            best, best_rank = None, None
            for i in range(len(syms) - 1):
                r = self.ranks.get((syms[i], syms[i + 1]))
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = i, r
            if best is None:
                break
            syms[best:best + 2] = [syms[best] + syms[best + 1]]
        ids = [self.vocab[s] for s in syms]
        self.cache[word] = ids
        return ids

    def encode(self, text):
        ids = []
        for piece in self.pat.findall(text):
            ids.extend(self._bpe("".join(self.b2u[b] for b in piece.encode("utf-8"))))
        return ids

    def decode(self, ids):
        data = bytes(self.u2b[ch] for i in ids for ch in self.inv[i] if ch in self.u2b)
        return data.decode("utf-8", errors="replace")


def tokenizer_json(vocab, merges, specials):
    added = [{"id": vocab[s], "content": s, "single_word": False, "lstrip": False,
              "rstrip": False, "normalized": False, "special": True} for s in specials]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": PRETOKENIZE}, "behavior": "Isolated",
                 "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                 "use_regex": False},
            ],
        },
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True,
                    "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": None, "end_of_word_suffix": None,
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [a + " " + b for a, b in merges]},
    }


# ---------------------------------------------------------------------------------------------
# The model: Llama architecture (RMSNorm, RoPE, grouped-query attention, SwiGLU).

PRESETS = {
    # ~7.6 M parameters, 15 MiB at fp16: head_dim 64, 8 query heads over 2 KV heads.
    "tiny": dict(hidden_size=512, intermediate_size=768, num_hidden_layers=3,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=4096,
                 max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                 tie_word_embeddings=True, attention_bias=False, seq_len=512),
    # A differently shaped second model (Qwen2-style q/k/v biases, untied head, head_dim 32,
    # GQA 3) to prove the loader is not written for one shape.
    "qwen2-shape": dict(hidden_size=192, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=6, num_key_value_heads=2, vocab_size=4096,
                        max_position_embeddings=4096, rope_theta=1000000.0,
                        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=True,
                        seq_len=256),
    # The second bundled model (issue 44): attention shaped as a modern LLM's — head_dim 128,
    # 4 query heads per KV head, RoPE theta 500000, SwiGLU, pre-norm — at ~31.5 M parameters
    # (63 MB at bf16: small enough to ship), trained on a GPU for hundreds of millions of token
    # passes over data prepared here (--prepare-only, then --data there).
    "strata-small": dict(hidden_size=1024, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                         max_position_embeddings=4096, rope_theta=500000.0, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, attention_bias=False, seq_len=1024,
                         corpus="debian-docs+dict", corpus_bytes=120 << 20),
    # Pipeline check: tiny and fast.
    "smoke": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, attention_bias=False, seq_len=128),
}


def build_model(cfg):
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    D = cfg["hidden_size"] // H

    class RMSNorm(nn.Module):
        def __init__(self, n, eps):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(n))
            self.eps = eps

        def forward(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight

    def rope(x, pos):  # x [B, heads, T, D]; rotate (i, i + D/2) pairs, as Hugging Face Llama
        inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, D, 2, dtype=torch.float32,
                                                        device=x.device) / D))
        ang = pos[:, None].float() * inv[None, :]
        cos = torch.cat([ang.cos(), ang.cos()], -1)
        sin = torch.cat([ang.sin(), ang.sin()], -1)
        x1, x2 = x[..., :D // 2], x[..., D // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            hs, bias = cfg["hidden_size"], cfg["attention_bias"]
            self.input_layernorm = RMSNorm(hs, cfg["rms_norm_eps"])
            self.q_proj = nn.Linear(hs, H * D, bias=bias)
            self.k_proj = nn.Linear(hs, KV * D, bias=bias)
            self.v_proj = nn.Linear(hs, KV * D, bias=bias)
            self.o_proj = nn.Linear(H * D, hs, bias=False)
            self.post_attention_layernorm = RMSNorm(hs, cfg["rms_norm_eps"])
            self.gate_proj = nn.Linear(hs, cfg["intermediate_size"], bias=False)
            self.up_proj = nn.Linear(hs, cfg["intermediate_size"], bias=False)
            self.down_proj = nn.Linear(cfg["intermediate_size"], hs, bias=False)

        def forward(self, x, pos):
            B, T, _ = x.shape
            h = self.input_layernorm(x)
            q = self.q_proj(h).view(B, T, H, D).transpose(1, 2)
            k = self.k_proj(h).view(B, T, KV, D).transpose(1, 2)
            v = self.v_proj(h).view(B, T, KV, D).transpose(1, 2)
            q, k = rope(q, pos), rope(k, pos)
            k = k.repeat_interleave(H // KV, dim=1)
            v = v.repeat_interleave(H // KV, dim=1)
            if hasattr(F, "scaled_dot_product_attention"):  # PyTorch >= 2: a fused kernel
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:  # causal attention, written out (Debian's PyTorch 1.13 has no SDPA)
                s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
                s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1),
                                  float("-inf"))
                a = torch.softmax(s.float(), -1).to(q.dtype) @ v
            x = x + self.o_proj(a.transpose(1, 2).reshape(B, T, H * D))
            h = self.post_attention_layernorm(x)
            return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg["vocab_size"], cfg["hidden_size"])
            self.layers = nn.ModuleList(Layer() for _ in range(cfg["num_hidden_layers"]))
            self.norm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
            self.lm_head = None if cfg["tie_word_embeddings"] else nn.Linear(
                cfg["hidden_size"], cfg["vocab_size"], bias=False)

        def forward(self, ids):
            pos = torch.arange(ids.shape[1], device=ids.device)
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x, pos)
            x = self.norm(x)
            w = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            return x @ w.t()

    model = Model()
    # GPT-2-style initialization: N(0, 0.02), residual output projections scaled down by depth,
    # zero biases. (PyTorch's defaults give an initial loss far above ln(vocab).)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            nn.init.zeros_(p)
        elif p.dim() == 2:
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std /= math.sqrt(2 * cfg["num_hidden_layers"])
            nn.init.normal_(p, 0.0, std)
    return model


def hf_state_dict(model):
    """Parameter names as Hugging Face Llama / Qwen2 checkpoints spell them."""
    out = {}
    for name, p in model.state_dict().items():
        if name.startswith("lm_head"):
            out[name] = p
            continue
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            group = "self_attn" if rest.split(".")[0] in ("q_proj", "k_proj", "v_proj",
                                                          "o_proj") else \
                ("mlp" if rest.split(".")[0] in ("gate_proj", "up_proj", "down_proj") else None)
            name = f"layers.{i}.{group}.{rest}" if group else f"layers.{i}.{rest}"
        out["model." + name] = p
    return out


def write_safetensors(path, tensors, dtype):
    """The safetensors format: u64 little-endian header length, JSON header, raw data."""
    import torch
    names = {torch.float16: "F16", torch.bfloat16: "BF16", torch.float32: "F32",
             torch.int32: "I32", torch.int64: "I64"}
    tdtype = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}.get(dtype)
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu")
        if tdtype is not None and t.is_floating_point():  # dtype None: keep each tensor's own
            t = t.to(tdtype)
        t = t.contiguous()
        data = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": names[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    """{name: float32 tensor} of a safetensors file write_safetensors wrote (F16, BF16, F32)."""
    import numpy as np
    import torch
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: shorter than a safetensors header")
    n = struct.unpack("<Q", raw[:8])[0]
    if 8 + n > len(raw):
        raise ValueError(f"{path}: header length {n} runs past the file ({len(raw)} bytes)")
    header, base, out = json.loads(raw[8:8 + n]), 8 + n, {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        if not 0 <= a <= b <= len(raw) - base:
            raise ValueError(f"{path}: {name}'s data [{a}, {b}) is outside the file")
        buf = raw[base + a:base + b]
        if meta["dtype"] == "BF16":
            arr = (np.frombuffer(buf, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif meta["dtype"] in ("F16", "F32"):
            arr = np.frombuffer(buf, dtype=np.float16 if meta["dtype"] == "F16" else np.float32)
        else:
            raise ValueError(f"{path}: {name} has dtype {meta['dtype']}, not a weight's")
        out[name] = torch.from_numpy(arr.astype(np.float32).reshape(meta["shape"]))
    return out


MODEL_CARD = """# {name}

A small Llama-architecture language model trained by Strata's own `tools/train_model.py`, so that
Strata runs end to end on a laptop-class CPU with a model whose KV cache is real.

| | |
| --- | --- |
| preset | {preset} |
| parameters | {params:,} ({mib:.1f} MiB at {dtype}) |
| shape | {layers} layers, hidden {hidden}, {heads} query heads over {kv} KV heads, head dim {head_dim}, SwiGLU {ffn}, RoPE theta {theta:g}, context {ctx} |
| tokenizer | byte-level BPE, {vocab} tokens, trained by the script on the training split |
| data | {docs} documents from Debian's /usr/share/doc (READMEs, .txt/.md/.rst), GNU info manuals and English manual pages, kept when mostly prose (the Google Cloud SDK's generated per-command pages left out){dict_note} (corpus `{corpus}`): {train_chars:,} training and {held_chars:,} held-out characters ({train_tokens:,} / {held_tokens:,} tokens); held-out documents chosen by a hash of their path, never trained on; calibration.txt (for codecs that calibrate) is training-split text |
| training | {steps} steps of batch {batch} x {seq} tokens{long}{bos} ({tokens:,} tokens seen), AdamW, peak lr {lr:g}, cosine schedule, {minutes:.1f} min on {device}, PyTorch {torch}, seed {seed}{init} |
| loss | {first:.3f} at the first logged step, {last:.3f} at the last (curve in train_log.json) |
| held-out perplexity | {ppl:.2f} (windows of {eval_len} tokens) |

Reproduce: `/usr/bin/python3 tools/train_model.py {argv}` (after `scripts/setup_training.sh`);
with a step budget the run is deterministic given the seed (a wall-clock budget, as used here,
spaces the learning-rate schedule by time instead, so the same command with `--minutes` differs
slightly from machine to machine).

The text is package documentation, under each package's own license (see /usr/share/doc/*/copyright
on a Debian machine); the weights are a statistical summary of it meant for testing Strata.
"""


# ---------------------------------------------------------------------------------------------

def write_calibration_text(docs, heldout, path, max_chars=400_000):
    """Training-split documents (never the held-out ones) for codecs that calibrate: every 7th
    training document by path order until max_chars, so it spans the corpus."""
    out, n = [], 0
    train = [(p, t) for p, t in docs if not is_heldout(p, heldout)]
    for p, t in train[::7]:
        out.append(t)
        n += len(t)
        if n >= max_chars:
            break
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join(out))


def reproduce_argv(steps):
    """This run's arguments with a wall-clock budget replaced by the steps it reached, so the
    command in the model card reproduces the same weights on any machine."""
    out, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
            continue
        if a == "--minutes":
            skip = True
            continue
        if a.startswith("--minutes="):
            continue
        out.append(a)
    if "--steps" not in out and not any(a.startswith("--steps=") for a in out):
        out += ["--steps", str(steps)]
    return " ".join(out)


def prepare(args, cfg, corpus, specials, t0):
    """Collects `corpus`, trains the tokenizer on the training split and encodes both splits:
    the dict write_prepared saves and the training reads (token ids as lists)."""
    docs = collect(corpus, args.corpus_bytes)
    train_docs = [t for p, t in docs if not is_heldout(p, args.heldout)]
    held_docs = [t for p, t in docs if is_heldout(p, args.heldout)]
    print(f"corpus {corpus}: {len(docs)} documents, {sum(map(len, train_docs))} train and "
          f"{sum(map(len, held_docs))} held-out characters ({time.time() - t0:.0f} s)",
          flush=True)
    tok_text, n = [], 0
    for t in train_docs:
        tok_text.append(t)
        n += len(t)
        if n >= args.tokenizer_bytes:
            break
    vocab, merges = train_bpe(tok_text, cfg["vocab_size"], specials)
    tok = Tokenizer(vocab, merges)
    bos, eos = vocab[specials[0]], vocab[specials[1]]
    print(f"tokenizer: {len(vocab)} tokens, {len(merges)} merges ({time.time() - t0:.0f} s)",
          flush=True)

    def encode_docs(texts):
        ids = []
        for t in texts:
            ids += [bos] + tok.encode(t) + [eos]
        return ids

    cal_path = os.path.join(args.out, ".calibration.tmp")
    write_calibration_text(docs, args.heldout, cal_path)
    with open(cal_path, encoding="utf-8") as f:
        calibration_text = f.read()
    os.remove(cal_path)
    return {
        "vocab": vocab, "merges": merges, "specials": specials,
        "train_ids": encode_docs(train_docs), "held_ids": encode_docs(held_docs),
        "heldout_text": "\n\n".join(held_docs[:200]), "calibration_text": calibration_text,
        "stats": {"corpus": corpus, "corpus_bytes": args.corpus_bytes, "seed": args.seed,
                  "heldout_fraction": args.heldout, "documents": len(docs),
                  "train_chars": sum(map(len, train_docs)),
                  "heldout_chars": sum(map(len, held_docs))},
    }


def _u16_bytes(ids):
    import array
    if ids and max(ids) > 0xFFFF:
        raise ValueError("token ids beyond 16 bits: the prepared format holds uint16")
    a = array.array("H", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _u16_ids(raw):
    import array
    a = array.array("H")
    a.frombytes(raw)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


def write_prepared(out, data):
    """The prepared data in `out`: token ids as little-endian uint16 (the training split
    xz-compressed: the form a lent GPU machine is carried), the tokenizer, the texts, and
    data.json (what was collected, how; token counts; the files' SHA-256)."""
    import lzma
    files = {
        "train.u16.xz": lzma.compress(_u16_bytes(data["train_ids"]), preset=6),
        "heldout.u16": _u16_bytes(data["held_ids"]),
        "tokenizer.json": json.dumps(tokenizer_json(data["vocab"], data["merges"],
                                                    data["specials"]),
                                     ensure_ascii=False).encode("utf-8"),
        "heldout.txt": data["heldout_text"].encode("utf-8"),
        "calibration.txt": data["calibration_text"].encode("utf-8"),
    }
    meta = dict(data["stats"])
    meta.update({"train_tokens": len(data["train_ids"]), "heldout_tokens": len(data["held_ids"]),
                 "specials": data["specials"],
                 "sha256": {name: hashlib.sha256(b).hexdigest() for name, b in files.items()}})
    for name, b in files.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(b)
    with open(os.path.join(out, "data.json"), "w") as f:
        json.dump(meta, f, indent=1, sort_keys=True)


def load_prepared(folder):
    """What write_prepared wrote, checked against data.json's hashes."""
    import lzma
    with open(os.path.join(folder, "data.json")) as f:
        meta = json.load(f)
    raw = {}
    for name, want in meta["sha256"].items():
        with open(os.path.join(folder, name), "rb") as f:
            raw[name] = f.read()
        if hashlib.sha256(raw[name]).hexdigest() != want:
            raise SystemExit(f"{folder}/{name}: its SHA-256 is not the one data.json records")
    tj = json.loads(raw["tokenizer.json"].decode("utf-8"))
    vocab = dict(tj["model"]["vocab"])
    for t in tj.get("added_tokens", []):
        vocab[t["content"]] = t["id"]
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m)
              for m in tj["model"]["merges"]]
    train_ids = _u16_ids(lzma.decompress(raw["train.u16.xz"]))
    held_ids = _u16_ids(raw["heldout.u16"])
    if len(train_ids) != meta["train_tokens"] or len(held_ids) != meta["heldout_tokens"]:
        raise SystemExit(f"{folder}: token counts differ from data.json")
    return {"vocab": vocab, "merges": merges, "specials": meta["specials"],
            "train_ids": train_ids, "held_ids": held_ids,
            "heldout_text": raw["heldout.txt"].decode("utf-8"),
            "calibration_text": raw["calibration.txt"].decode("utf-8"),
            "stats": {k: meta[k] for k in ("corpus", "corpus_bytes", "seed", "heldout_fraction",
                                            "documents", "train_chars", "heldout_chars")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--corpus-bytes", type=int, default=0,
                    help="characters of text to collect (default: the preset's, else 40 Mi)")
    ap.add_argument("--tokenizer-bytes", type=int, default=6 << 20,
                    help="text used to train the tokenizer")
    ap.add_argument("--heldout", type=float, default=0.05)
    ap.add_argument("--minutes", type=float, default=0, help="train for this long (wall time)")
    ap.add_argument("--steps", type=int, default=0, help="or for this many steps")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=0, help="training context (default: preset)")
    ap.add_argument("--long-seq-len", type=int, default=0,
                    help="train the last --long-fraction of the run at this context (same tokens "
                         "per step), so the model learns long positions cheaply")
    ap.add_argument("--long-fraction", type=float, default=0.2)
    ap.add_argument("--vocab", type=int, default=0, help="tokenizer size (default: preset)")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cuda" if os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="F16", choices=["F16", "BF16", "F32"])
    ap.add_argument("--calibration-text-only", action="store_true",
                    help="write OUT/calibration.txt (training-split text for codec calibration, "
                         "disjoint from heldout.txt) and stop")
    ap.add_argument("--corpus", default="", choices=[""] + sorted(CORPORA),
                    help="the text to train on (default: the preset's)")
    ap.add_argument("--prepare-only", action="store_true",
                    help="collect the corpus, train the tokenizer, encode both splits, write the "
                         "data to OUT (data.json, tokenizer.json, train.u16.xz, heldout.u16, "
                         "heldout.txt, calibration.txt) and stop; needs no PyTorch. A GPU "
                         "machine without Debian's documentation trains from it (--data)")
    ap.add_argument("--init", default="",
                    help="start from the weights of a model this script exported to this folder "
                         "(same preset) instead of a random initialization: a second phase")
    ap.add_argument("--bos-windows", action="store_true",
                    help="every training window begins with <|begin_of_text|> (as every prompt "
                         "Strata serves does), so position 0 is always the same token")
    ap.add_argument("--data", default="",
                    help="train from what --prepare-only wrote in this folder instead of "
                         "collecting the corpus here")
    args = ap.parse_args()
    cfg = dict(PRESETS[args.preset])
    seq_len = cfg.pop("seq_len")
    corpus = args.corpus or cfg.get("corpus", "debian-docs")
    cfg.pop("corpus", None)
    args.corpus_bytes = args.corpus_bytes or cfg.get("corpus_bytes", 40 << 20)
    cfg.pop("corpus_bytes", None)
    if args.seq_len:
        seq_len = args.seq_len
    if args.vocab:
        cfg["vocab_size"] = args.vocab
    if args.calibration_text_only:
        os.makedirs(args.out, exist_ok=True)
        docs = collect(corpus, args.corpus_bytes)
        write_calibration_text(docs, args.heldout, os.path.join(args.out, "calibration.txt"))
        return 0
    if not args.prepare_only and not args.minutes and not args.steps:
        ap.error("give --minutes or --steps")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()

    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    if args.data:
        data = load_prepared(args.data)
    else:
        data = prepare(args, cfg, corpus, specials, t0)
    if args.prepare_only:
        write_prepared(args.out, data)
        print(f"prepared {args.out}: {len(data['train_ids'])} train and {len(data['held_ids'])} "
              f"held-out tokens ({time.time() - t0:.0f} s)", flush=True)
        return 0
    vocab, merges = data["vocab"], data["merges"]
    cfg["vocab_size"] = len(vocab)
    bos, eos = vocab[specials[0]], vocab[specials[1]]
    stats = data["stats"]

    import torch
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    train_ids = torch.tensor(data["train_ids"], dtype=torch.long)
    held_ids = torch.tensor(data["held_ids"], dtype=torch.long)
    print(f"tokens: {len(train_ids)} train, {len(held_ids)} held-out ({time.time() - t0:.0f} s)",
          flush=True)

    device = torch.device(args.device)
    model = build_model(cfg)
    init_note = ""
    if args.init:
        weights = read_safetensors(os.path.join(args.init, "model.safetensors"))
        names = list(hf_state_dict(model).keys())
        missing = [n for n in names if n not in weights]
        if missing:
            raise SystemExit(f"--init {args.init}: its model.safetensors lacks {missing[0]} "
                             f"(and {len(missing) - 1} more): not a {args.preset} model")
        model.load_state_dict({k: weights[n] for k, n in zip(model.state_dict().keys(), names)})
        init_note = f"; continued from {args.init}"
        try:
            with open(os.path.join(args.init, "train_log.json")) as f:
                prior = json.load(f)
            init_note += (f" (itself {prior['steps']} steps, {prior['tokens_seen']:,} tokens"
                          f"{', ' + prior['init'] if prior.get('init') else ''})")
        except (OSError, KeyError, ValueError):
            pass
        print(f"initialized from {args.init}", flush=True)
    model = model.to(device)
    # On a GPU: the matrix products in bf16 (the weights and the optimizer stay fp32) and fp32
    # products on TF32 tensor cores; the token stream lives on the device.
    on_gpu = device.type == "cuda"
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        train_ids = train_ids.to(device)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu else (
        lambda: contextlib.nullcontext())
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    gen = torch.Generator().manual_seed(args.seed)

    def batch(ids, n, seq_len):
        starts = torch.randint(0, len(ids) - seq_len - 1, (n,), generator=gen)
        at = starts.to(ids.device)[:, None] + torch.arange(seq_len + 1, device=ids.device)
        window = ids[at]
        if args.bos_windows:  # <|begin_of_text|>, then seq_len tokens of the stream
            window = torch.cat([torch.full((n, 1), bos, dtype=window.dtype,
                                           device=window.device), window[:, :-1]], 1)
        return window[:, :-1].to(device), window[:, 1:].to(device)

    eval_len = args.long_seq_len or seq_len

    @torch.no_grad()
    def heldout_ppl(max_windows=64):
        model.eval()
        losses = []
        for w in range(min(max_windows, (len(held_ids) - 1) // eval_len)):
            x = held_ids[w * eval_len:(w + 1) * eval_len][None].to(device)
            y = held_ids[w * eval_len + 1:(w + 1) * eval_len + 1][None].to(device)
            if args.bos_windows:  # as trained: <|begin_of_text|> first, every token predicted
                y = x
                x = torch.cat([torch.full((1, 1), bos, dtype=x.dtype, device=device),
                               x[:, :-1]], 1)
            with autocast():
                logits = model(x)
            losses.append(torch.nn.functional.cross_entropy(
                logits.float().flatten(0, 1), y.flatten()).item())
        model.train()
        return math.exp(sum(losses) / len(losses))

    log, step, tokens_seen = [], 0, 0
    train_start = time.time()
    budget = args.minutes * 60
    total_steps = args.steps or None
    while True:
        elapsed = time.time() - train_start
        if (total_steps and step >= total_steps) or (budget and elapsed >= budget):
            break
        frac = (step / total_steps) if total_steps else (elapsed / budget)
        lr = args.lr * min(1.0, (step + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        long_phase = args.long_seq_len and frac >= 1 - args.long_fraction
        if long_phase:
            x, y = batch(train_ids, max(1, args.batch * seq_len // args.long_seq_len),
                         args.long_seq_len)
        else:
            x, y = batch(train_ids, args.batch, seq_len)
        with autocast():
            logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x.numel()
        if step % 25 == 0 or step == 1:
            log.append({"step": step, "tokens": tokens_seen, "loss": loss.item(), "lr": lr,
                        "seq_len": x.shape[1],
                        "seconds": round(time.time() - train_start, 1)})
            print(f"step {step} loss {loss.item():.3f} lr {lr:.2e} tokens {tokens_seen}",
                  flush=True)
    ppl = heldout_ppl()
    print(f"held-out perplexity {ppl:.2f} after {step} steps, {tokens_seen} tokens", flush=True)

    model = model.to("cpu").eval()
    hf = dict(cfg)
    hf.update({"architectures": ["Qwen2ForCausalLM" if cfg["attention_bias"] else
                                 "LlamaForCausalLM"],
               "model_type": "qwen2" if cfg["attention_bias"] else "llama",
               "hidden_act": "silu", "bos_token_id": bos, "eos_token_id": eos,
               "torch_dtype": {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}[args.dtype],
               "head_dim": cfg["hidden_size"] // cfg["num_attention_heads"]})
    if not cfg["attention_bias"]:
        hf["attention_bias"] = False
    else:
        del hf["attention_bias"]  # Qwen2 implies q/k/v biases
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(hf, f, indent=2, sort_keys=True)
    write_safetensors(os.path.join(args.out, "model.safetensors"), hf_state_dict(model),
                      args.dtype)
    with open(os.path.join(args.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tokenizer_json(vocab, merges, specials), f, ensure_ascii=False)
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": specials[0], "eos_token": specials[1],
                   "model_max_length": cfg["max_position_embeddings"]}, f, indent=2)
    with open(os.path.join(args.out, "heldout.txt"), "w", encoding="utf-8") as f:
        f.write(data["heldout_text"])
    with open(os.path.join(args.out, "calibration.txt"), "w", encoding="utf-8") as f:
        f.write(data["calibration_text"])

    # Fixture: logits of the exported (rounded) weights for a few held-out sequences.
    import torch.nn.functional as F  # noqa: F401
    rounded = build_model(cfg)
    sd = {k: v.to({"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32}[args.dtype]
                  ).float() for k, v in model.state_dict().items()}
    rounded.load_state_dict(sd)
    rounded.eval()
    fixture = {}
    with torch.no_grad():
        for i in range(3):  # windows of the held-out token stream
            start = i * (len(held_ids) // 3)
            ids = [bos] + held_ids[start:start + 23 + 8 * i].tolist()
            fixture[f"ids.{i}"] = torch.tensor(ids, dtype=torch.int32)
            fixture[f"logits.{i}"] = rounded(torch.tensor([ids]))[0].float()
    write_safetensors(os.path.join(args.out, "fixture.safetensors"), fixture, None)

    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump({"preset": args.preset, "seed": args.seed, "config": hf, "data": stats,
                   "parameters": n_params, "steps": step, "tokens_seen": tokens_seen,
                   "train_tokens_available": len(train_ids), "heldout_tokens": len(held_ids),
                   "heldout_perplexity": ppl, "device": str(device),
                   "init": init_note.lstrip("; "), "bos_windows": args.bos_windows,
                   "torch": torch.__version__, "curve": log}, f, indent=1)
    with open(os.path.join(args.out, "README.md"), "w") as f:
        f.write(MODEL_CARD.format(
            name=os.path.basename(os.path.normpath(args.out)), preset=args.preset,
            params=n_params, mib=n_params * {"F16": 2, "BF16": 2, "F32": 4}[args.dtype] / 2**20,
            dtype=args.dtype, layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
            heads=cfg["num_attention_heads"], kv=cfg["num_key_value_heads"],
            head_dim=cfg["hidden_size"] // cfg["num_attention_heads"],
            ffn=cfg["intermediate_size"], vocab=cfg["vocab_size"], ctx=cfg["max_position_embeddings"],
            theta=cfg["rope_theta"], docs=stats["documents"], corpus=stats.get("corpus", "?"),
            dict_note=(", then the GCIDE dictionary (dict-gcide) in 64 KiB pieces"
                       if "dict" in stats.get("corpus", "") else ""), train_chars=stats["train_chars"],
            held_chars=stats["heldout_chars"], train_tokens=len(train_ids),
            held_tokens=len(held_ids), steps=step, tokens=tokens_seen, batch=args.batch,
            seq=seq_len, lr=args.lr, eval_len=eval_len,
            long=(f", the last {args.long_fraction:.0%} of the time at {args.long_seq_len} tokens"
                  if args.long_seq_len else ""), ppl=ppl, device=device, torch=torch.__version__,
            seed=args.seed, minutes=(time.time() - train_start) / 60, init=init_note,
            bos=", each window opening with <|begin_of_text|>" if args.bos_windows else "",
            first=log[0]["loss"] if log else float("nan"),
            last=log[-1]["loss"] if log else float("nan"), argv=reproduce_argv(step)))
    print(f"exported to {args.out} ({time.time() - t0:.0f} s in all)", flush=True)


if __name__ == "__main__":
    sys.exit(main())
