"""Errors and warnings raised by the models layer."""


class ModelError(ValueError):
    """Invalid model configuration or weights; the message names the problem and the valid choices."""


class PretrainedWeightsWarning(UserWarning):
    """Pretrained weights were requested but could not be loaded; the model uses random init."""
