"""A sliding-window model's saved state cut back in another slot (edge.model.windowed), on the tiny
Gemma 3 (a 32-token window) with 4 slots: the end's state alone continues only from its end;
with its piece spliced in it continues from any of its last window and a half of positions with
the logits a fresh prefill gives."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edge.config import ModelConfig
from edge.model.gguf import read_gguf_info
from edge.model.llm import GGUFModel, load_gguf_model
from edge.model.windowed import cut_piece, splice_piece

N_SWA = 32


@pytest.fixture()
def model(tiny_swa_gguf: Path) -> GGUFModel:
    cfg = ModelConfig(name="tiny", path=str(tiny_swa_gguf), n_ctx=512, n_batch=64, n_threads=1, use_mlock=False,
                      parallel=4)
    m = load_gguf_model(cfg, read_gguf_info(tiny_swa_gguf))
    assert m.native.n_swa == N_SWA and not m.native.whole_states
    yield m
    m.close()


def prompt(n: int) -> list[int]:
    rng = np.random.default_rng(5)
    return [1] + [int(t) for t in rng.integers(3, 268, n - 1)]


def fresh_logits(m: GGUFModel, tokens: list[int]) -> np.ndarray:
    n = m.native
    n.clear(3)
    n.decode(3, tokens, 0)
    out = n.logits().copy()
    n.clear(3)
    return out


def test_the_piece_lets_a_windowed_state_be_cut_back_in_another_slot(model: GGUFModel) -> None:
    n, tokens = model.native, prompt(200)
    n.clear(0)
    n.decode(0, tokens, 0)
    end_state = n.state_bytes(0)
    piece, lo = cut_piece(n, 0, len(tokens))
    c = len(tokens) - N_SWA
    assert lo == c - N_SWA and n.pos_min(n.spare) == -1  # the spare sequence is left empty
    n.clear(0)
    for cut in (c - 1, c + 5, len(tokens) - 2):
        assert n.set_state(2, end_state)
        assert not n.can_continue_at(2, cut)  # the end's window alone does not reach back there
        assert splice_piece(n, 2, piece, lo, c)
        assert n.can_continue_at(2, cut) and n.keep(2, cut)
        n.decode(2, tokens[cut:cut + 1], cut)
        assert np.abs(n.logits() - fresh_logits(model, tokens[:cut + 1])).max() < 1e-3, cut
        n.clear(2)
    assert n.set_state(2, end_state) and splice_piece(n, 2, piece, lo, c)
    assert not n.can_continue_at(2, c - 2)  # before the piece's window: not there either
    n.clear(2)


def test_a_state_within_one_window_needs_no_piece(model: GGUFModel) -> None:
    n, tokens = model.native, prompt(N_SWA)
    n.clear(0)
    n.decode(0, tokens, 0)
    assert cut_piece(n, 0, len(tokens)) is None
    n.clear(0)
