"""IMDB reviews (aclImdb text release) as subword token ids, shape (N, seq_len) int64, labels 1 = pos, 0 = neg.

    dprun dataset=imdb data_dir=/work/shared/data model=bilstm           # reads imdb/aclImdb_labeled_text.tar.gz
    dprun dataset=imdb dataset.vocab_size=16000 dataset.seq_len=256
    dprun dataset=imdb dataset.download=true                            # fetch aclImdb_v1.tar.gz (md5-checked)

Sources tried, in <data_dir>/imdb then <data_dir>: the folder aclImdb/{train,test}/{pos,neg}/*.txt (or the folder
itself holding train/ and test/), then the tarballs aclImdb_v1.tar.gz and aclImdb_labeled_text.tar.gz (read in
place), then any other aclImdb*.tar.gz. Reviews are ordered by (label, review id) in each split; the 50k unlabeled
reviews are not used.

Integrity (runner/data/integrity.py): a tarball with a standard name must have its known sha256; any tarball must
decompress to its end with a good gzip CRC and read as a tar archive; every source must hold 12,500 reviews per
split and class. Each failure is one line naming the file; nothing is cached from data that failed a check.

Tokenizer: byte-level BPE (the `tokenizers` library) trained on the TRAINING split only, vocab_size tokens in all
(default 8,185, the size of the JL paper's subwords8k), id 0 = "<pad>"; text is lower-cased, NFKC-normalised and
"<br />" becomes a space. Byte-level means no unknown token. Sequences keep their last seq_len tokens
(`dataset.truncate=start`, the default, as Keras `pad_sequences` does: a review's verdict is usually at its end) or
their first ones (`truncate=end`), and are zero-padded in front (`dataset.pad=start`, the default, Keras's) or at the
end (`pad=end`). The trained tokenizer and the encoded tensors are cached in <data_dir>/imdb/ (or
dataset.cache_dir; the per-user cache when that folder is read-only), keyed by (source content, vocab_size,
seq_len): a tarball's sha256, or a folder's list of review files with their sizes and modification times.

Privacy: the tokenizer is fit to the private training split (the public unlabeled reviews are not shipped), so
it is outside the privacy accounting; the Dataset says so in `privacy_notes`.
"""
from __future__ import annotations

import hashlib
import os
import re
import tarfile
import tempfile
from itertools import islice
from pathlib import Path

import torch

from runner.data.base import DATASETS, DataInfo, Dataset, default_data_dir
from runner.data.download import fetch, missing_files
from runner.data.integrity import GZIP_ERRORS, check_count, check_gzip_stream, check_known, sha256_file
from runner.errors import DprunError

TARBALLS = ("aclImdb_v1.tar.gz", "aclImdb_labeled_text.tar.gz")
MIRRORS = ["https://ai.stanford.edu/~amaas/data/sentiment/"]
V1_MD5 = "7c2ac02c03563afcf9b574c7e56c153a"
BR = re.compile(r"<br\s*/?>")  # the reviews' HTML line breaks
WORD = re.compile(r"\S+")
REVIEW = re.compile(r"(?:^|/)aclImdb/(train|test)/(pos|neg)/(\d+)_\d+\.txt$")
CLASSES = ((0, "neg"), (1, "pos"))
PER_CLASS = {"train": 12500, "test": 12500}  # reviews per class in each split of the aclImdb release
CACHE_VERSION = 2  # bump when the tokenizer recipe, the tensor layout or the cache key changes
# 2: keyed by the source's content, so caches written from unchecked (possibly damaged) data are never reused
TOKENIZER_NOTE = ("imdb tokenizer (BPE vocabulary) trained on the private training split: outside the privacy "
                  "accounting")
MIN_VOCAB = 257  # 256 byte symbols + padding


def find_source(root: Path) -> Path | None:
    for base in (root / "imdb", root):
        for folder in (base / "aclImdb", base):
            if all((folder / s / c).is_dir() for s in ("train", "test") for c in ("pos", "neg")):
                return folder
        for name in TARBALLS:
            if (base / name).is_file():
                return base / name
        if others := sorted(p for p in base.glob("aclImdb*.tar.gz") if p.is_file()):
            return others[0]  # e.g. a user's own repack: no known checksum, its structure and counts are checked
    return None


def fix_for(source: Path) -> str:
    """What to do about a damaged source, for the one-line errors."""
    if source.is_dir():
        return f"extract aclImdb_v1.tar.gz ({MIRRORS[0]}) again into {source.parent}"
    if source.name == TARBALLS[0]:
        return f"delete it and download it again ({MIRRORS[0]} or dataset.download=true) into {source.parent}"
    return (f"delete it and put a good copy there, or download {TARBALLS[0]} ({MIRRORS[0]} or dataset.download=true) "
            f"into {source.parent}")


def folder_files(source: Path) -> dict[tuple[str, str], list[Path]]:
    """(split, class) -> the review files of an extracted folder, after checking their number."""
    files = {(split, cls): sorted((source / split / cls).glob("*.txt")) for split in PER_CLASS for _, cls in CLASSES}
    for (split, cls), paths in files.items():
        check_count(source / split / cls, "reviews", len(paths), PER_CLASS[split], fix_for(source))
    return files


def read_folder(source: Path) -> dict[str, list[tuple[int, int, str]]]:
    found: dict[str, list[tuple[int, int, str]]] = {"train": [], "test": []}
    for (split, cls), paths in folder_files(source).items():
        label = int(cls == "pos")
        for p in paths:
            try:
                found[split].append((label, int(p.name.split("_")[0]), p.read_text(encoding="utf-8")))
            except (UnicodeDecodeError, ValueError) as e:  # every review of the release is UTF-8, named <id>_<rating>
                raise DprunError(f"{p} is not an aclImdb review ({type(e).__name__}); {fix_for(source)}") from None
    return found


def read_tarball(source: Path) -> dict[str, list[tuple[int, int, str]]]:
    fix = fix_for(source)
    with open(source, "rb") as f:
        gzipped = f.read(2) == b"\x1f\x8b"
    if gzipped:
        check_gzip_stream(source, fix)  # tarfile stops without an error at a garbled header: check the CRC first
    found: dict[str, list[tuple[int, int, str]]] = {"train": [], "test": []}
    try:
        with tarfile.open(source) as tar:
            for m in tar:
                if m.isfile() and (r := REVIEW.search(m.name)):
                    text = tar.extractfile(m).read().decode("utf-8")
                    found[r.group(1)].append((int(r.group(2) == "pos"), int(r.group(3)), text))
    except (tarfile.TarError, UnicodeDecodeError, *GZIP_ERRORS) as e:
        reason = f"{type(e).__name__}: {(str(e) or 'corrupt').splitlines()[0]}"
        raise DprunError(f"{source} is a damaged tar archive ({reason}); {fix}") from None
    for split, rows in found.items():
        for label, cls in CLASSES:
            got = sum(r[0] == label for r in rows)
            check_count(source, f"aclImdb/{split}/{cls} reviews", got, PER_CLASS[split], fix)
    return found


def read_reviews(source: Path) -> dict[str, tuple[list[str], list[int]]]:
    """-> {"train": (texts, labels), "test": (texts, labels)}, ordered by (label, review id); counts checked."""
    found = read_folder(source) if source.is_dir() else read_tarball(source)
    for rows in found.values():
        rows.sort(key=lambda r: r[:2])
    return {s: ([r[2] for r in rows], [r[0] for r in rows]) for s, rows in found.items()}


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.Sequence([normalizers.Replace(Regex(BR.pattern), " "), normalizers.NFKC(),
                                           normalizers.Lowercase()])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id("<pad>") == 0
    return tok


SIDES = ("end", "start")


def encode(tok, texts: list[str], seq_len: int, truncate: str = "end") -> torch.Tensor:
    """-> (N, seq_len) int64 ids, zero-padded at the end: the first seq_len tokens (truncate="end") or the last
    (truncate="start").

    truncate="end" encodes only a prefix of each review (less work for long reviews): the text up to its seq_len-th
    run of non-space characters. Every such run yields at least one token and no token crosses whitespace, so the
    prefix holds the first seq_len tokens of the whole review. "<br />" (which contains a space) is replaced before
    the cut. truncate="start" encodes whole reviews and keeps the tail."""
    def prefix(t: str) -> str:
        t = BR.sub(" ", t)
        run = next(islice(WORD.finditer(t), seq_len - 1, None), None)  # the seq_len-th run, if any
        return t[:run.end()] if run else t

    tok.no_truncation()
    tok.no_padding()
    if truncate == "end":
        ids = [e.ids[:seq_len] for e in tok.encode_batch_fast([prefix(t) for t in texts])]
    else:
        ids = [e.ids[-seq_len:] for e in tok.encode_batch_fast([BR.sub(" ", t) for t in texts])]
    out = torch.zeros(len(ids), seq_len, dtype=torch.int64)
    for i, row in enumerate(ids):
        out[i, :len(row)] = torch.tensor(row, dtype=torch.int64)
    return out


def pad_at_start(x: torch.Tensor) -> torch.Tensor:
    """(N, T) end-padded ids -> the same ids with the padding moved to the start (id 0 is only ever padding)."""
    lengths = (x != 0).sum(1)  # (N,)
    index = (torch.arange(x.shape[1]) - (x.shape[1] - lengths).unsqueeze(1)) % x.shape[1]  # (N, T)
    return x.gather(1, index)


def cache_folder(cfg, root: Path) -> Path:
    if cfg.get("cache_dir"):
        return Path(os.path.expanduser(str(cfg.get("cache_dir"))))
    here = root / "imdb"
    probe = here if here.exists() else root
    # write bits too, not only os.access: a 0555 data folder stays untouched even when running as root
    writable = probe.exists() and os.access(probe, os.W_OK) and probe.stat().st_mode & 0o222
    return here if writable else Path(default_data_dir()) / "imdb"


def fingerprint(source: Path) -> str:
    """Short hash naming the source's content (a changed or damaged source -> a new cache key). A tarball: its
    sha256, checked against the known one when its name is standard. A folder: its review files' names, sizes and
    modification times, after checking their number (hashing 50,000 files at every load would be slow)."""
    if source.is_dir():
        files = folder_files(source)
        h = hashlib.sha256()
        for paths in files.values():
            for p in paths:
                st = p.stat()
                h.update(f"{p.relative_to(source)}|{st.st_size}|{st.st_mtime_ns}\n".encode())
        content = h.hexdigest()
    else:
        content = sha256_file(source)
        check_known(source, "imdb", fix_for(source), digest=content)
    return hashlib.sha1(f"{content}|{CACHE_VERSION}".encode()).hexdigest()[:8]


def atomic_write(path: Path, write) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".")
    except OSError as e:
        raise DprunError(f"cannot write the IMDB cache in {path.parent} ({e.strerror}); "
                         f"set dataset.cache_dir to a writable folder")
    os.close(fd)
    try:
        write(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; a cache is as readable as any data file
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@DATASETS.register("imdb")
def load_imdb(cfg, root) -> Dataset:
    from tokenizers import Tokenizer

    root = Path(root)
    vocab_size, seq_len = int(cfg.get("vocab_size", 8185)), int(cfg.get("seq_len", 150))
    if vocab_size < MIN_VOCAB or seq_len < 1:
        raise DprunError(f"dataset.vocab_size={vocab_size}, dataset.seq_len={seq_len}: need vocab_size >= "
                         f"{MIN_VOCAB} (256 bytes + padding) and seq_len >= 1")
    truncate, pad = str(cfg.get("truncate", "start")), str(cfg.get("pad", "start"))
    for knob, value in (("truncate", truncate), ("pad", pad)):
        if value not in SIDES:
            raise DprunError(f"dataset.{knob}={value}: expected one of {', '.join(SIDES)}")
    source = find_source(root)
    if source is None and cfg.get("download", False):
        source = fetch(TARBALLS[0], MIRRORS, root / "imdb", md5=V1_MD5)
    if source is None:
        raise missing_files("imdb", ["aclImdb/{train,test}/{pos,neg}/*.txt or " + " or ".join(TARBALLS)],
                            root / "imdb")

    cache = cache_folder(cfg, root)
    stem = f"imdb-{fingerprint(source)}-bpe{vocab_size}"
    kept = "" if truncate == "end" else "-tail"  # the cache of the last seq_len tokens
    tok_path, data_path = cache / f"{stem}.tokenizer.json", cache / f"{stem}-len{seq_len}{kept}.pt"
    if data_path.is_file() and tok_path.is_file():
        t = torch.load(data_path, weights_only=True)
    else:
        reviews = read_reviews(source)
        if tok_path.is_file():
            tok = Tokenizer.from_file(str(tok_path))
        else:
            tok = train_tokenizer(reviews["train"][0], vocab_size)  # the training split only
            atomic_write(tok_path, lambda p: tok.save(p))
        t, small = {}, torch.int16 if vocab_size <= 32768 else torch.int32  # a quarter of the int64 cache size
        for split, (texts, labels) in reviews.items():
            t[f"{split}_x"] = encode(tok, texts, seq_len, truncate).to(small)
            t[f"{split}_y"] = torch.tensor(labels, dtype=torch.int64)
        atomic_write(data_path, lambda p: torch.save(t, p))
    xtr, xte = t["train_x"].long(), t["test_x"].long()  # (N, seq_len) int64, padded at the end
    if pad == "start":
        xtr, xte = pad_at_start(xtr), pad_at_start(xte)
    info = DataInfo("imdb", (seq_len,), 2, kind="text", vocab_size=vocab_size,
                    train_size=len(t["train_y"]), test_size=len(t["test_y"]))
    return Dataset(info, xtr, t["train_y"], xte, t["test_y"], source="real", privacy_notes=[TOKENIZER_NOTE],
                   extras={"source": str(source), "tokenizer": str(tok_path), "cache": str(data_path)})
