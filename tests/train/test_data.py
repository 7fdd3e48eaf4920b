"""Byte tokenizer, embedded corpus, token data sets and the deterministic, resumable sampler."""

from __future__ import annotations

import json
import os
import re
from importlib import resources

import numpy as np
import pytest
import torch

from meshplan.errors import ConfigError
from meshplan.train import tokenizer
from meshplan.train.data import BatchSampler, TokenDataset, _feistel, _round_keys, rank_slice, write_token_file


# ---- tokenizer ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["hello world", "", "naïve café — 東京 🚀", "line\nbreak\ttab"])
def test_tokenizer_round_trip(text):
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert all(0 <= i < tokenizer.VOCAB_SIZE for i in ids)
    assert tokenizer.decode(ids) == text


def test_tokenizer_eos_and_bad_ids():
    ids = tokenizer.encode("ab", eos=True)
    assert ids == [97, 98, tokenizer.EOS_ID]
    assert tokenizer.decode(ids + tokenizer.encode("c")) == "abc"         # EOS dropped
    assert tokenizer.decode([104, 300, 105]) == "h\ufffdi"                 # id outside the byte range
    assert tokenizer.decode([0xE6, 0x9D]) == "\ufffd"                      # truncated UTF-8
    assert tokenizer.encode_array("hi", eos=True).dtype == np.uint16


# ---- embedded corpus ---------------------------------------------------------------------
def test_corpus_is_the_generators_output_and_small():
    from meshplan.train.corpus.generate import generate
    shipped = resources.files("meshplan.train.corpus").joinpath("corpus.txt").read_bytes()
    assert shipped == generate().encode("ascii")
    assert 500_000 <= len(shipped) <= 2_000_000
    assert b"\x00" not in shipped                                           # NUL is the EOS token
    readme = resources.files("meshplan.train.corpus").joinpath("README.md").read_text()
    assert "Apache-2.0" in readme and "generate.py" in readme


def test_corpus_facts_are_consistent():
    """Every 'X lives in Y' / 'X is a T' agrees with the cast table: the structure is learnable."""
    from meshplan.train.corpus.generate import CAST
    text = resources.files("meshplan.train.corpus").joinpath("corpus.txt").read_text()
    lives = re.findall(r"\b([A-Z][a-z]+) lives in ([A-Z][a-z]+(?: [A-Z][a-z]+)?)\.", text)
    trades = re.findall(r"\b([A-Z][a-z]+) the ([a-z]+) went", text)
    assert len(lives) > 100 and len(trades) > 500
    assert all(CAST[name][3] == town for name, town in lives)
    assert all(CAST[name][4] == trade for name, trade in trades)
    sums = re.findall(r"\b(\d+) \+ (\d+) = (\d+)\.", text)
    assert len(sums) > 100 and all(int(a) + int(b) == int(c) for a, b, c in sums)


def test_embedded_dataset():
    ds = TokenDataset.open()
    assert TokenDataset.open("embedded").num_tokens == ds.num_tokens == len(ds)
    assert ds.vocab_size == 256 and ds.source == "embedded corpus"
    assert ds.tokens[-1] == tokenizer.EOS_ID and ds.max_token_id() < 128      # ASCII
    ds.check_vocab(256)
    with pytest.raises(ConfigError, match="vocabulary of 256.*only 100"):
        ds.check_vocab(100)


@pytest.mark.slow
def test_tiny_llama_learns_the_corpus():
    """The default data must show a falling loss within a few dozen steps (hidden 128, 4 layers, seq 128)."""
    from meshplan import models
    from meshplan.models import causal_lm_loss
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # tiny matmuls: more threads only contend on a shared CI box
    try:
        model = models.build("tiny-llama", device="cpu", seq_len=128)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95))
        losses = []
        for x, y in TokenDataset.open().batches(8, 128, seed=0):
            loss = causal_lm_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            if len(losses) == 30:
                break
    finally:
        torch.set_num_threads(threads)
    assert losses[0] > 5.0                                   # ~ln(256) at init
    assert sum(losses[-5:]) / 5 < 3.2, losses                # measured: 5.6 -> 2.85


# ---- sampler -----------------------------------------------------------------------------
def _toy(n: int = 1001) -> TokenDataset:
    return TokenDataset(np.arange(n, dtype=np.uint16) % 250, vocab_size=256, source="toy")


def test_windows_and_labels():
    ds = _toy()
    s = ds.sampler(global_batch=4, seq_len=10, seed=3)
    assert s.num_windows == 100
    x, y = s.batch(0)
    assert x.shape == y.shape == (4, 10) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    for row, w in zip(x, s.window_indices(0)):
        assert torch.equal(row, torch.from_numpy(ds.tokens[w * 10:w * 10 + 10].astype(np.int64)))


def test_every_window_once_per_epoch_and_seeded():
    ds = _toy()
    s = BatchSampler(ds, global_batch=10, seq_len=10, seed=1)
    epoch0 = np.concatenate([s.window_indices(k) for k in range(10)])
    epoch1 = np.concatenate([s.window_indices(k) for k in range(10, 20)])
    assert sorted(epoch0) == sorted(epoch1) == list(range(100))
    assert not np.array_equal(epoch0, epoch1)                             # reshuffled each epoch
    assert not np.array_equal(epoch0, np.arange(100))                     # shuffled at all
    other = BatchSampler(ds, global_batch=10, seq_len=10, seed=2)
    assert not np.array_equal(epoch0[:10], other.window_indices(0))
    again = BatchSampler(ds, global_batch=10, seq_len=10, seed=1)
    assert np.array_equal(epoch0[:10], again.window_indices(0))


def test_batch_larger_than_an_epoch():
    s = BatchSampler(_toy(61), global_batch=14, seq_len=10, seed=0)      # 6 windows
    rows = s.window_indices(0)
    assert sorted(rows[:6]) == sorted(rows[6:12]) == list(range(6))
    assert s.epoch == 0 and s.steps_per_epoch == pytest.approx(6 / 14)
    next(s)
    assert s.epoch == 2


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 17, 64, 100, 1000, 4097])
def test_feistel_is_a_permutation(n):
    p = _feistel(np.arange(n), n, _round_keys(7, 0))
    assert sorted(p.tolist()) == list(range(n))


@pytest.mark.parametrize("dp", [1, 2, 4, 8])
def test_rank_batch_equals_slice_of_global_batch(dp):
    s = _toy().sampler(global_batch=8, seq_len=10, seed=5)
    for step in (0, 3, 12):
        x, y = s.batch(step)
        parts = [s.rank_batch(r, dp, step) for r in range(dp)]
        for r, (xr, yr) in enumerate(parts):
            assert xr.shape == (8 // dp, 10)
            assert torch.equal(xr, rank_slice(x, r, dp)) and torch.equal(yr, rank_slice(y, r, dp))
        assert torch.equal(torch.cat([p[0] for p in parts]), x)


def test_rank_errors():
    s = _toy().sampler(global_batch=6, seq_len=10)
    with pytest.raises(ConfigError, match="does not split over dp=4.*multiple of 4"):
        s.rank_batch(0, 4)
    with pytest.raises(ConfigError, match="dp_rank 2 is outside 0..1"):
        s.rank_batch(2, 2)


def test_resume_reads_the_same_batches():
    ds = _toy()
    straight = list(zip(range(12), ds.batches(4, 10, seed=9)))
    first = ds.sampler(global_batch=4, seq_len=10, seed=9)
    for _ in range(7):
        next(first)
    state = json.loads(json.dumps(first.state_dict()))                  # as a checkpoint would store it
    assert state["step"] == 7 and state["epoch"] == 7 * 4 // 100 and state["seed"] == 9
    resumed = ds.sampler(global_batch=4, seq_len=10, seed=9)
    resumed.load_state_dict(state)
    for k in range(7, 12):
        x, y = next(resumed)
        assert torch.equal(x, straight[k][1][0]) and torch.equal(y, straight[k][1][1])
    via_start = ds.batches(4, 10, seed=9, start_step=7)
    assert torch.equal(next(via_start)[0], straight[7][1][0])


def test_resume_refuses_a_different_order():
    ds = _toy()
    state = ds.sampler(global_batch=4, seq_len=10, seed=9).state_dict()
    with pytest.raises(ConfigError, match="global batch 4, this run has 8.*global_batch=4"):
        ds.sampler(global_batch=8, seq_len=10, seed=9).load_state_dict(state)
    with pytest.raises(ConfigError, match="seed 9, this run has 1"):
        ds.sampler(global_batch=4, seq_len=10, seed=1).load_state_dict(state)
    with pytest.raises(ConfigError, match="data changed"):
        _toy(2001).sampler(global_batch=4, seq_len=10, seed=9).load_state_dict(state)


def test_too_short_for_one_sequence():
    ds = TokenDataset(np.arange(50, dtype=np.uint16), vocab_size=256, source="tiny.txt")
    ds.sampler(global_batch=1, seq_len=49)                                # exactly one window
    with pytest.raises(ConfigError, match="50 tokens, fewer than one sequence of seq_len=128.*at most 49"):
        ds.sampler(global_batch=1, seq_len=128)
    with pytest.raises(ConfigError, match="global_batch must be"):
        ds.sampler(global_batch=0, seq_len=8)


# ---- text directories --------------------------------------------------------------------
def test_text_directory_is_tokenised_and_cached(tmp_path):
    data, cache = tmp_path / "data", tmp_path / "cache"
    (data / "sub").mkdir(parents=True)
    (data / ".git").mkdir()
    (data / "a.txt").write_text("alpha ")
    (data / "sub" / "b.md").write_text("béta")
    (data / ".git" / "c.txt").write_text("hidden")
    (data / "notes.json").write_text("{}")
    ds = TokenDataset.open(data, cache_dir=cache)
    expected = tokenizer.encode("alpha ", eos=True) + tokenizer.encode("béta", eos=True)
    assert ds.tokens.tolist() == expected and ds.vocab_size == 256
    bins = list(cache.glob("*.bin"))
    manifest = json.loads(next(cache.glob("*.json")).read_text())
    assert len(bins) == 1 and manifest["num_tokens"] == len(expected)
    assert [f[0] for f in manifest["files"]] == ["a.txt", "sub/b.md"]
    before = bins[0].stat().st_mtime_ns
    assert TokenDataset.open(data, cache_dir=cache).tokens.tolist() == expected
    assert bins[0].stat().st_mtime_ns == before                           # served from the cache
    (data / "a.txt").write_text("changed!")
    assert TokenDataset.open(data, cache_dir=cache).tokens[:8].tolist() == tokenizer.encode("changed!")
    single = TokenDataset.open(data / "a.txt", cache_dir=cache)
    assert single.tokens.tolist() == tokenizer.encode("changed!", eos=True)


def test_corrupt_cache_manifest_is_rebuilt(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("some text here")
    ds = TokenDataset.open(tmp_path / "d", cache_dir=tmp_path / "c")
    next((tmp_path / "c").glob("*.json")).write_text("{not json")
    assert TokenDataset.open(tmp_path / "d", cache_dir=tmp_path / "c").tokens.tolist() == ds.tokens.tolist()


def test_default_cache_dir_follows_env(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHPLAN_CACHE", str(tmp_path / "mc"))
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x.txt").write_text("abc")
    TokenDataset.open(tmp_path / "d")
    assert len(list((tmp_path / "mc" / "tokens").glob("*.bin"))) == 1


def test_bad_text_inputs(tmp_path):
    with pytest.raises(ConfigError, match="does not exist.*embedded"):
        TokenDataset.open(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match=r"no text files \(\*\.txt"):
        TokenDataset.open(tmp_path / "empty")
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "a.txt").write_text("")
    with pytest.raises(ConfigError, match="all empty"):
        TokenDataset.open(tmp_path / "blank", cache_dir=tmp_path / "c")
    (tmp_path / "data.csv").write_text("a,b")
    with pytest.raises(ConfigError, match="neither text"):
        TokenDataset.open(tmp_path / "data.csv")


# ---- token files -------------------------------------------------------------------------
def test_token_file_with_sidecar(tmp_path):
    ids = np.array([5, 70000, 3, 99999], dtype=np.int64)
    path = write_token_file(tmp_path / "train.bin", ids, vocab_size=100_000)
    sidecar = json.loads((tmp_path / "train.json").read_text())
    assert sidecar["dtype"] == "uint32" and sidecar["vocab_size"] == 100_000
    ds = TokenDataset.open(path)
    assert isinstance(ds.tokens, np.memmap) and ds.tokens.tolist() == ids.tolist()
    assert ds.vocab_size == 100_000
    ds.check_vocab(100_000)
    with pytest.raises(ConfigError, match="vocabulary of 100000, but the model has only 50000"):
        ds.check_vocab(50_000)


def test_token_file_dtype_conventions(tmp_path):
    ids = np.arange(40) * 7
    (tmp_path / "a.bin").write_bytes(ids.astype("<u2").tobytes())               # nanoGPT default: uint16
    assert TokenDataset.open(tmp_path / "a.bin").tokens.tolist() == ids.tolist()
    (tmp_path / "b.uint32.bin").write_bytes(ids.astype("<u4").tobytes())        # dtype in the name
    assert TokenDataset.open(tmp_path / "b.uint32.bin").tokens.tolist() == ids.tolist()
    (tmp_path / "c.bin").write_bytes(ids.astype("<u4").tobytes())
    assert TokenDataset.open(tmp_path / "c.bin", dtype="uint32").tokens.tolist() == ids.tolist()
    assert TokenDataset.open(tmp_path / "c.bin", dtype="uint32").vocab_size is None
    (tmp_path / "c.json").write_text(json.dumps({"some": "other tool"}))         # not our sidecar format
    with pytest.raises(ConfigError, match="dtype 'int8' is not supported"):
        TokenDataset.open(tmp_path / "c.bin", dtype="int8")


def test_wrong_dtype_is_caught(tmp_path):
    ids = np.arange(1, 201)
    (tmp_path / "odd.bin").write_bytes(ids.astype("<u2").tobytes() + b"\x01")
    with pytest.raises(ConfigError, match="401 bytes, not a multiple of 2"):
        TokenDataset.open(tmp_path / "odd.bin")
    (tmp_path / "wide.bin").write_bytes(ids.astype("<u4").tobytes())             # uint32 with no hint
    with pytest.raises(ConfigError, match="looks like uint32.*wide.uint32.bin"):
        TokenDataset.open(tmp_path / "wide.bin")
    (tmp_path / "narrow.bin").write_bytes(ids.astype("<u2").tobytes())            # uint16 read as uint32
    ds = TokenDataset.open(tmp_path / "narrow.bin", dtype="uint32")
    with pytest.raises(ConfigError, match="does not fit the model's vocab of 256.*dtype"):
        ds.check_vocab(256)
    lying = write_token_file(tmp_path / "lying.bin", ids, vocab_size=300)
    (tmp_path / "lying.json").write_text(json.dumps({"dtype": "uint16", "vocab_size": 100}))
    with pytest.raises(ConfigError, match="declared vocabulary is 100"):
        TokenDataset.open(lying).check_vocab(256)
    (tmp_path / "empty.bin").write_bytes(b"")
    with pytest.raises(ConfigError, match="is empty"):
        TokenDataset.open(tmp_path / "empty.bin")


def test_write_token_file_checks_ids(tmp_path):
    with pytest.raises(ConfigError, match=r"0\.\.9, got 0\.\.10"):
        write_token_file(tmp_path / "t.bin", [0, 10], vocab_size=10)
    with pytest.raises(ConfigError, match="end in .bin"):
        write_token_file(tmp_path / "t.npy", [0], vocab_size=10)
    assert not os.path.exists(tmp_path / "t.bin")
