"""Fixtures of the sampler tests: the tiny byte-level tokenizer and the tiny random-weight
decoder (seed 0), built once per test module."""

import pytest
from flax import nnx

from hgpo_jax.models import config, decoder, tokenizer


@pytest.fixture(scope="module")
def tok():
  return tokenizer.tiny_tokenizer()


@pytest.fixture(scope="module")
def model():
  return decoder.Decoder(config.get_preset("tiny"), rngs=nnx.Rngs(0))
