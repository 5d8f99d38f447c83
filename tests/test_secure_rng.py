"""rng=secure (runner/randomness.py): sampling and noise from a keystream keyed by the OS, never written; rng=seeded
(the default) as it always was.

Secure runs with the same seed differ, seeded ones are bit-identical and draw exactly torch's old stream; the secure
Gaussian passes moment and Kolmogorov-Smirnov tests over 10^6 draws, is uncorrelated across steps and generators;
the Poisson mask's rate is floor(q 2^64) / 2^64; on 2 ranks (gloo) every rank samples the same batch and holds the
same parameters after every step; no file of a run's folder holds the key; a bad rng= is one line.
"""
from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from scipy.special import ndtr

from conftest import compose_config, dprun_in_process
from runner import distributed, randomness
from runner.data.sampler import Sampler
from runner.errors import DprunError
from runner.methods.noise import add_noise_and_scale
from runner.randomness import SecureRandom, poisson_mask, secure_standard_normal, standard_normal
from runner.train import train

SHORT = ["progress=false", "method=reweight", "epochs=2", "max_steps_per_epoch=2", "dtype=float64",
         "max_eval_batches=1", "eval_batch_size=64"]
N = 10**6
Z = 6.0  # a moment test fails only beyond 6 standard errors: ~2e-9 per check for a correct sampler


def loss_fn(out, y):
    return F.cross_entropy(out, y, reduction="none")


def final_weights(run_dir: Path) -> list[torch.Tensor]:
    return list(torch.load(run_dir / "checkpoint.pt", weights_only=True)["model"].values())


# -- seeded stays as it was; secure differs --------------------------------------------------------------------
def test_secure_runs_with_the_same_seed_differ_and_seeded_runs_are_bit_identical(tmp_path):
    def weights(name, overrides):
        train(compose_config(SHORT + ["seed=3", "epochs=1"] + overrides), tmp_path / name)
        return final_weights(tmp_path / name)

    seeded = [weights(f"seeded{i}", []) for i in range(2)]
    secure = [weights(f"secure{i}", ["rng=secure"]) for i in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*seeded))
    assert not any(torch.equal(a, b) for a, b in zip(*secure))  # not one tensor replayed


def test_seeded_draws_are_torchs_own_streams():
    """rng=seeded keeps the exact draws of before: the Poisson mask is torch.rand < q, the noise torch.randn."""
    sampler = Sampler("poisson", 50, 7, torch.Generator().manual_seed(5))
    expected = torch.Generator().manual_seed(5)
    for idx in list(sampler.epoch())[:3]:
        assert torch.equal(idx, (torch.rand(50, generator=expected) < 7 / 50).nonzero().squeeze(1))
    model = torch.nn.Linear(3, 2)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    torch.manual_seed(11)
    add_noise_and_scale(model, 2.0, 4.0)
    torch.manual_seed(11)
    flat = torch.randn(8) * 2.0 / 4.0
    torch.testing.assert_close(torch.cat([p.grad.reshape(-1) for p in model.parameters()]), flat, rtol=0, atol=0)


def shared_values(a: torch.Generator | None, b: torch.Generator | None, n: int = 20000) -> int:
    """How many of n float64 uniforms drawn from b also occur among n drawn from a (None: torch's global RNG):
    two streams apart share ~n^2 / 2^53 ~ 0; one stream at two offsets shares nearly all of them."""
    first = set(torch.rand(n, dtype=torch.float64, generator=a).tolist())
    return sum(v in first for v in torch.rand(n, dtype=torch.float64, generator=b).tolist())


def test_the_clis_sampler_and_torchs_global_rng_are_streams_apart(tmp_path):
    """Review 19: set_up seeded the sampler and torch's global RNG (the CPU noise's, after the model's
    initialisation) with the same seed: the noise re-used the sampler's words, and each noise value told whether an
    example joined a later batch (965,624 of 965,888 uniforms behind a digits run's noise)."""
    from runner.train import set_up

    cfg = compose_config(SHORT + ["seed=3"])
    run = set_up(cfg, tmp_path / "run", distributed.current())
    sampler = torch.Generator().set_state(run.sampler.generator.get_state())  # a copy: the run's own stays put
    assert shared_values(None, sampler) == 0  # the global stream from here on: the noise's
    torch.manual_seed(3)
    assert shared_values(None, torch.Generator().set_state(run.sampler.generator.get_state())) == 0


def test_make_private_seeds_its_sampler_apart_and_refuses_a_generator_seeded_as_the_global_rng():
    import dprun

    x, y = torch.randn(64, 4), torch.randint(0, 2, (64,))
    torch.manual_seed(5)
    model = torch.nn.Linear(4, 2)
    private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), method="reweight",
                                 batch_size=8, seed=5)
    torch.manual_seed(5)
    assert shared_values(None, torch.Generator().set_state(private.generator.get_state())) == 0
    for seed in (6, 6 + 2**32):  # review 21: torch keeps a seed's low 32 bits, so 6 + 2^32 is the same stream
        torch.manual_seed(6)
        with pytest.raises(DprunError, match=rf"generator= is seeded with {seed}, as torch's global RNG is"):
            model = torch.nn.Linear(4, 2)
            dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), method="reweight",
                               batch_size=8, generator=torch.Generator().manual_seed(seed))


def test_seeds_derived_for_each_purpose_differ_from_the_seed_and_each_other():
    seeds = {randomness.derived_seed(s, p) for s in range(50) for p in ("sampling", "synthetic-data")}
    assert len(seeds) == 100 and not seeds & set(range(50))
    assert all(0 <= s < 2**63 for s in seeds)
    assert all((randomness.derived_seed(s, "sampling") ^ s) & 0xFFFFFFFF for s in range(1000))  # torch's 32 bits


def test_secure_forks_the_ranks_dropout_from_a_secret_not_the_public_seed():
    """Review 21: on several ranks each step's dropout comes from a fork seeded by (World.seed, step, rank), and under
    rng=secure World.seed was still the run's public seed: rank 1's masks replayed from seed=5 alone."""
    worlds = [distributed.World(seed=5) for _ in range(2)]
    for w in worlds:
        randomness.reseeded(SecureRandom(w, ahead=False))
    assert all(w.seed != 5 for w in worlds) and worlds[0].seed != worlds[1].seed


# -- the secure Gaussian and masks -----------------------------------------------------------------------------
def test_secure_normal_moments_and_kolmogorov_smirnov_over_a_million_draws():
    z = secure_standard_normal(SecureRandom(), N, torch.device("cpu")).numpy()
    assert abs(z.mean()) < Z / math.sqrt(N)
    assert abs(z.var() - 1) < Z * math.sqrt(2 / N)
    assert abs((z**3).mean()) < Z * math.sqrt(15 / N)  # skewness: var(z^3) = 15
    assert abs((z**4).mean() - 3) < Z * math.sqrt(96 / N)  # kurtosis: var(z^4) = 105 - 9
    assert abs((np.abs(z) > 3).mean() - 0.0026998) < Z * math.sqrt(0.0027 / N)  # the tails, not only the bulk
    # Kolmogorov-Smirnov against N(0, 1): D_n < c(alpha) / sqrt(n) with alpha = 1e-6 (c = sqrt(-ln(alpha/2) / 2))
    xs = np.sort(z)
    cdf = ndtr(xs)  # N(0, 1)'s distribution function (scipy is a core dependency)
    ranks = np.arange(1, N + 1) / N
    d = max(np.max(ranks - cdf), np.max(cdf - (ranks - 1 / N)))
    assert d < math.sqrt(-math.log(1e-6 / 2) / 2) / math.sqrt(N), d


def test_secure_noise_is_uncorrelated_across_steps_generators_and_neighbours():
    a, b = SecureRandom(), SecureRandom()
    step1, step2 = (standard_normal(a, (N // 4,), torch.device("cpu"), torch.float64) for _ in range(2))
    other = standard_normal(b, (N // 4,), torch.device("cpu"), torch.float64)  # another process's key
    bound = Z / math.sqrt(N // 4)
    corr = lambda u, v: float(torch.corrcoef(torch.stack([u, v]))[0, 1])  # noqa: E731
    assert abs(corr(step1, step2)) < bound  # two steps of one run
    assert abs(corr(step1, other)) < bound  # two generators (keys)
    assert abs(corr(step1[1:], step1[:-1])) < bound  # neighbouring coordinates
    assert not torch.equal(step1, step2)
    bits = np.unpackbits(a.words(4096).view(np.uint8))  # every bit of the keystream fair
    assert abs(bits.mean() - 0.5) < Z * 0.5 / math.sqrt(bits.size)


def test_secure_poisson_mask_rate_is_q_rounded_down_exactly(monkeypatch):
    rng = SecureRandom()
    words = rng.words(1000)
    monkeypatch.setattr(rng, "words", lambda n: words[:n])  # the mask is a function of these words
    mask = poisson_mask(rng, 1000, 7)
    threshold = (7 << 64) // 1000  # the inclusion probability threshold / 2^64 <= 7 / 1000, within 2^-64
    assert torch.equal(mask, torch.from_numpy(words.view(np.uint64) < np.uint64(threshold)))
    assert poisson_mask(rng, 5, 5).all()  # q = 1: everyone
    rate = np.mean([poisson_mask(SecureRandom(), 10**5, 100).float().mean().item() for _ in range(3)])
    assert abs(rate - 1e-3) < Z * math.sqrt(1e-3 / 3e5)


def test_uniforms_are_open_and_centred():
    u = randomness.uniform_open(np.array([0, -1, 2**62], dtype=np.int64))  # all-zero, all-one and middle words
    assert u.dtype == np.float64
    assert u[0] == 2.0**-53 and u[1] == 1 - 2.0**-53 and 0 < u.min() and u.max() < 1
    assert u[0] == 1 - u[1]


def test_angle_uniforms_are_open_centred_float32_cells():
    words = np.array([0, 2**32 - 1, 2**31, 511, 512], dtype=np.uint64).astype(np.uint32)  # 9 low bits dropped
    u = randomness.uniform_open_float32(words.copy())
    assert u.dtype == np.float32
    assert u[0] == 2.0**-24 and u[1] == 1 - 2.0**-24 and u[2] == 0.5 + 2.0**-24  # the cells' centres, exact
    assert u[3] == u[0] and u[4] == 2.0**-24 + 2.0**-23  # 23 random bits: the word's top 23
    assert u[0] == 1 - u[1]


def test_the_noise_uses_the_keystream_bytes_it_accounts_for(monkeypatch):
    """12 bytes per Box-Muller draw, two draws per value: a draw of n values takes 24 n bytes (none wasted, none
    reused), and the values change when any of those bytes does."""
    rng = SecureRandom(ahead=False)
    taken = []
    real = rng.bytes
    monkeypatch.setattr(rng, "bytes", lambda size: taken.append(size) or real(size))
    secure_standard_normal(rng, 1000, torch.device("cpu"))
    assert sum(taken) == 24 * 1000
    fixed = np.frombuffer(np.random.default_rng(0).bytes(24 * 1000), dtype=np.uint8)
    monkeypatch.setattr(rng, "bytes", lambda size: fixed[:size].copy())
    a = secure_standard_normal(rng, 1000, torch.device("cpu"))
    flipped = fixed.copy()
    flipped[-1] ^= 0x80  # the last angle word's top bit
    monkeypatch.setattr(rng, "bytes", lambda size: flipped[:size].copy())
    b = secure_standard_normal(rng, 1000, torch.device("cpu"))
    assert (a != b).sum() == 1 and a.dtype == torch.float32
    monkeypatch.setattr(rng, "bytes", lambda size: fixed[:size].copy())
    wide = secure_standard_normal(rng, 1000, torch.device("cpu"), torch.float64)
    assert wide.dtype == torch.float64  # float64 noise: the two float32 draws added in float64, not rounded
    assert (wide.float() - a).abs().max() < 1e-5 and (wide != wide.float().double()).any()


def test_each_value_is_two_draws_of_its_own_bytes_as_documented(monkeypatch):
    """An independent float64 reference from the keystream bytes: value j = sqrt(-ln u_j) cos(2 pi a_j) +
    sqrt(-ln u_{n+j}) cos(2 pi a_{n+j}), with u the 52-bit radius uniforms (first 16 n bytes) and a the 23-bit angle
    uniforms (the last 8 n): no uniform shared between values or draws (Holohan & Braghin's n counts draws with
    their own variates), so every byte moves exactly one value."""
    n = 257
    fixed = np.frombuffer(np.random.default_rng(1).bytes(24 * n), dtype=np.uint8)
    rng = SecureRandom(ahead=False)
    monkeypatch.setattr(rng, "bytes", lambda size: fixed[:size].copy())
    got = secure_standard_normal(rng, n, torch.device("cpu")).double().numpy()
    words = fixed[:16 * n].view(np.uint64)
    u = ((words >> np.uint64(12)).astype(np.float64) + 0.5) / 2.0**52  # the centres of 2^52 cells
    a = ((fixed[16 * n:].view(np.uint32) >> np.uint32(9)).astype(np.float64) + 0.5) / 2.0**23  # of 2^23 cells
    draws = np.sqrt(-np.log(u)) * np.cos(2 * np.pi * a)  # (2n,) each N(0, 1/2)
    np.testing.assert_allclose(got, draws[:n] + draws[n:], rtol=0, atol=4e-6)
    for position in np.random.default_rng(2).choice(24 * n, 64, replace=False):  # any byte: one value moves
        flipped = fixed.copy()
        flipped[position] ^= 0xFF
        monkeypatch.setattr(rng, "bytes", lambda size, f=flipped: f[:size].copy())
        moved = secure_standard_normal(rng, n, torch.device("cpu")).double().numpy() != got
        assert moved.sum() <= 1, position  # (0 only if the flip hit a dropped low bit of a radius or angle word)
        value = position // 8 % n if position < 16 * n else (position - 16 * n) // 4 % n
        assert not moved[np.arange(n) != value].any(), position


# -- two ranks ---------------------------------------------------------------------------------------------------
def _secure_worker(rank, world, init_file, out_dir):
    import dprun

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    torch.manual_seed(0)  # the same initial model on both ranks (the user's job)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (40,), generator=g)
    private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.3), (x, y), method="reweight",
                                 noise_multiplier=0.8, max_grad_norm=0.5, batch_size=8, rng="secure")
    record = {"equal_every_step": [], "batches_disjoint_and_ordered": [], "moved": []}
    for _ in range(2):  # epochs
        for xb, yb in private.batches():
            before = torch.cat([p.detach().reshape(-1) for p in private.model.parameters()])
            private.step(xb, yb, loss_fn)
            mine = torch.cat([p.detach().reshape(-1) for p in private.model.parameters()])
            every = [torch.zeros_like(mine) for _ in range(world)]
            dist.all_gather(every, mine)
            record["equal_every_step"].append(all(torch.equal(every[0], t) for t in every))
            record["moved"].append(not torch.equal(before, mine))
            padded = torch.full((len(y),), -1, dtype=torch.int64)  # this rank's share, padded: equal sizes to gather
            padded[:len(private._last_indices)] = private._last_indices
            shares = [torch.zeros_like(padded) for _ in range(world)]
            dist.all_gather(shares, padded)
            joined = torch.cat([s[s >= 0] for s in shares])  # one global batch split in order: strictly increasing
            record["batches_disjoint_and_ordered"].append(bool((joined[1:] > joined[:-1]).all()))
    private.method.world.check_replicas(private.model, torch.device("cpu"), "after the steps")
    torch.save(record, Path(out_dir) / f"rank{rank}.pt")
    # the command line's run on the same 2 processes: check_replicas after every epoch raises if they differ; JL's
    # directions come from torch's RNG under a secret seed that rank 0 broadcast
    train(compose_config(SHORT + ["rng=secure", "method=jl", "method.r=2"]), Path(out_dir) / "run")
    distributed.leave()  # the ranks leave together (runner/distributed.py)


def test_two_ranks_in_secure_mode_hold_the_same_parameters_after_every_step(tmp_path):
    """make_private on 2 gloo processes, then a `dprun` run on them (one spawn: starting processes is the cost)."""
    from test_distributed import spawn

    spawn(_secure_worker, 2, tmp_path)
    for r in range(2):
        record = torch.load(tmp_path / f"rank{r}.pt", weights_only=False)
        assert len(record["equal_every_step"]) == 10 and all(record["equal_every_step"]), record
        assert all(record["moved"]) and all(record["batches_disjoint_and_ordered"]), record
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["world_size"] == 2


# -- the key is never written ------------------------------------------------------------------------------------
def test_no_file_of_a_secure_run_holds_the_key_and_a_resume_draws_fresh_entropy(tmp_path, monkeypatch, caplog):
    keys: list[bytes] = []
    monkeypatch.setattr(randomness, "_observe_key", keys.append)
    caplog.set_level("INFO", logger="dprun")
    first = train(compose_config(SHORT + ["rng=secure", "epochs=1", "log_norms=true"]), tmp_path)
    assert len(keys) == 1 and first["epochs_completed"] == 1
    resumed = train(compose_config(SHORT + ["rng=secure", "log_norms=true", f"resume={tmp_path}"]), tmp_path)
    assert resumed["status"] == "finished" and resumed["epochs_completed"] == 2
    assert len(keys) == 2 and keys[0] != keys[1]  # the resume keyed a new stream: nothing was saved to replay
    assert "fresh entropy" in caplog.text
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"summary.json", "metrics.csv", "checkpoint.pt"}
    for key in keys:
        forms = [key, key.hex().encode(), key.hex().upper().encode(), str(list(key)).encode()]
        for p in files:
            content = p.read_bytes()
            assert not any(f in content for f in forms), p
        assert not any(f.decode("latin-1") in caplog.text for f in forms[1:])
    notes = resumed["privacy_notes"]
    assert notes[0].startswith("rng=secure") and any("log_norms" in n and "NOT differentially private" in n
                                                      for n in notes)
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["torch_rng"] is None


def test_seeded_notes_name_the_seed_and_the_end_of_run_line_says_which_holds(capsys):
    from runner.cli import print_guarantee

    note = randomness.guarantee_note("seeded", 7)
    assert note.startswith("rng=seeded: the guarantee holds against an adversary who does not know seed=7")
    # runs sharing a seed share their noise: an lr sweep's models, published together, cancel it (stop 55's review)
    assert "Runs with the same seed draw the same noise" in note and "publish at most one run per seed" in note
    print_guarantee({"sigma": 1.0, "config": {"seed": 7}})  # the run's last line, after "dprun: ... -> <folder>"
    print_guarantee({"sigma": 1.0, "config": {"seed": 7, "rng": "secure"}})
    print_guarantee({"sigma": None, "config": {}})  # non-private: nothing to say
    inf = "epsilon is inf: sigma=0 adds no noise, so the clipped sums are released exactly (no privacy)"
    print_guarantee({"sigma": 0.0, "config": {"seed": 7}, "epsilon_note": inf})  # no guarantee to qualify: why not
    assert capsys.readouterr().out.splitlines() == [f"dprun: {note}",
                                                    f"dprun: {randomness.guarantee_note('secure', 7)}",
                                                    f"dprun: {inf}"]


# -- bad values --------------------------------------------------------------------------------------------------
def test_a_bad_rng_is_one_line_naming_the_accepted_values(tmp_path):
    import dprun

    model = torch.nn.Linear(3, 2)
    with pytest.raises(DprunError, match=r"^rng='crypto' is not valid: rng must be one of: seeded, secure$"):
        dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           (torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=2, rng="crypto")
    with pytest.raises(DprunError, match="no generator"):
        dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1),
                           (torch.randn(8, 3), torch.randint(0, 2, (8,))), batch_size=2, rng="secure",
                           generator=torch.Generator())
    # the command line's one line, in this process (test_validation.py starts `python -m runner.cli` for one)
    out = dprun_in_process("rng=crypto", f"out_dir={tmp_path / 'x'}", cwd=Path(__file__).resolve().parent.parent)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr
    assert lines[0] == "dprun: rng='crypto' is not valid: rng must be one of: seeded, secure"


def test_the_noise_worker_runs_its_torch_ops_on_one_thread_and_leaves_the_default():
    """The draw ahead must not start a second OpenMP team beside the step's (both would spin on the same cores)."""
    import threading

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a team of 2 even where the suite runs single-threaded: the check must be able to fail
    default = torch.get_num_threads()
    worker = randomness.single_threaded_worker()
    assert worker.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == default
    seen = []
    later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    later.start()
    later.join()
    assert seen == [default]  # threads started afterwards get the default back
    worker.shutdown()
    torch.set_num_threads(before)


# -- the GPU route: the same values from the same bytes, keystream from parallel lanes -------------------------------
def test_the_gpu_routes_uniforms_and_gaussians_equal_the_cpu_routes_bit_for_bit(monkeypatch):
    """on_gpu turns the raw keystream into uniforms with torch's int64/int32 ops (normal_from_keystream); here on
    the CPU, against uniform_open / uniform_open_float32 and the CPU route's Gaussians from the same bytes, including
    words whose sign bit is set (torch's >> is arithmetic) and the extreme words."""
    from runner.randomness import (normal_from_keystream, uniform_open, uniform_open_bits, uniform_open_float32,
                                   uniform_open_float32_bits)

    words = np.frombuffer(np.random.default_rng(3).bytes(8 * 4096), dtype=np.int64).copy()
    words[:4] = [0, -1, np.iinfo(np.int64).max, np.iinfo(np.int64).min]
    assert torch.equal(uniform_open_bits(torch.from_numpy(words.copy())), torch.from_numpy(uniform_open(words.copy())))
    w32 = words.view(np.uint32).copy()
    assert torch.equal(uniform_open_float32_bits(torch.from_numpy(w32.view(np.int32).copy())),
                       torch.from_numpy(uniform_open_float32(w32.copy())))
    n = 5000
    fixed = np.frombuffer(np.random.default_rng(4).bytes(24 * n), dtype=np.uint8)
    rng = SecureRandom(ahead=False)
    monkeypatch.setattr(rng, "bytes", lambda size: fixed[:size].copy())
    for dtype, wide in ((torch.float32, False), (torch.float64, True)):
        cpu = secure_standard_normal(rng, n, torch.device("cpu"), dtype)
        gpu_math = normal_from_keystream(torch.from_numpy(fixed.copy()), n, wide)
        assert gpu_math.dtype == cpu.dtype
        torch.testing.assert_close(gpu_math, cpu, rtol=0, atol=2e-6)  # one ulp where a kernel's tail differs


def test_parallel_lanes_fill_every_byte_and_nothing_past_the_buffer():
    rng = SecureRandom(ahead=False)
    rng._lanes_ready()
    from runner.randomness import KeystreamLane, ThreadPoolExecutor
    rng._lanes = [KeystreamLane() for _ in range(3)]  # three lanes whatever this machine's cores
    rng._lane_pool = ThreadPoolExecutor(3)
    used = []
    for lane in rng._lanes:
        real = lane.fill
        lane.fill = lambda out, size=None, real=real, lane=lane: used.append(lane) or real(out, size)
    for size, parts in ((1, 1), (100, 1), (3 * 64 + 5, 1), (2**20 + 7, 1), (2 * 2**22, 2), (3 * 2**22 + 13, 3)):
        buf = np.zeros(size + 64, dtype=np.uint8)
        buf[size:] = 0xAB  # a sentinel past the part handed over
        used.clear()
        rng.fill(buf[:size])
        assert (buf[size:] == 0xAB).all(), size
        assert len(set(used)) == len(used) == parts, size  # a small draw: one lane, no thread hand-off
        if size >= 2**20:  # keystream: every byte value about equally often, no zero runs left unwritten
            counts = np.bincount(buf[:size], minlength=256)
            assert counts.min() > 0.8 * size / 256, size
            assert not (buf[:size].reshape(-1)[: size // 64 * 64].reshape(-1, 64) == 0).all(1).any()
    a, b = np.empty(2**20, np.uint8), np.empty(2**20, np.uint8)
    rng.fill(a)
    rng.fill(b)
    assert (a != b).mean() > 0.99  # the streams go on: no part repeated


def test_a_draw_ahead_uses_fewer_keystream_lanes_than_a_draw_the_step_waits_for():
    """On a 16-core GPU host, eight lanes beside a step that launches kernels slowed it (1.69x vs 1.11x with four,
    docs/bench.md): a SecureRandom drawing ahead makes at most LANES_AHEAD lanes, one that is waited for up to
    LANES_WAITING, each at most half the cores and at least one."""
    from runner.randomness import LANES_AHEAD, LANES_WAITING, keystream_lanes

    assert (LANES_AHEAD, LANES_WAITING) == (4, 8)
    assert [keystream_lanes(True, c) for c in (1, 2, 8, 16, 64)] == [1, 1, 4, 4, 4]
    assert [keystream_lanes(False, c) for c in (1, 2, 8, 16, 64)] == [1, 1, 4, 8, 8]
    for ahead in (True, False):
        rng = SecureRandom(ahead=ahead)
        assert len(rng._lanes_ready()) == keystream_lanes(ahead, os.cpu_count() or 2)


def test_make_private_secure_reseeds_torchs_global_rng_so_jls_directions_are_not_the_programs():
    """The API left torch's global RNG to the program: two runs of one seeded program drew the same JL directions,
    and a record built orthogonal to them was released unclipped (122 C). Now rng='secure' reseeds it from the OS,
    as the CLI does; rng='seeded' leaves the program's stream alone."""
    import dprun

    x, y = torch.randn(60, 5), torch.randint(0, 3, (60,))
    draws = {}
    for rng in ("seeded", "secure"):
        for run in range(2):
            torch.manual_seed(0)
            model = torch.nn.Linear(5, 3)
            dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), method="jl", r=2,
                               batch_size=20, rng=rng, **({"seed": 0} if rng == "seeded" else {}))
            draws[rng, run] = torch.randn(4)  # what JL's next directions would draw from
    assert torch.equal(draws["seeded", 0], draws["seeded", 1])
    assert not torch.equal(draws["secure", 0], draws["secure", 1])


def test_secure_cpu_streams_are_not_one_of_2_32_seeds():
    """Review 40: torch.manual_seed keeps a seed's low 32 bits on the CPU, so the secret 63-bit reseed of torch's
    global RNG (JL's directions, dropout) and the API's JL direction generator were each one of 2^32 streams, found
    by a search against the released model's initialisation. Now their mt19937 words come from the keystream: no seed
    torch.manual_seed accepts (the low 32 bits of the one they report, nor 5 others) starts their stream."""
    import dprun

    secure = SecureRandom(distributed.World())
    randomness.reseeded(secure)
    drawn = torch.randn(64)
    g = randomness.secret_device_generator(torch.nn.Linear(2, 2), secure)
    api = torch.randn(64, generator=g)
    for candidate in [torch.initial_seed(), torch.initial_seed() & 0xFFFFFFFF, g.initial_seed() & 0xFFFFFFFF,
                      0, 1, 2**31]:
        replay = torch.randn(64, generator=torch.Generator().manual_seed(candidate))
        assert not torch.equal(replay, drawn) and not torch.equal(replay, api)
    assert abs(float(torch.randn(10**5).std()) - 1) < 0.02  # still a working generator
    # the API's jl directions (a CPU model) come from such a generator; two secure runs of one program differ
    x, y = torch.randn(60, 5), torch.randint(0, 3, (60,))
    directions = []
    for _ in range(2):
        torch.manual_seed(0)
        model = torch.nn.Linear(5, 3)
        private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), (x, y), method="jl", r=2,
                                     batch_size=20, rng="secure")
        gen = private.method.direction_generator
        directions.append(torch.randn(8, generator=gen))
        low = torch.randn(8, generator=torch.Generator().manual_seed(gen.initial_seed() & 0xFFFFFFFF))
        assert not torch.equal(directions[-1], low)
    assert not torch.equal(*directions)


def test_a_secure_cli_run_initialises_its_model_from_seed_before_the_secret_reseed(tmp_path, monkeypatch):
    """Review 40: the CLI built the model after the secure reseed, so the released weights (which stay near their
    initialisation) were a window onto the secret state behind JL's directions and dropout. The initialisation now
    comes from `seed` (public, data-independent), the reseed after it."""
    import runner.train as train_module

    built = {}
    real = train_module.build_model

    def build(cfg, data, device, dtype):
        model, kwargs = real(cfg, data, device, dtype)
        built[str(cfg.rng)] = [p.detach().clone() for p in model.parameters()]
        built[str(cfg.rng) + " next draw"] = torch.randn(4)  # what the global RNG gives right after the build
        return model, kwargs

    monkeypatch.setattr(train_module, "build_model", build)
    for rng in ("seeded", "secure"):
        train(compose_config(SHORT + [f"rng={rng}", "epochs=1", "max_steps_per_epoch=1", "seed=3"]), tmp_path / rng)
    assert all(torch.equal(a, b) for a, b in zip(built["seeded"], built["secure"]))  # the same public init
    assert torch.equal(built["secure next draw"], built["seeded next draw"])  # both still seed's stream at the build


def test_make_privates_record_probe_leaves_the_gpu_generators_secret(monkeypatch):
    """Review 41: the collate probe fetched each record under torch.manual_seed(index), which reseeds every CUDA
    generator as well (fork_rng(devices=[]) restores only the CPU's), after make_private's secret reseed: a GPU
    run's dropout then came from the last probed index, a function of the dataset's size. Only the secret reseed may
    seed the CUDA generators now (recorded here on the CPU, where torch still calls manual_seed_all)."""
    import dprun

    seeds = []
    real = torch.cuda.manual_seed_all
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: (seeds.append(int(seed)), real(seed))[1])

    class Records(torch.utils.data.Dataset):
        def __len__(self):
            return 60

        def __getitem__(self, i):
            return torch.full((5,), float(i) / 60), i % 3

    torch.manual_seed(0)
    seeds.clear()
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 3))
    private = dprun.make_private(model, torch.optim.SGD(model.parameters(), lr=0.1), Records(), method="reweight",
                                 batch_size=16, rng="secure", noise_multiplier=1.0, max_grad_norm=1.0, delta=1e-5)
    for x, y in private.batches():
        private.step(x, y, loss_fn)
        break
    assert len(seeds) == 1 and seeds[0] not in range(60)  # the secret reseed alone, no record index after it
