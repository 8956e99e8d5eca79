"""dflash-bench: timing, statistics and reports of DFlash against plain decoding and other methods."""
