"""The error raised for bad input at the library's boundaries."""


class DFlashError(ValueError):
    """Bad input (a model, a drafter, an argument), with a one-line message saying the fix.

    Command-line tools print it without a traceback.
    """
