"""The one error every export target raises for a model it cannot write exactly."""


class ExportError(ValueError):
    """A model that cannot be exported exactly to the asked format (one-line reason)."""
