"""Speculative decoding: proposers of draft tokens and the verifier that accepts or rejects them."""
