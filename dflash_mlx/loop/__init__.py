"""The speculative loop's parts: the pair's cache, the verifier, the options, the proposal protocol."""
