"""Per-slot top-k / temperature sampling (the published exponential-race algorithm)."""

from __future__ import annotations

import numpy as np
import torch

from personaplex_voice.engine.base import Sampling
from personaplex_voice.engine.sampling import (
    STATIC_AUDIO_WIDTH,
    STATIC_TEXT_WIDTH,
    SlotSampler,
    sample_tokens,
)


def test_distribution_matches_softmax_of_top_k():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 3.0, 0.0]])
    n = 20000
    gen = torch.Generator().manual_seed(0)
    noise = torch.empty(n, 6).exponential_(1.0, generator=gen)
    tokens = sample_tokens(
        logits.expand(n, 6),
        torch.full((n,), 0.8),
        torch.full((n,), 3),
        torch.zeros(n, dtype=torch.bool),
        noise,
    )
    counts = np.bincount(tokens.numpy(), minlength=6)
    probs = torch.softmax(logits / 0.8, -1)[0].numpy()
    keep = np.argsort(-probs)[:3]
    expected = np.zeros(6)
    expected[keep] = probs[keep] / probs[keep].sum()
    np.testing.assert_allclose(counts / n, expected, atol=0.015)


def test_greedy_top1_and_zero_temperature_pick_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    noise = torch.empty(4, 50).exponential_(1.0, generator=torch.Generator().manual_seed(2))
    tokens = sample_tokens(
        logits,
        torch.tensor([0.7, 0.0, 0.7, 1.0]),
        torch.tensor([25, 25, 1, 50]),
        torch.tensor([True, False, False, False]),
        noise,
    )
    best = logits.argmax(-1)
    assert tokens[:3].tolist() == best[:3].tolist()


def test_slot_draws_do_not_depend_on_neighbours():
    def draws(other_topk: int) -> list[int]:
        sampler = SlotSampler(2, text_card=40, card=64, dep_q=2, device=torch.device("cpu"))
        sampler.configure(0, Sampling(text_topk=5, audio_topk=7), seed=42)
        sampler.configure(1, Sampling(text_topk=other_topk, audio_topk=other_topk), seed=9)
        logits = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
        out = []
        for _ in range(20):
            sampling = sampler.prepare_tick([True, True])
            sampler.draw()
            out.append(int(sampler.audio(logits, 1, sampling)[0]))
            sampler.advance(None)
        return out

    assert draws(3) == draws(60)


def test_graph_mode_updates_sampling_constants_in_place():
    """A captured CUDA graph keeps reading the same tensors: settings changes must land in them."""
    sampler = SlotSampler(2, text_card=40, card=64, dep_q=2, device=torch.device("cpu"))
    sampler.static = True
    sampler.configure(0, Sampling(greedy=True), seed=1)
    sampler.prepare_tick([True, True])
    widths = (sampler.text_width, sampler.audio_width)
    buffers = sampler._derived[widths]
    sampler.configure(1, Sampling(audio_topk=3, audio_temperature=0.5), seed=2)
    sampler.prepare_tick([True, True])
    assert all(a is b for a, b in zip(sampler._derived[widths], buffers, strict=True))
    _, _, _, audio_best, audio_t, audio_keep = buffers
    assert audio_best.tolist() == [True, False] and float(audio_t[1]) == 0.5
    assert audio_keep[1].sum() == 3


def test_static_ticks_rank_a_capped_width_unless_a_slot_asks_for_more():
    """A static (CUDA graph) tick ranks only the top STATIC_*_WIDTH candidates, not the whole
    vocabularies; a slot asking for a larger top-k switches the tick to the full widths (the
    second graph), and a seed draws the same tokens either way."""
    card, text_card = 4096, 1000
    sampler = SlotSampler(2, text_card=text_card, card=card, dep_q=2, device=torch.device("cpu"))
    sampler.static = True
    sampler.configure(0, Sampling(text_topk=25, audio_topk=250), seed=5)
    assert sampler.prepare_tick([True, False]) and not sampler.wide
    assert (sampler.text_width, sampler.audio_width) == (STATIC_TEXT_WIDTH, STATIC_AUDIO_WIDTH)
    logits = torch.randn(2, card, generator=torch.Generator().manual_seed(4))
    sampler.draw()
    narrow = int(sampler.audio(logits, 0, True)[0])
    sampler.configure(1, Sampling(audio_topk=STATIC_AUDIO_WIDTH + 1), seed=6)
    assert sampler.prepare_tick([True, False]) and not sampler.wide  # slot 1 idle: still narrow
    assert sampler.prepare_tick([True, True]) and sampler.wide
    assert (sampler.text_width, sampler.audio_width) == (text_card, card)
    sampler.draw()
    assert int(sampler.audio(logits, 0, True)[0]) == narrow  # same seed, step, rank: same token
