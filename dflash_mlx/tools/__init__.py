"""The tools over the library: the command line, server, benchmark, training, and the OpenAI client."""
