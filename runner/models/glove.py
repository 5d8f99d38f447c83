"""Initial embedding rows from a GloVe text file (`word v1 ... vd` per line), as Lee & Kifer did for IMDB.

The token ids come from a vocabulary file with one token per line, line i = token id i (id 0 = padding). A token
is looked up as written, then lower-cased without a WordPiece `##` or SentencePiece `▁` prefix. Tokens that
GloVe lacks keep a N(0, 0.1^2) row; the padding row is zero.

    weight = load_glove("glove.6B.200d.txt", "vocab.txt", vocab_size=8185, dim=200)   # (8185, 200)
"""
from __future__ import annotations

from pathlib import Path

import torch

from runner.errors import DprunError


def read_vocab(vocab_path: str | None, vocab_size: int) -> list[str]:
    if not vocab_path:
        raise DprunError("model.glove_path needs model.vocab_path (one token per line, line i = token id i)")
    path = Path(vocab_path).expanduser()
    if not path.is_file():
        raise DprunError(f"model.vocab_path={vocab_path!r} is not a file; expected one token per line")
    tokens = path.read_text(encoding="utf-8").splitlines()
    if len(tokens) > vocab_size:
        raise DprunError(f"model.vocab_path has {len(tokens)} tokens but the dataset's vocab_size is {vocab_size}")
    return tokens


def load_glove(glove_path: str, vocab_path: str | None, vocab_size: int, dim: int) -> torch.Tensor:
    tokens = read_vocab(vocab_path, vocab_size)
    wanted: dict[str, list[int]] = {}
    for i, tok in enumerate(tokens):
        for key in dict.fromkeys((tok, tok.removeprefix("##").removeprefix("▁").lower())):
            wanted.setdefault(key, []).append(i)
    path = Path(glove_path).expanduser()
    if not path.is_file():
        raise DprunError(f"model.glove_path={glove_path!r} is not a file; expected a GloVe text file")
    weight = torch.randn(vocab_size, dim, generator=torch.Generator().manual_seed(0)) * 0.1  # (V, d)
    found = torch.zeros(vocab_size, dtype=torch.bool)
    with path.open(encoding="utf-8") as f:
        for line in f:
            word, _, rest = line.rstrip().partition(" ")
            ids = [i for i in wanted.get(word, ()) if not found[i]]
            if not ids:
                continue
            vec = torch.tensor([float(v) for v in rest.split(" ")])
            if vec.numel() != dim:
                raise DprunError(f"GloVe vectors in {glove_path} have {vec.numel()} dimensions; model.d_model={dim}")
            weight[ids] = vec
            found[ids] = True
    weight[0] = 0.0  # padding
    return weight
