"""Dataset loaders on tiny files written here in the real formats, the download path, and the real data when present."""
import gzip
import hashlib
import pickle
import tarfile
import time
import urllib.error
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.data import download, imdb, integrity, load_dataset, mnist
from runner.data import cifar10 as cifar
from conftest import SHARED_DATA
from runner.errors import DprunError

REAL = SHARED_DATA  # the real datasets: $DPRUN_DATA_DIR, else ../shared/data (tests/conftest.py)


# ---- writers for the real formats ----

@pytest.fixture
def tiny_release(monkeypatch):
    """Tiny files stand in for the real releases: their counts are the expected ones, and their standard names
    carry no known checksum (tests/test_data_integrity.py checks both on the real values)."""
    monkeypatch.setattr(integrity, "KNOWN_SHA256", {})
    monkeypatch.setattr(mnist, "COUNTS", {"train": 12, "t10k": 5})  # tiny_idx's default n
    monkeypatch.setattr(imdb, "PER_CLASS", {"train": 2, "test": 1})  # TRAIN_TEXT, TEST_TEXT per class
    monkeypatch.setattr(cifar, "PER_BATCH", 2)  # write_cifar's default per_batch


def write_idx(path: Path, a: np.ndarray, gz: bool) -> None:
    raw = b"\x00\x00\x08" + bytes([a.ndim]) + b"".join(d.to_bytes(4, "big") for d in a.shape) + a.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    (gzip.open(str(path) + ".gz", "wb") if gz else open(path, "wb")).write(raw)


def tiny_idx(folder: Path, gz_images=True, n=(12, 5), seed=0) -> dict:
    rng = np.random.default_rng(seed)
    out = {}
    for split, count in zip(("train", "t10k"), n):
        x = rng.integers(0, 256, (count, 28, 28), dtype=np.uint8)
        y = (np.arange(count) % 10).astype(np.uint8)
        write_idx(folder / f"{split}-images-idx3-ubyte", x, gz=gz_images)
        write_idx(folder / f"{split}-labels-idx1-ubyte", y, gz=not gz_images)
        out[split] = (x, y)
    return out


def cifar_records(labels, value_of_channel) -> bytes:
    """One binary record per label: the label byte, then the R, G, B planes (1,024 bytes each)."""
    return b"".join(bytes([lab]) + b"".join(bytes([value_of_channel(c, i)]) * 1024 for c in range(3))
                    for i, lab in enumerate(labels))


def write_cifar(folder: Path, per_batch=2) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name in cifar.TRAIN + cifar.TEST:
        (folder / f"{name}.bin").write_bytes(cifar_records([3, 7][:per_batch], lambda c, i: 50 * c + i))


def write_aclimdb(root: Path, train, test, unsup=()) -> Path:
    """train/test: lists of (label, text); files <id>_<rating>.txt as in the release."""
    for split, rows in (("train", train), ("test", test), ("train_unsup", unsup)):
        for i, (label, text) in enumerate(rows):
            cls = "unsup" if split == "train_unsup" else ("pos" if label else "neg")
            folder = root / "aclImdb" / split.split("_")[0] / cls
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{i}_{8 if label else 2}.txt").write_text(text, encoding="utf-8")
    return root / "aclImdb"


TRAIN_TEXT = [(1, "A wonderful film, I loved it.<br /><br />Great acting and a great story!"),
              (0, "Terrible. Boring plot and awful acting; I want my money back."),
              (1, "Loved every minute " * 30),
              (0, "The worst movie of the year.")]
TEST_TEXT = [(0, "Zyzzyva qwxq never seen words"), (1, "great great great")]


# ---- MNIST / Fashion-MNIST ----

@pytest.mark.parametrize("gz_images", [True, False])
def test_mnist_reads_idx_raw_and_gz_and_normalises(tiny_release, tmp_path, gz_images):
    raw = tiny_idx(tmp_path / "mnist", gz_images)
    d = load_dataset({"name": "mnist"}, tmp_path)
    assert d.train_x.shape == (12, 1, 28, 28) and d.test_x.shape == (5, 1, 28, 28)
    assert d.train_x.dtype == torch.float32 and d.train_y.dtype == torch.int64 and d.train_x.device.type == "cpu"
    assert d.info.input_shape == (1, 28, 28) and d.info.num_classes == 10 and d.info.train_size == 12
    assert d.train_y.tolist() == raw["train"][1].tolist()
    expect = (torch.from_numpy(raw["t10k"][0].astype(np.float32)) / 255 - 0.1307) / 0.3081
    assert torch.allclose(d.test_x[:, 0], expect, atol=1e-6)


@pytest.mark.parametrize("sub", ["fashion-mnist", "fmnist", "."])
def test_fmnist_folders_and_constants(tiny_release, tmp_path, sub):
    raw = tiny_idx(tmp_path / sub)
    d = load_dataset({"name": "fmnist"}, tmp_path)
    assert d.info.name == "fmnist"
    zero = raw["train"][0] == 0  # pixel 0 -> -mean/std with the Fashion-MNIST constants
    assert torch.allclose(d.train_x[:, 0][torch.from_numpy(zero)], torch.tensor(-0.2860 / 0.3530))


def test_bad_idx_header_is_a_one_line_error(tmp_path):
    tiny_idx(tmp_path)
    (tmp_path / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(b"\x00\x00\x0d\x03" + bytes(12)))
    with pytest.raises(DprunError, match="not an idx file of unsigned bytes") as e:
        load_dataset({"name": "mnist"}, tmp_path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, folder", [("mnist", "mnist"), ("fmnist", "fashion-mnist"), ("cifar10", "cifar10"),
                                          ("imdb", "imdb")])
def test_missing_files_error_names_files_and_folder(tmp_path, name, folder):
    with pytest.raises(DprunError) as e:
        load_dataset({"name": name}, tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / folder) in msg and "dataset.download=true" in msg
    expected = {"mnist": mnist.FILES, "fmnist": mnist.FILES, "cifar10": ["data_batch_5", cifar.BIN_TAR],
                "imdb": ["aclImdb/{train,test}/{pos,neg}/*.txt", "aclImdb_v1.tar.gz"]}[name]
    assert all(f in msg for f in expected)


# ---- CIFAR-10 ----

def test_cifar10_binary_batches(tiny_release, tmp_path):
    write_cifar(tmp_path / "cifar10" / cifar.BIN_DIR)
    d = load_dataset({"name": "cifar10"}, tmp_path)
    assert d.train_x.shape == (10, 3, 32, 32) and d.test_x.shape == (2, 3, 32, 32)
    assert d.train_y.tolist() == [3, 7] * 5 and d.train_y.dtype == torch.int64
    for c in range(3):  # image i, channel c holds 50 c + i everywhere
        want = ((50 * c + 1) / 255 - cifar.MEAN[c]) / cifar.STD[c]
        assert torch.allclose(d.train_x[1, c], torch.full((32, 32), want), atol=1e-6)


def test_cifar10_tarball_and_folder_agree(tiny_release, tmp_path):
    write_cifar(tmp_path / "src" / cifar.BIN_DIR)
    (tmp_path / "tar").mkdir()
    with tarfile.open(tmp_path / "tar" / cifar.BIN_TAR, "w:gz") as t:
        t.add(tmp_path / "src" / cifar.BIN_DIR, arcname=cifar.BIN_DIR)
    a, b = load_dataset({"name": "cifar10"}, tmp_path / "src"), load_dataset({"name": "cifar10"}, tmp_path / "tar")
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_y, b.test_y)


def test_cifar10_never_unpickles_unless_allowed(tiny_release, tmp_path):
    folder = tmp_path / cifar.PY_DIR
    folder.mkdir()
    for name in cifar.TRAIN + cifar.TEST:
        batch = {b"data": np.full((2, 3072), 9, np.uint8), b"labels": [1, 2]}
        (folder / name).write_bytes(pickle.dumps(batch))
    with pytest.raises(DprunError, match="allow_pickle=true") as e:
        load_dataset({"name": "cifar10"}, tmp_path)
    assert "\n" not in str(e.value)
    d = load_dataset({"name": "cifar10", "allow_pickle": True}, tmp_path)
    assert d.train_x.shape == (10, 3, 32, 32) and d.test_y.tolist() == [1, 2]


def test_cifar10_truncated_batch_is_an_error(tiny_release, tmp_path):
    write_cifar(tmp_path)
    (tmp_path / "test_batch.bin").write_bytes(b"\x01" * 100)
    with pytest.raises(DprunError, match="3073-byte"):
        load_dataset({"name": "cifar10"}, tmp_path)


# ---- IMDB ----

def imdb_cfg(tmp_path, **kw):
    """Tests read the first tokens, padded at the end, unless they say otherwise (the loader's default is Keras's)."""
    return {"name": "imdb", "vocab_size": 300, "seq_len": 16, "truncate": "end", "pad": "end", **kw}


def test_imdb_folder_shapes_labels_padding(tiny_release, tmp_path):
    write_aclimdb(tmp_path / "imdb", TRAIN_TEXT, TEST_TEXT)
    d = load_dataset(imdb_cfg(tmp_path), tmp_path)
    assert d.info.kind == "text" and d.info.vocab_size == 300 and d.info.input_shape == (16,)
    assert d.train_x.shape == (4, 16) and d.test_x.shape == (2, 16) and d.train_x.dtype == torch.int64
    assert d.train_y.tolist() == [0, 0, 1, 1] and d.test_y.tolist() == [0, 1]  # ordered by (label, id)
    assert int(d.train_x.max()) < 300 and int(d.train_x.min()) >= 0
    assert (d.train_x[3] != 0).all()  # "Loved every minute" x 30: truncated to 16 tokens
    short = d.test_x[1]  # "great great great": a few tokens, then zeros only
    k = int((short != 0).sum())
    assert 0 < k < 16 and (short[:k] != 0).all() and (short[k:] == 0).all()
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(d.extras["tokenizer"])
    assert tok.token_to_id("<pad>") == 0
    assert tok.decode(d.train_x[0].tolist()).strip().startswith("terrible. boring plot")
    assert "<br" not in tok.decode(d.train_x[2].tolist())  # HTML line breaks removed


def test_imdb_keras_style_truncation_and_padding(tiny_release, tmp_path):
    """truncate=start keeps each review's LAST seq_len tokens, pad=start moves the zeros in front (Keras
    pad_sequences' defaults, and the loader's); truncate=end keeps the first tokens; each gets its own cache."""
    write_aclimdb(tmp_path / "imdb", [(1, "alpha beta gamma " * 10 + "the ending"), *TRAIN_TEXT[1:]], TEST_TEXT)
    # rows are ordered by (label, id): the two negatives, then this review (the first positive)
    head = load_dataset(imdb_cfg(tmp_path), tmp_path)
    tail = load_dataset(imdb_cfg(tmp_path, truncate="start"), tmp_path)
    front = load_dataset(imdb_cfg(tmp_path, truncate="start", pad="start"), tmp_path)
    default = load_dataset({"name": "imdb", "vocab_size": 300, "seq_len": 16}, tmp_path)  # Keras's, as the yaml
    assert torch.equal(default.train_x, front.train_x) and torch.equal(default.test_x, front.test_x)
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(head.extras["tokenizer"])
    assert tok.decode(head.train_x[2].tolist()).strip().startswith("alpha beta")
    assert tok.decode(tail.train_x[2].tolist()).rstrip().endswith("the ending")
    assert "the ending" not in tok.decode(head.train_x[2].tolist())
    assert tail.extras["cache"] != head.extras["cache"]
    assert torch.equal(front.train_x[2], tail.train_x[2])  # a full row has no padding to move
    wide = dict(seq_len=40)  # "great great great" is shorter than 40 tokens: both truncations agree
    short = load_dataset(imdb_cfg(tmp_path, truncate="start", **wide), tmp_path).test_x[1]
    assert torch.equal(short, load_dataset(imdb_cfg(tmp_path, **wide), tmp_path).test_x[1])
    k = int((short != 0).sum())
    assert 0 < k < 40
    moved = load_dataset(imdb_cfg(tmp_path, pad="start", **wide), tmp_path).test_x[1]
    assert (moved[:40 - k] == 0).all() and torch.equal(moved[40 - k:], short[:k])
    with pytest.raises(DprunError, match="dataset.pad=left: expected one of end, start"):
        load_dataset(imdb_cfg(tmp_path, pad="left"), tmp_path)


def test_imdb_tokenizer_sees_the_training_split_only(tiny_release, tmp_path):
    other_test = [(0, "xylophone xylophone xylophone quokka quokka " * 20), (1, "quokka xylophone")]
    write_aclimdb(tmp_path / "a" / "imdb", TRAIN_TEXT, TEST_TEXT)
    write_aclimdb(tmp_path / "b" / "imdb", TRAIN_TEXT, other_test)
    a = load_dataset(imdb_cfg(tmp_path), tmp_path / "a")
    b = load_dataset(imdb_cfg(tmp_path), tmp_path / "b")
    assert Path(a.extras["tokenizer"]).read_text() == Path(b.extras["tokenizer"]).read_text()
    assert torch.equal(a.train_x, b.train_x)


def test_imdb_tarball_matches_folder_and_skips_unsup(tiny_release, tmp_path):
    src = write_aclimdb(tmp_path / "src", TRAIN_TEXT, TEST_TEXT, unsup=[(0, "unlabeled review text")])
    (tmp_path / "tar" / "imdb").mkdir(parents=True)
    with tarfile.open(tmp_path / "tar" / "imdb" / "aclImdb_v1.tar.gz", "w:gz") as t:
        t.add(src, arcname="aclImdb")
    a = load_dataset(imdb_cfg(tmp_path), tmp_path / "src")  # data_dir/aclImdb also accepted
    b = load_dataset(imdb_cfg(tmp_path), tmp_path / "tar")
    assert torch.equal(a.train_x, b.train_x) and torch.equal(a.test_x, b.test_x) and len(b.train_y) == 4


def test_imdb_cache_is_reused_and_keyed_by_vocab_and_seq_len(tiny_release, tmp_path, monkeypatch):
    write_aclimdb(tmp_path / "imdb", TRAIN_TEXT, TEST_TEXT)
    first = load_dataset(imdb_cfg(tmp_path), tmp_path)
    assert Path(first.extras["cache"]).parent == tmp_path / "imdb"

    def no_training(*a, **k):
        raise AssertionError("tokenizer retrained despite a cache")

    real_training = imdb.train_tokenizer
    monkeypatch.setattr(imdb, "train_tokenizer", no_training)
    again = load_dataset(imdb_cfg(tmp_path), tmp_path)
    assert torch.equal(first.train_x, again.train_x)
    longer = load_dataset(imdb_cfg(tmp_path, seq_len=40), tmp_path)  # same tokenizer, new tensors
    assert longer.train_x.shape == (4, 40) and torch.equal(longer.train_x[:, :16], first.train_x)
    assert longer.extras["cache"] != first.extras["cache"]
    with pytest.raises(AssertionError, match="retrained"):
        load_dataset(imdb_cfg(tmp_path, vocab_size=320), tmp_path)
    monkeypatch.setattr(imdb, "train_tokenizer", real_training)  # not undo(): that would undo tiny_release too
    other = load_dataset(imdb_cfg(tmp_path, cache_dir=str(tmp_path / "c")), tmp_path)
    assert Path(other.extras["cache"]).parent == tmp_path / "c"


def test_imdb_cache_avoids_a_read_only_data_folder(tiny_release, tmp_path, monkeypatch):
    write_aclimdb(tmp_path / "imdb", TRAIN_TEXT, TEST_TEXT)
    monkeypatch.setenv("DPRUN_DATA_DIR", str(tmp_path / "user-cache"))
    (tmp_path / "imdb").chmod(0o555)  # read-only, even for root (write bits are checked)
    try:
        d = load_dataset(imdb_cfg(tmp_path), tmp_path)
    finally:
        (tmp_path / "imdb").chmod(0o755)
    assert Path(d.extras["cache"]).parent == tmp_path / "user-cache" / "imdb"
    assert sorted(p.name for p in (tmp_path / "imdb").iterdir()) == ["aclImdb"]


def test_imdb_too_small_vocab_is_an_error(tiny_release, tmp_path):
    write_aclimdb(tmp_path / "imdb", TRAIN_TEXT, TEST_TEXT)
    with pytest.raises(DprunError, match="vocab_size=100"):
        load_dataset(imdb_cfg(tmp_path, vocab_size=100), tmp_path)


# ---- downloads (no internet here: file:// URLs and a patched opener) ----

def test_fetch_verifies_checksums(tmp_path):
    (tmp_path / "mirror").mkdir()
    payload = b"official bytes" * 1000
    (tmp_path / "mirror" / "f.bin").write_bytes(payload)
    url = (tmp_path / "mirror").as_uri() + "/"
    md5, sha = hashlib.md5(payload).hexdigest(), hashlib.sha256(payload).hexdigest()
    got = download.fetch("f.bin", [url], tmp_path / "dest", md5=md5, sha256=sha)
    assert got.read_bytes() == payload
    with pytest.raises(DprunError, match="served a file with md5") as e:
        download.fetch("f.bin", [url], tmp_path / "bad", md5="0" * 32)
    assert "\n" not in str(e.value)
    assert not any((tmp_path / "bad").iterdir())  # neither the file nor a .part is left behind
    (tmp_path / "dest" / "f.bin").write_bytes(b"corrupt")
    with pytest.raises(DprunError, match="has md5"):
        download.fetch("f.bin", [url], tmp_path / "dest", md5=md5)


def test_fetch_unreachable_is_one_line_and_tries_every_mirror(tmp_path, monkeypatch):
    tried = []

    def offline(url, timeout):
        tried.append(url)
        raise urllib.error.URLError("Temporary failure in name resolution")

    monkeypatch.setattr(download, "URLOPEN", offline)
    with pytest.raises(DprunError, match="not reachable: Temporary failure") as e:
        download.fetch("x.gz", ["https://a.example/", "https://b.example/"], tmp_path, md5="0" * 32)
    assert tried == ["https://a.example/x.gz", "https://b.example/x.gz"]
    assert "\n" not in str(e.value) and str(tmp_path) in str(e.value)


def test_mnist_download_true_fetches_and_loads(tiny_release, tmp_path, monkeypatch):
    tiny_idx(tmp_path / "mirror", gz_images=True)
    for stem in ("train-labels-idx1-ubyte", "t10k-labels-idx1-ubyte"):  # the mirror serves .gz only
        p = tmp_path / "mirror" / stem
        p.with_name(stem + ".gz").write_bytes(gzip.compress(p.read_bytes()))
    md5s = tuple(download.file_digest(tmp_path / "mirror" / (s + ".gz")) for s in mnist.FILES)
    subdirs, consts, _, _ = mnist.SPECS["mnist"]
    monkeypatch.setitem(mnist.SPECS, "mnist", (subdirs, consts, [(tmp_path / "mirror").as_uri() + "/"], md5s))
    d = load_dataset({"name": "mnist", "download": True}, tmp_path / "data")
    assert d.train_x.shape == (12, 1, 28, 28)
    assert sorted(p.name for p in (tmp_path / "data" / "mnist").iterdir()) == sorted(s + ".gz" for s in mnist.FILES)


# ---- the real data (skipped when absent) ----

@pytest.mark.skipif(not (REAL / "mnist").is_dir(), reason=f"no real MNIST in {REAL}")
def test_real_mnist():
    d = load_dataset({"name": "mnist"}, REAL)
    assert d.train_x.shape == (60000, 1, 28, 28) and d.test_x.shape == (10000, 1, 28, 28)
    assert d.train_y.bincount().tolist() == [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
    assert round((d.train_x * 0.3081 + 0.1307).mean().item(), 4) == 0.1307  # pixel mean / 255
    assert abs(d.train_x.std().item() - 1) < 0.01


@pytest.mark.skipif(not (REAL / "fashion-mnist").is_dir(), reason=f"no real Fashion-MNIST in {REAL}")
def test_real_fmnist():
    d = load_dataset({"name": "fmnist"}, REAL)
    assert d.train_y.bincount().tolist() == [6000] * 10 and d.test_y.bincount().tolist() == [1000] * 10
    assert round((d.train_x * 0.3530 + 0.2860).mean().item(), 4) == 0.2860


@pytest.mark.slow
@pytest.mark.skipif(not (REAL / "imdb").is_dir(), reason=f"no real IMDB in {REAL}")
def test_real_imdb_and_its_cache(tmp_path):
    cfg = {"name": "imdb", "vocab_size": 8185, "seq_len": 150, "cache_dir": str(tmp_path)}
    t0 = time.perf_counter()
    d = load_dataset(cfg, REAL)
    t1 = time.perf_counter()
    again = load_dataset(cfg, REAL)
    t2 = time.perf_counter()
    print(f"imdb first load {t1 - t0:.1f} s, cached load {t2 - t1:.2f} s")
    assert d.train_x.shape == (25000, 150) and d.test_x.shape == (25000, 150)
    assert d.train_y.bincount().tolist() == [12500, 12500] and d.test_y.bincount().tolist() == [12500, 12500]
    assert int(d.train_x.max()) == 8184 and torch.equal(d.test_x, again.test_x)
    assert t2 - t1 < 5


def test_the_real_data_tests_read_DPRUN_DATA_DIR_when_set(tmp_path):
    """tests/conftest.py's SHARED_DATA is the one place the real-data tests find their files."""
    import os
    import re
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    code = "import conftest; print(conftest.SHARED_DATA)"
    env = {**os.environ, "DPRUN_DATA_DIR": str(tmp_path / "mine")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tests, env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == str(tmp_path / "mine"), out.stderr
    own = [p.name for p in tests.glob("*.py") if p.name != "conftest.py"
           and re.search(r'"shared"\s*/\s*"data"|/work/shar[e]d', p.read_text())]
    assert not own, f"these tests look for the real data themselves, not through conftest.SHARED_DATA: {own}"
