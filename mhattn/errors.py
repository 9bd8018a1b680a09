"""Exceptions raised by mhattn. Every message names the argument, what was expected and what came."""


class MhattnError(Exception):
    """Base class of every error mhattn raises on purpose."""


class InputError(MhattnError, ValueError):
    """An argument of a public function is malformed (shape, dtype, device, value)."""


class BackendUnavailableError(MhattnError, RuntimeError):
    """A backend was asked for by name but cannot run this problem; the message lists its reasons."""


class UnknownBackendError(MhattnError, ValueError):
    """A backend name that no registered backend carries."""
