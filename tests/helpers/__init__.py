"""Shared test helpers: tiny checkpoints, oracle drafters, decoding runs, the snapshot app."""
