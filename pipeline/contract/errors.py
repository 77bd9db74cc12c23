"""Exceptions the engine raises to its users (dependency-free, so the CLI can import them cheaply)."""


class RequestFailed(RuntimeError):
    """A request ended with an error event (its message is fit for the user)."""
