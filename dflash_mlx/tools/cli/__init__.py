"""The command-line tools' shared options, console-script entry points and progress lines."""
