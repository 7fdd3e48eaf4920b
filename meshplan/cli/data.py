"""`meshplan data prepare`: tokenise training text once into token shards (meshplan.train.prepare)
that `meshplan train --data DIR` reads."""

from __future__ import annotations

import sys


def register(sub) -> None:
    d = sub.add_parser("data", help="prepare training data (tokenise once into token shards)")
    dsub = d.add_subparsers(dest="data_cmd", required=True)
    p = dsub.add_parser("prepare", help="tokenise text / JSONL / Parquet files into token shards with a "
                                        "document index; rerunning skips the shards already done")
    p.add_argument("sources", nargs="+", metavar="SOURCE",
                   help="text files (.txt .md .text, one document each), JSON Lines (.jsonl, one document a "
                        "line), Parquet (.parquet, one a row; needs pyarrow) or directories of them")
    p.add_argument("--out", required=True, help="directory to write the shards and index.json to")
    p.add_argument("--tokenizer", default=None,
                   help="directory with tokenizer.json, or a transformers tokenizer directory (default: bytes)")
    p.add_argument("--text-field", default="text", help="JSONL field / Parquet column with the text (default: text)")
    p.add_argument("--quiet", action="store_true", help="no per-file progress lines")
    p.set_defaults(fn=cmd_prepare)


def cmd_prepare(args) -> int:
    from meshplan.train import tokenizer
    from meshplan.train.prepare import prepare
    tok = tokenizer.load(args.tokenizer)
    print(f"tokenizer: {tok.name} (vocab {tok.vocab_size}, end-of-text id {tok.eos_id})", file=sys.stderr, flush=True)
    prepare(args.sources, args.out, tokenizer=tok, text_field=args.text_field,
            progress=None if args.quiet else sys.stderr)
    print(args.out)
    return 0


# ---- `meshplan train` data options (registered by cli/train.py) ---------------------------------
DATA_FIELDS = ("tokenizer", "text_field", "document_mask", "eval_every", "eval_batches", "eval_data", "eval_fraction")


def register_train_options(t) -> None:
    import argparse
    g = t.add_argument_group("data: tokenizer, document masking, validation (see docs/training.md, Data)")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (tokenizer.json or a transformers tokenizer) for text, JSONL and "
                        "Parquet --data; default: the byte tokenizer. Prepared data carries its own")
    g.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    g.add_argument("--document-mask", action=argparse.BooleanOptionalAction, default=None,
                   help="keep attention inside documents and restart positions per document; default: on "
                        "for data with document boundaries (prepared, JSONL, Parquet, --tokenizer text)")
    g.add_argument("--eval-every", type=int, default=0, help="validation loss every N steps (0: never)")
    g.add_argument("--eval-batches", type=int, default=1, help="global batches per validation (default 1)")
    g.add_argument("--eval-data", default=None, help="validation data (any --data form)")
    g.add_argument("--eval-fraction", type=float, default=None,
                   help="hold out the last FRACTION of the training data for validation (e.g. 0.01)")


def train_options(args) -> dict:
    """TrainConfig keywords of the data options (absent from an older train-args.json: defaults)."""
    defaults = {"text_field": "text", "eval_every": 0, "eval_batches": 1}
    return {k: getattr(args, k, defaults.get(k)) for k in DATA_FIELDS}


def check_train_data(args, model_vocab: int | None) -> None:
    """Open --data (and --eval-data) as rank 0 will, before any process starts: sources exist,
    text is tokenised into the cache, the tokenizer fits the model, one sequence fits the data."""
    from meshplan.errors import ConfigError
    from meshplan.train import tokenizer
    from meshplan.train.inputs import open_datasets
    tok = getattr(args, "tokenizer", None)
    if tok is not None:
        tokenizer.check_model_vocab(tokenizer.load(tok), model_vocab)
    field = getattr(args, "text_field", "text")
    for flag, spec in (("--data", args.data), ("--eval-data", getattr(args, "eval_data", None))):
        if spec is None:
            continue
        for ds in open_datasets(spec, tokenizer=tok, text_field=field)[0]:
            if model_vocab:
                ds.check_vocab(model_vocab)
            if len(ds) < args.seq_len + 1:
                raise ConfigError(f"{flag} {ds.source!r} holds {len(ds)} tokens, fewer than one sequence of "
                                  f"--seq-len {args.seq_len} (+1 target); give more data or a shorter --seq-len")
