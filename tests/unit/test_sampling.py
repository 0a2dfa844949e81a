"""The sampling step: truncation, the pad id, the distribution, the log-probs it reports."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from streamrl.model.sampling import SamplingParams, _truncate, check_sampling, sample_tokens


def test_truncation_top_k_then_top_p() -> None:
    # probs 0.5, 0.3, 0.15, 0.05. top_p 0.7: the mass before token 1 is 0.5 < 0.7 (kept),
    # before token 2 it is 0.8 (dropped). top_k 3 drops token 3 only.
    scaled = jnp.log(jnp.asarray([[0.15, 0.5, 0.05, 0.3]], jnp.float32))
    kept = np.isfinite(np.asarray(_truncate(scaled, SamplingParams(1.0, 0.7, 0))))
    np.testing.assert_array_equal(kept, [[False, True, False, True]])
    kept = np.isfinite(np.asarray(_truncate(scaled, SamplingParams(1.0, 1.0, 3))))
    np.testing.assert_array_equal(kept, [[True, True, False, True]])
    kept = np.isfinite(np.asarray(_truncate(scaled, SamplingParams(1.0, 0.4, 0))))
    np.testing.assert_array_equal(kept, [[False, True, False, False]])


def _draw(
    probs: list[float], sampling: SamplingParams, n: int = 20000, pad: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    logits = jnp.log(jnp.tile(jnp.asarray(probs, jnp.float32), (n, 1)))
    keys = jax.vmap(jax.random.PRNGKey)(jnp.arange(n, dtype=jnp.uint32))
    toks, lps = jax.jit(sample_tokens, static_argnums=(2, 3))(logits, keys, sampling, pad)
    return np.asarray(toks), np.asarray(lps)


def test_frequencies_follow_the_distribution() -> None:
    # pad (id 0) has no chance; the rest renormalise to 0.5, 0.3, 0.2 over ids 1..3.
    toks, lps = _draw([0.5, 0.25, 0.15, 0.1], SamplingParams(1.0, 1.0, 0))
    freq = np.bincount(toks, minlength=4) / len(toks)
    assert freq[0] == 0
    # 20000 draws: a frequency's standard error is below 0.004; allow 4 of them
    np.testing.assert_allclose(freq[1:], [0.5, 0.3, 0.2], atol=0.016)
    # the reported log-prob is of the untruncated distribution (pad included)
    np.testing.assert_allclose(lps, np.log([0.5, 0.25, 0.15, 0.1])[toks], rtol=1e-5)


def test_top_k_and_temperature() -> None:
    toks, _ = _draw([0.05, 0.5, 0.3, 0.15], SamplingParams(1.0, 1.0, 2))
    assert set(np.unique(toks)) == {1, 2}
    freq = np.bincount(toks, minlength=4) / len(toks)
    np.testing.assert_allclose(freq[1:3], [0.5 / 0.8, 0.3 / 0.8], atol=0.016)
    # temperature 0.5 squares the odds: 0.5^2 : 0.3^2 : 0.15^2 over ids 1..3
    toks, lps = _draw([0.05, 0.5, 0.3, 0.15], SamplingParams(0.5, 1.0, 0))
    p = np.array([0.05, 0.5, 0.3, 0.15]) ** 2
    freq = np.bincount(toks, minlength=4) / len(toks)
    np.testing.assert_allclose(freq[1:], p[1:] / p[1:].sum(), atol=0.016)
    np.testing.assert_allclose(lps, np.log(p / p.sum())[toks], rtol=1e-4)


def test_pad_never_sampled_even_when_it_dominates() -> None:
    toks, _ = _draw([0.999, 0.0005, 0.0005], SamplingParams(1.0, 1.0, 0), n=2000)
    assert 0 not in toks


def test_bad_settings_are_named() -> None:
    with pytest.raises(ValueError, match=r"temperature 0 must be > 0"):
        check_sampling(SamplingParams(0, 1.0, 0))
    with pytest.raises(ValueError, match=r"top_p 1.5 must be in \(0, 1\]"):
        check_sampling(SamplingParams(1.0, 1.5, 0))
