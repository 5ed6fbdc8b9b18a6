"""The one error type the CLI turns into a one-line message and exit code 2."""


class FmoeError(Exception):
    """Bad input or an unsupported model: the message is shown to the user as one line."""
