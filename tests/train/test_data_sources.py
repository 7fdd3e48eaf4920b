"""Real training data: tokenizers loaded from a directory, text / JSONL / Parquet sources,
`meshplan data prepare` (shards, index, resume), packing with document masking (equal to running
each document alone), weighted blends (proportions, determinism, exact resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from data_fixtures import bpe_tokenizer, documents, wordlevel_tokenizer, write_jsonl

from meshplan.errors import ConfigError
from meshplan.train import prepare as prep
from meshplan.train import tokenizer
from meshplan.train.blend import BLOCK, BlendedSampler, parse_data_spec
from meshplan.train.data import TokenDataset
from meshplan.train.sources import read_documents


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return bpe_tokenizer(tmp_path_factory.mktemp("tok"))


# ---- tokenizers ----------------------------------------------------------------------------
def test_tokenizer_from_directory_encodes_and_decodes(tok_dir, tmp_path):
    tok = tokenizer.load(tok_dir)
    assert tok.vocab_size <= 120 and tok.eos_id == tok._tok.token_to_id("<|endoftext|>")
    ids = tok.encode_array("the quick brown fox", eos=True)
    assert ids[-1] == tok.eos_id and len(ids) < len("the quick brown fox")     # merges, not bytes
    assert tok.decode(ids[:-1]).replace(" ", "") == "thequickbrownfox"
    words = tokenizer.load(wordlevel_tokenizer(tmp_path / "wl"))
    assert words.eos_id == words._tok.token_to_id("</s>")
    assert words.encode_ids(["the lazy dog"])[0] == [words._tok.token_to_id(w) for w in ("the", "lazy", "dog")]
    assert tokenizer.load(None).vocab_size == 256 and tokenizer.load(tok_dir).id == tok.id


def test_tokenizer_vocab_larger_than_model_is_refused(tok_dir, tmp_path):
    tok = tokenizer.load(tok_dir)
    tokenizer.check_model_vocab(tok, tok.vocab_size)
    with pytest.raises(ConfigError, match=rf"vocabulary of {tok.vocab_size} tokens.*only 50 rows.*vocab>={tok.vocab_size}"):
        tokenizer.check_model_vocab(tok, 50)
    with pytest.raises(ConfigError, match="not a directory"):
        tokenizer.load(tmp_path / "missing")


# ---- sources -------------------------------------------------------------------------------
def test_jsonl_text_and_parquet_sources(tmp_path):
    docs = documents(5)
    write_jsonl(tmp_path / "a.jsonl", docs, field="body")
    assert [d for batch in read_documents(tmp_path / "a.jsonl", text_field="body") for d in batch] == docs
    with pytest.raises(ConfigError, match="no 'text' field.*--text-field"):
        list(read_documents(tmp_path / "a.jsonl"))
    (tmp_path / "b.txt").write_text("one whole file")
    assert list(read_documents(tmp_path / "b.txt")) == [["one whole file"]]
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"text": docs, "n": list(range(5))}), tmp_path / "c.parquet", row_group_size=2)
    assert [d for batch in read_documents(tmp_path / "c.parquet") for d in batch] == docs
    with pytest.raises(ConfigError, match="no column 'body'"):
        list(read_documents(tmp_path / "c.parquet", text_field="body"))


# ---- prepare ---------------------------------------------------------------------------------
def test_prepare_writes_shards_with_document_index_and_resumes(tok_dir, tmp_path, monkeypatch, capsys):
    from meshplan.cli import main
    from meshplan.train import sources
    a, b = documents(30), documents(20, offset=2)
    write_jsonl(tmp_path / "src" / "a.jsonl", a)
    write_jsonl(tmp_path / "src" / "b.jsonl", b)
    (tmp_path / "src" / "c.txt").write_text("a plain text document")
    out = tmp_path / "prepared"
    real = sources.read_documents

    def interrupted(path, **kw):           # the run dies inside the second shard
        if path.name == "b.jsonl":
            yield next(real(path, **kw))
            raise KeyboardInterrupt
        yield from real(path, **kw)
    monkeypatch.setattr(prep, "read_documents", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep.prepare([tmp_path / "src"], out, tokenizer=tokenizer.load(tok_dir), progress=None)
    assert (out / "shard_00000.json").exists() and not (out / "shard_00001.json").exists()
    assert not list(out.glob("*.tmp")) and not (out / "index.json").exists()
    monkeypatch.setattr(prep, "read_documents", real)
    assert main(["data", "prepare", "--tokenizer", str(tok_dir), "--out", str(out), str(tmp_path / "src")]) == 0
    err = capsys.readouterr().err
    assert "a.jsonl: done in an earlier run, skipped" in err and "b.jsonl: 20 documents" in err
    index = json.loads((out / "index.json").read_text())
    assert index["dtype"] == "uint16" and index["num_docs"] == 51 and len(index["shards"]) == 3
    tok = tokenizer.load(tok_dir)
    expect = np.concatenate([tok.encode_array(d, eos=True) for d in a + b + ["a plain text document"]])
    ds = TokenDataset.open(out)
    assert np.array_equal(ds.tokens[np.arange(len(ds))], expect)
    lengths = [len(tok.encode_array(d, eos=True)) for d in a + b]
    assert ds.doc_starts.tolist()[:51] == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    # a third run has nothing to do; changing a source redoes only its shard
    assert prep.prepare([tmp_path / "src"], out, tokenizer=tok, progress=None).skipped == 3
    write_jsonl(tmp_path / "src" / "b.jsonl", b[:5])
    again = prep.prepare([tmp_path / "src"], out, tokenizer=tok, progress=None)
    assert (again.skipped, again.num_docs) == (2, 36)


def test_prepared_data_needs_its_own_tokenizer(tok_dir, tmp_path):
    write_jsonl(tmp_path / "a.jsonl", documents(10))
    prep.prepare([tmp_path / "a.jsonl"], tmp_path / "p", progress=None)      # byte tokenizer
    with pytest.raises(ConfigError, match="prepared with tokenizer 'bytes'"):
        TokenDataset.open(tmp_path / "p", tokenizer=str(tok_dir))
    # JSONL given directly is prepared into the cache, with the same tokens as prepare writes
    direct = TokenDataset.open(tmp_path / "a.jsonl", cache_dir=tmp_path / "cache")
    assert np.array_equal(direct.tokens[np.arange(len(direct))],
                          TokenDataset.open(tmp_path / "p").tokens[np.arange(len(direct))])
    assert direct.doc_starts is not None and direct.vocab_size == 256
    cache = next((tmp_path / "cache").glob("prepared-*"))
    byte = tokenizer.load(None)
    assert prep.up_to_date([tmp_path / "a.jsonl"], cache, tokenizer=byte)        # later ranks only read it
    write_jsonl(tmp_path / "a.jsonl", documents(12))
    assert not prep.up_to_date([tmp_path / "a.jsonl"], cache, tokenizer=byte)
    assert len(TokenDataset.open(tmp_path / "a.jsonl", cache_dir=tmp_path / "cache").doc_starts) == 12


# ---- packing with document masking ---------------------------------------------------------------
def _packed(tmp_path, tok_dir, seq_len):
    write_jsonl(tmp_path / "a.jsonl", documents(40))
    prep.prepare([tmp_path / "a.jsonl"], tmp_path / "p", tokenizer=tokenizer.load(tok_dir), progress=None)
    return TokenDataset.open(tmp_path / "p")


def test_document_mask_labels_and_ids(tok_dir, tmp_path):
    ds = _packed(tmp_path, tok_dir, 24)
    b = ds.sampler(global_batch=4, seq_len=24, seed=3, document_mask=True).sample(2)
    plain = ds.sampler(global_batch=4, seq_len=24, seed=3).sample(2)
    assert torch.equal(b.input_ids, plain.input_ids) and plain.document_ids is None
    crossing = b.document_ids[:, 1:] != b.document_ids[:, :-1]                      # (B, S-1)
    assert crossing.any()
    assert (b.labels[:, :-1][crossing] == -100).all()
    assert torch.equal(b.labels[b.labels != -100], plain.labels[b.labels != -100])
    assert (plain.labels[:, :-1][crossing] == tokenizer.load(tok_dir).eos_id).sum() == 0   # targets after EOS


@pytest.mark.parametrize("position", ["rope", "learned"])
def test_packed_documents_equal_each_document_alone(tok_dir, tmp_path, position):
    from meshplan import models
    from meshplan.models.transformer import causal_lm_loss
    seq = 24
    ds = _packed(tmp_path, tok_dir, seq)
    b = ds.sampler(global_batch=2, seq_len=seq, seed=1, document_mask=True).sample(0)
    torch.manual_seed(0)
    model = models.build("tiny-llama", seq_len=seq, device="cpu", vocab=128, position=position)
    model.init_weights()
    logits = model(b.input_ids, document_ids=b.document_ids)                      # (B, S, V)
    pieces, labels = [], []
    for row in range(b.input_ids.shape[0]):
        d = b.document_ids[row]
        for doc in torch.unique_consecutive(d):
            m = d == doc
            alone = model(b.input_ids[row, m][None])[0]                             # (n, V)
            torch.testing.assert_close(logits[row, m], alone, rtol=1e-5, atol=1e-5)
            pieces.append(alone)
            labels.append(b.labels[row, m])
    torch.testing.assert_close(causal_lm_loss(logits, b.labels), causal_lm_loss(torch.cat(pieces), torch.cat(labels)))


# ---- blends --------------------------------------------------------------------------------
def test_parse_data_spec():
    assert parse_data_spec(None) is None and parse_data_spec("data/dir") is None
    assert parse_data_spec("a:0.7,b:0.3") == [("a", 0.7), ("b", 0.3)]
    assert parse_data_spec("a:3,b") == [("a", 3.0), ("b", 1.0)]
    with pytest.raises(ConfigError, match="positive number"):
        parse_data_spec("a:0,b:1")
    with pytest.raises(ConfigError, match="twice"):
        parse_data_spec("a:1,a:2")


def _stream(n: int, value: int) -> TokenDataset:
    return TokenDataset(np.full(n, value, dtype=np.uint16), vocab_size=256, source=f"ds{value}")


def test_blend_proportions_determinism_and_exact_resume():
    sets = [_stream(50_001, 1), _stream(20_001, 2), _stream(9_001, 3)]
    blend = BlendedSampler(sets, [0.5, 0.3, 0.2], global_batch=64, seq_len=10, seed=7)
    xs = torch.cat([blend.batch(k)[0][:, 0] for k in range(BLOCK // 64)])        # one block of samples
    counts = [int((xs == v).sum()) for v in (1, 2, 3)]
    assert counts == [2048, 1229, 819]                                            # exact per block
    again = BlendedSampler(sets, [0.5, 0.3, 0.2], global_batch=64, seq_len=10, seed=7)
    assert torch.equal(again.batch(5)[0], blend.batch(5)[0])
    assert not torch.equal(BlendedSampler(sets, [0.5, 0.3, 0.2], global_batch=64, seq_len=10, seed=8).batch(5)[0],
                           blend.batch(5)[0])
    # each component reads its windows without repeats within an epoch (third set: 900 windows)
    comp, index = blend.assign(np.arange(4 * BLOCK))
    assert len(np.unique(index[comp == 2])) == (comp == 2).sum()
    # exact resume: a sampler restored from a saved position continues the same batches
    for _ in range(3):
        next(blend)
    state = blend.state_dict()
    resumed = BlendedSampler(sets, [0.5, 0.3, 0.2], global_batch=64, seq_len=10, seed=7)
    resumed.load_state_dict(state)
    for _ in range(3):
        assert torch.equal(next(resumed)[0], next(blend)[0])
    other = BlendedSampler(sets, [0.6, 0.2, 0.2], global_batch=64, seq_len=10, seed=7)
    with pytest.raises(ConfigError, match="data blend"):
        other.load_state_dict(state)
    rows = blend.rank_batch(1, 4, step=9)[0]
    assert torch.equal(rows, blend.batch(9)[0][16:32])


# ---- options: document masking's refusals, the command line ------------------------------------
def test_document_mask_refusals(tok_dir, tmp_path, capsys):
    from types import SimpleNamespace

    from meshplan import models
    from meshplan.train.inputs import _document_mask
    ds = _packed(tmp_path, tok_dir, 24)
    model = models.build("tiny-llama", seq_len=24, device="meta", vocab=128)
    cp2, cp1 = SimpleNamespace(mesh={"cp": 2}), SimpleNamespace(mesh={"cp": 1})
    cfg = lambda mask: SimpleNamespace(document_mask=mask)
    assert _document_mask(cfg(None), cp1, model, [ds]) is True
    assert _document_mask(cfg(None), cp1, model, [TokenDataset.embedded()]) is False   # no boundaries: as before
    assert _document_mask(cfg(None), cp2, model, [ds]) is False
    assert "without document masking: context parallelism (cp=2)" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"cp=2.*--no-document-mask"):
        _document_mask(cfg(True), cp2, model, [ds])
    with pytest.raises(ConfigError, match="embedded corpus does not record.*meshplan data prepare"):
        _document_mask(cfg(True), cp1, model, [TokenDataset.embedded()])
    plain = torch.nn.Linear(2, 2)
    with pytest.raises(ConfigError, match="takes no document_ids"):
        _document_mask(cfg(True), cp1, plain, [ds])


def test_train_command_line_data_options():
    from meshplan.cli import build_parser
    from meshplan.cli.train import train_config
    args = build_parser().parse_args(["train", "--data", "a:0.7,b:0.3", "--tokenizer", "tok", "--text-field", "body",
                                      "--no-document-mask", "--eval-every", "5", "--eval-batches", "2",
                                      "--eval-fraction", "0.1", "--steps", "10"])
    cfg = train_config(args)
    assert (cfg.data, cfg.tokenizer, cfg.text_field, cfg.document_mask) == ("a:0.7,b:0.3", "tok", "body", False)
    assert (cfg.eval_every, cfg.eval_batches, cfg.eval_fraction, cfg.eval_data) == (5, 2, 0.1, None)
    args = build_parser().parse_args(["train", "--eval-every", "5"])
    with pytest.raises(ConfigError, match="--eval-data PATH, or --eval-fraction"):
        train_config(args)
