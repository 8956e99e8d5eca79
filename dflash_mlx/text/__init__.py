"""Plain-Python text handling: responses and tau, reasoning, chat templates, input checks."""
