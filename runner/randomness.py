"""Where a run's privacy randomness comes from: `rng=seeded` (torch generators seeded by `seed`) or `rng=secure`.

    rng = sampling_generator("secure", seed=0, world=world)   # SecureRandom: AES-256-CTR keyed from os.urandom
    mask = poisson_mask(rng, n, batch_size)                   # (n,) bool: the step's Poisson sample
    z = standard_normal(rng, numel, device, dtype)            # (numel,) N(0, 1), the same on every rank

seeded (default): the Poisson masks come from a torch.Generator seeded from `seed` (derived_seed: a stream of its
own) and the noise from torch's global RNG, seeded by `seed`, so a run is replayable bit for bit (exactness tests,
resume). The guarantee then holds only
against an adversary who does not know `seed` (it is in summary.json): with it, training on D and on D' replays
both runs and the released model equals exactly one of them.

secure: the masks, the shuffles/partitions and the Gaussian noise come from SecureRandom, the AES-256-CTR keystream
of the `cryptography` package (OpenSSL) under a 256-bit key from os.urandom (`secrets`). The key lives only inside the
cipher object: it is never written (not summary.json, not the log, not the checkpoint); a resumed run draws a fresh
key. The Gaussian is the sum of two independent Box-Muller draws of N(0, 1/2) (the cosine output only; 52-bit
uniforms for the radius, its logarithm in float64, 23-bit ones for the angle) per value, Holohan & Braghin's
n = 2 (arXiv 2107.10138; Opacus's secure_mode sums four torch.normal draws whose pairs share uniforms) against the
floating-point attacks on Gaussian samplers (docs/privacy.md); the next step's noise is drawn ahead on a worker thread.
On a GPU the keystream is made by several streams in parallel into a pinned buffer and turned into uniforms and
Gaussians on the device (on_gpu: the same values from the same bytes). On several ranks rank 0 draws
and broadcasts, so every rank samples the same batch and adds the same noise.
"""
from __future__ import annotations

import hashlib
import math
import os
import secrets
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from runner.errors import DprunError

RNGS = ("seeded", "secure")
REKEY_BYTES = 2**36  # a fresh key every 64 GiB of keystream (far below AES-CTR's 2^64-block limit for one key)
CHUNK_BYTES = 2**22  # keystream made in blocks of 4 MiB: big enough for OpenSSL's vector code, a small zero buffer
_ZEROS = memoryview(bytes(CHUNK_BYTES))


def check_rng(rng: str) -> str:
    if rng not in RNGS:
        raise DprunError(f"rng={rng!r} is not valid: rng must be one of: {', '.join(RNGS)}")
    return rng


def _observe_key(key: bytes) -> None:
    """Test hook (tests/test_secure_rng.py replaces it to search a run's files for the key); does nothing."""


class SecureRandom:
    """An AES-256-CTR keystream (cryptography's OpenSSL binding) keyed from the OS, turned into masks and Gaussians with
    vectorised numpy/torch ops. `world`: on several ranks only rank 0 draws; the others receive its draws.
    `ahead`: draw the next step's noise on a worker thread while this step computes (the noise does not depend on
    the data, only on the parameter count): its cost leaves the step when a core is free."""

    def __init__(self, world=None, ahead: bool = True):
        from runner.distributed import World

        self.world = world if world is not None else World()
        self.ahead = ahead
        self._pending: dict[tuple, Future] = {}  # (n, device, dtype) -> the next noise of that size
        self._worker: ThreadPoolExecutor | None = None
        self._lanes: list | None = None  # fill()'s parallel streams, made on first use (the GPU noise)
        self._lane_pool: ThreadPoolExecutor | None = None
        self._staging: torch.Tensor | None = None  # pinned host keystream for the GPU noise, reused
        self._staged: torch.cuda.Event | None = None  # its last copy to the GPU (wait before refilling)
        self._lock_staging = threading.Lock()
        self._stream = KeystreamLane()  # shared by the sampler (main thread) and the noise worker: it has a lock

    def bytes(self, size: int) -> np.ndarray:
        """(size,) uint8 of the keystream (a fresh array; size a multiple of 8): the sampler's and the CPU noise's."""
        out = np.empty(size + 64, dtype=np.uint8)  # update_into wants room for a block more than it writes
        self._stream.fill(out, size)
        return out[:size]

    def fill(self, out: np.ndarray) -> None:
        """out (size,) uint8, contiguous, overwritten with keystream: cut into parts of at least CHUNK_BYTES (at most
        one per lane), each part from its own AES-256-CTR stream under its own key from the OS, on its own thread
        (OpenSSL releases the GIL: a GPU's noise, 24 bytes a value, needs several cores' keystream); a small draw
        (a model of under ~175k parameters) is one part, made here without a thread hand-off. The same security as
        one stream: independent keys."""
        lanes = self._lanes_ready()[:max(1, out.size // CHUNK_BYTES)]
        bounds = np.linspace(0, out.size, len(lanes) + 1).astype(np.int64) // 64 * 64
        bounds[-1] = out.size
        parts = [(lane, out[bounds[i]:bounds[i + 1]]) for i, lane in enumerate(lanes) if bounds[i + 1] > bounds[i]]
        if len(parts) == 1:
            parts[0][0].fill(parts[0][1])
            return
        for f in [self._lane_pool.submit(lane.fill, part) for lane, part in parts]:
            f.result()

    def _lanes_ready(self) -> list:
        if self._lanes is None:
            count = keystream_lanes(self.ahead, os.cpu_count() or 2)
            self._lanes = [KeystreamLane() for _ in range(count)]
            self._lane_pool = ThreadPoolExecutor(count, thread_name_prefix="dprun-keystream")
        return self._lanes

    def words(self, n: int) -> np.ndarray:
        """(n,) int64: 64 uniformly random bits each (the keystream, 8 bytes a word; a fresh array)."""
        return self.bytes(8 * n).view(np.int64)

    def normal(self, n: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """(n,) N(0, 1) of `dtype` on `device`: the one drawn ahead for this size if there is one, else drawn now;
        then the next one of this size is started on the worker thread."""
        key = (n, device, dtype)
        pending = self._pending.pop(key, None)
        z = pending.result() if pending is not None else self._draw(key)
        if self.ahead:
            if self._worker is None:
                self._worker = single_threaded_worker()
            self._pending[key] = self._worker.submit(self._draw, key)
        return z

    def drain(self) -> None:
        """Wait for the draws started ahead (the bench: a step's whole cost, none of it left to overlap others)."""
        for pending in self._pending.values():
            pending.result()

    def _draw(self, key: tuple) -> torch.Tensor:
        n, device, dtype = key
        return secure_standard_normal(self, n, device, dtype).to(dtype)

    # the checkpoint's view (runner/checkpoint.py): nothing is saved, nothing restored; a resume draws a fresh key
    def get_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_state(self, state) -> None:
        pass

    def shared(self, draw, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """draw() on rank 0, broadcast to the others (on `device`: nccl needs CUDA tensors); one process: draw()."""
        if self.world.size == 1:
            return draw()
        import torch.distributed as dist

        out = draw().to(device) if self.world.main else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(out, src=0)
        return out


# keystream lanes for the GPU noise (SecureRandom.fill): up to 8 when the step waits for the draw, up to 4 when it is
# drawn ahead beside a step whose host thread is busy launching kernels. Measured on an H100 host (16 cores, stop 30,
# reweight-bk, 10 consecutive steps, one run; docs/bench.md): secure over seeded with 1 / 2 / 4 / 8 lanes 1.27 / 1.21 /
# 1.11 / 1.69x on the IMDB transformer (2.1 M parameters), 1.95 / 1.08 / 1.22 / 1.42x on ResNet-18 (11.2 M): eight
# lanes finish a lone draw soonest but slow the launching thread beside them.
LANES_WAITING, LANES_AHEAD = 8, 4


def keystream_lanes(ahead: bool, cpus: int) -> int:
    """How many AES-CTR lanes make the GPU noise's keystream: half the cores, at most LANES_AHEAD when drawn ahead
    (overlapping the step), else LANES_WAITING."""
    return max(1, min(LANES_AHEAD if ahead else LANES_WAITING, cpus // 2))


class KeystreamLane:
    """One AES-256-CTR stream under its own key from the OS (SecureRandom.bytes, and each of SecureRandom.fill's
    parts), rekeyed every REKEY_BYTES; thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._rekey()

    def _rekey(self) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        key = secrets.token_bytes(32)
        _observe_key(key)
        # AES-256 in counter mode (AES instructions: ~2x ChaCha20's keystream rate on x86 here); a fresh random key
        # per stream, so the 128-bit counter block may start at 0
        self._cipher = Cipher(algorithms.AES(key), modes.CTR(bytes(16))).encryptor()
        self._used = 0

    def fill(self, out: np.ndarray, size: int | None = None) -> None:
        """out[:size] (uint8; size: all of out) overwritten with this stream's next bytes. update_into asks for a
        block more room than it writes: the bytes of out past `size` serve as that room; where there are not 64 of
        them, the last piece goes through a scratch buffer, so nothing past `out` is touched (another lane's)."""
        size = out.size if size is None else size
        with self._lock:
            if self._used + size > REKEY_BYTES:
                self._rekey()
            self._used += size
            view = memoryview(out)
            for start in range(0, size, CHUNK_BYTES):
                part = min(CHUNK_BYTES, size - start)
                if start + part + 64 <= out.size:
                    self._cipher.update_into(_ZEROS[:part], view[start:start + part + 64])
                else:
                    scratch = bytearray(part + 64)
                    self._cipher.update_into(_ZEROS[:part], scratch)
                    view[start:start + part] = scratch[:part]


def single_threaded_worker() -> ThreadPoolExecutor:
    """A one-thread pool whose torch ops run on that thread alone. A new thread's first parallel op would start its
    own OpenMP team beside the main thread's: both spin on the same cores and stall each other (the draw ahead then
    slows the step it should hide behind). torch.set_num_threads sets the calling thread's team size and the default
    for threads not yet started, so the worker sets 1 for itself and the default is put back afterwards."""
    default = torch.get_num_threads()
    worker = ThreadPoolExecutor(1, thread_name_prefix="dprun-secure-noise",
                                initializer=lambda: (torch.set_num_threads(1), torch.get_num_threads()))
    worker.submit(lambda: None).result()  # the initializer has run
    torch.set_num_threads(default)  # this thread's team and later threads' default, as before
    return worker


def uniform_open(words: np.ndarray) -> np.ndarray:
    """int64 random words (n,), overwritten -> float64 (n,) in (0, 1): 52 random bits as the mantissa of a float in
    [1, 2), minus 1 - 2^-53, so the values are the centres of 2^52 equal cells: never 0 or 1 (log(u) is finite),
    symmetric about 1/2. In place, in numpy: the fastest vectorised route here (torch's int64 ops are 5x slower)."""
    bits = words.view(np.uint64)
    bits >>= np.uint64(12)
    bits |= np.uint64(0x3FF0000000000000)
    u = bits.view(np.float64)
    u -= 1.0 - 2.0**-53
    return u


def uniform_open_float32(words: np.ndarray) -> np.ndarray:
    """uint32 random words (n,), overwritten -> float32 (n,) in (0, 1): 23 random bits, the centres of 2^23 equal
    cells ((2k + 1) / 2^24, exact in float32), as uniform_open does with 52."""
    bits = words.view(np.uint32)
    bits >>= np.uint32(9)
    bits |= np.uint32(0x3F800000)
    u = bits.view(np.float32)
    u -= np.float32(1.0 - 2.0**-24)
    return u


def box_muller_cosine(u: torch.Tensor, angle: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """(m,) float64 uniforms u in (0, 1) (52 bits) and (m,) float32 uniforms for the angle (23 bits), both
    overwritten -> `out`, (m,) float32: sqrt(-ln u) cos(2 pi angle), each N(0, 1/2) (Box-Muller's first output over
    sqrt 2; its second, the sine, is not used: see secure_standard_normal). ln u in float64 (u near 1, where the
    radius is small, has all its bits there), then rounded to float32: the root, the cosine and the product in
    float32, the precision of the noise that is added (float64 roots and trigonometry cost 2-2.5x)."""
    out.copy_(u.log_()).neg_()  # -ln u >= 0, rounded once to float32 (copy_ then neg_: 2x a mixed-dtype mul's speed)
    return out.sqrt_().mul_(angle.mul_(2.0 * math.pi).cos_())


SAMPLE_BYTES = 12  # one Box-Muller draw: 8 bytes (52 bits) for the radius's uniform, 4 (23 bits) for the angle's
SAMPLES = 2  # per noise value: Holohan & Braghin's n = 2 draws with no uniforms shared between values


def secure_standard_normal(rng: SecureRandom, n: int, device: torch.device,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(n,) N(0, 1) on `device`: each value the sum of SAMPLES = 2 independent Box-Muller draws of N(0, 1/2),
    sqrt(-ln u) cos(theta), each from its own uniforms (Holohan & Braghin, arXiv 2107.10138: n draws suffice when no
    uniform is shared between draws; Box-Muller's sine would share the cosine's, so it is not used. The previous
    r (cos + sin) per pair equals sqrt 2 r cos(theta - pi/4): the same one draw, at twice the trigonometry). The sum
    is float32, or float64 for float64 noise: a float64 gradient plus noise rounded to the float32 grid would show
    the gradient's low bits (Mironov's attack), while a float64 sum of two float32 draws is not confined to one grid.
    The keystream and the uniforms are made on the CPU, in blocks that stay in the cache (2^15 values: 768 KiB of
    keystream); the Box-Muller math runs on `device` (one block on a GPU)."""
    wide = dtype == torch.float64
    if device.type == "cuda":
        return on_gpu(rng, n, device, wide)
    out = torch.empty(n, dtype=torch.float64 if wide else torch.float32, device=device)
    block = n if device.type != "cpu" else 2**15
    draws = torch.empty(SAMPLES * min(block, n), dtype=torch.float32, device=device)  # reused by every block
    for start in range(0, n, block):
        b = min(block, n - start)
        m = SAMPLES * b  # Box-Muller draws for this block: the first b are the values' first summands
        raw = rng.bytes(SAMPLE_BYTES * m)  # (12 m,) uint8
        u = torch.from_numpy(uniform_open(raw[:8 * m].view(np.int64))).to(device)  # (m,) float64
        angle = torch.from_numpy(uniform_open_float32(raw[8 * m:].view(np.uint32))).to(device)  # (m,) float32
        z = box_muller_cosine(u, angle, draws[:m])  # (m,) float32, each N(0, 1/2)
        if wide:
            torch.sum(z.view(SAMPLES, b), 0, dtype=torch.float64, out=out[start:start + b])
        else:
            torch.add(z[:b], z[b:], out=out[start:start + b])
    return out


def uniform_open_bits(words: torch.Tensor) -> torch.Tensor:
    """uniform_open in torch ops, for a GPU: (m,) int64 words -> (m,) float64 in (0, 1), bit for bit the same values
    (the top 52 bits as the mantissa of [1, 2), minus 1 - 2^-53). >> is arithmetic on int64: the mask drops the sign's
    copies."""
    bits = (words >> 12).bitwise_and_(2**52 - 1).bitwise_or_(0x3FF0000000000000)
    return bits.view(torch.float64).sub_(1.0 - 2.0**-53)


def uniform_open_float32_bits(words: torch.Tensor) -> torch.Tensor:
    """uniform_open_float32 in torch ops: (m,) int32 words -> (m,) float32 in (0, 1), the top 23 bits, bit for bit."""
    bits = (words >> 9).bitwise_and_(2**23 - 1).bitwise_or_(0x3F800000)
    return bits.view(torch.float32).sub_(1.0 - 2.0**-24)


def on_gpu(rng: SecureRandom, n: int, device: torch.device, wide: bool) -> torch.Tensor:
    """secure_standard_normal for a CUDA device: the same 24 n keystream bytes and the same values as the CPU route
    (uniforms bit for bit, the Box-Muller math in torch on the device), but the keystream is made by several lanes
    in parallel (SecureRandom.fill) into a pinned host buffer, copied as raw bytes (24 n, not 16 n + 8 n after
    conversion) and turned into uniforms on the GPU: ~20 ns a value on one core was 235 ms a step for ResNet-18."""
    m = SAMPLES * n
    size = SAMPLE_BYTES * m
    with rng._lock_staging:
        if rng._staging is None or rng._staging.numel() < size:
            rng._staging = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        elif rng._staged is not None:
            rng._staged.synchronize()  # the previous copy out of the buffer has finished
        host = rng._staging[:size]
        rng.fill(host.numpy())
        raw = torch.empty(size, dtype=torch.uint8, device=device)
        raw.copy_(host, non_blocking=True)
        rng._staged = torch.cuda.Event()
        rng._staged.record()
    return normal_from_keystream(raw, n, wide)


def normal_from_keystream(raw: torch.Tensor, n: int, wide: bool = False) -> torch.Tensor:
    """(24 n,) uint8 keystream on any device -> (n,) N(0, 1) as secure_standard_normal makes them (its layout: the
    radius words first, 16 n bytes, then the angle words, 8 n), float32, or float64 when `wide`."""
    m = SAMPLES * n
    u = uniform_open_bits(raw[:8 * m].view(torch.int64))  # (m,) float64
    angle = uniform_open_float32_bits(raw[8 * m:].view(torch.int32))  # (m,) float32
    z = box_muller_cosine(u, angle, torch.empty(m, dtype=torch.float32, device=raw.device))  # (m,) N(0, 1/2) each
    if wide:
        return z.view(SAMPLES, n).sum(0, dtype=torch.float64)
    return torch.add(z[:n], z[n:])


# -- what noise.py and sampler.py call: seeded keeps torch's draws exactly as they were ------------------------------
def standard_normal(generator, shape: tuple[int, ...], device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """N(0, 1) noise of `shape`: from SecureRandom (the same on every rank), else torch.randn as always (generator
    None: torch's global RNG, seeded by the run; a torch.Generator must live on `device`)."""
    if isinstance(generator, SecureRandom):
        n = math.prod(shape)
        draw = lambda: generator.normal(n, device, dtype).view(shape)  # noqa: E731
        return generator.shared(draw, tuple(shape), dtype, device)
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)


def poisson_mask(generator, n: int, batch_size: int) -> torch.Tensor:
    """(n,) bool on the CPU: each example in with probability q = batch_size / n. Secure: 64-bit word < floor(q 2^64),
    exactly, with integers, so the realised rate is at most q and within 2^-64 of it (epsilon only grows with q).
    Seeded: torch.rand's float32 uniforms are k / 2^24, so `u < q` held with probability ceil(q 2^24) / 2^24 >= q
    (1.4e-5 relative above q at MNIST's 256 / 60,000; 6e-4 at q = 1e-4): compared with floor(q 2^24) / 2^24 (exact
    in float32, integers), the realised rate is at most q and within 2^-24 of it. The same stream of uniforms: a
    batch differs from `u < q`'s only where a uniform equals that threshold (probability 2^-24 per example)."""
    if not isinstance(generator, SecureRandom):
        threshold = ((int(batch_size) << 24) // int(n)) / 2**24 if n > 0 else 0.0  # <= q, a multiple of 2^-24
        return torch.rand(n, generator=generator) < threshold
    if batch_size >= n:
        return torch.ones(n, dtype=torch.bool)
    threshold = np.uint64((batch_size << 64) // n)
    draw = lambda: torch.from_numpy(generator.words(n).view(np.uint64) < threshold)  # noqa: E731
    return generator.shared(draw, (n,), torch.bool, _collective_device(generator)).cpu()


def permutation(generator, n: int) -> torch.Tensor:
    """(n,) int64 on the CPU, a uniformly random permutation (shuffle and fixed sampling). Secure: the order of n
    random 64-bit keys (a tie, probability < n^2 / 2^65, keeps index order)."""
    if not isinstance(generator, SecureRandom):
        return torch.randperm(n, generator=generator)
    draw = lambda: torch.from_numpy(np.argsort(generator.words(n).view(np.uint64), kind="stable"))  # noqa: E731
    return generator.shared(draw, (n,), torch.int64, _collective_device(generator)).cpu()


def _collective_device(generator: SecureRandom) -> torch.device:
    backend = generator.world.backend
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


# -- set-up: the CLI (runner/train.py) and the API (runner/api.py) ---------------------------------------------------
def derived_seed(seed: int, purpose: str) -> int:
    """A 63-bit seed for one of a run's streams ("sampling", "synthetic-data"), hashed from `seed` and the purpose: its
    own mt19937 stream, never the one torch.manual_seed(seed) starts for the model's initialisation, dropout, JL's
    directions and the CPU noise. Review 19: the CLI seeded the sampler and torch's global RNG with the same seed, so
    the noise re-used the sampler's words (965,624 of 965,888 uniforms behind the noise of a digits run) and each
    noise value told whether an example joined a later batch."""
    for attempt in range(8):  # torch's CPU generator keeps a seed's low 32 bits: those must differ from seed's
        key = f"dprun/{purpose}/{int(seed)}" + (f"/{attempt}" if attempt else "")
        digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
        derived = int.from_bytes(digest, "little") & (2**63 - 1)
        if (derived ^ int(seed)) & 0xFFFFFFFF:
            return derived
    raise AssertionError("eight 64-bit hashes agreeing with the seed in 32 bits")  # (probability 2^-256)


def sampling_generator(rng: str, seed: int, world) -> torch.Generator | SecureRandom:
    """The run's sampling generator: seeded from `seed` (derived_seed: apart from torch's global RNG; the same global
    batches on every rank), or SecureRandom, whose draws every rank shares. secure also reseeds torch's global RNG
    (JL directions, dropout) with a secret seed from the OS, broadcast from rank 0, so `seed` does not replay them
    either."""
    if check_rng(rng) == "seeded":
        return torch.Generator().manual_seed(derived_seed(seed, "sampling"))
    return reseeded(SecureRandom(world))


def reseeded(secure: SecureRandom) -> SecureRandom:
    """Reseed torch's global RNG (JL's directions, dropout masks) with a secret from the OS, the same on every rank:
    under rng=secure a program's own torch.manual_seed must not replay them either (JL's directions known in
    advance let a crafted record's gradient be orthogonal to them all: estimated ~0, released unclipped, 122 C).
    The CPU generator gets a whole mt19937 state from the keystream (secret_cpu_state), CUDA's Philox a 63-bit seed
    of its own: torch.manual_seed keeps only a seed's low 32 bits on the CPU (review 40: a 2^32 search of the seeds
    against a released model's initialisation replayed every later direction)."""
    torch.manual_seed(shared_secret_seed(secure))  # CUDA's generators: 63 secret bits (Philox keeps 64)
    torch.set_rng_state(secret_cpu_state(secure))  # the CPU's: 624 secret words, not that seed's low 32 bits
    # several ranks draw their forwards' dropout from forks seeded by (World.seed, step, rank): a secret too, not the
    # run's public seed (review 21: rank 1's masks replayed from seed=5 alone, 1000 of 1000)
    secure.world.seed = shared_secret_seed(secure)
    return secure


MT19937_WORDS = 624  # the CPU generator's state: 624 32-bit words (19,968 bits)


def secret_cpu_state(secure: SecureRandom) -> torch.Tensor:
    """A CPU torch.Generator state (uint8 bytes, torch's CPUGeneratorImplState) whose mt19937 words come from the
    keystream, rank 0's on every rank: torch.manual_seed(seed) sets them from seed's low 32 bits alone, so any
    manual_seed'ed CPU stream is one of 2^32. The layout (torch's legacy pod, little-endian): the initial seed
    (u64), left (i32), seeded (i32), next (u64), the 624 words (u64 slots), then the cached normals, which a
    freshly seeded generator marks invalid; left = 1 makes the first draw twist the words, as after a seed."""
    words = secure.shared(lambda: torch.from_numpy(secure.words(MT19937_WORDS // 2 + 1).copy()),
                          (MT19937_WORDS // 2 + 1,), torch.int64, _collective_device(secure)).cpu()
    return mt19937_state(words.numpy().view(np.uint32))


def mt19937_state(raw: np.ndarray) -> torch.Tensor:
    """A CPU generator state (secret_cpu_state's layout) from 626 uint32: the 624 words, then 64 bits for the seed
    field (informational)."""
    state = bytearray(torch.Generator().manual_seed(1).get_state().numpy().tobytes())  # caches invalid
    slots = np.zeros(MT19937_WORDS, dtype="<u8")
    slots[:] = raw[:MT19937_WORDS]
    slots[0] |= 1 << 31  # never the all-zero state (mt19937's one bad state; 2^-19968 anyway): one bit of 19,968
    state[0:8] = (int(raw[MT19937_WORDS]) | int(raw[MT19937_WORDS + 1]) << 32).to_bytes(8, "little")
    state[8:16] = (1).to_bytes(4, "little") + (1).to_bytes(4, "little")  # left = 1, seeded = 1
    state[16:24] = bytes(8)  # next = 0
    state[24:24 + 8 * MT19937_WORDS] = slots.tobytes()
    return torch.frombuffer(state, dtype=torch.uint8).clone()


def secret_cpu_generator(secure: SecureRandom) -> torch.Generator:
    """A CPU torch.Generator with a whole secret mt19937 state (secret_cpu_state), the same on every rank."""
    generator = torch.Generator()
    generator.set_state(secret_cpu_state(secure))
    return generator


def expanded_generator(seed: int, purpose: str) -> torch.Generator:
    """A CPU torch.Generator whose whole mt19937 state (624 words) is SHAKE-256 of (seed, purpose): a function of all of
    a 63-bit seed's bits, where torch.manual_seed keeps its low 32 on the CPU (review 41: the one-run audit's draws under
    rng=secure, from a secret seed, were each one of 2^32 streams). Deterministic: a public seed replays it."""
    words = np.frombuffer(hashlib.shake_256(f"dprun/{purpose}/{int(seed)}".encode()).digest(4 * (MT19937_WORDS + 2)),
                          dtype="<u4")
    generator = torch.Generator()
    generator.set_state(mt19937_state(words))
    return generator


def secret_device_generator(model: torch.nn.Module, secure: SecureRandom) -> torch.Generator:
    """A secret torch.Generator on the model's device, the same on every rank: the CPU's with a whole secret state
    (secret_cpu_generator), a GPU's (Philox, 64-bit seeds) seeded with 63 secret bits."""
    device = next(model.parameters()).device
    if device.type == "cpu":
        return secret_cpu_generator(secure)
    return torch.Generator(device=device).manual_seed(shared_secret_seed(secure))


def shared_secret_seed(secure: SecureRandom) -> int:
    """A 63-bit seed from the OS's randomness, rank 0's on every rank (secure's shared draw)."""
    secret = lambda: torch.tensor([secrets.randbits(63)], dtype=torch.int64)  # noqa: E731
    return int(secure.shared(secret, (1,), torch.int64, _collective_device(secure)).item())


def noise_generator(generator, model: torch.nn.Module):
    """What the noise draws from: SecureRandom itself; a torch.Generator only if it lives on the model's device
    (torch.randn needs that), else None (torch's global RNG)."""
    if isinstance(generator, SecureRandom):
        return generator
    device = next(model.parameters()).device
    return generator if generator is not None and generator.device == device else None


def device_generator(model: torch.nn.Module, seed: int) -> torch.Generator:
    """A torch.Generator on the model's device seeded with `seed`: the noise of ranks that must draw alike."""
    return torch.Generator(device=next(model.parameters()).device).manual_seed(int(seed))


def is_secure(generator) -> bool:
    return isinstance(generator, SecureRandom)


def api_generator(rng: str, generator: torch.Generator | None, world):
    """make_private's: rng='seeded' keeps `generator` (None: torch's global RNG), unless it was seeded as torch's global
    RNG was (review 19: the same stream twice); 'secure' refuses a generator."""
    if check_rng(rng) == "seeded":
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu" \
                and (generator.initial_seed() ^ torch.initial_seed()) & 0xFFFFFFFF == 0:  # mt19937 keeps 32 bits
            seed = generator.initial_seed()
            raise DprunError(f"generator= is seeded with {seed}, as torch's global RNG is (torch.manual_seed): the "
                             f"batches would be drawn from the very stream that draws the model's initialisation, "
                             f"dropout and JL's directions, which would then tell which examples join which batch; "
                             f"pass seed={seed} instead (dprun derives the sampler's seed apart from it), seed the "
                             f"generator apart, or use rng='secure'")
        return generator
    if generator is not None:
        raise DprunError("rng='secure' draws from the operating system's entropy: pass no generator= with it")
    return reseeded(SecureRandom(world))


def guarantee_note(rng: str, seed: int | None) -> str:
    """summary.json's privacy note and the end-of-run line: who the guarantee holds against. seed None: the library
    API, whose generators the caller seeds."""
    if rng == "secure":
        return ("rng=secure: the batch sampling and the noise came from an AES-256-CTR keystream keyed from the "
                "operating system's entropy and never written; the guarantee does not rest on keeping `seed` secret")
    which = f"seed={seed} (recorded in summary.json)" if seed is not None else "the seed of its generators"
    return (f"rng=seeded: the guarantee holds against an adversary who does not know {which}; whoever knows it can "
            f"replay the sampling and the noise. Runs with the same seed draw the same noise: two of them published "
            f"together (a sweep over lr that keeps the seed) cancel it without knowing the seed, so publish at most "
            f"one run per seed. Use rng=secure for a model you release")


def end_line(summary: dict) -> str | None:
    """The end-of-run line's privacy statement (runner/cli.py); None for a non-private run, or one whose epsilon is
    inf (no guarantee to qualify: its epsilon_note says why)."""
    if summary.get("sigma") is None or summary.get("epsilon_note"):
        return None
    config = summary.get("config", {})
    return guarantee_note(str(config.get("rng", "seeded")), config.get("seed"))
