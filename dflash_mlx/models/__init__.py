"""The models: the DFlash drafter, and the target's hidden-state taps per family (dense and hybrid)."""
