"""What the loop learns about this machine: the adaptive policy's state and the verify widths' costs."""
