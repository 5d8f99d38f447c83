"""Damaged or incomplete data never trains silently: one-line DprunErrors naming the file, nothing cached from it.

Small files in the real formats are written here; the real files (tests/conftest.py SHARED_DATA: $DPRUN_DATA_DIR,
else ../shared/data) are COPIED to tmp_path (never modified in place) and those tests are skipped when they are
absent. The module-level constants are patched with raising=False so that each test also runs (and fails for its
real reason) on a loader without them.
"""
import gzip
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from runner.data import imdb, load_dataset, mnist
from conftest import SHARED_DATA
from runner.errors import DprunError

REAL = SHARED_DATA  # the real datasets: $DPRUN_DATA_DIR, else ../shared/data (tests/conftest.py)
PER_CLASS = 30  # reviews per split and class in the small aclImdb written here


def one_line_error(excinfo, path) -> str:
    """The error is a DprunError, one line, naming the file (or folder) at fault."""
    msg = str(excinfo.value)
    assert excinfo.type is DprunError or issubclass(excinfo.type, DprunError), excinfo.type
    assert "\n" not in msg and str(path) in msg, msg
    return msg


def flip_middle(path: Path, n: int = 64, at: float = 0.5) -> None:
    """Invert n bytes in the middle of the file (or at fraction `at` of it), keeping its size and modification time."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    mid = int(len(data) * at)
    data[mid:mid + n] = bytes(b ^ 0xFF for b in data[mid:mid + n])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def truncate(path: Path, keep: float = 0.5) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ---- IMDB ----

def review(rng, i) -> str:
    words = ["film", "plot", "actor", "great", "awful", "scene", "story", "boring", "loved", "music", "ending"]
    return " ".join(rng.choice(words, 300)) + f" review {i}"


def write_aclimdb(root: Path, per_class: int = PER_CLASS) -> Path:
    """aclImdb/{train,test}/{pos,neg}/<id>_<rating>.txt, per_class files each, ~2 kB of text per review."""
    rng = np.random.default_rng(0)
    for split in ("train", "test"):
        for cls, rating in (("pos", 8), ("neg", 2)):
            folder = root / "aclImdb" / split / cls
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                (folder / f"{i}_{rating}.txt").write_text(review(rng, i), encoding="utf-8")
    return root / "aclImdb"


def write_tarball(tmp_path: Path, name: str = "aclImdb_v1.tar.gz") -> Path:
    """A gzipped tarball of a small aclImdb in tmp_path/data/imdb/<name>."""
    src = write_aclimdb(tmp_path / "src")
    dest = tmp_path / "data" / "imdb" / name
    dest.parent.mkdir(parents=True)
    with tarfile.open(dest, "w:gz") as t:
        t.add(src, arcname="aclImdb")
    return dest


def imdb_cfg(tmp_path: Path) -> dict:
    return {"name": "imdb", "vocab_size": 300, "seq_len": 16, "cache_dir": str(tmp_path / "cache")}


def cached_files(tmp_path: Path) -> list[str]:
    folder = tmp_path / "cache"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


@pytest.fixture
def small_imdb(monkeypatch):
    """The small aclImdb written here is the complete release as far as the counts go."""
    monkeypatch.setattr(imdb, "PER_CLASS", {"train": PER_CLASS, "test": PER_CLASS}, raising=False)


@pytest.fixture
def unknown_checksums(monkeypatch):
    """No file has a known checksum: the small files written under the standard names are checked by their
    structure and counts only (as any file without a known checksum is)."""
    try:
        from runner.data import integrity
        monkeypatch.setattr(integrity, "KNOWN_SHA256", {})
    except ImportError:  # a loader without the table: nothing to switch off
        pass


def test_small_tarball_with_an_unknown_name_loads(small_imdb, tmp_path):
    write_tarball(tmp_path, "aclImdb_small.tar.gz")  # intact data of the right structure, no known checksum: passes
    d = load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    assert d.train_y.bincount().tolist() == [PER_CLASS, PER_CLASS] and len(d.test_y) == 2 * PER_CLASS


def test_tarball_with_64_flipped_bytes_is_refused_and_not_cached(small_imdb, unknown_checksums, tmp_path):
    tarball = write_tarball(tmp_path)
    flip_middle(tarball)
    with pytest.raises(DprunError) as e:
        load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    assert "damaged" in one_line_error(e, tarball)
    assert cached_files(tmp_path) == []  # neither a tokenizer nor tensors from the damaged data


def test_truncated_tarball_is_one_line(small_imdb, unknown_checksums, tmp_path):
    tarball = write_tarball(tmp_path)
    truncate(tarball)
    with pytest.raises(Exception) as e:
        load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    assert "download" in one_line_error(e, tarball)
    assert cached_files(tmp_path) == []


def test_standard_name_with_other_content_is_refused(small_imdb, tmp_path):
    tarball = write_tarball(tmp_path, name="aclImdb_v1.tar.gz")  # right structure, not the Stanford file
    with pytest.raises(Exception) as e:
        load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    assert "sha256" in one_line_error(e, tarball)


def test_damaged_source_never_reuses_an_earlier_cache(small_imdb, unknown_checksums, tmp_path):
    tarball = write_tarball(tmp_path)
    load_dataset(imdb_cfg(tmp_path), tmp_path / "data")  # a good load writes the cache
    flip_middle(tarball)  # same size and modification time: only the content changed
    with pytest.raises(Exception) as e:
        load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    one_line_error(e, tarball)


def test_folder_with_deleted_reviews_is_refused(small_imdb, tmp_path):
    folder = write_aclimdb(tmp_path / "data" / "imdb")
    for p in sorted((folder / "train" / "pos").glob("*.txt"))[:20]:  # 30 -> 10, as 12,500 -> 500
        p.unlink()
    with pytest.raises(Exception) as e:
        load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    msg = one_line_error(e, folder / "train" / "pos")
    assert f"holds 10 reviews, the release has {PER_CLASS}" in msg
    assert cached_files(tmp_path) == []


def test_folder_review_that_is_not_utf8_is_one_line(small_imdb, tmp_path):
    folder = write_aclimdb(tmp_path / "data" / "imdb")
    bad = folder / "test" / "pos" / "3_8.txt"
    bad.write_bytes(b"\xff\xfe garbled \x80")
    with pytest.raises(Exception) as e:
        load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    one_line_error(e, bad)


def test_folder_edited_after_caching_is_not_served_from_the_cache(small_imdb, tmp_path, monkeypatch):
    folder = write_aclimdb(tmp_path / "data" / "imdb")
    load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    p = sorted((folder / "train" / "neg").glob("*.txt"))[0]
    p.write_text("an entirely different review, longer than before " * 3, encoding="utf-8")
    monkeypatch.setattr(imdb.torch, "load", lambda *a, **k: pytest.fail("stale cache reused"))
    load_dataset(imdb_cfg(tmp_path), tmp_path / "data")


def test_imdb_states_what_is_outside_the_accounting(small_imdb, tmp_path):
    write_aclimdb(tmp_path / "data" / "imdb")
    d = load_dataset(imdb_cfg(tmp_path), tmp_path / "data")
    assert any("tokenizer" in note and "outside the privacy accounting" in note for note in d.privacy_notes)
    assert d.to("cpu").privacy_notes == d.privacy_notes


@pytest.fixture
def real_imdb(tmp_path) -> Path:
    src = REAL / "imdb" / "aclImdb_labeled_text.tar.gz"
    if not src.is_file():
        pytest.skip(f"no real IMDB tarball in {REAL}")
    dest = tmp_path / "data" / "imdb" / src.name
    dest.parent.mkdir(parents=True)
    shutil.copyfile(src, dest)
    return dest


def test_real_imdb_tarball_with_64_flipped_bytes_is_refused(real_imdb, tmp_path):
    # the case: at 52% of the file the old loader read 589 training reviews, all negative, and the 25,000
    # test reviews, without an error (at 50% it found no training review at all)
    flip_middle(real_imdb, at=0.52)
    with pytest.raises(Exception) as e:
        load_dataset({**imdb_cfg(tmp_path), "vocab_size": 8185, "seq_len": 150}, tmp_path / "data")
    assert "sha256" in one_line_error(e, real_imdb)
    assert cached_files(tmp_path) == []


def test_real_imdb_tarball_renamed_and_damaged_fails_the_gzip_check(real_imdb, tmp_path):
    renamed = real_imdb.with_name("aclImdb_mine.tar.gz")  # no known checksum: the gzip CRC and counts decide
    real_imdb.rename(renamed)
    flip_middle(renamed, at=0.52)
    with pytest.raises(Exception) as e:
        load_dataset({**imdb_cfg(tmp_path), "vocab_size": 8185, "seq_len": 150}, tmp_path / "data")
    assert "damaged gzip" in one_line_error(e, renamed)
    assert cached_files(tmp_path) == []


# ---- MNIST / Fashion-MNIST ----

def write_idx(path: Path, a: np.ndarray, magic_ndim: int | None = None) -> None:
    ndim = a.ndim if magic_ndim is None else magic_ndim
    shape = a.shape if magic_ndim is None else (a.shape + (1,) * ndim)[:ndim]
    raw = b"\x00\x00\x08" + bytes([ndim]) + b"".join(d.to_bytes(4, "big") for d in shape) + a.tobytes()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.with_name(path.name + ".gz").write_bytes(gzip.compress(raw))


def write_mnist(folder: Path, n=(12, 5)) -> None:
    rng = np.random.default_rng(0)
    for split, count in zip(("train", "t10k"), n):
        write_idx(folder / f"{split}-images-idx3-ubyte", rng.integers(0, 256, (count, 28, 28), dtype=np.uint8))
        write_idx(folder / f"{split}-labels-idx1-ubyte", (np.arange(count) % 10).astype(np.uint8))


@pytest.fixture
def small_mnist(monkeypatch):
    """Small idx files stand in for the release: their counts are expected and their names carry no checksum."""
    monkeypatch.setattr(mnist, "COUNTS", {"train": 12, "t10k": 5}, raising=False)


def crc_corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # the gzip trailer: CRC32 (4 bytes), then the length
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [truncate, crc_corrupt, flip_middle], ids=["truncated", "crc", "flipped"])
def test_damaged_mnist_gz_is_one_line_naming_the_file(small_mnist, unknown_checksums, tmp_path, damage):
    write_mnist(tmp_path / "mnist")
    bad = tmp_path / "mnist" / "train-images-idx3-ubyte.gz"
    damage(bad)
    with pytest.raises(Exception) as e:
        load_dataset({"name": "mnist"}, tmp_path)
    msg = one_line_error(e, bad)
    assert "download" in msg and "damaged gzip" in msg


def test_labels_file_with_the_images_magic_is_refused(small_mnist, unknown_checksums, tmp_path):
    write_mnist(tmp_path / "mnist")
    labels = tmp_path / "mnist" / "train-labels-idx1-ubyte"
    write_idx(labels, (np.arange(12) % 10).astype(np.uint8), magic_ndim=3)  # header 00000803, dims (12, 1, 1)
    with pytest.raises(Exception) as e:
        load_dataset({"name": "mnist"}, tmp_path)
    assert "00000801" in one_line_error(e, labels.with_name(labels.name + ".gz"))


def test_too_few_mnist_images_is_refused(tmp_path):
    write_mnist(tmp_path / "mnist")  # 12 / 5 examples: a valid idx file, not the 60,000 / 10,000 release
    with pytest.raises(Exception) as e:
        load_dataset({"name": "mnist"}, tmp_path)
    msg = one_line_error(e, tmp_path / "mnist" / "train-images-idx3-ubyte.gz")
    assert "holds 12 images, the release has 60,000" in msg


@pytest.mark.parametrize("name, sub", [("mnist", "mnist"), ("fmnist", "fashion-mnist")])
def test_real_idx_file_with_one_changed_label_fails_its_checksum(tmp_path, name, sub):
    if not (REAL / sub).is_dir():
        pytest.skip(f"no real {name} in {REAL}")
    shutil.copytree(REAL / sub, tmp_path / sub)
    labels = tmp_path / sub / "t10k-labels-idx1-ubyte.gz"
    raw = bytearray(gzip.decompress(labels.read_bytes()))
    raw[100] = (raw[100] + 1) % 10  # a valid gzip of a valid idx file with the right count: only the content differs
    labels.write_bytes(gzip.compress(bytes(raw)))
    with pytest.raises(Exception) as e:
        load_dataset({"name": name}, tmp_path)
    assert "sha256" in one_line_error(e, labels)


def test_real_mnist_gz_truncated_names_the_file(tmp_path):
    if not (REAL / "mnist").is_dir():
        pytest.skip(f"no real MNIST in {REAL}")
    shutil.copytree(REAL / "mnist", tmp_path / "mnist")
    bad = tmp_path / "mnist" / "t10k-images-idx3-ubyte.gz"
    truncate(bad, 0.9)
    with pytest.raises(Exception) as e:
        load_dataset({"name": "mnist"}, tmp_path)
    one_line_error(e, bad)


# ---- digits: a fixed input transform ----

def test_digits_transform_does_not_depend_on_the_training_split(monkeypatch):
    import sklearn.model_selection
    from sklearn.datasets import load_digits

    images = load_digits().images  # (1797, 8, 8)
    default = load_dataset({"name": "digits"}, None)

    def other_split(x, y, **kwargs):  # the first 300 images only, against ~1,440 in the default split
        return x[:300], x[300:], y[:300], y[300:]

    monkeypatch.setattr(sklearn.model_selection, "train_test_split", other_split)
    small = load_dataset({"name": "digits"}, None)
    # the same image gets the same tensor whatever the training split is (image 0 is in small's training split)
    zero = small.train_x[0]
    matches = [t for t in torch.cat([default.train_x, default.test_x]) if torch.equal(t, zero)]
    assert matches, "image 0 is transformed differently under another training split"
    assert torch.allclose(small.test_x[-1, 0], torch.from_numpy((images[-1] / 16 - 0.5) / 0.5).float())
    assert default.privacy_notes == []


# ---- CIFAR-10 (binary release) ----

def write_cifar_tarball(tmp_path: Path, records=(2, 2, 2, 2, 2, 2)) -> Path:
    """cifar10/cifar-10-binary.tar.gz with the given number of records in data_batch_1..5 and test_batch."""
    from runner.data import cifar10 as cifar

    folder = tmp_path / "src" / cifar.BIN_DIR
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name, n in zip(cifar.TRAIN + cifar.TEST, records):
        (folder / f"{name}.bin").write_bytes(rng.integers(0, 10, (n, cifar.RECORD), dtype=np.uint8).tobytes())
    dest = tmp_path / "data" / "cifar10" / cifar.BIN_TAR
    dest.parent.mkdir(parents=True)
    with tarfile.open(dest, "w:gz") as t:
        t.add(folder, arcname=cifar.BIN_DIR)
    return dest


@pytest.fixture
def small_cifar(monkeypatch):
    from runner.data import cifar10 as cifar

    monkeypatch.setattr(cifar, "PER_BATCH", 2, raising=False)


def test_cifar10_truncated_tarball_is_one_line(small_cifar, tmp_path):
    tarball = write_cifar_tarball(tmp_path)
    truncate(tarball)
    with pytest.raises(Exception) as e:
        load_dataset({"name": "cifar10"}, tmp_path / "data")
    assert "download" in one_line_error(e, tarball)


def test_cifar10_batch_with_missing_images_is_refused(small_cifar, tmp_path):
    tarball = write_cifar_tarball(tmp_path, records=(2, 2, 1, 2, 2, 2))  # data_batch_3 lost an image
    with pytest.raises(Exception) as e:
        load_dataset({"name": "cifar10"}, tmp_path / "data")
    assert "holds 1 images, the release has 2" in one_line_error(e, f"{tarball}/data_batch_3.bin")
