"""What runs only on MLX's CPU backend: the one switch, fast float32 math, compiled layers, OpenBLAS.

Nothing here runs on an Apple GPU: ``speedups.choose_speedups`` turns it on only for ``mx.cpu`` in float32."""
