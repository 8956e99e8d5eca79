"""Loading a pair: targets and drafters from folders, GGUF files and the hub, and the registry of published pairs."""
