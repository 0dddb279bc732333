"""Corpus and tokenizer of the shipped demo model.

Corpus: the King James Version of the Bible (1611; public domain), as shipped by Debian's
`bible-kjv-text` package (data) and decoded with the `bible` program of the `bible-kjv`
package. Both are fetched with the ordinary client (`apt-get download`) and unpacked with
`dpkg-deb -x` into a cache folder; nothing is installed. The decoded text is checked
against a fixed SHA-256, so every rebuild trains on byte-identical text.

Documents are chapters (1,189): verse texts without their references, one verse a line.
Every HELDOUT_EVERY-th chapter (offset HELDOUT_OFFSET) is held out from training.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import subprocess
import tempfile

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOT = "<|endoftext|>"
EOT_ID = 0  # bos = eos = pad, as in the Ouro checkpoints
DEB_PACKAGES = ("bible-kjv-text", "bible-kjv")
KJV_SHA256 = "cd45f0c9cedab8e4439bd6486c8952c77cc8b0ecc5d1f6ae3513f2039f47229d"
HELDOUT_EVERY = 40
HELDOUT_OFFSET = 17
CACHE = os.environ.get("OURO_DEMO_CACHE", os.path.expanduser("~/.cache/ouro_jax_demo"))

SOURCE = ("King James Version of the Bible (1611), public domain (copyright expired; "
          "see /usr/share/doc/bible-kjv-text/copyright in the Debian package). Text taken "
          "from Debian bookworm packages bible-kjv-text 4.38 (data) and bible-kjv 4.38 "
          "(decoder, GPL-2+; only used to decode, not shipped).")

_REF = re.compile(r"^(\S+?)(\d+):(\d+) (.*)$")


def _fetch_raw(cache: str) -> str:
    """Downloads and decodes the KJV into cache/kjv_raw.txt (one 'BookC:V text' a line)."""
    out = os.path.join(cache, "kjv_raw.txt")
    if os.path.exists(out):
        return out
    os.makedirs(cache, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for pkg in DEB_PACKAGES:
            subprocess.run(["apt-get", "download", pkg], cwd=tmp, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        root = os.path.join(tmp, "root")
        for deb in sorted(glob.glob(os.path.join(tmp, "*.deb"))):
            subprocess.run(["dpkg-deb", "-x", deb, root], check=True)
        text = subprocess.run(
            [os.path.join(root, "usr/bin/bible"), "-p", os.path.join(root, "usr/lib"), "-f",
             "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    with open(out + ".tmp", "w") as f:
        f.write(text)
    os.replace(out + ".tmp", out)
    return out


def chapters(cache: str = CACHE) -> list[str]:
    """All 1,189 chapters in canonical order, each as verse lines joined by newlines."""
    raw = open(_fetch_raw(cache)).read()
    digest = hashlib.sha256(raw.encode()).hexdigest()
    if KJV_SHA256 and digest != KJV_SHA256:
        raise RuntimeError(f"decoded KJV text has sha256 {digest}, expected {KJV_SHA256}: "
                           "the Debian package changed; update KJV_SHA256 knowingly")
    docs: list[list[str]] = []
    key = None
    for line in raw.splitlines():
        m = _REF.match(line)
        if not m:
            raise RuntimeError(f"unexpected line in decoded KJV: {line[:80]!r}")
        book, chap, _, text = m.groups()
        if (book, chap) != key:
            docs.append([])
            key = (book, chap)
        docs[-1].append(text.strip())
    return ["\n".join(d) for d in docs]


def split(docs: list[str]) -> tuple[list[str], list[str]]:
    train = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY != HELDOUT_OFFSET]
    held = [d for i, d in enumerate(docs) if i % HELDOUT_EVERY == HELDOUT_OFFSET]
    return train, held


def train_tokenizer(docs: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE; id 0 is <|endoftext|>. Deterministic for a given corpus."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOT], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2)
    tok.train_from_iterator(docs, trainer=trainer)
    assert tok.token_to_id(EOT) == EOT_ID
    return tok


def encode_stream(tok: Tokenizer, docs: list[str]) -> list[int]:
    """Documents as one id stream, each preceded by <|endoftext|> (it doubles as BOS)."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.append(EOT_ID)
        ids.extend(enc.ids)
    return ids
