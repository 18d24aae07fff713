"""Greedy sampling without the chain's candidate array (edge.model.generate._Argmax): the same token
as llama.cpp's logit-bias and greedy samplers over every candidate, for logits of real decodes,
with banned, boosted and repeated biases."""

from __future__ import annotations

from pathlib import Path

import pytest

from edge.config import ModelConfig
from edge.model.generate import GenParams, SamplerChain
from edge.model.gguf import read_gguf_info
from edge.model.llm import load_gguf_model


@pytest.mark.parametrize("bias", [(), ((1, -100.0),), ((5, 3.5), (9, -2.0), (5, 1.25)), ((200, 50.0),)])
def test_greedy_from_the_logits_is_the_chains_token(tiny_gguf: Path, bias: tuple) -> None:
    m = load_gguf_model(ModelConfig(name="t", path=str(tiny_gguf), n_ctx=256, n_threads=1, use_mlock=False),
                        read_gguf_info(tiny_gguf))
    try:
        n = m.native
        params = GenParams(max_tokens=1, temperature=0, logit_bias=bias)
        fast, chain = SamplerChain(n, params), SamplerChain(n, params)
        chain._argmax = None  # llama.cpp's samplers over the whole candidate array: the reference
        assert fast._argmax is not None
        for text in ("Hello world", "The quick brown fox", "tea", "One two three four five six seven"):
            tokens = m.tokenize_prompt(text)
            n.clear(0)
            n.decode(0, tokens, 0)
            assert fast.sample() == chain.sample(), (text, bias)
        fast.close()
        chain.close()
    finally:
        m.close()
